"""Where progress records live (`peer.training.shards`): one key while the collaboration is
small, 2^L keys by peer id past it, and a writer and a reader whose sizes differ meet."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from peer.training import shards
from peer.training.progress import ProgressRecord, progress_key


def record(peer: int, seen: int = 0) -> ProgressRecord:
    return ProgressRecord(
        peer_id=f"peer-{peer}", role="trainer", addrs=[], step=0, digest="d", samples=0,
        samples_per_second=0.0, updated_at=1.0, seen=seen,
    )  # fmt: skip


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


def test_the_size_is_the_records_read_or_the_median_they_state_never_a_minoritys():
    assert shards.collaboration_size([record(i) for i in range(5)]) == 5
    # A reader of the wrong level read 20 of 400: their writers read 400.
    assert shards.collaboration_size([record(i, seen=400) for i in range(20)]) == 400
    # Seven lie: the median is the honest thirteen's.
    lying = [record(i, seen=10**9) for i in range(7)] + [record(i, seen=20) for i in range(13)]
    assert shards.collaboration_size(lying) == 20
    # Stated sizes below the count do not lower it.
    assert shards.collaboration_size([record(i, seen=2) for i in range(30)]) == 30


def test_a_probe_counts_a_shards_records_for_every_shard_of_its_level():
    assert shards.probe_size([]) == 0
    assert shards.probe_size([(0, []), (3, [record(i) for i in range(12)]), (4, [])]) == 96
    stated = [record(i, seen=700) for i in range(10)]
    assert shards.probe_size([(2, stated), (5, [record(0)])]) == 700
