"""Where progress records live (`peer.training.shards`): one key while the collaboration is
small, 2^L keys by peer id past it, and a writer and a reader whose sizes differ meet."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.training import shards
from peer.training.progress import progress_key


def test_a_small_collaboration_keeps_every_record_on_the_progress_key():
    assert shards.level(0) == shards.level(shards.SHARD_RECORDS) == 0
    assert shards.write_levels(0) == shards.write_levels(12) == [0]
    assert shards.level_keys("c", 0) == [progress_key("c")]
    assert shards.record_key("c", "anyone", 0) == progress_key("c")


def test_a_level_holds_about_shard_records_a_shard_up_to_the_last_level():
    assert shards.level(shards.SHARD_RECORDS + 1) == 1
    assert shards.level(100) == 3  # 8 shards of 12-13
    assert shards.level(1000) == 6
    assert shards.level(10**6) == shards.MAX_LEVEL
    keys = shards.level_keys("c", 3)
    assert len(set(keys)) == 8 and progress_key("c") not in keys


def test_each_record_lands_in_one_shard_of_a_level_and_the_shards_share_them_evenly():
    at = 4
    keys = shards.level_keys("c", at)
    placed = Counter(shards.record_key("c", f"peer-{i}", at) for i in range(1600))
    assert set(placed) == set(keys)
    assert all(60 <= count <= 140 for count in placed.values()), placed  # 100 each, about


@given(
    writer=st.integers(min_value=0, max_value=10**6),
    ratio=st.floats(min_value=0.8, max_value=1.25),
)
def test_a_reader_whose_size_is_within_a_quarter_of_a_writers_reads_a_level_it_wrote(
    writer: int, ratio: float
):
    reader = int(writer * ratio)
    if not writer * 4 // 5 <= reader <= writer * 5 // 4:
        return  # rounded out of the range
    assert shards.level(reader) in shards.write_levels(writer)
    assert len(shards.write_levels(writer)) <= 2


def test_a_probe_reads_the_level_whose_shard_shows_the_most_records():
    assert shards.probe_level([]) == shards.probe_level([(0, 0), (3, 0)]) == 0
    assert shards.probe_level([(0, 0), (3, 12), (4, 0)]) == 3
    assert shards.probe_level([(0, 5), (2, 10), (5, 1)]) == 2  # 40 projected against 32
    # A level's shard is a sample: 7 of a level-4 shard project 112, level 3's range, and
    # level 3 is empty; the level read is 4, where the records are.
    assert shards.probe_level([(0, 0), (3, 0), (4, 7)]) == 4


def test_a_shard_keeps_the_entries_whose_subkeys_shard_index_names_it():
    """`of_shard` is the filter `shard_index` states, at every level: peer ids and open
    subkeys alike, none kept twice across a level's shards, none lost."""
    rng = random.Random(5)
    pairs = [create_new_key_pair(rng.randbytes(32)) for _ in range(120)]
    subkeys = [ID.from_pubkey(p.public_key).to_base58() for p in pairs]
    subkeys += [f"open-{i}" for i in range(40)]
    entries = {subkey: i for i, subkey in enumerate(subkeys)}
    for at in range(shards.MAX_LEVEL + 1):
        kept: dict[str, int] = {}
        for index in range(2**at):
            shard = shards.of_shard(entries, at, index)
            assert shard == {s: e for s, e in entries.items() if shards.shard_index(s, at) == index}
            assert not kept.keys() & shard.keys()
            kept |= shard
        assert kept == entries
