"""Where progress records live: the progress key split into shards by peer id (pure).

While a collaboration is small one key holds every record (level 0, `<collaboration>/progress`).
A key's records are served by its `dht.replicas` closest nodes, and every trainer reads every
record each interval: at 100 simulated peers the 8 replicas of the one key sent 9-11 Mbit/s
of replies each (10x the mean node), two of them on 10 Mbit/s uplinks, members whose
averaging rounds the others then waited for. At level L the records are split over 2^L keys
`<collaboration>/progress/L/<i>`, `i` the top L bits of the peer id's hash, each on replicas
of its own: the same bytes, from 2^L times as many nodes.

Every peer places the shards by the number of records its last read found (its size). A writer
stores its record at the level of its size and, within a quarter of a level's boundary, at the
one across it (`write_levels`); a reader reads the level of its size (`level`), so a writer and
a reader whose counts differ by up to a quarter meet. A reader that read a level few writers
wrote finds few records and reads a lower level next; one that found none, or has read nothing
yet, probes one shard of every level (`probe_level`). Sizes are counts of owner-signed records,
never a number a record states: a few records stating a huge collaboration would otherwise move
a reader to a level where only they are, and keep it there.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Iterable, Mapping
from typing import TypeVar

from libp2p.peer.id import ID

from peer.dht.routing import ID_BITS, node_id, spread_key
from peer.training.progress import progress_key

T = TypeVar("T")

SHARD_RECORDS = 16
"""Records a shard holds, about (at most twice as many, at least half while the size is read
right): ~11 KB from each of the two replicas a hot read asks."""
MAX_LEVEL = 10
"""Shards are at most 2^MAX_LEVEL = 1,024 (16,384 records at `SHARD_RECORDS`; beyond, shards
grow); each is a hot key whose holders a reader remembers (`peer.dht.node.HOT_KEYS`). At 6
(64 shards), the holders of a shard's prefix, up to 24 (`peer.dht.node.SPREAD_HOLDERS`), served
10,000 peers' shards of ~156 records: the busiest node 7.6x the mean (by placement,
`python -m simulation.progressload --placed`); at 10, 1.1x (1.4x since thin prefixes are read
from any holder: `routing.MIN_PREFIX_READ`). A read of 10,000 records then asks
1,024 keys for the same bytes."""


def level(size: int) -> int:
    """The shard level for a collaboration of `size` records: the lowest at which a shard holds
    at most `SHARD_RECORDS` of them, at most `MAX_LEVEL`."""
    if size <= SHARD_RECORDS:
        return 0
    return min(MAX_LEVEL, math.ceil(math.log2(size / SHARD_RECORDS)))


def write_levels(size: int) -> list[int]:
    """The levels a writer who reads `size` records stores its record at: its own, and near a
    level's boundary the one across it too, for readers whose size differs from ours by up to a
    quarter (a reader further off reads a level with fewer records, or none, and moves or
    probes: `publisher.ProgressReader`)."""
    return sorted({level(size * 4 // 5), level(size * 5 // 4)})


def shard_index(peer_id: str, at_level: int) -> int:
    """Which of the level's 2^level shards holds `peer_id`'s record: the top bits of its DHT
    node id (`routing.node_id`), the prefix of the nodes that hold that shard
    (`shard_key`). Records and holders then fall alike: a shard's records are about as many
    as its holders, and no holder serves much more than the mean node (by placement alone,
    at 300 and 1,000 peers: 2.3-4.7x with records placed by another hash, 1.0-1.4x by their
    own node ids)."""
    if at_level == 0:
        return 0
    return _place(peer_id) >> (64 - at_level)


def of_shard(entries: Mapping[str, T], at_level: int, index: int) -> dict[str, T]:
    """The entries of `entries` (by subkey) whose subkey shard `index` of `at_level` holds
    (`shard_index`): what a read keeps of that shard's replies. One pass with the level's shift
    worked out once (a read filters every record it gets: at 1,000 simulated peers the filter
    with a call of `shard_index` for each was 2.3 % of the simulator's time)."""
    if at_level == 0:
        return dict(entries)
    shift = 64 - at_level
    return {subkey: entry for subkey, entry in entries.items() if _place(subkey) >> shift == index}


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
