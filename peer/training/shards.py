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

import hashlib
import math
from collections.abc import Iterable

from peer.training.progress import progress_key

SHARD_RECORDS = 16
"""Records a shard holds, about (at most twice as many, at least half while the size is read
right): ~11 KB from each of the two replicas a hot read asks."""
MAX_LEVEL = 6
"""Shards are at most 2^MAX_LEVEL = 64 (1,024 records at `SHARD_RECORDS`; beyond, shards
grow: 10,000 records are ~160 a shard, 110 KB, within one DHT reply); each is a hot key whose
replicas a reader remembers (`peer.dht.node.HOT_KEYS`)."""


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
    """Which of the level's 2^level shards holds `peer_id`'s record: its hash's top bits."""
    if at_level == 0:
        return 0
    digest = int.from_bytes(hashlib.sha256(peer_id.encode()).digest()[:8], "big")
    return digest >> (64 - at_level)


def shard_key(collaboration: str, at_level: int, index: int) -> str:
    if at_level == 0:
        return progress_key(collaboration)
    return f"{progress_key(collaboration)}/{at_level}/{index}"


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
