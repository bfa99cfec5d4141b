"""The pure parts of averaging: the cut by shares, wire codecs, include masks, the chunked
reducer, and the rules that make a round exact over the members it kept."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.averaging.allreduce import RoundReport, check_spec, retry_spec
from peer.averaging.compression import BLOCK, CODECS, BadPart
from peer.averaging.partition import chunk_ranges, part_ranges, part_sizes
from peer.averaging.reduce import ChunkResult, PartReducer, ResultAssembler
from peer.averaging.wire import include_mask, included_by, mask_bytes
from peer.errors import ProtocolError

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


def test_check_is_the_pass_over_the_values_and_add_checked_keeps_the_books():
    """The shell runs `check` in a worker thread, then `add_checked` on the loop: together
    they refuse what `add` refuses, and a refused chunk changes nothing."""
    reducer = PartReducer(0, 8, chunk_elements=4, weights={"a": 1.0, "b": 1.0})
    with pytest.raises(BadPart, match="NaN or Inf"):
        reducer.check(0, np.array([1, np.inf, 1, 1], np.float32))
    with pytest.raises(BadPart, match="expected float32"):
        reducer.check(1, np.ones(4, np.float64))
    assert reducer.pending["a"] == {0, 1} and not reducer.queued["a"]
    reducer.add_checked("a", 0, np.ones(4, np.float32))
    with pytest.raises(BadPart, match="came twice"):
        reducer.add_checked("a", 0, np.ones(4, np.float32))
    with pytest.raises(BadPart, match="from b"):  # a mix-up of the caller's is caught too
        reducer.add_checked("b", 0, np.ones(3, np.float32))
    with pytest.raises(BadPart, match="not a sender"):
        reducer.add_checked("mallory", 0, np.ones(4, np.float32))
    reducer.add_checked("b", 0, np.full(4, 3.0, np.float32))
    assert reducer.take_complete() == [0] and reducer.queued == {"a": 0, "b": 0}
    average, senders = reducer.average(0)
    assert senders == 2 and average.tolist() == [2.0] * 4


def test_an_average_in_a_scratch_chunk_has_the_bits_of_the_running_sum():
    """`average(out=...)` sums in a caller's chunk (reused, full of old values) instead of the
    part-sized sum: the same float operations in the same order, so the same bits, and both
    the bits of adding each contribution, weighted, in order in float64, rounded once."""
    rng = np.random.default_rng(9)
    weights = dict(zip("abcd", [1.0, 2.5, 0.0, 1 / 3], strict=True))
    values = {s: (rng.standard_normal(10) * 10.0 ** rng.integers(-3, 4)).astype(np.float32)
              for s in weights}  # fmt: skip
    expected64 = np.zeros(10, np.float64)
    total = 0.0
    for sender in "dbca":
        w = weights[sender]
        if w > 0:
            expected64 += values[sender].astype(np.float64) * w
            total += w
    expected = (expected64 / total).astype(np.float32)
    averages = []
    for scratch in (None, np.full(16, np.nan, np.float32)):
        reducer = PartReducer(0, 10, chunk_elements=10, weights=weights, order=list("dbca"))
        for sender in "abcd":
            reducer.add(sender, 0, values[sender])
        assert reducer.take_complete() == [0]
        average, senders = reducer.average(0, out=scratch)
        assert senders == 4 and len(average) == 10
        if scratch is not None:
            assert np.shares_memory(average, scratch) and not reducer.sum.any()
        averages.append(average.tobytes())
    assert averages[0] == averages[1] == expected.tobytes()


FLOAT32_MAX = float(np.finfo(np.float32).max)


def reference_mean(values: list[np.ndarray], weights: list[float]) -> np.ndarray:
    """The weighted mean in float64, added in the order given, rounded once to float32."""
    total, acc = 0.0, np.zeros(len(values[0]), np.float64)
    for v, w in zip(values, weights, strict=True):
        acc += v.astype(np.float64) * w
        total += w
    return (acc / total).astype(np.float32)


def averaged(weights: dict[str, float], values: dict[str, np.ndarray]):
    """(reducer, average, senders) of one chunk that every sender delivered."""
    size = len(next(iter(values.values())))
    reducer = PartReducer(0, size, chunk_elements=size, weights=weights)
    for sender, v in values.items():
        reducer.add(sender, 0, v)
    assert reducer.take_complete() == [0]
    average, senders = reducer.average(0)
    return reducer, average, senders


def test_float32_max_beside_honest_values_is_averaged_finite_and_exact():
    """A sender of finite float32-max values: the float32 sum overflowed, and the chunk was
    kept local by everyone while nobody was at fault. The sum is float64 now: the average is
    finite and exactly the float64 mean, over every sender (nobody is dropped)."""
    honest = np.random.default_rng(2).standard_normal(6).astype(np.float32)
    huge = np.array([FLOAT32_MAX, FLOAT32_MAX, -FLOAT32_MAX, FLOAT32_MAX, 1.0, 0.0], np.float32)
    weights = {"a": 3.0, "b": 1.0, "c": 2.0}
    values = {"a": honest, "b": huge, "c": huge}
    reducer, average, senders = averaged(weights, values)
    assert np.isfinite(average).all()
    assert senders == 3 and reducer.included(0) == {"a", "b", "c"} and not reducer.unfit(0)
    assert average.tobytes() == reference_mean([honest, huge, huge], [3.0, 1.0, 2.0]).tobytes()


@pytest.mark.parametrize(
    ("weights", "seed"),
    [((2.0**24 + 1, 1.0), None), ((2.0**53 - 1, 2.0**52 + 3, 12345.0), 7)],
    ids=["2^24+1", "near-2^53"],
)
def test_weights_above_2_24_give_the_exact_float64_mean(weights, seed):
    """Sample counts are exact to 2^53: a float32 weight is exact only to 2^24 (2^24 + 1
    samples counted as 2^24), and gives another mean than the float64 reference."""
    if seed is None:
        rows = [np.ones(4, np.float32), np.zeros(4, np.float32)]
    else:
        rng = np.random.default_rng(seed)
        rows = [rng.standard_normal(4096).astype(np.float32) for _ in weights]
    names = "abc"[: len(weights)]
    _, average, _ = averaged(
        dict(zip(names, weights, strict=True)), dict(zip(names, rows, strict=True))
    )
    expected = reference_mean(rows, list(weights))
    assert average.tobytes() == expected.tobytes()
    as_float32 = sum(r * np.float32(w) for r, w in zip(rows, weights, strict=True))
    assert not np.array_equal(as_float32 / np.float32(sum(weights)), expected)


def test_a_weight_above_2_53_is_refused():
    with pytest.raises(ValueError, match="expected a number in"):
        PartReducer(0, 4, chunk_elements=4, weights={"a": 2.0**53 + 2})


@pytest.mark.parametrize("norm_factor", [None, 2.0], ids=["mean", "centered_clip"])
def test_a_contribution_that_decodes_to_inf_is_left_out_and_its_sender_named(norm_factor):
    """Our own contribution goes through the codec as the reducer adds it (`prepare`): int8
    turns float32-max into inf. That sender is left out of the chunk (its weight too) and named
    (`unfit`) for the shell to drop; the others' average stands (it voided the chunk for all)."""
    int8 = CODECS["int8"]
    rng = np.random.default_rng(4)
    rows = {s: rng.standard_normal(BLOCK).astype(np.float32) for s in "abcd"}
    rows["a"][:] = FLOAT32_MAX  # finite: `add` takes it

    def as_sent(sender: str, values: np.ndarray) -> np.ndarray:
        if sender != "a":
            return values
        return int8.decode(int8.encode(values), len(values))

    weights = {"a": 5.0, "b": 1.0, "c": 2.0, "d": 4.0}
    reducer = PartReducer(0, BLOCK, chunk_elements=BLOCK, weights=weights, norm_factor=norm_factor)
    for sender in "abcd":
        reducer.add(sender, 0, rows[sender])
    assert reducer.take_complete() == [0]
    with np.errstate(over="ignore"):
        average, senders = reducer.average(0, prepare=as_sent)
    assert np.isfinite(average).all()
    assert list(reducer.unfit(0)) == ["a"] and "not finite" in reducer.unfit(0)["a"]
    assert senders == 3 and reducer.included(0) == {"b", "c", "d"}
    if norm_factor is None:
        expected = reference_mean([rows[s] for s in "bcd"], [1.0, 2.0, 4.0])
        assert average.tobytes() == expected.tobytes()


def test_the_assembler_writes_a_chunk_only_if_it_is_valid():
    """`put` in three steps, as the shell takes them: `check` (on the loop), `write` (the pass
    over the values, in a worker thread), `record` (on the loop)."""
    vector = np.arange(6, dtype=np.float32)
    assembler = ResultAssembler(vector, [(0, 6)], chunk_elements=3)
    two = frozenset("ab")
    assembler.check(0, 1, two)
    with pytest.raises(BadPart, match="not a finite average"):
        assembler.write(0, 1, np.array([1, np.nan, 1], np.float32))
    with pytest.raises(BadPart):
        assembler.write(0, 1, np.ones(2, np.float32))
    assert vector.tolist() == [0, 1, 2, 3, 4, 5] and not assembler.received  # untouched
    assembler.write(0, 1, np.full(3, 7.0, np.float32))
    assembler.record(0, 1, two)
    with pytest.raises(BadPart, match="came twice"):
        assembler.check(0, 1, two)
    with pytest.raises(BadPart, match="no chunk"):
        assembler.check(0, 2, two)
    assert vector.tolist() == [0, 1, 2, 7, 7, 7] and assembler.received == {(0, 1): two}


def test_the_assembler_keeps_local_values_where_nothing_arrived():
    vector = np.arange(10, dtype=np.float32)
    assembler = ResultAssembler(vector, [(0, 6), (6, 10)], chunk_elements=3)
    four = frozenset("abcd")
    assembler.put(0, 1, np.full(3, -1.0, np.float32), four)
    with pytest.raises(BadPart, match="came twice"):
        assembler.put(0, 1, np.full(3, -1.0, np.float32), four)
    with pytest.raises(BadPart, match="not a finite average"):
        assembler.put(1, 0, np.full(3, np.nan, np.float32), four)
    with pytest.raises(BadPart, match="not a finite average"):  # an average of nobody
        assembler.put(1, 0, np.full(3, 1.0, np.float32), frozenset())
    assert vector.tolist() == [0, 1, 2, -1, -1, -1, 6, 7, 8, 9]
    assert [(c.start, c.end, c.senders, c.included) for c in assembler.report()] == [
        (0, 3, 0, frozenset()),
        (3, 6, 4, four),
        (6, 9, 0, frozenset()),
        (9, 10, 0, frozenset()),
    ]
    assert not assembler.part_complete(0)


def test_fp16_keeps_inf_so_the_receiver_rejects_it():
    decoded = CODECS["fp16"].decode(CODECS["fp16"].encode(np.array([np.inf, 1.0], np.float32)), 2)
    assert decoded[0] == np.inf


def test_int8_quantises_denormal_blocks_to_zero():
    values = np.full(10, 1e-40, np.float32)
    assert (CODECS["int8"].decode(CODECS["int8"].encode(values), 10) == 0).all()


# ---------------------------------------------------------------------------- include masks


def test_include_masks_name_computing_members_by_position():
    members = [f"peer-{i:02d}" for i in range(10)]
    assert mask_bytes(10) == 2 and mask_bytes(8) == 1 and mask_bytes(1) == 1
    mask = include_mask({"peer-00", "peer-03", "peer-09"}, members)
    assert mask == bytes([0b00001001, 0b00000010])
    assert included_by(mask, members) == {"peer-00", "peer-03", "peer-09"}
    assert included_by(include_mask(members, members), members) == set(members)


@pytest.mark.parametrize(
    ("mask", "match"),
    [
        (bytes([0xFF, 0b00000100]), "past the 10 members"),  # bit 10 of 10 members
        (bytes([0xFF]), "1 bytes for 10 members"),
        (bytes([0xFF, 0x03, 0x00]), "3 bytes for 10 members"),
    ],
)
def test_a_malformed_include_mask_is_a_protocol_error(mask, match):
    with pytest.raises(ProtocolError, match=match):
        included_by(mask, [f"peer-{i:02d}" for i in range(10)])


@given(st.binary(max_size=6), st.integers(1, 40))
def test_any_bytes_decode_to_members_or_a_protocol_error(mask, count):
    members = [f"peer-{i:02d}" for i in range(count)]
    try:
        included = included_by(mask, members)
    except ProtocolError:
        return
    assert included <= set(members)
    assert include_mask(included, members) == mask  # one mask per set: nothing else decodes


# ---------------------------------------------------------------------------- exact over S


def test_a_dropped_sender_leaves_every_chunk_that_has_not_settled():
    """A drops out after delivering chunks 0 and 1; chunk 0 had settled (B delivered it too),
    chunk 1 had not (B still owed it): A stays in chunk 0 only, chunk 1 is B's alone."""
    reducer = PartReducer(0, 9, chunk_elements=3, weights={"a": 1.0, "b": 3.0})
    reducer.add("a", 0, np.full(3, 1.0, np.float32))
    reducer.add("a", 1, np.full(3, 1.0, np.float32))
    reducer.add("b", 0, np.full(3, 5.0, np.float32))
    assert reducer.take_complete() == [0]
    reducer.drop("a", "stalled")
    reducer.add("b", 1, np.full(3, 5.0, np.float32))
    reducer.add("b", 2, np.full(3, 5.0, np.float32))
    assert reducer.take_complete() == [1, 2] and reducer.done
    assert [reducer.included(i) for i in range(3)] == [{"a", "b"}, {"b"}, {"b"}]
    assert reducer.queued == {"a": 0, "b": 0}  # nothing of A's is kept
    average, senders = reducer.average(0)
    assert senders == 2 and np.allclose(average, (1 * 1 + 3 * 5) / 4)
    average, senders = reducer.average(1)  # normalised by B's weight only
    assert senders == 1 and np.array_equal(average, np.full(3, 5.0, np.float32))


def test_contributions_are_added_in_order_once_the_chunk_settles():
    """The sum is the same float sum whatever the arrival order (Moshpit's groups need it)."""
    rng = np.random.default_rng(5)
    values = {s: rng.standard_normal(4).astype(np.float32) * 1e3 for s in "abcde"}
    weights = dict(zip("abcde", [1.0, 2.5, 0.0, 7.0, 3.0], strict=True))
    averages = set()
    for arrival in ("abcde", "edcba", "caebd"):
        reducer = PartReducer(0, 4, chunk_elements=4, weights=weights, order=list("dbeac"))
        for sender in arrival:
            reducer.add(sender, 0, values[sender])
        assert reducer.take_complete() == [0] and reducer.included(0) == set("abcde")
        average, senders = reducer.average(0)
        assert senders == 5
        averages.add(average.tobytes())
    assert len(averages) == 1


def report_of(included: list[set[str]], **fields) -> RoundReport:
    chunks = [ChunkResult(i, i + 1, len(s), frozenset(s)) for i, s in enumerate(included)]
    return RoundReport(chunks=chunks, computing=("a", "b", "c", "d"), **fields)


def test_a_round_is_exact_over_s_only_when_every_chunk_includes_s():
    assert report_of([{"a", "b", "c"}] * 3).exact_over == {"a", "b", "c"}
    assert report_of([{"a", "b", "c", "d"}] * 3).exact_over == {"a", "b", "c", "d"}
    # Sets differ across chunks, or a chunk kept local values: not exact over anything.
    assert report_of([{"a", "b", "c"}, {"a", "b", "c", "d"}]).exact_over is None
    assert report_of([{"a", "b", "c"}, set()]).exact_over is None
    assert report_of([set(), set()]).exact_over is None
    assert report_of([]).exact_over is None
    # Our part did not reach a member of S: it would retry without us.
    undelivered = report_of([{"a", "b", "c"}] * 2, undelivered={"b": "no receipt"})
    assert undelivered.exact_over is None


def test_a_retry_leaves_out_whom_the_chunks_and_failures_name():
    assert report_of([{"a", "b", "c"}, {"a", "b", "c", "d"}]).excluded() == {"d"}
    failed = report_of([{"a", "b", "c", "d"}, set()], failed_reducers={"c": "stalled"})
    assert failed.excluded() == {"c"}
    dropped = report_of([{"a", "b"}, set()], dropped_senders={"c": "stalled"})
    assert dropped.excluded() == {"c", "d"}
    unconfirmed = report_of([{"a", "b", "c", "d"}] * 2, undelivered={"b": "no receipt"})
    assert unconfirmed.excluded() == {"b"}
    assert report_of([{"a", "b", "c", "d"}] * 2).excluded() == set()


def test_a_retry_spec_is_the_same_group_without_the_excluded_under_a_derived_id():
    from tests.test_group import joined, spec_of

    spec = spec_of([joined(weight=w) for w in (2.0, 3.0, 4.0, 5.0)], size=1000)
    ids = [m.peer_id for m in spec.members]
    derived = retry_spec(spec, {ids[1], "not-a-member"})
    assert [m.peer_id for m in derived.members] == [ids[0], ids[2], ids[3]]
    kept = tuple(m for m in spec.members if m.peer_id != ids[1])
    unshared = [dataclasses.replace(m, share=0.0) for m in derived.members]
    assert unshared == [dataclasses.replace(m, share=0.0) for m in kept]
    # Equal shares stay equal (renormalised among those left).
    assert [m.share for m in derived.members] == pytest.approx([1 / 3] * 3)
    assert (derived.size, derived.codec, derived.chunk_elements, derived.view) == (
        spec.size, spec.codec, spec.chunk_elements, spec.view
    )  # fmt: skip
    check_spec(derived, ids[0])
    # The shares cut the whole vector among those left.
    parts = derived.parts()
    assert parts[0][0] == 0 and parts[-1][1] == spec.size
    assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
    # Everyone who leaves out the same members derives the same id; nobody else does.
    assert retry_spec(spec, [ids[1]]).round_id == derived.round_id != spec.round_id
    assert retry_spec(spec, [ids[2]]).round_id != derived.round_id
    assert retry_spec(spec, [ids[1], ids[2]]).round_id != derived.round_id
    other = dataclasses.replace(spec, round_id=b"another round")
    assert retry_spec(other, [ids[1]]).round_id != derived.round_id


def test_a_retry_caps_the_shares_again_among_the_reducers_left():
    """Dropping a reducer must not lift another above the cap: with shares 3/8, 3/8, 1/8, 1/8
    (at the cap for 4), leaving out one at 3/8 would give the other 3/5 of the vector among
    3 reducers, whose cap is 1/2."""
    from peer.roles import share_cap
    from tests.test_group import joined, spec_of

    spec = spec_of([joined(weight=1.0) for _ in range(4)], size=1000)
    shares = (3 / 8, 3 / 8, 1 / 8, 1 / 8)
    members = tuple(
        dataclasses.replace(m, share=g) for m, g in zip(spec.members, shares, strict=True)
    )
    spec = dataclasses.replace(spec, members=members)
    derived = retry_spec(spec, {members[0].peer_id})
    got = [m.share for m in derived.members]
    assert sum(got) == pytest.approx(1.0)
    assert max(got) <= share_cap(3) * (1 + 1e-12)
    assert got[0] == pytest.approx(share_cap(3))
    # A member with no share (client-only) gets none in the retry either.
    spec0 = dataclasses.replace(
        spec,
        members=tuple(
            dataclasses.replace(m, share=g)
            for m, g in zip(members, (0.5, 0.5, 0.0, 0.0), strict=True)
        ),
    )
    assert [m.share for m in retry_spec(spec0, {members[3].peer_id}).members][2] == 0.0
