"""Progress records and the collaboration's view of them (pure)."""

from __future__ import annotations

import math

import msgspec

from peer.dht.records import Entry
from peer.training.progress import (
    CollaborationView,
    Moves,
    ProgressRecord,
    company,
    decode_progress,
    encode_progress,
    should_call,
)
from tests.helpers import new_identity

PEERS = [new_identity().peer_id.to_base58() for _ in range(5)]


def rec(i: int, **fields) -> ProgressRecord:
    base = dict(
        peer_id=PEERS[i],
        role="trainer",
        addrs=[],
        step=3,
        digest="d",
        samples=0,
        samples_per_second=0.0,
        updated_at=1.0,
    )
    return ProgressRecord(**{**base, **fields})


def entry(value: bytes) -> Entry:
    return Entry(value=value, expiration=2e9)


def test_decode_keeps_only_owner_subkeys_naming_themselves_with_finite_figures():
    good = rec(0, samples=5)
    entries = {
        PEERS[0]: entry(encode_progress(good)),
        PEERS[1]: entry(encode_progress(rec(2))),  # names someone else
        "open-subkey": entry(encode_progress(rec(3))),
        PEERS[2]: entry(b"\x93junk"),
        PEERS[3]: entry(encode_progress(rec(3, loss=math.nan))),
    }
    assert decode_progress(entries) == [good]


def test_decode_rejects_negative_steps():
    raw = msgspec.msgpack.encode({**msgspec.structs.asdict(rec(0)), "step": -1})
    assert decode_progress({PEERS[0]: entry(raw)}) == []


def test_global_step_samples_and_eta_count_only_trainers_at_the_step():
    view = CollaborationView(
        [
            rec(0, samples=100, samples_per_second=10.0),
            rec(1, samples=50, samples_per_second=30.0),
            rec(2, step=2, samples=1000, samples_per_second=100.0),
            rec(3, role="keeper", step=3),
        ]
    )
    assert view.global_step == 3
    assert view.samples(3) == 150 and view.throughput(3) == 40.0
    assert view.eta(3, 350) == 5.0
    assert view.eta(3, 100) == 0.0
    assert math.isinf(CollaborationView([rec(0)]).eta(3, 10))


def test_a_step_is_called_when_the_projected_samples_reach_the_target():
    view = CollaborationView([rec(0, samples=80, samples_per_second=10.0)])  # published at 1.0

    def call(target: int, *, now: float = 1.0, window: float = 2.0) -> bool:
        return should_call(view, 3, target_batch=target, window=window, now=now, horizon=4.0)

    assert not call(101) and call(100)
    assert not call(121, now=3.0) and call(120, now=3.0)  # 2 s since its record: 20 more
    assert not call(141, now=9.0) and call(140, now=9.0)  # projected at most `horizon` on
    assert not should_call(view, 4, target_batch=1, window=2.0, now=1.0, horizon=4.0)


def test_a_holding_peer_counts_as_it_stands_and_adds_no_throughput():
    """A peer whose part of the step is done stops computing: projecting its rate on would
    make the others stop short of the target."""
    view = CollaborationView(
        [
            rec(0, samples=80, samples_per_second=10.0, holding=True),
            rec(1, samples=30, samples_per_second=5.0),
            rec(2, samples=500, samples_per_second=50.0, downloading=True, step=3),
        ]
    )
    assert view.projected_samples(3, now=3.0, horizon=4.0) == 80 + 30 + 10 + 500
    assert view.computing_throughput(3) == 55.0 and view.throughput(3) == 65.0


def test_a_peer_that_missed_a_call_looks_for_the_next_one():
    view = CollaborationView(
        [rec(0, call_step=3, gather_until=10.0), rec(1, call_step=3, gather_until=14.0)]
    )
    assert view.call(3) == 10.0
    assert view.call(3, after=10.0) == 14.0  # the missed gathering no longer hides this one
    assert view.call(3, after=14.0) is None


def test_the_earliest_call_wins_and_with_record_replaces_our_own():
    view = CollaborationView([rec(0, call_step=3, gather_until=12.0), rec(1)])
    assert view.call(3) == 12.0 and view.call(4) is None
    mine = view.with_record(rec(1, call_step=3, gather_until=11.5))
    assert mine.call(3) == 11.5 and len(mine.records) == 2


def test_consensus_is_the_most_common_digest_and_ties_break_by_the_smallest():
    view = CollaborationView([rec(0, digest="b"), rec(1, digest="b"), rec(2, digest="a")])
    assert view.consensus(3) == "b"
    assert [r.peer_id for r in view.donors(3)] == sorted([PEERS[0], PEERS[1]])
    tie = CollaborationView([rec(0, digest="b"), rec(1, digest="a")])
    assert tie.consensus(3) == "a"
    keeper_last = CollaborationView([rec(0, role="keeper"), rec(1)])
    assert [r.role for r in keeper_last.donors(3)] == ["trainer", "keeper"]


def test_newest_validation_loss():
    view = CollaborationView(
        [
            rec(0, validation_loss=2.0, validation_step=10),
            rec(1, validation_loss=1.5, validation_step=20),
            rec(2),
        ]
    )
    assert view.validation_loss() == (20, 1.5)
    assert CollaborationView([rec(0)]).validation_loss() is None


def test_company_those_behind_and_when_the_collaboration_has_settled():
    view = CollaborationView(
        [rec(0), rec(1, digest="e"), rec(2, step=2), rec(3, role="keeper", step=4), rec(4, step=5)]
    )
    # Trainers at our step or beyond (not us, not keepers), and those behind only while their
    # step moves (catching up).
    moves = Moves()
    moves.note(view, now=100.0)
    assert moves.since[PEERS[2]] == (2, 100.0)  # appeared
    in_company = [r.peer_id for r in company(view, 3, PEERS[0], moves, within=30, now=120.0)]
    assert in_company == [PEERS[1], PEERS[2], PEERS[4]]
    moves.note(view, now=140.0)  # peer 2 still at step 2
    in_company = [r.peer_id for r in company(view, 3, PEERS[0], moves, within=30, now=140.0)]
    assert in_company == [PEERS[1], PEERS[4]]
    moved = CollaborationView([*view.records[:2], rec(2, step=3), *view.records[3:]])
    moves.note(moved, now=141.0)
    assert moves.since[PEERS[2]] == (3, 141.0) and moves.since[PEERS[1]] == (3, 100.0)
    moves.note(CollaborationView([rec(1)]), now=142.0)
    assert list(moves.since) == [PEERS[1]]  # those gone are forgotten
    assert [r.peer_id for r in view.catching_up(3)] == [PEERS[2]]
    fetching = CollaborationView([rec(0), rec(1, downloading=True)])
    assert [r.peer_id for r in fetching.catching_up(3)] == [PEERS[1]]
    assert not fetching.settled(3, "d")  # its digest is about to change
    view = CollaborationView(
        [rec(0), rec(1, digest="e"), rec(2, step=2), rec(3, role="keeper", step=1)]
    )
    assert not view.settled(3, "d")  # peer 1 holds another digest, peer 2 is behind
    assert CollaborationView([rec(0), rec(1), rec(3, role="keeper", step=1)]).settled(3, "d")
    assert not CollaborationView([rec(0), rec(1)]).settled(4, "d")
