"""The Moshpit plan, pure: groups for any number of peers, and the exact, bit-identical weighted
mean after the last round when every group reduces the way `PartReducer` does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.averaging.moshpit import plan, rounds_for
from peer.averaging.reduce import PartReducer

CHUNK = 7


def test_rounds_are_the_fewest_groups_of_m_allow():
    assert rounds_for(1, 2) == 1 and rounds_for(4, 4) == 1 and rounds_for(5, 4) == 2
    assert rounds_for(27, 3) == 3 and rounds_for(28, 3) == 4
    with pytest.raises(ValueError, match="at least 2"):
        rounds_for(4, 1)


@pytest.mark.parametrize("group_size", range(2, 9))
def test_every_round_partitions_the_peers_into_groups_of_at_most_m_plus_one(group_size):
    for count in range(1, 400):
        moshpit = plan(count, group_size)
        assert len(moshpit.rounds) == rounds_for(count, group_size)
        for groups in moshpit.rounds:
            assert sorted(i for g in groups for i in g) == list(range(count))
            assert all(list(g) == sorted(g) for g in groups)
            assert max(len(g) for g in groups) <= group_size + 1
        # Every peer's value stands for everyone after the last round.
        assert all(basis == tuple(range(count)) for basis in moshpit.bases[-1])


def test_a_power_of_m_is_the_moshpit_grid_and_nobody_meets_twice():
    moshpit = plan(27, 3)
    met = set()
    for groups in moshpit.rounds:
        assert {len(g) for g in groups} == {3}
        pairs = {(a, b) for g in groups for a in g for b in g if a < b}
        assert not pairs & met
        met |= pairs


def test_five_peers_in_groups_of_four_by_hand():
    """The issue's case. Round 0: blocks {0,1,2} and {3,4}; round 1 deals each block out over
    two groups, one member of each block per group, peer 2 doubling up with peer 0."""
    moshpit = plan(5, 4)
    assert moshpit.rounds == (((0, 1, 2), (3, 4)), ((0, 2, 3), (1, 4)))
    weights = [1.0, 2.0, 3.0, 4.0, 5.0]
    first = moshpit.seats(0, 0, weights)
    assert [(s.member, s.block, s.weight) for s in first] == [(0, 0, 1), (1, 1, 2), (2, 2, 3)]
    # Round 1: peer 0 stands for block {0,1,2} (6 samples), peer 2 holds the same value and
    # adds nothing, peer 3 stands for {3,4} (9 samples).
    last = moshpit.seats(1, 2, weights)
    assert [(s.member, s.block, s.weight) for s in last] == [(0, 0, 6), (2, 0, 0), (3, 3, 9)]
    assert [(s.member, s.block, s.weight) for s in moshpit.seats(1, 4, weights)] == [
        (1, 0, 6),
        (4, 3, 9),
    ]


def simulate(count: int, group_size: int, weights: list[float], vectors, rng) -> list:
    """Every round of the plan, each group reduced by a PartReducer in the order of its
    seats, the chunks arriving in a random order (as over a network)."""
    moshpit = plan(count, group_size)
    values = [v.copy() for v in vectors]
    size = len(vectors[0])
    for index, groups in enumerate(moshpit.rounds):
        after = list(values)
        for group in groups:
            seats = moshpit.seats(index, group[0], weights)
            if len(group) == 1 or sum(s.weight for s in seats) == 0:
                continue  # alone, or nobody in the group stands for any sample
            name = {s.member: f"peer-{s.member:03d}" for s in seats}
            ordered = sorted(seats, key=lambda s: (s.block, name[s.member]))
            reducer = PartReducer(
                0,
                size,
                chunk_elements=CHUNK,
                weights={name[s.member]: s.weight for s in seats},
                order=[name[s.member] for s in ordered],
            )
            arrivals = [(s.member, c) for s in seats for c in range(len(reducer.chunks))]
            for k in rng.permutation(len(arrivals)):
                member, chunk = arrivals[k]
                lo, hi = reducer.chunks[chunk]
                reducer.add(name[member], chunk, values[member][lo:hi])
            average = np.empty(size, dtype=np.float32)
            done = reducer.take_complete()
            assert done == list(range(len(reducer.chunks)))
            for chunk in done:
                lo, hi = reducer.chunks[chunk]
                average[lo:hi], senders = reducer.average(chunk)
                assert senders == len(group)
            for member in group:
                after[member] = average.copy()
        values = after
    return values


@settings(max_examples=300, deadline=None)
@given(
    count=st.integers(2, 33),
    group_size=st.integers(2, 8),
    data=st.data(),
)
def test_every_peer_ends_on_the_same_bits_and_the_exact_weighted_mean(count, group_size, data):
    weights = data.draw(
        st.lists(st.integers(0, 5000), min_size=count, max_size=count).filter(any), label="w"
    )
    seed = data.draw(st.integers(0, 2**32 - 1), label="seed")
    rng = np.random.default_rng(seed)
    size = 3 * CHUNK + 2
    vectors = [
        (rng.standard_normal(size) * rng.uniform(0.1, 10)).astype(np.float32) for _ in range(count)
    ]
    results = simulate(count, group_size, [float(w) for w in weights], vectors, rng)
    exact = np.average(np.stack(vectors).astype(np.float64), axis=0, weights=weights)
    contributing = [v for v, w in zip(vectors, weights, strict=True) if w > 0]
    scale = max(float(np.abs(v).max()) for v in contributing)
    for values in results:
        assert values.tobytes() == results[0].tobytes()  # bit-identical on every peer
        np.testing.assert_allclose(values, exact, rtol=0, atol=2e-6 * scale)
