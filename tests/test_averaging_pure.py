"""The pure parts of averaging: the cut by shares, wire codecs, the chunked reducer."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.averaging.compression import BLOCK, CODECS, BadPart
from peer.averaging.partition import chunk_ranges, part_ranges, part_sizes
from peer.averaging.reduce import PartReducer, ResultAssembler

# ---------------------------------------------------------------------------- partition


def test_parts_follow_the_shares_and_cover_the_vector():
    assert part_ranges(10, [1, 1, 1]) == [(0, 4), (4, 7), (7, 10)]
    assert part_ranges(7, [0.0, 0.5, 0.5]) == [(0, 0), (0, 4), (4, 7)]  # client-only: nothing
    assert chunk_ranges(3, 10, 3) == [(3, 6), (6, 9), (9, 10)]
    with pytest.raises(ValueError, match="nobody reduces"):
        part_sizes(5, [0.0, 0.0])
    with pytest.raises(ValueError):
        part_sizes(5, [float("nan"), 1.0])


@given(st.integers(0, 10**9), st.lists(st.floats(0, 1e6), min_size=1, max_size=40))
def test_sizes_add_up_and_stay_within_one_of_proportional(total, shares):
    if sum(shares) <= 0:
        return
    sizes = part_sizes(total, shares)
    assert sum(sizes) == total and all(s >= 0 for s in sizes)
    weight = sum(shares)
    for size, share in zip(sizes, shares, strict=True):
        assert abs(size - total * share / weight) < 1 + 1e-6 * total


# ---------------------------------------------------------------------------- codecs


@pytest.mark.parametrize("count", [1, BLOCK - 1, BLOCK, 3 * BLOCK + 17])
@pytest.mark.parametrize("name", sorted(CODECS))
def test_codecs_round_trip_within_their_error_bound(name, count):
    codec = CODECS[name]
    values = np.random.default_rng(count).standard_normal(count).astype(np.float32) * 10
    wire = codec.encode(values)
    assert len(wire) == codec.wire_bytes(count)
    decoded = codec.decode(bytes(wire), count)
    assert decoded.dtype == np.float32 and decoded.shape == (count,)
    error = np.abs(decoded - values)
    if name == "none":
        assert np.array_equal(decoded, values)
    elif name == "fp16":
        assert (error <= np.abs(values) * 2**-11 + 1e-7).all()
    else:  # half a step of each block's scale (largest magnitude / 127)
        for start in range(0, count, BLOCK):
            block = values[start : start + BLOCK]
            assert error[start : start + BLOCK].max() <= np.abs(block).max() / 254 * 1.001


def test_fp16_clips_instead_of_overflowing_to_inf():
    decoded = CODECS["fp16"].decode(CODECS["fp16"].encode(np.array([1e6, -1e6], np.float32)), 2)
    assert np.isfinite(decoded).all() and decoded[0] == 65504


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_wrong_length_is_a_bad_part(name):
    codec = CODECS[name]
    wire = bytes(codec.encode(np.ones(100, np.float32)))
    with pytest.raises(BadPart, match="bytes for"):
        codec.decode(wire[:-1], 100)


def test_int8_rejects_a_bad_scale():
    wire = bytearray(CODECS["int8"].encode(np.ones(10, np.float32)))
    wire[:4] = np.array([np.inf], np.float32).tobytes()
    with pytest.raises(BadPart, match="scale"):
        CODECS["int8"].decode(bytes(wire), 10)


# ---------------------------------------------------------------------------- reducer


def test_the_reducer_weights_contributions_per_chunk():
    reducer = PartReducer(100, 110, chunk_elements=4, weights={"a": 1.0, "b": 3.0})
    assert [reducer.chunk_size(i) for i in range(3)] == [4, 4, 2]
    for index in range(3):
        size = reducer.chunk_size(index)
        reducer.add("a", index, np.full(size, 1.0, np.float32))
    assert reducer.take_complete() == [] and reducer.waiting_for() == ["b"]
    reducer.add("b", 0, np.full(4, 5.0, np.float32))
    assert reducer.take_complete() == [0]
    average, senders = reducer.average(0)
    assert senders == 2 and np.allclose(average, (1 * 1 + 3 * 5) / 4)
    reducer.drop("b", "died")  # chunks 1 and 2 go on without it
    assert reducer.take_complete() == [1, 2] and reducer.done
    average, senders = reducer.average(2)
    assert senders == 1 and np.allclose(average, 1.0)


@pytest.mark.parametrize(
    ("sender", "index", "values", "match"),
    [
        ("mallory", 0, np.ones(4, np.float32), "not a sender"),
        ("a", 7, np.ones(4, np.float32), "out of range"),
        ("a", 0, np.ones(3, np.float32), "expected float32"),
        ("a", 0, np.ones(4, np.float64), "expected float32"),
        ("a", 0, np.array([1, np.nan, 1, 1], np.float32), "NaN or Inf"),
        ("a", 0, np.array([1, np.inf, 1, 1], np.float32), "NaN or Inf"),
    ],
)
def test_the_reducer_refuses_bad_chunks_without_adding_them(sender, index, values, match):
    reducer = PartReducer(0, 8, chunk_elements=4, weights={"a": 1.0})
    with pytest.raises(BadPart, match=match):
        reducer.add(sender, index, values)
    assert not reducer.sum.any() and not reducer.chunk_weight.any()


def test_a_chunk_cannot_come_twice_and_a_dropped_sender_is_ignored():
    reducer = PartReducer(0, 4, chunk_elements=4, weights={"a": 1.0, "b": 1.0})
    reducer.add("a", 0, np.ones(4, np.float32))
    with pytest.raises(BadPart, match="came twice"):
        reducer.add("a", 0, np.ones(4, np.float32))
    reducer.drop("b", "stalled")
    with pytest.raises(BadPart, match="was dropped"):
        reducer.add("b", 0, np.ones(4, np.float32))


def test_the_assembler_keeps_local_values_where_nothing_arrived():
    vector = np.arange(10, dtype=np.float32)
    assembler = ResultAssembler(vector, [(0, 6), (6, 10)], chunk_elements=3)
    assembler.put(0, 1, np.full(3, -1.0, np.float32), senders=4)
    with pytest.raises(BadPart, match="came twice"):
        assembler.put(0, 1, np.full(3, -1.0, np.float32), senders=4)
    with pytest.raises(BadPart, match="not a finite average"):
        assembler.put(1, 0, np.full(3, np.nan, np.float32), senders=4)
    assert vector.tolist() == [0, 1, 2, -1, -1, -1, 6, 7, 8, 9]
    assert [(c.start, c.end, c.senders) for c in assembler.report()] == [
        (0, 3, 0),
        (3, 6, 4),
        (6, 9, 0),
        (9, 10, 0),
    ]
    assert not assembler.part_complete(0)


def test_fp16_keeps_inf_so_the_receiver_rejects_it():
    decoded = CODECS["fp16"].decode(CODECS["fp16"].encode(np.array([np.inf, 1.0], np.float32)), 2)
    assert decoded[0] == np.inf


def test_int8_quantises_denormal_blocks_to_zero():
    values = np.full(10, 1e-40, np.float32)
    assert (CODECS["int8"].decode(CODECS["int8"].encode(values), 10) == 0).all()
