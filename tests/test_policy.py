"""The step protocol's decisions (`StepPolicy`): pure, on an explicit clock. No torch, no DHT;
records come from `tests.test_progress.rec`, time is the `now` each call is given."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.averaging.allreduce import RoundReport
from peer.averaging.averager import AveragingResult, longest_averaging
from peer.averaging.reduce import ChunkResult
from peer.config import AveragingConfig, PeerConfig, TaskConfig, TrainingConfig
from peer.training.certificate import (
    CARRIED_SIGNATURES,
    MAX_SIGNATURES,
    StepSignature,
    carried,
    merge_signatures,
)
from peer.training.deal import MAX_RATE_CLAIM, REMEASURE_STEPS, deal, shares
from peer.training.policy import (
    CALL_GRID,
    MAX_FALLBACK_TURNS,
    MAX_WAIT_FOR_OTHERS,
    SLOW_CLAIM,
    TRANSITIONS,
    Call,
    CatchUp,
    Compute,
    Declare,
    Event,
    Local,
    Phase,
    PhaseError,
    StepPolicy,
    Stop,
    Wait,
)
from peer.training.progress import CollaborationView, ProgressRecord, VoteRecord
from peer.training.steprule import Candidate, Vote, plan_of
from peer.training.timing import SLOW_BATCH, STORES_PER_WINDOW
from tests.test_progress import PEERS, rec

T0 = 1000.0
ME = "m"  # peer ids sort: "0" < "12D3KooW..." < "m" < "z..."


def make_policy(
    *, min_group_size: int = 2, mode: str = "dedloc", max_steps: int = 0, me: str = ME, **training
) -> StepPolicy:
    config = PeerConfig(
        averaging=AveragingConfig(min_group_size=min_group_size),
        task=TaskConfig(name="tiny", micro_batch=8, target_batch=64),
        training=TrainingConfig(mode=mode, max_steps=max_steps, **training),
    )
    policy = StepPolicy(me=me, config=config, vector_size=1000)
    policy.hold(0, "d0", own_signature(0))
    policy.started()
    return policy


def own_signature(step: int) -> StepSignature:
    return StepSignature(ME, step.to_bytes(64, "big"))  # ours: the policy checks no signature


def other(peer_id: str, **fields) -> ProgressRecord:
    """Another trainer's record at step 0 (the task's initial state, as ours), published at T0."""
    return msgspec.structs.replace(
        rec(0, step=0, digest="d0", updated_at=T0), peer_id=peer_id, **fields
    )


def on_grid(close: float) -> float:
    """The close a call names: the next multiple of CALL_GRID."""
    return math.ceil(close / CALL_GRID) * CALL_GRID


def read(policy: StepPolicy, *records: ProgressRecord, now: float = T0) -> None:
    policy.observe(CollaborationView(list(records), policy.quorum), now)


def step_alone(policy: StepPolicy, now: float) -> bool:
    """An averaging that read no other ticket: whether it is a step (of our 8 samples). It
    ends in COMPUTING, as one declared in the background (delayed updates) would: a read since
    its declaration may show a peer ahead, whose call `declare` would now refuse."""
    verdict = policy.averaged(AveragingResult(peers_seen=1), 8, now, now)
    if verdict.step:
        policy.hold(policy.held.step + 1, "d", own_signature(policy.held.step + 1))
    return verdict.step


def group_result(weight: float, *, complete: bool = True, members: int = 3) -> AveragingResult:
    report = RoundReport(chunks=[ChunkResult(0, 10, 3)])
    if not complete:
        report.dropped_senders["someone"] = "timed out"
        return AveragingResult(peers_seen=3, rounds=[report], skipped=["round 0: incomplete"])
    average = np.full(10, 0.25, dtype=np.float32)
    return AveragingResult(
        peers_seen=3, rounds=[report], average=average, weight=weight, members=members
    )


# ---------------------------------------------------------------------------- the machine


@pytest.mark.parametrize("phase", list(Phase))
@pytest.mark.parametrize("event", list(Event))
def test_every_phase_takes_only_the_events_its_row_of_the_table_names(phase, event):
    policy = make_policy()
    policy.phase = phase
    target = TRANSITIONS[phase].get(event)
    if target is None:
        with pytest.raises(PhaseError):
            policy._move(event)
        assert policy.phase is phase
    else:
        policy._move(event)
        assert policy.phase is target


def test_the_table_leads_from_start_to_stop_and_nothing_leaves_stopped():
    reachable, frontier = {Phase.STARTING}, [Phase.STARTING]
    while frontier:
        for target in TRANSITIONS[frontier.pop()].values():
            if target not in reachable:
                reachable.add(target)
                frontier.append(target)
    assert reachable == set(Phase)
    assert TRANSITIONS[Phase.STOPPED] == {}


def test_one_dedloc_step_walked_on_a_virtual_clock():
    """Two peers; we have the lowest id, so we call. Each row: what we know, what we do."""
    policy = make_policy()
    window = policy.timing.window(policy.store_seconds)
    peer = other("z1", samples_per_second=10.0)
    read(policy, peer)
    rate = dict(samples_per_second=10.0, batch_seconds=0.8)
    # 8 samples, and 2 x 10/s over the window: 48 of 64 by the gathering. Compute.
    assert policy.next_action(Local(samples=8, **rate), T0) == Compute()
    assert policy.phase is Phase.COMPUTING
    # 32, our quota (4 of the 8 micro-batches): we hold (the others' projections take our
    # count as final). Ours final, the other's 10/s over the window: 53 of 64. Wait.
    action = policy.next_action(Local(samples=32, **rate), T0 + 0.1)
    assert isinstance(action, Wait) and policy.take_changed()
    assert policy.phase is Phase.HOLDING and policy.own_record(Local(samples=32), T0).holding
    # Its record a second later: 16, and 20 more by the gathering, 68; we have the lowest
    # id: we call.
    now = T0 + 1.0
    read(policy, other("z1", samples=16, samples_per_second=10.0, updated_at=now), now=now)
    action = policy.next_action(Local(samples=32, **rate), now)
    # Time for the other to see the call (a progress interval), finish a micro-batch (twice
    # ours) and declare.
    called = policy.timing.window(policy.store_seconds, rate["batch_seconds"])
    assert called == pytest.approx(1.0 + 2 * 0.8 + 0.25) and called > window
    assert action == Call(on_grid(now + called)) and policy.take_changed()
    assert policy.own_record(Local(samples=32), now).call_step == 0
    assert isinstance(policy.next_action(Local(samples=32, **rate), now + 0.1), Wait)
    # Half the window before the close: declare, after one more read.
    gather_until = on_grid(now + called)
    action = policy.next_action(Local(samples=32, **rate), gather_until - window / 2)
    assert isinstance(action, Declare) and action.gather_until == gather_until
    assert policy.declare(gather_until, gather_until - window / 2, in_background=False)
    assert policy.phase is Phase.AVERAGING and policy.holding
    # An exact average of both: a step of the whole batch.
    verdict = policy.averaged(group_result(64, members=2), 32, gather_until, gather_until + 1)
    assert verdict.step and verdict.global_batch == 64 and verdict.members == 2
    policy.hold(1, "d1", own_signature(1))
    assert policy.phase is Phase.COMPUTING and policy.held.step == 1 and policy.call is None


def test_a_peer_declares_nowhere_once_an_earlier_call_or_a_step_past_ours_shows():
    policy = make_policy()
    read(policy, other("0", holding=True, samples=32))  # the lowest: it calls, not us
    assert isinstance(policy.next_action(Local(samples=32), T0), Wait)  # holding
    earlier = other("z2", call_step=0, gather_until=T0 + 1.0)
    read(policy, earlier)
    assert not policy.declare(T0 + 2.0, T0, in_background=False)
    past = rec(1, cosigners=(2,), step=1, digest="x")
    read(policy, past)
    assert not policy.declare(T0 + 2.0, T0, in_background=False)
    assert policy.phase is Phase.HOLDING and policy.call is None


def test_a_missed_gathering_is_not_joined_late_and_not_called_again():
    policy = make_policy()
    margin = policy.timing.declare_margin(policy.store_seconds)
    called = other("0", call_step=0, gather_until=T0 + 1.0)
    read(policy, called)
    assert policy.next_action(Local(), T0 + 1.0 - margin / 4) == Compute()  # too late
    # That call is the one we missed: it is no call of ours to wait for or declare in.
    assert policy._current_call(policy.view, T0 + 1.0) is None


def test_a_dedloc_peer_declares_while_a_slow_micro_batch_would_still_end_in_time():
    """A micro-batch may run twice its moving average beside busy peers (at 100 M one ran past
    the margin, and its peer missed the step it had called): a computing peer declares once
    a micro-batch of twice its average would end past the margin, not just one of it."""
    policy = make_policy()
    margin = policy.timing.declare_margin(policy.store_seconds)
    gather_until = T0 + 10.0
    read(policy, other("0", call_step=0, gather_until=gather_until))
    rate = dict(samples_per_second=1.0, batch_seconds=1.0)
    # Time for a slow micro-batch (and then some): compute.
    now = gather_until - margin - 2.5
    assert policy.next_action(Local(samples=8, **rate), now) == Compute()
    # An average micro-batch would end 0.5 s before the margin, a slow one 0.5 s past it.
    action = policy.next_action(Local(samples=8, **rate), now + 1.0)
    assert action == Declare(gather_until, read_for=margin / 4)


def test_a_torn_state_neither_computes_nor_calls_nor_declares_and_moves_nothing():
    """After a download into our tensors failed part-way (`Local.torn`), the moments when the
    peer would compute, call a step (which others then gather for) or declare are waits, and
    the policy's own state (a call recorded, holding) does not move."""
    rate = dict(samples_per_second=10.0, batch_seconds=1.0)
    policy = make_policy()
    assert isinstance(policy.next_action(Local(torn=True, **rate), T0), Wait)
    assert policy.next_action(Local(**rate), T0) == Compute()
    # With another peer's samples, ours make the batch and we have the lowest id: we would call.
    policy = make_policy()
    read(policy, other("z1", samples=16, samples_per_second=10.0))
    torn = policy.next_action(Local(samples=8, torn=True, **rate), T0)
    assert isinstance(torn, Wait) and policy.call is None
    assert not policy.own_record(Local(samples=8, torn=True), T0).holding
    assert isinstance(policy.next_action(Local(samples=8, **rate), T0), Call)
    # A call of someone else's, its gathering about to close: we would declare.
    policy = make_policy()
    margin = policy.timing.declare_margin(policy.store_seconds)
    gather_until = T0 + 10.0
    read(policy, other("0", call_step=0, gather_until=gather_until))
    now = gather_until - margin - 1.5
    assert isinstance(policy.next_action(Local(samples=8, torn=True, **rate), now), Wait)
    assert policy.next_action(Local(samples=8, **rate), now) == Declare(
        gather_until, read_for=margin / 4
    )


# ---------------------------------------------------------------------------- alone


def test_a_peer_that_read_no_other_ticket_steps_alone_only_once_nobody_is_left():
    """A step of our samples alone parts from everyone at our step or beyond; a peer cut off
    from the others (or one that missed their gathering) accumulates instead, until nobody at
    our step or beyond has been in view for `solo_after` seconds; and only where
    `averaging.min_group_size` = 1 lets one peer make a step (`peer.training.certificate`)."""
    policy = make_policy(min_group_size=1)
    solo = policy.timing.solo_wait
    read(policy, other("z1"))  # at our step
    assert not step_alone(policy, T0)
    read(policy, other("z1", step=5))  # ahead
    assert not step_alone(policy, T0 + 1)
    # Its record gone (left, or cut off from us): not yet, it was in view a moment ago.
    read(policy, now=T0 + 2)
    assert not step_alone(policy, T0 + 2)
    # solo_after seconds later nobody came back: the accumulated samples make our step.
    assert step_alone(policy, T0 + 1 + solo)
    assert policy.held.step == 1
    # With the default min_group_size = 2, never: a step of one certifies nothing.
    pair = make_policy()
    read(pair)
    assert not any(step_alone(pair, T0 + t * solo) for t in range(3))


def test_a_peer_ahead_waits_for_those_catching_up_but_not_for_one_stuck_behind():
    """The partition testbed run: a peer that had stepped alone during a 35 s cut was ahead
    after the heal, and stepped alone 19 more times while the others, behind, downloaded its
    state after each of its steps (8 downloads each) and never averaged with it."""
    policy = make_policy(min_group_size=1)
    solo = policy.timing.solo_wait
    assert step_alone(policy, T0) and step_alone(policy, T0 + 1)  # nobody seen: a lone first
    behind = other("z1", step=0, digest="x")
    read(policy, behind, now=T0 + 2)  # appeared: it is about to download
    assert not step_alone(policy, T0 + 2)
    read(policy, msgspec.structs.replace(behind, step=1), now=T0 + 100)  # caught up to 1
    assert not step_alone(policy, T0 + 100)
    # Stuck at step 1 for solo_after seconds: it holds us back no longer.
    read(policy, msgspec.structs.replace(behind, step=1), now=T0 + 100 + solo)
    assert step_alone(policy, T0 + 100 + 2 * solo)
    assert policy.held.step == 3


def test_a_peer_left_behind_when_the_collaboration_finished_stops_instead_of_stepping_alone():
    """The 5 Mbit testbed run: the others reached max_steps and left while a laggard was still
    downloading; it then stepped alone to the last step and ended on parameters nobody held."""
    policy = make_policy(max_steps=3)
    read(policy, rec(0, cosigners=(1,), step=3, digest="x"))
    assert isinstance(policy.next_action(Local(), T0), CatchUp)  # it downloads from them
    policy.fetched(ok=False, now=T0)
    read(policy, now=T0 + 1)  # they left (or a read missed them: wait solo_after)
    assert policy.next_action(Local(), T0 + 1) == Compute()
    later = T0 + 1 + policy.timing.solo_wait
    assert isinstance(policy.next_action(Local(), later), Stop)
    assert policy.phase is Phase.STOPPED and policy.held.step == 0
    # Without max_steps nothing changes.
    free = make_policy()
    read(free, rec(0, cosigners=(1,), step=3, digest="x"))
    read(free, now=T0 + 1)
    assert free.next_action(Local(), T0 + 1 + 10 * free.timing.solo_wait) == Compute()


# ---------------------------------------------------------------------------- settling


def finished(policy: StepPolicy, now: float) -> None:
    """At max_steps (3): the next action settles, and our record says so at once."""
    policy.hold(3, "d3", own_signature(3))
    policy.take_changed()
    policy.next_action(Local(), now)
    assert policy.phase in (Phase.SETTLING, Phase.STOPPED)
    assert policy.take_changed()


def stored(step: int, *cosigners: str) -> ProgressRecord:
    """Our own record as a read returns it: at `step`, signed by us and `cosigners`."""
    signatures = [own_signature(step), *(StepSignature(c, bytes(64)) for c in cosigners)]
    return other(ME, step=step, digest=f"d{step}", signatures=signatures)


def test_the_last_finished_peer_leaves_only_once_its_stored_record_certifies_the_step():
    """Settled peers withdraw their records as they stop. The last one's stored record carried
    only its own signature (the others' were merged, not yet stored): a status read between
    their leaving and its own saw the step uncertified, and global step 0 after step 29."""
    policy = make_policy(max_steps=3)
    peer = other("z1", step=3, digest="d3", signatures=[StepSignature("z1", bytes(64))])
    finished(policy, T0)
    policy.take_changed()
    read(policy, peer, stored(3))
    assert policy.take_changed()  # z1's signature merged: publish it
    assert {s.signer for s in policy.held.signatures} == {ME, "z1"}
    assert isinstance(policy.next_action(Local(), T0), Wait)  # everyone holds d3, but
    read(policy, peer, stored(3), now=T0 + 1)  # our stored record has our signature only
    assert isinstance(policy.next_action(Local(), T0 + 1), Wait)
    # z1 left (its signature stays ours); z2, at our step too, signed only for itself. Our
    # stored record certifies the step now, but z2's does not: were we to leave, z2's would be
    # the only record of the step, uncertified (the churn test's global step 0 after 29).
    z2 = other("z2", step=3, digest="d3", signatures=[StepSignature("z2", bytes(64))])
    read(policy, stored(3, "z1"), z2, now=T0 + 2)
    assert {s.signer for s in policy.held.signatures} == {ME, "z1", "z2"}
    assert isinstance(policy.next_action(Local(), T0 + 2), Wait)
    # z2 merged our signatures: its own record certifies the step too.
    z2 = msgspec.structs.replace(z2, signatures=[StepSignature(p, bytes(64)) for p in ("z2", ME)])
    read(policy, stored(3, "z1"), z2, now=T0 + 3)
    assert policy.next_action(Local(), T0 + 3) == Stop()
    # Where our stores keep failing: no longer than the usual bound, and everyone agreed.
    unstored = make_policy(max_steps=3)
    finished(unstored, T0)
    read(unstored, peer)
    patience = unstored.timing.settle_patience(unstored.store_seconds)
    assert isinstance(unstored.next_action(Local(), T0 + patience - 1), Wait)
    assert unstored.next_action(Local(), T0 + patience + 0.1) == Stop()


def test_a_finished_peer_waits_for_one_behind_it_up_to_a_download_deadline():
    """Finished peers used to leave after 2 gather_window + 4 progress_interval + 5 s (13 s)
    whatever the others did: a laggard mid-way through a 20 s download lost its donors."""
    policy = make_policy(max_steps=3)
    patience = policy.timing.settle_patience(policy.store_seconds)
    deadline = patience + policy.timing.download_timeout
    laggard = other("z1", step=1, digest="x")
    read(policy, laggard)
    finished(policy, T0)
    assert isinstance(policy.next_action(Local(), T0 + 40), Wait)
    caught_up = msgspec.structs.replace(laggard, step=3, digest="d3")
    read(policy, caught_up, stored(3, "z1"), now=T0 + 40)
    assert policy.next_action(Local(), T0 + 40) == Stop()
    # One that never catches up (e.g. a dead peer's record, not yet expired) is waited for no
    # longer than a download's deadline after the usual bound.
    stuck = make_policy(max_steps=3)
    read(stuck, laggard)
    finished(stuck, T0)
    assert isinstance(stuck.next_action(Local(), T0 + deadline - 1), Wait)
    assert isinstance(stuck.next_action(Local(), T0 + deadline), Stop)
    # One at our step and digest but downloading (two groups swapping digests at the end).
    fetching = make_policy(max_steps=3)
    read(fetching, other("z1", step=3, digest="d3", downloading=True))
    finished(fetching, T0)
    assert isinstance(fetching.next_action(Local(), T0 + patience + 1), Wait)
    # Nobody behind, one at our step on another digest: the usual bound.
    apart = make_policy(max_steps=3)
    read(apart, other("z1", step=3, digest="x"))
    finished(apart, T0)
    assert isinstance(apart.next_action(Local(), T0 + patience - 1), Wait)
    assert isinstance(apart.next_action(Local(), T0 + patience + 0.1), Stop)


def test_a_settling_peer_downloads_the_consensus_within_what_is_left_of_its_bound():
    policy = make_policy(max_steps=3)
    read(policy, rec(0, cosigners=(1,), step=3, digest="x"), rec(1, step=3, digest="x"))
    policy.hold(3, "d3", own_signature(3))  # our last step: a digest the others do not hold
    action = policy.next_action(Local(), T0)
    assert policy.phase is Phase.SETTLING
    assert isinstance(action, CatchUp) and action.target == 3
    deadline = policy.timing.settle_patience(0.0) + policy.timing.download_timeout
    assert action.within == pytest.approx(deadline)
    assert policy.own_record(Local(), T0).downloading
    policy.fetched(ok=False, now=T0 + 5)
    assert policy.phase is Phase.SETTLING and not policy.own_record(Local(), T0).downloading
    assert policy.next_action(Local(), T0 + 5).within == pytest.approx(deadline - 5)


# ---------------------------------------------------------------------------- results


def test_failed_averagings_warn_only_once_they_persist():
    policy = make_policy()
    outcomes = [False] * 4 + [True] + [False] * 14  # 4 failures, a step, 14 failures
    warned, failures = [], 0
    for gather_until, complete in enumerate(outcomes, start=1):
        assert policy.declare(gather_until, T0, in_background=False)
        verdict = policy.averaged(group_result(3, complete=complete), 8, gather_until, T0)
        if not verdict.step:
            failures += 1
            if verdict.warn:
                warned.append(failures)
    # The 3rd failure in a row warns, then the 13th, 23rd...; a step starts the count over.
    assert failures == 18 and warned == [3, 7, 17]


@pytest.mark.parametrize(
    ("samples", "weight", "complete", "steps"),
    [
        (8, 24, True, True),  # an ordinary step
        (0, 16, True, True),  # we had nothing, others did: the group's average still applies
        (0, 0, True, False),  # nobody had samples: nothing was averaged
        (8, 24, False, False),  # a member failed: our work waits for the next try
    ],
)
def test_a_group_result_is_a_step_only_if_exact_and_someone_contributed(
    samples, weight, complete, steps
):
    policy = make_policy()
    assert policy.declare(1.0, T0, in_background=False)
    verdict = policy.averaged(group_result(weight, complete=complete), samples, 1.0, T0)
    assert verdict.step == steps and not verdict.alone
    assert bool(verdict.reason) == (not complete)  # no sample at all is routine


@pytest.mark.parametrize(("weighting", "batch"), [("samples", 3.0), ("uniform", None)])
def test_a_uniformly_weighted_step_has_no_global_batch(weighting, batch):
    """With peers weighted equally the average's weight counts peers: it was logged and kept as
    the step's global batch ("8 local samples of 3")."""
    policy = make_policy(mode="diloco", outer_weighting=weighting)
    read(policy, other("z1"), other("z2"))
    assert policy.declare(1.0, T0, in_background=False)
    verdict = policy.averaged(group_result(3.0), 8, 1.0, T0)
    assert verdict.step and verdict.global_batch == batch


# ---------------------------------------------------------------------------- quotas, calls


def dedloc(*others: ProgressRecord, me_rate: float = 10.0) -> tuple[StepPolicy, float]:
    policy = make_policy()
    read(policy, *others)
    return policy, me_rate


def is_full(policy: StepPolicy, samples: int, now: float = T0, rate: float = 10.0) -> bool:
    view = policy.view_with(Local(samples=samples, samples_per_second=rate), now)
    return policy._batch_is_full(view, Local(samples=samples, samples_per_second=rate), now)


def test_a_dedloc_peer_stops_at_its_quota_of_the_target_batch():
    """Each peer computes its quota (by speed) of the target's micro-batches and holds: the
    global batch is the target, give or take a micro-batch per peer, however stale the
    records are (target 256 gave 160-704 before)."""
    policy, rate = dedloc(*(other(f"z{i}", samples_per_second=10.0) for i in range(3)))
    assert policy.quota(policy.view, Local(samples_per_second=rate)) == 2
    assert not is_full(policy, 8) and is_full(policy, 16)
    fast, _ = dedloc(*(other(f"z{i}", samples_per_second=10.0) for i in range(3)))
    assert fast.quota(fast.view, Local(samples_per_second=30.0)) == 4
    # A peer at another step, or downloading, takes no part in this step.
    apart, _ = dedloc(
        other("z1", samples_per_second=10.0, step=5),
        other("z2", samples_per_second=10.0, downloading=True),
    )
    assert apart.quota(apart.view, Local(samples_per_second=10.0)) == 8


def test_the_quotas_of_every_peer_add_up_to_the_target():
    """16 peers and a target of 8 micro-batches: half of them compute one, the others none
    and only receive the average (a share of half a micro-batch each, rounded, made every peer
    hold with nothing: 16 peers averaged zero samples again and again)."""
    peers = [f"p{i:02d}" for i in range(16)]
    rates = {peer: 10.0 + i for i, peer in enumerate(peers)}
    quotas = []
    for me in peers:
        policy = make_policy()
        policy.me = me
        read(policy, *(other(p, samples_per_second=rates[p]) for p in peers if p != me))
        quotas.append(policy.quota(policy.view, Local(samples_per_second=rates[me])))
    assert sum(quotas) == 8 and set(quotas) == {0, 1}
    assert quotas[-1] == 1  # the fastest gets one


def test_warming_up_peers_deal_quotas_from_the_rates_they_published():
    """Each peer deals from the records everyone reads, its own included: two peers whose
    first (slow) micro-batches were published at 10/s and who run at 30/s now each took
    themselves for the faster one (6 + 6 of 8 micro-batches: a global batch of 96)."""
    quotas = []
    for me, peer in (("a", "b"), ("b", "a")):
        policy = make_policy()
        policy.me = me
        read(policy, other(me, samples_per_second=10.0), other(peer, samples_per_second=10.0))
        quotas.append(policy.quota(policy.view, Local(samples_per_second=30.0)))
    assert quotas == [4, 4]


def trainers_at(step: int, rates: dict[str, float]) -> list[ProgressRecord]:
    """Trainers at `step` with these published rates (samples/s), nobody's samples yet."""
    return [
        other(peer, step=step, digest=f"d{step}", samples_per_second=rate)
        for peer, rate in rates.items()
    ]


def peer_policy(me: str) -> StepPolicy:
    policy = make_policy()
    policy.me = me
    return policy


def dealt_micro_batches(policy: StepPolicy) -> int:
    """The micro-batches `policy` computes toward its next step with nobody's samples in view
    (its own record in it): its quota."""
    count = 0
    while not is_full(policy, count * policy.config.task.micro_batch, rate=0.0):
        count += 1
    return count


def test_the_deal_rounds_each_share_down_or_up_and_averages_it_over_the_steps():
    """Systematic rounding, by hand: shares of 8/3 end to end, [0, 2.67), [2.67, 5.33),
    [5.33, 8), and step 0's points 0.5, 1.5, ..., 7.5: 3, 2, 3. Over the steps each quota
    averages its share; a rate not measured yet counts as the median one, and a share below
    1/REMEASURE_STEPS of a micro-batch is raised to it, from the others'."""
    assert deal(8, {"a": 1.0, "b": 1.0, "c": 1.0}, 0) == {"a": 3, "b": 2, "c": 3}
    rates = {"a": 5.0, "b": 3.0, "c": 1.0, "d": 0.0}  # d: as the median, 3
    split = shares(8, rates)
    assert split == pytest.approx({"a": 10 / 3, "b": 2.0, "c": 2 / 3, "d": 2.0})
    steps = 1000
    totals = dict.fromkeys(rates, 0)
    for step in range(steps):
        dealt = deal(8, rates, step)
        assert sum(dealt.values()) == 8, step
        for peer, quota in dealt.items():
            assert math.floor(split[peer]) <= quota <= math.ceil(split[peer]), (step, peer)
            totals[peer] += quota
    assert {peer: total / steps for peer, total in totals.items()} == pytest.approx(split, abs=0.01)
    crawl = shares(8, {"fast": 1e9, "slow": 1.0})
    assert crawl == pytest.approx({"fast": 8 - 1 / REMEASURE_STEPS, "slow": 1 / REMEASURE_STEPS})
    # Claims near the float's range overflow nothing; more peers than 8 x REMEASURE_STEPS
    # share equally.
    huge = shares(8, {"a": 1e308, "b": 1e308, "c": 1.0})
    assert huge == pytest.approx({"a": 3.95, "b": 3.95, "c": 0.1})
    crowd = shares(8, {f"p{i}": 1.0 + i for i in range(100)})
    assert set(crowd.values()) == {0.08}


def test_one_records_rate_claim_counts_for_at_most_a_few_times_the_median():
    """A record's rate is its own word: claiming 10^9 samples/s beside three peers at 1, it
    took 7.7 of 8 micro-batches and, computing nothing, shrank every step to a quarter of the
    target. It counts as MAX_RATE_CLAIM times the median."""
    split = shares(8, {"liar": 1e9, "a": 1.0, "b": 1.0, "c": 1.0})
    total = MAX_RATE_CLAIM + 3
    assert split == pytest.approx(
        {"liar": 8 * MAX_RATE_CLAIM / total, "a": 8 / total, "b": 8 / total, "c": 8 / total}
    )


def test_peers_whose_rates_are_not_known_yet_deal_the_target_among_themselves():
    """16 peers just started, none with a published rate (a peer's first micro-batch, torch's
    warm-up, is none), and 8 micro-batches: half of them compute one, the other half at the
    next step. Each computed one anyway (a rate never measured), and the benchmark's first
    step at 16 peers applied 512 for 256."""
    rates = dict.fromkeys((f"p{i:02d}" for i in range(16)), 0.0)
    turns = dict.fromkeys(rates, 0)
    for step in range(2):
        for peer in rates:
            policy = peer_policy(peer)
            policy.hold(step, f"d{step}", own_signature(step))
            read(policy, *trainers_at(step, rates))
            turns[peer] += dealt_micro_batches(policy)
        assert sum(turns.values()) == 8 * (step + 1), (step, turns)
    assert set(turns.values()) == {1}


def test_a_peer_dealt_next_to_nothing_computes_now_and_then_from_the_targets_micro_batches():
    """12 peers for 8 micro-batches, one published at 1/s against 1000/s (a restart whose
    warm-up micro-batch was slow, 19 of 22 steps idle in the churn test). Its share, at least
    1/REMEASURE_STEPS of a micro-batch, has it compute one about every REMEASURE_STEPS steps
    (its rate measured again), and the micro-batches dealt add up to the target's 8 at every
    step: a peer dealt none computed one on top, at its start and then every REMEASURE_STEPS
    steps, and 12 peers applied a mean of 305 for 256."""
    peers = [f"p{i:02d}" for i in range(12)]
    rates = dict.fromkeys(peers, 1000.0) | {"p05": 1.0}
    policies = {peer: peer_policy(peer) for peer in peers}
    turns = []
    for step in range(4 * REMEASURE_STEPS):
        dealt = {}
        for peer, policy in policies.items():
            policy.hold(step, f"d{step}", own_signature(step))
            read(policy, *trainers_at(step, rates))
            dealt[peer] = dealt_micro_batches(policy)
        assert sum(dealt.values()) == 8, (step, dealt)
        if dealt["p05"]:
            turns.append(step)
    gaps = [b - a for a, b in zip([-1, *turns[:-1]], turns, strict=True)]
    assert len(turns) == 4 and max(gaps) <= 1.5 * REMEASURE_STEPS, turns


def test_a_quota_is_dealt_once_a_step_and_again_only_when_the_trainers_change():
    """The published rates move with each record (moving averages): of three peers at about
    the same speed one was dealt 2 by a read and 3 by the next, and having held at 2 computed
    a third (a step applied the most each peer was dealt over its reads: 288 for 256). The
    deal stands for the step unless a trainer comes or goes."""
    policy = make_policy()  # "m", between "a" and "z"
    read(policy, *trainers_at(0, {"a": 9.5, ME: 9.5, "z": 10.5}))
    assert dealt_micro_batches(policy) == 2
    read(policy, *trainers_at(0, {"a": 9.2, ME: 9.7, "z": 10.8}))
    assert policy.quota(policy.view, Local()) == 3  # what this read alone deals us
    assert dealt_micro_batches(policy) == 2
    read(policy, *trainers_at(0, {"a": 9.2, ME: 9.7}))  # z left: dealt again
    assert dealt_micro_batches(policy) == 4
    policy.hold(1, "d1", own_signature(1))  # the next step: dealt again
    read(policy, *trainers_at(1, {"a": 9.2, ME: 9.7, "z": 10.8}))
    assert dealt_micro_batches(policy) == policy.quota(policy.view, Local()) == 2
    # While our averaging of step 2 runs in the background (delayed updates), our
    # micro-batches are step 3's: dealt as the peers that applied step 2 deal them.
    rates = {"a": 9.2, ME: 9.7, "z": 10.8}
    assert deal(8, rates, 1)[ME] == 2 and deal(8, rates, 2)[ME] == 3
    assert policy.quota(policy.view, Local(averaging=True)) == 3


def test_a_dedloc_peer_stops_when_the_others_already_hold_the_batch():
    policy, _ = dedloc(other("z1", samples=40, holding=True), other("z2", samples=20, holding=True))
    assert is_full(policy, 0)  # 60 >= 64 - 4: one more would overshoot
    # Their counts move on at their speed until they hold (projected at most 2 intervals on).
    moving, _ = dedloc(other("z1", samples=40, samples_per_second=10.0))
    assert not is_full(moving, 0)  # 40, and our share is 32
    assert is_full(moving, 0, now=T0 + 2 * moving.training.progress_interval)  # 40 + 10/s x 2 s


def test_only_the_lowest_trainer_calls_a_step_unless_it_stays_silent():
    """Two calls of a step made at nearly the same moment split it (8 peers in one process
    split 5-3): one caller, with a fallback in case it is gone."""
    low, _ = dedloc(other("z1", samples=40, holding=True))
    high, _ = dedloc(other("0", samples=40, holding=True, updated_at=T0))
    ours = Local(samples=24, samples_per_second=10.0)
    assert isinstance(low.next_action(ours, T0), Call)
    assert isinstance(high.next_action(ours, T0), Wait)  # the lowest calls
    fallback = high.timing.fallback_caller_wait(high.store_seconds)
    # The lowest stayed silent: its record is stale, or it holds and no call came.
    assert isinstance(high.next_action(ours, T0 + fallback + 0.1), Call)


def test_fallback_callers_take_turns_from_the_lowest_up():
    """When the lowest stays silent, the peers that wait for it do not all call at once (at
    300 simulated peers 36 did, within 2 s): each live peer between the lowest and us adds a
    turn, time enough for its call to be seen. A gone one (stale record) adds none."""
    silent = other("0", samples=20, holding=True, updated_at=T0)
    next_up, _ = dedloc(silent, other("a", samples=20, holding=True, updated_at=T0))
    ours = Local(samples=24, samples_per_second=10.0)
    assert isinstance(next_up.next_action(ours, T0), Wait)  # "m": "a" is between "0" and us
    fallback = next_up.timing.fallback_caller_wait(next_up.store_seconds)
    turn = next_up.timing.fallback_turn(next_up.store_seconds)
    assert turn > 0
    assert isinstance(next_up.next_action(ours, T0 + fallback + 0.1), Wait)  # "a"'s turn
    assert isinstance(next_up.next_action(ours, T0 + fallback + turn + 0.1), Call)
    # "a" is gone (its record stale): our turn comes right after the lowest's.
    gone = other("a", samples=20, holding=True, updated_at=T0 - next_up.timing.stale_record - 1)
    after_gone, _ = dedloc(silent, gone)
    assert isinstance(after_gone.next_action(ours, T0), Wait)
    assert isinstance(after_gone.next_action(ours, T0 + fallback + 0.1), Call)
    # A record dated far ahead of our clock (its peer's claim) looks no more alive than one
    # long stale: it adds no turn either.
    ahead = other("a", samples=20, holding=True, updated_at=T0 + 3600)
    after_ahead, _ = dedloc(silent, ahead)
    assert isinstance(after_ahead.next_action(ours, T0), Wait)
    assert isinstance(after_ahead.next_action(ours, T0 + fallback + 0.1), Call)

    # Ids ground below ours hold our fallback call back by MAX_FALLBACK_TURNS turns at most.
    def crowd(now: float) -> list[ProgressRecord]:  # 20 fresh records between "0" and us
        fresh = [other(f"a{i:02}", samples=1, holding=True, updated_at=now) for i in range(20)]
        return [silent, *fresh]

    held_back, _ = dedloc(*crowd(T0))
    longest = fallback + MAX_FALLBACK_TURNS * turn
    assert isinstance(held_back.next_action(ours, T0), Wait)
    for now, action in ((T0 + longest - 0.2, Wait), (T0 + longest + 0.1, Call)):
        read(held_back, *crowd(now), now=now)
        assert isinstance(held_back.next_action(ours, now), action)


def test_a_caller_done_with_its_own_quota_waits_for_the_collaboration():
    """Being done with one's own quota is not the batch being full: a step called then made
    the others declare half-way through theirs. Nor does a peer with nothing to do take over
    the call from a lowest peer that is still computing."""
    policy, _ = dedloc(other("z1", samples=8, samples_per_second=10.0))
    ours = Local(samples=32, samples_per_second=10.0)  # our quota: 4 of 8 micro-batches
    assert isinstance(policy.next_action(ours, T0), Wait)  # 40 of 64, and 20 more in 2 s
    read(policy, other("z1", samples=32, holding=True))
    assert isinstance(policy.next_action(ours, T0), Call)  # everyone holds
    # One that computes nothing never holds: it must not keep the step from being called.
    idle_other, _ = dedloc(other("z1", samples=0, samples_per_second=0.0))
    assert isinstance(idle_other.next_action(ours, T0), Call)
    # A peer with nothing done yet, while the lowest computes and publishes: no call of its
    # own, until a long wait says the lowest will not call.
    idle = make_policy()
    lowest = other("0", samples=40, samples_per_second=10.0, updated_at=T0)
    nothing = Local(samples=0, samples_per_second=10.0)  # 40 + 2 x 10/s x 2 s: ready
    fallback = idle.timing.fallback_caller_wait(0.0)
    window = idle.timing.window(0.0)
    for t in (0.0, fallback + 0.1):  # fresh records: the lowest is alive and computing
        read(idle, msgspec.structs.replace(lowest, updated_at=T0 + t), now=T0 + t)
        assert not isinstance(idle.next_action(nothing, T0 + t), Call)
    later = T0 + fallback + 4 * window + 0.2
    read(idle, msgspec.structs.replace(lowest, updated_at=later), now=later)
    assert isinstance(idle.next_action(nothing, later), Call)


def test_a_peer_one_step_behind_that_missed_our_step_holds_no_call():
    """One behind that voted on our step, or is a member of its plan, is about to step with
    us (its record was published before its step): we wait for it. One behind that is
    neither missed our step and will download it: waiting for it held every call while its
    machine was paused (a simulated volunteer paused a minute at step 3, and the five at step
    4 waited it out)."""
    policy = make_policy()
    policy.hold(1, "d1", own_signature(1))
    done = other("z1", step=1, digest="d1", samples=16, holding=True)
    ours = Local(samples=32, samples_per_second=10.0)
    paused = other("z2", samples=8, samples_per_second=10.0)  # at step 0, computing
    read(policy, done, paused)
    assert isinstance(policy.next_action(ours, T0), Call)
    plan = plan_of([ME, "z1", "z2"])
    vote = VoteRecord.of(Vote("z2", Candidate(1, "a1", plan), plan))
    voted = msgspec.structs.replace(paused, vote=vote)
    waiting = make_policy()
    waiting.hold(1, "d1", own_signature(1))
    read(waiting, done, voted)
    assert isinstance(waiting.next_action(ours, T0), Wait)
    # A member of our step's plan whose vote has not landed yet (a partial average defers it).
    member = make_policy()
    member.hold(1, "d1", own_signature(1), electorate=plan)
    assert member.learn_members([ME, "z1", "z2"])
    read(member, done, paused)
    assert isinstance(member.next_action(ours, T0), Wait)


def test_a_member_downloading_our_step_holds_the_call_for_a_grace_at_most():
    """At 100 simulated peers, 30 of every gathering "missed the gathering" right after a
    download of the step before: a peer that misses a step downloads it while the next is
    called, for ever. A fresh record of a member of our step's electorate downloading our
    step holds our call (one behind, or at our step on another digest), at most
    `download_grace` from the first time it did; a stranger's, or a stale one (a paused
    machine), holds nothing."""
    ours = Local(samples=32, samples_per_second=10.0)
    done = other("z1", step=1, digest="d1", samples=16, holding=True)
    plan = plan_of([ME, "z1", "z2"])

    def policy_reading(*records: ProgressRecord, now: float = T0) -> StepPolicy:
        policy = make_policy()
        policy.hold(1, "d1", own_signature(1), electorate=plan)
        assert policy.learn_members([ME, "z1", "z2"])
        read(policy, *records, now=now)
        return policy

    assert isinstance(policy_reading(done).next_action(ours, T0), Call)
    for downloader in (
        other("z2", downloading=True),  # one behind
        other("z2", step=1, digest="dx", downloading=True),  # at our step, on another digest
    ):
        policy = policy_reading(done, downloader)
        assert isinstance(policy.next_action(ours, T0), Wait)
        grace = policy.timing.download_grace(policy.store_seconds)
        later = T0 + grace - 0.1
        fresh = msgspec.structs.replace(downloader, updated_at=later)
        read(policy, done, fresh, now=later)
        assert isinstance(policy.next_action(ours, later), Wait)
        # Its download done, it holds our step: we call at once.
        arrived = msgspec.structs.replace(
            fresh, step=1, digest="d1", downloading=False, holding=True
        )
        read(policy, done, arrived, now=later)
        assert isinstance(policy.next_action(ours, later), Call)
    # However long its record goes on saying it downloads: one grace from our first wait.
    stuck = policy_reading(done, other("z2", downloading=True))
    assert isinstance(stuck.next_action(ours, T0), Wait)
    grace = stuck.timing.download_grace(stuck.store_seconds)
    read(stuck, done, other("z2", downloading=True, updated_at=T0 + grace), now=T0 + grace)
    assert isinstance(stuck.next_action(ours, T0 + grace), Call)
    # A stranger to the electorate, a stale record (its machine paused), or a joiner
    # downloading from far behind: no wait.
    assert isinstance(
        policy_reading(done, other("y9", downloading=True)).next_action(ours, T0), Call
    )
    stale_at = T0 + stuck.timing.stale_record + 1
    paused = policy_reading(done, other("z2", downloading=True), now=stale_at)
    assert isinstance(paused.next_action(ours, stale_at), Call)
    joiner = policy_reading(done, other("z2", step=0, downloading=True))
    joiner.hold(3, "d3", own_signature(3), electorate=plan)
    read(joiner, msgspec.structs.replace(done, step=3, digest="d3"), other("z2", downloading=True))
    assert isinstance(joiner.next_action(ours, T0), Call)


def test_after_a_failed_averaging_nobody_calls_while_others_are_still_in_it():
    """A call of ours while others are still in an averaging we missed (or that failed for
    us) would close before they are free: they would miss it and the step would split."""
    policy, _ = dedloc(other("z1", call_step=0, gather_until=T0 - 0.5, holding=True))
    ours = Local(samples=32, samples_per_second=10.0)
    assert isinstance(policy.next_action(ours, T0), Wait)  # missed: they are in it
    assert isinstance(policy.next_action(ours, T0 + 1), Wait)  # still in it
    read(policy, other("z1", holding=True), now=T0 + 1)  # done with it
    assert isinstance(policy.next_action(ours, T0 + 1), Call)
    # At most as long as an averaging may take, whatever their record goes on saying.
    stuck, _ = dedloc(other("z1", call_step=0, gather_until=T0 - 0.5, holding=True))
    stuck.next_action(ours, T0)
    longest = stuck.longest_averaging(stuck.view, ours)
    assert isinstance(stuck.next_action(ours, T0 + longest - 1), Wait)
    assert isinstance(stuck.next_action(ours, T0 + longest), Call)


def test_a_few_still_in_a_failed_averaging_do_not_hold_the_step_of_the_many():
    """At 100 simulated peers, 12 still in a failed averaging held 47 ready peers for 148 s.
    Below a third of the trainers at our step, the rest call without them (they download)."""
    ours = Local(samples=32, samples_per_second=10.0)

    def collaboration(still: int, free: int) -> StepPolicy:
        records = [
            other(f"zs{i:02}", call_step=0, gather_until=T0 - 0.5, holding=True, samples=8)
            for i in range(still)
        ] + [other(f"zf{i:02}", holding=True, samples=8) for i in range(free)]
        policy, _ = dedloc(*records)
        assert isinstance(policy.next_action(ours, T0), Wait)  # we missed their gathering
        return policy

    # 2 of the 10 trainers at our step still in it: we call.
    assert isinstance(collaboration(still=2, free=7).next_action(ours, T0 + 1), Call)
    # 4 of 10: a third or more, we wait for them.
    assert isinstance(collaboration(still=4, free=5).next_action(ours, T0 + 1), Wait)


def test_how_long_others_may_still_be_averaging_grows_with_the_vector():
    """A fixed 30 s was shorter than one round of a 400 MB vector at 50 MB/s, and a peer
    called the step while the others were still in it."""
    config = PeerConfig(averaging=AveragingConfig(min_bandwidth=1.0))
    policy = StepPolicy(me=ME, config=config, vector_size=1000)
    averaging = config.averaging
    fixed = 4 * averaging.join_timeout + 2 * averaging.timeout_floor
    unmeasured = longest_averaging(1000, 0, [], averaging)  # the floors alone
    assert policy.longest_averaging(policy.view, Local()) == max(fixed, unmeasured)
    rate = 4 * 1000 / 40.0  # bytes/s: the float32 vector takes 40 s
    longest = policy.longest_averaging(policy.view, Local(bandwidth=rate))
    assert longest > 2 * 40.0 * averaging.timeout_multiplier > fixed
    # However slow our link: a record claiming to be in a failed averaging holds calls 10 min.
    assert policy.longest_averaging(policy.view, Local(bandwidth=1.0)) == MAX_WAIT_FOR_OTHERS


def test_a_diloco_peer_takes_exactly_its_inner_steps_and_calls_once_everyone_did():
    """H was a minimum: peers kept taking inner steps until the gathering (29-31 with H = 10)."""
    policy = make_policy(mode="diloco", inner_steps=3)
    read(policy, other("z1", samples=8))
    assert policy.next_action(Local(samples=16), T0) == Compute()
    assert isinstance(policy.next_action(Local(samples=24), T0), Wait)  # exactly H: no more
    read(policy, other("z1", samples=24, holding=True))
    assert isinstance(policy.next_action(Local(samples=24), T0), Call)


# ---------------------------------------------------------------------------- hostile records


def test_a_state_downloads_only_for_a_certified_step():
    """One peer's record at a higher step used to send everyone to download its state."""
    policy = make_policy()
    read(policy, rec(0, step=2, digest="x"))
    assert policy.view.global_step == 0 and policy.next_action(Local(), T0) == Compute()
    read(policy, rec(0, cosigners=(1,), step=2, digest="x"))  # two signers: the step counts
    action = policy.next_action(Local(), T0)
    assert isinstance(action, CatchUp) and [r.peer_id for r in action.donors] == [PEERS[0]]


def test_a_call_far_ahead_holds_nobody():
    """One peer's call of the next step 11 days ahead used to be the earliest call forever."""
    policy = make_policy()
    far = other("z1", call_step=0, gather_until=T0 + 11 * 86400)
    read(policy, far)
    assert policy._current_call(policy.view, T0) is None
    read(policy, far, other("z2", call_step=0, gather_until=T0 + 2))
    assert policy._current_call(policy.view, T0) == T0 + 2


def test_training_stops_at_the_target_on_our_own_validation_or_a_quorum():
    """One peer reporting a validation loss under the target used to end everyone's training."""
    liar = other("z1", validation_loss=0.01, validation_step=99)
    policy = make_policy(target_validation_loss=2.9)
    read(policy, liar)
    assert policy.next_action(Local(), T0) == Compute()
    assert isinstance(policy.next_action(Local(validation=(0, 2.5)), T0), Stop)  # our own
    quorum = make_policy(target_validation_loss=2.9)
    read(quorum, liar, other("z2", validation_loss=2.0, validation_step=99))
    assert isinstance(quorum.next_action(Local(validation=(0, 3.5)), T0), Stop)


def test_a_step_nobody_else_applied_is_given_up_for_the_certified_one():
    """Two peers under load: one's averaging completed, the other's did not. The first held a
    step only it signed, the second could neither download it nor average a step apart: both
    called their own steps for ever. The one stranded ahead goes back to the certified step."""
    policy = make_policy()
    policy.hold(1, "d1", own_signature(1))  # our averaging completed; the partner's did not
    behind = rec(0, step=0, digest="d0")
    read(policy, behind)
    assert policy.next_action(Local(), T0) == Compute()
    patience = policy.timing.settle_patience(policy.store_seconds)
    read(policy, behind, now=T0 + patience)
    action = policy.next_action(Local(), T0 + patience)
    assert isinstance(action, CatchUp) and action.target == 0
    # A step the partner signed too is never given up.
    held = make_policy()
    held.hold(1, "d1", own_signature(1))
    partner = rec(0, step=1, digest="d1")
    read(held, partner)
    read(held, partner, now=T0 + 10 * patience)
    assert held.next_action(Local(), T0 + 10 * patience) == Compute()


def test_slow_dht_stores_widen_the_gathering_window_and_the_declare_margin():
    """Over high-latency links a 2 s window closed before tickets landed (issue 7 testbed)."""
    policy = make_policy()
    timing = policy.timing
    configured = policy.training.gather_window
    assert timing.window(policy.store_seconds) == configured
    assert timing.declare_margin(policy.store_seconds) == min(configured / 4, 1.0)
    policy.note_store_time(0.01)  # a loopback store changes nothing
    assert timing.window(policy.store_seconds) == configured
    for _ in range(10):
        policy.note_store_time(1.5)  # a store over a 160 ms RTT path: several round trips
    assert policy.store_seconds == pytest.approx(1.5, rel=0.05)
    window = timing.window(policy.store_seconds)
    margin = timing.declare_margin(policy.store_seconds)
    assert window >= STORES_PER_WINDOW * 1.4 and margin >= 2 * 1.4
    assert window > margin + 1.0  # time left to compute
    # However slow: no wider than the furthest ahead anyone believes a call.
    assert timing.window(1e6) == timing.max_window < timing.latest_call(0.0)
    # Internet round trips (stores of 0.6 s): our record with the call lands, another peer
    # reads it within a progress interval and a read's time, finishes its micro-batch and
    # declares before the margin (with 2.4 s most peers of a simulated collaboration missed
    # every call, `simulation/`).
    store, batch = 0.6, 0.25
    assert timing.window(store, batch) >= (
        2 * store + timing.progress_interval + SLOW_BATCH * batch + timing.declare_margin(store) / 2
    )


def test_a_call_leaves_a_slow_peer_time_for_its_micro_batch():
    """A caller's window covers the others' micro-batches (their records' speed), not only
    its own: a fast caller left the slow peers of a simulated collaboration out of its steps."""
    policy = make_policy()
    rate = dict(samples_per_second=10.0, batch_seconds=0.8)
    read(policy, other("z1", samples_per_second=4.0))  # 8-sample micro-batches: 2 s each
    assert policy.next_action(Local(samples=8, **rate), T0) == Compute()
    now = T0 + 1.0
    read(policy, other("z1", samples=28, samples_per_second=4.0, updated_at=now), now=now)
    action = policy.next_action(Local(samples=40, **rate), now)
    assert action == Call(on_grid(now + policy.timing.window(policy.store_seconds, 2.0)))
    assert action.gather_until == on_grid(now + 1.0 + SLOW_BATCH * 2.0 + 0.25)


def test_a_record_claiming_a_crawl_widens_a_call_only_so_far():
    policy = make_policy()
    ours = Local(samples_per_second=10.0, batch_seconds=0.8)

    def batch(*records: ProgressRecord) -> float:
        read(policy, *records)
        return policy._call_batch_seconds(policy.view, ours, T0)

    crawl = other("z0", samples_per_second=1e-300)
    # However few we are, a claim counts for at most SLOW_CLAIM times the lower median.
    assert batch(crawl) == SLOW_CLAIM * 0.8
    # Among eleven others at our speed, one crawling is past the 90th percentile.
    peers = [other(f"z{i}", samples_per_second=10.0) for i in range(1, 11)]
    assert batch(crawl, *peers) == 0.8
    # Records of peers with no micro-batch under way (holding, downloading) or silent count
    # for nothing.
    slow = dict(samples_per_second=2.0)
    assert batch(other("z1", holding=True, **slow)) == 0.8
    assert batch(other("z1", downloading=True, **slow)) == 0.8
    stale = T0 - 2 * policy.timing.stale_record
    assert batch(other("z1", updated_at=stale, **slow)) == 0.8
    assert batch(other("z1", **slow)) == SLOW_CLAIM * 0.8  # 4 s, capped at 3.2


def test_a_record_carries_enough_signatures_to_certify_alone_and_no_more():
    """At 16 signatures a record was 2.5 KB, and a 192 KiB DHT reply held ~80 records: each
    peer of a simulated 100 read 85 % of the others' (docs/scale.md). It carries its own and
    the lowest others', `carried(quorum)` in all: enough to certify after they leave."""
    policy = make_policy(min_group_size=2)
    policy.hold(3, "d", own_signature(3))
    read(policy, *(rec(i, step=3, digest="d") for i in range(len(PEERS))))
    ours = policy.own_record(Local(), T0).signatures
    assert len(PEERS) > CARRIED_SIGNATURES == carried(2) == len(ours)
    assert ours[0] == own_signature(3)
    assert [s.signer for s in ours[1:]] == sorted(PEERS)[: CARRIED_SIGNATURES - 1]
    # A larger quorum is carried whole, up to what a reader accepts.
    assert carried(6) == 6 and carried(100) == MAX_SIGNATURES


SIGNERS = ["a", "b", "c", "d", "e", "n", "o", "p", "x", "y", "z"]


@given(
    st.lists(
        st.lists(
            st.tuples(st.sampled_from(SIGNERS), st.lists(st.sampled_from(SIGNERS), max_size=5)),
            max_size=4,
        ),
        min_size=1,
        max_size=4,
    ),
    st.integers(2, 4),
)
def test_a_read_carries_the_signatures_a_merge_of_every_record_at_our_step_would(reads, quorum):
    """What a read leaves us carrying is what merging every other record's signatures of our
    step would (ours first, then the smallest signers, `carried(quorum)` in all), whether the
    read is worked out from its records or, with nothing new to carry, from its signers."""
    policy = make_policy(min_group_size=quorum)
    policy.hold(3, "d", own_signature(3))
    limit = carried(quorum)
    for records in reads:
        view = [
            other(
                peer, step=3, digest="d", signatures=[StepSignature(s, bytes(64)) for s in signed]
            )
            for peer, signed in records
        ]
        held = policy.held.signatures
        merged = merge_signatures(
            held[0], [*held[1:], *(s for r in view for s in r.signatures)], limit=limit
        )
        expected = {s.signer for s in merged}
        read(policy, *view, stored(3, *(s.signer for s in held[1:])))
        assert {s.signer for s in policy.held.signatures} == expected


def test_backoff_after_failed_downloads_doubles_and_a_success_resets_it():
    policy = make_policy()
    read(policy, rec(0, cosigners=(1,), step=2, digest="x"))
    waits = []
    for ok in [False] * 8 + [True, False]:
        assert isinstance(policy.next_action(Local(), T0), CatchUp)
        waits.append(policy.fetched(ok=ok, now=T0))
        if ok:  # (as the executor's `hold` would): a new state, then behind again
            policy.hold(0, "d0", own_signature(0))
    interval = policy.training.progress_interval
    doubling = [min(interval * 2**i, 30.0) for i in range(8)]
    assert waits[:8] == doubling and doubling[-1] == 30.0
    assert waits[8] == 0 and waits[9] == interval
    assert not math.isinf(waits[-1])


def test_two_calls_made_a_moment_apart_name_one_gathering():
    """Two peers whose views name another lowest caller call at nearly the same moment: on
    the grid their calls close together, one gathering (at 100 simulated peers, calls 24 and
    18 strong, 0.1 s apart, split a step)."""
    ours = Local(samples=32, samples_per_second=10.0)
    first, second = dedloc(other("z1", samples=32, holding=True))[0], make_policy(me="n")
    read(second, other("z1", samples=32, holding=True))
    a, b = first.next_action(ours, T0 + 0.2), second.next_action(ours, T0 + 0.5)
    assert isinstance(a, Call) and isinstance(b, Call)
    assert a.gather_until == b.gather_until == on_grid(a.gather_until)


def test_slow_reads_of_the_records_widen_a_call_s_window():
    """At 100 simulated peers a read of the records took longer than a store, and most
    peers saw each 2-3 s call too late to declare in it."""
    ours = Local(samples=32, samples_per_second=10.0)

    def called(read_seconds: float) -> float:
        policy, _ = dedloc(other("z1", samples=32, holding=True))
        policy.note_store_time(0.2)
        policy.note_read_time(read_seconds)
        action = policy.next_action(ours, T0)
        assert isinstance(action, Call)
        return action.gather_until

    assert called(0.1) == called(0.2)  # a read no slower than a store: as before
    slow = called(4.0)
    assert slow >= T0 + 0.2 + 4.0 + 1.0  # the call lands, a read starts and ends
    assert slow > called(0.2)


def test_a_download_asks_reachable_donors_first_each_downloader_in_its_own_order():
    """Donors behind NAT (a relayed address announced) come after the reachable ones, and
    keepers last; within each class every downloader has an order of its own, so that
    downloads spread over the holders rather than all asking the same few first."""
    from peer.training.policy import donor_order

    relayed = "/ip4/198.51.100.1/tcp/4001/p2p/12D3KooRelay/p2p-circuit/p2p/12D3KooNated"
    direct = "/ip4/203.0.113.7/tcp/4001"
    holders = [other(f"n{i}", addrs=[direct, relayed]) for i in range(10)]
    holders += [other(f"p{i}", addrs=[direct]) for i in range(10)]
    holders.append(msgspec.structs.replace(other("k0", addrs=[direct]), role="keeper"))
    orders = [[r.peer_id for r in donor_order(holders, me)] for me in ("a", "b", "c")]
    for order in orders:
        assert {p[0] for p in order[:10]} == {"p"} and {p[0] for p in order[10:20]} == {"n"}
        assert order[-1] == "k0"
    assert len({tuple(order[:3]) for order in orders}) == 3  # each asks other donors first
