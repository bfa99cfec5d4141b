"""Where progress records live: the progress key split into shards by peer id (pure).

While a collaboration is small one key holds every record (level 0, `<collaboration>/progress`).
A key's records are served by its `dht.replicas` closest nodes, and every trainer reads every
record each interval: at 100 simulated peers the 8 replicas of the one key sent 9-11 Mbit/s
of replies each (10x the mean node), two of them on 10 Mbit/s uplinks, members whose
averaging rounds the others then waited for. At level L the records are split over 2^L keys
`<collaboration>/progress/L/<i>`, `i` the top L bits of the peer id's hash, each on replicas
of its own: the same bytes, from 2^L times as many nodes.

Every peer places the shards by what its last read found (its `Size`): the records, and of them
those whose peers serve the DHT (`ProgressRecord.serves`). A shard's holders are the servers of
its prefix, so the level is set by the servers (`SHARD_SERVERS` a shard), and by the records
only where too few serve (`MAX_SHARD_RECORDS`). A writer stores its record at the level of its
size and, within a quarter of a level's boundary, at the one across it (`write_levels`); a
reader reads the level of its size (`level`), so a writer and a reader whose counts each
differ by up to a quarter meet. A reader that read a level few writers
wrote finds few records and reads a lower level next; one that found none, or has read nothing
yet, probes one shard of every level (`probe_level`). Sizes are counts of owner-signed records,
never a number a record states: a few records stating a huge collaboration would otherwise move
a reader to a level where only they are, and keep it there. (A record's `serves` is its owner's
claim, counted once as the record is: where few peers serve, fewer identities move the level,
a quarter of the servers to cross a boundary, and writers follow within a read or two:
`write_levels`, the probes.)
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable
from typing import NamedTuple

from libp2p.peer.id import ID

from peer.dht.routing import ID_BITS, node_id, spread_key
from peer.training.progress import progress_key

SHARD_SERVERS = 24
"""DHT servers a shard's prefix holds, at most on average (from half as many): its records are
served by the servers of its prefix (`routing.hot_holders`: up to `SPREAD_HOLDERS` x replicas,
24), and a holder serves its prefix's records over its prefix's servers. With half the peers
behind NAT, the other half's records fall on the prefixes by chance: shards of 16 records (8
servers) left the busiest node at 1.7-2.4x the mean DHT server at 1,000 peers and 2.8-3.1x at
10,000; of 24 servers (48 records), at 1.3-1.7x and 1.7-2.0x (by placement, seeds 0-4,
`python -m simulation.progressload --placed --reachable 0.5`)."""
MAX_SHARD_RECORDS = 64
"""Records a shard holds, at most on average, however few of their peers serve the DHT: a
trainer's record with its signatures and vote is 1.4-2.0 KB (review), so a shard's fit one
reply (`node.REPLY_BYTES`, 192 KiB) with room for chance."""
ONE_KEY_RECORDS = 16
"""Records the one key (level 0) holds, at most: a hashed key, served by its `dht.replicas`
closest nodes alone, not by a prefix's servers (at 100 simulated trainers its 8 replicas sent
15 Mbit/s of replies each)."""
MAX_LEVEL = 10
"""Shards are at most 2^MAX_LEVEL = 1,024 (24,576 servers at `SHARD_SERVERS`; beyond, shards
grow); each is a hot key whose holders a reader remembers (`peer.dht.node.HOT_KEYS`)."""


class Size(NamedTuple):
    """What a read found, where the next read and store go (`level`)."""

    records: int
    servers: int
    """Of `records`, those whose peers serve the DHT (`ProgressRecord.serves`)."""

    def scaled(self, numerator: int, denominator: int) -> Size:
        return Size(
            self.records * numerator // denominator, self.servers * numerator // denominator
        )


def level(size: Size) -> int:
    """The shard level for a collaboration of `size`: the lowest at which a shard's prefix
    holds at most `SHARD_SERVERS` servers and at most `MAX_SHARD_RECORDS` records, on average,
    and level 0 (the one key) at most `ONE_KEY_RECORDS` records; at most `MAX_LEVEL`."""
    spread = size.records > ONE_KEY_RECORDS
    return min(
        MAX_LEVEL,
        max(
            int(spread),
            _halvings(size.servers, SHARD_SERVERS),
            _halvings(size.records, MAX_SHARD_RECORDS),
        ),
    )


def _halvings(count: int, most: int) -> int:
    """The fewest halvings of `count` that leave at most `most`."""
    return 0 if count <= most else math.ceil(math.log2(count / most))


def write_levels(size: Size) -> list[int]:
    """The levels a writer whose last read found `size` stores its record at: its own, and near
    a level's boundary the one across it too, for readers whose counts differ from ours by up to
    a quarter (a reader further off reads a level with fewer records, or none, and moves or
    probes: `publisher.ProgressReader`)."""
    return sorted({level(size.scaled(4, 5)), level(size.scaled(5, 4))})


def shard_index(peer_id: str, at_level: int) -> int:
    """Which of the level's 2^level shards holds `peer_id`'s record: the top bits of its DHT
    node id (`routing.node_id`), the prefix of the nodes that hold that shard
    (`shard_key`). Records and holders then fall alike: the records of the peers that serve are
    their prefix's holders, and no holder serves much more than the mean node (by placement
    alone, every peer serving, at 300 and 1,000 peers: 2.3-4.7x with records placed by another
    hash, 1.0-1.4x by their own node ids)."""
    if at_level == 0:
        return 0
    return _place(peer_id) >> (64 - at_level)


@functools.lru_cache(maxsize=16384)
def _place(peer_id: str) -> int:
    """The top 64 bits of `peer_id`'s node id; for a subkey that names no peer id (no
    owner-signed record is under one), of its text's hash."""
    try:
        return node_id(ID.from_base58(peer_id)) >> (ID_BITS - 64)
    except ValueError:
        return int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")


def shard_key(collaboration: str, at_level: int, index: int) -> str:
    """Shard `index` of `at_level`: held by the DHT nodes whose ids start with `index`
    (`routing.spread_key`), the prefix of the peer ids whose records it holds (`shard_index`)."""
    if at_level == 0:
        return progress_key(collaboration)
    return spread_key(f"{progress_key(collaboration)}/{at_level}", at_level, index)


def record_key(collaboration: str, peer_id: str, at_level: int) -> str:
    """The key `peer_id`'s record goes to at `at_level`."""
    return shard_key(collaboration, at_level, shard_index(peer_id, at_level))


def level_keys(collaboration: str, at_level: int) -> list[str]:
    """Every shard of a level: what a full read reads."""
    return [shard_key(collaboration, at_level, i) for i in range(2**at_level)]


def probe_level(found: Iterable[tuple[int, int]]) -> int:
    """The level a peer that has read nothing yet reads, from one shard read at each level
    (`found`: (level, the records that shard held)): of the levels where records are, the one
    whose shard, counted for all of its level's shards, shows the most (0 where none are). A
    level, not a size: a shard's count is a sample (12 +- 3.5 of 200 records in 16 shards), and
    the size it projects can fall on the other side of a level's boundary, where nobody writes."""
    best = max(((records << at, at) for at, records in found if records), default=(0, 0))
    return best[1]
