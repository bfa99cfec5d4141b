"""Where progress records live (`peer.training.shards`): one key while the collaboration is
small, 2^L keys by peer id past it, and a writer and a reader whose sizes differ meet."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from peer.training import shards
from peer.training.progress import progress_key


def every(records: int) -> shards.Size:
    return shards.Size(records, records)


def test_a_small_collaboration_keeps_every_record_on_the_progress_key():
    assert shards.level(every(0)) == shards.level(every(shards.ONE_KEY_RECORDS)) == 0
    assert shards.write_levels(every(0)) == shards.write_levels(every(12)) == [0]
    assert shards.level_keys("c", 0) == [progress_key("c")]
    assert shards.record_key("c", "anyone", 0) == progress_key("c")


def test_a_level_holds_about_shard_servers_a_shard_up_to_the_last_level():
    assert shards.level(every(shards.SHARD_SERVERS + 1)) == 1
    assert shards.level(every(100)) == 3  # 8 shards of 12-13
    assert shards.level(every(1000)) == 6
    assert shards.level(every(10**6)) == shards.MAX_LEVEL
    keys = shards.level_keys("c", 3)
    assert len(set(keys)) == 8 and progress_key("c") not in keys


def test_the_servers_set_the_level_and_the_records_only_where_few_serve():
    """A shard's holders are the servers of its prefix: with half the peers behind NAT, a
    shard holds as many servers as with none behind it, and twice the records."""
    assert shards.level(shards.Size(1000, 500)) == 5  # 32 shards of ~16 servers, ~31 records
    assert shards.level(shards.Size(100, 50)) == 2
    assert shards.level(shards.Size(1000, 0)) == 4  # nobody serves: ~63 records a shard
    assert shards.level(shards.Size(10**6, 10)) == shards.MAX_LEVEL


def test_the_one_key_holds_few_records_however_few_serve():
    """Level 0 is a hashed key held by its `dht.replicas` closest nodes alone, not a prefix's
    servers: past `ONE_KEY_RECORDS` a collaboration mostly behind NAT is read from two shards
    at least (found in review: 100 records of 20 servers went back to the one key)."""
    assert shards.level(shards.Size(shards.ONE_KEY_RECORDS, shards.ONE_KEY_RECORDS)) == 0
    assert shards.level(shards.Size(shards.ONE_KEY_RECORDS + 1, 0)) == 1
    assert shards.level(shards.Size(100, 20)) == 1
    assert shards.level(shards.Size(shards.MAX_SHARD_RECORDS * 2 + 1, 0)) == 2


def test_each_record_lands_in_one_shard_of_a_level_and_the_shards_share_them_evenly():
    at = 4
    keys = shards.level_keys("c", at)
    placed = Counter(shards.record_key("c", f"peer-{i}", at) for i in range(1600))
    assert set(placed) == set(keys)
    assert all(60 <= count <= 140 for count in placed.values()), placed  # 100 each, about


@given(
    records=st.integers(min_value=0, max_value=10**6),
    serving=st.floats(min_value=0.0, max_value=1.0),
    ratios=st.tuples(*[st.floats(min_value=0.8, max_value=1.25)] * 2),
)
def test_a_reader_whose_counts_are_within_a_quarter_of_a_writers_reads_a_level_it_wrote(
    records: int, serving: float, ratios: tuple[float, float]
):
    writer = shards.Size(records, int(records * serving))
    reader = shards.Size(int(writer.records * ratios[0]), int(writer.servers * ratios[1]))
    low, high = writer.scaled(4, 5), writer.scaled(5, 4)
    if not all(lo <= mine <= hi for lo, mine, hi in zip(low, reader, high, strict=True)):
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
