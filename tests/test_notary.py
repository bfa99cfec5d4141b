"""The genesis notary (`peer.training.notary`): one registered genesis per step whatever the
views, as two plans with disjoint views play it (the fork it exists for), its checks on a
claim, its registry across a restart, and its client's caps on the answer."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import msgspec
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.errors import ConfigError, RemoteError, RpcError
from peer.training.notary import (
    CLAIM_SECONDS,
    FRONTIER_SECONDS,
    NOT_READY_SECONDS,
    READ_WAIT,
    REGISTRY_FILE,
    SETTLE_SECONDS,
    Claim,
    Frontier,
    GenesisRegistry,
    NotaryService,
    Verdict,
    claim_genesis,
    frontier_of,
    notary_of,
)
from peer.training.policy import Outcome, StepPolicy
from peer.training.progress import ProgressRecord, VoteRecord
from peer.training.steprule import Candidate, Vote, plan_of
from tests.test_policy import T0, make_policy, other, read


def peer_id(seed: int) -> ID:
    return ID.from_pubkey(create_new_key_pair(bytes([seed]) * 32).public_key)


def first_step(name: str, members: list[str]) -> Candidate:
    return Candidate(1, name, plan_of(members))


BIG = [f"b{i}" for i in range(9)]
SMALL = [f"s{i}" for i in range(3)]
# The notary's read: everyone at step 0, the initial state "d0" (its digest).
AT_STEP_0 = Frontier(0, "d0", frozenset(BIG + SMALL))


def claim(
    registry: GenesisRegistry,
    claimant: str,
    candidate: Candidate,
    now: float,
    *,
    members: list[str] | None = None,
    frontier: Frontier | None = AT_STEP_0,
    parent: str = "d0",
) -> Candidate | float:
    if members is None:
        members = BIG if claimant.startswith("b") else SMALL
    return registry.claim(claimant, candidate, parent, frozenset(members), frontier, now)


def test_two_plans_each_certified_in_their_view_get_one_registration():
    """The fork a genesis had (300 simulated peers, 60 % of reads covered: a plan of 39 that
    saw 42 trainers and one of 147 each took step 1): both claim; after the settle time the
    plan with the most claimants is the step's, and every later claim is answered with it.
    The small plan counts here because the notary reads only it and two of the big one's."""
    registry = GenesisRegistry(min_votes=2)
    big, small = first_step("big", BIG), first_step("small", SMALL)
    partial = Frontier(0, "d0", frozenset(SMALL + BIG[:2]))  # a read that missed most of BIG
    assert claim(registry, "s0", small, T0, frontier=partial) == NOT_READY_SECONDS
    assert claim(registry, "s1", small, T0 + 1, frontier=partial) == SETTLE_SECONDS  # ready
    for i, member in enumerate(BIG[:5]):
        assert isinstance(claim(registry, member, big, T0 + 2 + i / 2), float)
    # Settled: 5 claimants against 2; everyone hears the same from now on, whatever it claims.
    assert claim(registry, "s2", small, T0 + SETTLE_SECONDS, frontier=partial) == 1.0
    assert claim(registry, "b8", big, T0 + 1 + SETTLE_SECONDS) == big
    assert claim(registry, "s2", small, T0 + SETTLE_SECONDS + 2) == big
    assert claim(registry, "s0", small, T0 + 1000 * CLAIM_SECONDS, frontier=None) == big
    assert registry.registered == {(1, "d0"): big}


def test_a_few_identities_with_a_plan_of_their_own_register_nothing():
    """Review: two throw-away identities claimed step 1 for a plan of themselves before any
    honest plan, and the notary registered it for good: every honest election then lost to a
    state nobody held. Then a plan padded with names nobody runs, or with honest trainers'
    ids, passed as a majority. Now only trainers the notary reads count, the claimant among
    them, and a padded plan still needs claims from more than a third of it."""
    registry = GenesisRegistry(min_votes=2)
    sybils = first_step("sybil", ["x0", "x1"])
    for claimant in ("x0", "x1"):
        with pytest.raises(RpcError, match="no progress record of the claimant"):
            claim(registry, claimant, sybils, T0, members=["x0", "x1"])
    with_records = AT_STEP_0._replace(trainers=AT_STEP_0.trainers | {"x0", "x1"})
    with pytest.raises(RpcError, match="no majority"):  # 2 of 14
        claim(registry, "x0", sybils, T0, members=["x0", "x1"], frontier=with_records)
    names = ["x0", "x1", *(f"ghost{i}" for i in range(20))]
    with pytest.raises(RpcError, match="no majority"):  # padded with names: still 2 of 14
        claim(registry, "x0", first_step("ghosts", names), T0, members=names, frontier=with_records)
    assert registry._claims == {}  # nothing held for them
    # Padded with the honest trainers' ids: a majority, but 2 claimants of 14 register nothing.
    padded = ["x0", "x1", *BIG, *SMALL]
    hijack = first_step("hijack", padded)
    for now in (T0, T0 + SETTLE_SECONDS, T0 + 2 * SETTLE_SECONDS):
        for claimant in ("x0", "x1"):
            answer = claim(registry, claimant, hijack, now, members=padded, frontier=with_records)
            assert answer == NOT_READY_SECONDS
    assert registry.registered == {}
    # Nor ahead of the collaboration: a step after a state the notary reads nobody holding.
    ahead = Candidate(7, "ahead", plan_of(BIG))
    with pytest.raises(RpcError, match="another state"):
        claim(registry, "b0", ahead, T0, parent="d6")
    with pytest.raises(RpcError, match="another state"):
        claim(registry, "b0", first_step("big", BIG), T0, parent="not-d0")
    with pytest.raises(RpcError, match="another state"):
        claim(registry, "b0", first_step("big", BIG), T0, frontier=None)  # nothing read


def test_registrations_are_kept_per_parent_state():
    """A registration of a step made from one state answers nothing for another: a group that
    once held the records' plurality with a state of its own blocks no honest genesis."""
    registry = GenesisRegistry(min_votes=1)
    fake = Frontier(4, "fake", frozenset(BIG))
    ours = Frontier(4, "d4", frozenset(BIG))
    theirs, honest = Candidate(5, "theirs", plan_of(BIG)), Candidate(5, "honest", plan_of(BIG))
    for now in (T0, T0 + SETTLE_SECONDS):
        for member in BIG[:4]:
            answer = claim(registry, member, theirs, now, frontier=fake, parent="fake")
    assert answer == theirs
    for now in (T0, T0 + SETTLE_SECONDS):
        for member in BIG[:4]:
            answer = claim(registry, member, honest, now, frontier=ours, parent="d4")
    assert answer == honest
    assert registry.registered == {(5, "fake"): theirs, (5, "d4"): honest}


def test_a_candidate_needs_a_third_of_its_plan_and_min_votes():
    registry = GenesisRegistry(min_votes=2)
    big = first_step("big", BIG)
    for member in BIG[:3]:  # 3 of 9: not more than a third
        assert claim(registry, member, big, T0) == NOT_READY_SECONDS
    assert claim(registry, BIG[3], big, T0) == SETTLE_SECONDS  # 4 of 9: settling from now
    assert claim(registry, BIG[3], big, T0 + SETTLE_SECONDS) == big
    # min_votes: one member of a plan of one does not register it.
    alone = GenesisRegistry(min_votes=2)
    one = first_step("one", ["x"])
    only_x = Frontier(0, "d0", frozenset({"x"}))
    for now in (T0, T0 + SETTLE_SECONDS):
        assert claim(alone, "x", one, now, members=["x"], frontier=only_x) == NOT_READY_SECONDS


def test_a_claimant_counts_once_with_its_latest_claim_and_claims_expire():
    """A member counts for one candidate: its retry's claim replaces its first (else a plan
    that stalled held its members' claims). A claim not renewed within `CLAIM_SECONDS` counts
    no more (review: claims outlived the averages they named, and the notary registered one
    nobody held any more)."""
    registry = GenesisRegistry(min_votes=1)
    first, retry = first_step("first", BIG), first_step("retry", BIG)
    for member in BIG[:4]:
        claim(registry, member, first, T0)
    for member in BIG[:4]:
        claim(registry, member, retry, T0 + 1)
    assert claim(registry, BIG[0], retry, T0 + 1 + SETTLE_SECONDS) == retry
    # The same claimant claiming again does not count twice.
    twice = GenesisRegistry(min_votes=1)
    for _ in range(9):
        claim(twice, "b0", first, T0)
    assert claim(twice, "b0", first, T0 + SETTLE_SECONDS) == NOT_READY_SECONDS
    # Four claims of a plan that then gave up: gone after CLAIM_SECONDS, nothing registered.
    stale = GenesisRegistry(min_votes=1)
    for member in BIG[:4]:
        claim(stale, member, first, T0)
    later = T0 + CLAIM_SECONDS
    assert claim(stale, BIG[4], retry, later) == NOT_READY_SECONDS
    assert claim(stale, BIG[4], retry, later + SETTLE_SECONDS) == NOT_READY_SECONDS
    assert stale.registered == {}


def test_a_registration_that_cannot_be_saved_is_none():
    """Review: a failed save still registered in memory, and after a restart another candidate
    was registered. Saved first, or not at all."""
    saved: list[object] = []

    def full_disk(state: dict[str, object]) -> None:
        raise OSError(28, "No space left on device")

    registry = GenesisRegistry(min_votes=1, save=full_disk)
    big = first_step("big", BIG)
    for member in BIG[:4]:
        claim(registry, member, big, T0)
    with pytest.raises(RpcError, match="cannot save"):
        claim(registry, BIG[0], big, T0 + SETTLE_SECONDS)
    assert registry.registered == {}
    registry.save = saved.append
    assert claim(registry, BIG[0], big, T0 + SETTLE_SECONDS) == big
    assert saved == [{"registered": [[1, "d0", "big", big.plan.digest, big.plan.size]]}]


def test_the_frontier_is_what_most_trainers_hold():
    def record(peer: str, step: int, digest: str, **fields: object) -> ProgressRecord:
        return other(peer, step=step, digest=digest, **fields)

    records = [
        *(record(f"a{i}", 3, "d3") for i in range(4)),
        *(record(f"x{i}", 900, "fake") for i in range(3)),  # a few claim a step far ahead
        record("b0", 4, "d4"),
        record("l0", 3, "d3", leaving=True),
        record("k0", 3, "d3", role="keeper"),
        record("c0", 2, "d2", downloading=True),
    ]
    assert frontier_of(records) == Frontier(3, "d3", frozenset({"a0", "a1", "a2", "a3", "b0"}))
    assert frontier_of([]) is None


class FakeHost:
    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}

    def set_stream_handler(self, protocol: str, handler: object) -> None:
        self.handlers[protocol] = handler


def service(directory: Path | None, clock: list[float], read_seconds: float = 0.0) -> NotaryService:
    """A notary whose reads show the trainers of `IDS` at step 0 (each read taking
    `read_seconds`); its `run` is started by `running`."""
    reads: list[float] = []

    async def read_records() -> list[ProgressRecord]:
        reads.append(clock[0])
        await trio.sleep(read_seconds)
        return [other(p.to_base58()) for p in IDS]

    notary = NotaryService(
        FakeHost(),  # type: ignore[arg-type]
        GenesisRegistry(min_votes=1),
        read_records=read_records,
        directory=directory,
        clock=lambda: clock[0],
        max_message_bytes=1 << 20,
    )
    notary.reads = reads  # type: ignore[attr-defined]
    return notary


@asynccontextmanager
async def running(notary: NotaryService) -> AsyncIterator[None]:
    async with trio.open_nursery() as nursery:
        await nursery.start(notary.run)
        yield
        nursery.cancel_scope.cancel()


IDS = [peer_id(i) for i in range(3)]
MEMBERS = [p.to_base58() for p in IDS]


def claim_of(candidate: Candidate, members: list[str], parent: str = "d0") -> Claim:
    plan = candidate.plan
    return Claim(candidate.step, candidate.average, plan.digest, plan.size, parent, members)


async def test_only_a_trainer_in_the_plan_it_names_may_claim(tmp_path: Path):
    ours = first_step("ours", MEMBERS)
    clock = [T0]
    notary = service(tmp_path, clock)
    async with running(notary):
        with pytest.raises(RpcError, match="only a member"):
            await notary._on_claim(peer_id(9), claim_of(ours, MEMBERS))
        with pytest.raises(RpcError, match="do not make the claimed plan"):
            await notary._on_claim(IDS[0], claim_of(ours, MEMBERS[:2]))  # padded in name
        assert notary.reads == []  # type: ignore[attr-defined]  # refused before any read
        verdict = await notary._on_claim(IDS[0], claim_of(ours, MEMBERS))
        assert not verdict.registered and verdict.retry_after == NOT_READY_SECONDS
        assert notary.registry._claims.keys() == {MEMBERS[0]}  # refused claims hold nothing
        # Claims in a burst share one read of the records; a later one reads again.
        await notary._on_claim(IDS[1], claim_of(ours, MEMBERS))
        clock[0] += FRONTIER_SECONDS
        await notary._on_claim(IDS[2], claim_of(ours, MEMBERS))
        assert notary.reads == [T0, T0 + FRONTIER_SECONDS]  # type: ignore[attr-defined]


async def test_a_read_slower_than_a_claim_goes_on_for_the_next(autojump_clock):
    """Review: the notary read the records inside the claim's handler, so a read slower than
    the claimant's deadline was cancelled with it, and no claim was ever judged. Reads run in
    the service's own task; a claim waits `READ_WAIT` for one, then is told to ask again."""
    notary = service(None, [T0], read_seconds=3 * READ_WAIT)
    ours = first_step("ours", MEMBERS)
    async with running(notary):
        with trio.move_on_after(READ_WAIT / 2):  # a claimant that gives up: the read goes on
            await notary._on_claim(IDS[0], claim_of(ours, MEMBERS))
        verdict = await notary._on_claim(IDS[0], claim_of(ours, MEMBERS))  # waits READ_WAIT
        assert verdict == Verdict(False, retry_after=NOT_READY_SECONDS)
        await trio.sleep(2 * READ_WAIT)
        await notary._on_claim(IDS[1], claim_of(ours, MEMBERS))  # judged on that read
        assert notary.registry._claims.keys() == {MEMBERS[1]}
        assert len(notary.reads) == 1  # type: ignore[attr-defined]


async def test_a_restarted_notary_answers_what_it_registered(tmp_path: Path):
    """The registry is written before the registration is told: a notary that restarts (or
    fails) answers as before, never a second genesis of the step."""
    directory, clock = tmp_path / "collab-genesis", [T0]
    first, second = first_step("first", MEMBERS), first_step("second", MEMBERS)
    notary = service(directory, clock)
    async with running(notary):
        for claimant in IDS[:2]:  # two of three: more than a third
            await notary._on_claim(claimant, claim_of(first, MEMBERS))
        clock[0] += SETTLE_SECONDS
        verdict = await notary._on_claim(IDS[1], claim_of(first, MEMBERS))
    assert verdict == Verdict(True, "first", first.plan.digest, first.plan.size)
    restarted = service(directory, clock)
    async with running(restarted):
        for claimant in IDS:  # all three claim another candidate now: still the first
            verdict = await restarted._on_claim(claimant, claim_of(second, MEMBERS))
        clock[0] += SETTLE_SECONDS
        assert (await restarted._on_claim(IDS[0], claim_of(second, MEMBERS))).average == "first"
        assert restarted.reads == []  # type: ignore[attr-defined]  # a registered step: no read
        # A claim made from another state of step 0 is judged on its own, and refused here.
        with pytest.raises(RpcError, match="another state"):
            await restarted._on_claim(IDS[0], claim_of(second, MEMBERS, parent="d0-other"))
    # A registry it cannot read stops it with a one-line error, rather than starting empty.
    path = directory / REGISTRY_FILE
    for broken in ("{not json", "[]", json.dumps({"registered": [[0, "d", "x", "y", 1]]})):
        path.write_text(broken)  # not JSON; not an object; step 0 (no genesis)
        with pytest.raises(ConfigError, match="cannot read the genesis registry"):
            service(directory, clock)


class FakeRpc:
    def __init__(self, verdict: Verdict) -> None:
        self.verdict = verdict
        self.sent: list[Claim] = []

    async def call(self, peer, service, method, request, reply_type, *, timeout):
        self.sent.append(request)
        return msgspec.msgpack.decode(msgspec.msgpack.encode(self.verdict), type=reply_type)


async def test_the_client_caps_the_notarys_wait_and_checks_its_candidate():
    ours = first_step("ours", SMALL)
    notary = peer_id(1)
    rpc = FakeRpc(Verdict(False, retry_after=1e9))
    answer = await claim_genesis(rpc, notary, ours, "d0", SMALL, timeout=1)  # type: ignore[arg-type]
    assert answer == CLAIM_SECONDS
    assert rpc.sent[0].members == sorted(SMALL) and rpc.sent[0].parent == "d0"
    with pytest.raises(RemoteError, match="registered no candidate"):
        await claim_genesis(
            FakeRpc(Verdict(True)),  # type: ignore[arg-type]
            notary,
            ours,
            "d0",
            SMALL,
            timeout=1,
        )
    theirs = first_step("theirs", BIG)
    rpc = FakeRpc(Verdict(True, "theirs", theirs.plan.digest, theirs.plan.size))
    answer = await claim_genesis(rpc, notary, ours, "d0", SMALL, timeout=1)  # type: ignore[arg-type]
    assert answer == theirs


def test_every_peer_given_the_same_backbones_asks_the_same_notary():
    backbones = [peer_id(i) for i in range(4)]
    assert notary_of(backbones) == notary_of(reversed(backbones))
    assert notary_of([]) is None


# ------------------------------------------------------------------ the policy plays it


def genesis_policy(me: str, members: list[str], others: list[str]) -> tuple[StepPolicy, Candidate]:
    """`me`, at step 0, in a first-step plan of `members` whose votes it reads, seeing `others`
    besides: its view certifies the plan's candidate."""
    policy = make_policy(me=me)
    policy.notary = True
    candidate = first_step(f"avg-{members[0]}", members)
    policy.elect(candidate, frozenset(members), T0)
    votes = [
        other(p, vote=VoteRecord.of(Vote(p, candidate, candidate.plan))) for p in members if p != me
    ]
    read(policy, *votes, *(other(p) for p in others))
    return policy, candidate


def play(
    policy: StepPolicy, registry: GenesisRegistry, now: float, frontier: Frontier = AT_STEP_0
) -> tuple[Outcome, object]:
    """The trainer's loop (`Trainer._elect`): count, claim where due, count again."""
    outcome, certified = policy.election(now)
    due = policy.claim_due(now)
    if outcome is Outcome.WAITING and due is not None:
        candidate, members, parent = due
        try:
            answer = registry.claim(policy.me, candidate, parent, members, frontier, now)
        except RpcError:
            answer = None  # refused: as unanswered
        policy.notarized(answer, now)
        outcome, certified = policy.election(now)
    return outcome, certified


def test_two_genesis_plans_with_disjoint_views_take_one_step_1():
    """Each plan's members see only their own plan (their reads cover that part of the
    collaboration): each view certifies its own first step. Without the notary both are
    applied (the fork); with it, one wins and the other's members download it."""
    # Without a notary: both win in their views.
    for members in (BIG, SMALL):
        policy, candidate = genesis_policy(members[0], members, [])
        policy.notary = False
        assert policy.election(T0) == (Outcome.WON, candidate)
    registry = GenesisRegistry(min_votes=2)
    players = [genesis_policy(m, BIG, []) for m in BIG[:5]]
    players += [genesis_policy(m, SMALL, []) for m in SMALL]
    outcomes: dict[str, tuple[Outcome, object]] = {}
    now = T0
    while len(outcomes) < len(players) and now < T0 + 10 * SETTLE_SECONDS:
        for policy, _ in players:
            if policy.me not in outcomes:
                outcome, certified = play(policy, registry, now)
                if outcome is not Outcome.WAITING:
                    outcomes[policy.me] = (outcome, certified)
        now += 1.0
    big = players[0][1]
    assert registry.registered == {(1, "d0"): big}
    assert outcomes == {
        **{m: (Outcome.WON, big) for m in BIG[:5]},
        **{m: (Outcome.LOST, big) for m in SMALL},
    }


def test_a_genesis_waits_for_an_unreachable_notary():
    """No answer (the notary backbone down): no step, and the claim is made again a vote turn
    later, never at once in a loop."""
    policy, candidate = genesis_policy(BIG[0], BIG, [])
    assert policy.election(T0) == (Outcome.WAITING, None)
    assert policy.claim_due(T0) == (candidate, frozenset(BIG), "d0")
    policy.notarized(None, T0)
    assert policy.claim_due(T0) is None
    assert policy.claim_at >= T0 + 1.0
    assert policy.election(policy.claim_at) == (Outcome.WAITING, None)
    assert policy.claim_due(policy.claim_at) is not None
    policy.notarized(candidate, policy.claim_at)
    assert policy.election(policy.claim_at) == (Outcome.WON, candidate)


def test_an_election_stays_open_while_the_notary_decides():
    """Review: the notary's settle outlasted the election's patience, so every genesis that
    certified a few seconds after its ballot began stalled before the notary answered. While
    the notary asks a claimant to wait, its election stays open (at most `CLAIM_SECONDS` past
    the patience)."""
    for delay in (0.0, 6.0, 12.0):
        registry = GenesisRegistry(min_votes=2)
        players = [genesis_policy(m, BIG, [])[0] for m in BIG[:5]]
        patience = players[0].election_patience()
        outcomes: dict[str, Outcome] = {}
        now = T0 + delay  # the plan's votes certify in the members' views this late
        while len(outcomes) < len(players) and now < T0 + patience + 2 * CLAIM_SECONDS:
            for policy in players:
                if policy.me not in outcomes:
                    outcome, _ = play(policy, registry, now)
                    if outcome is not Outcome.WAITING:
                        outcomes[policy.me] = outcome
            now += 1.0
        assert set(outcomes.values()) == {Outcome.WON}, (delay, patience, outcomes)
    # A notary that keeps asking to wait holds nobody for ever.
    policy, _ = genesis_policy(BIG[0], BIG, [])
    policy.election(T0)
    end = T0 + policy.election_patience() + CLAIM_SECONDS
    now = T0
    while now < end + 2 * CLAIM_SECONDS and policy.election(now)[0] is Outcome.WAITING:
        if policy.claim_due(now) is not None:
            policy.notarized(CLAIM_SECONDS, now)
        now += 1.0
    assert policy.election(now)[0] is Outcome.STALLED and now <= end + 1


def test_the_registry_forgets_its_oldest_registration_never_the_one_it_just_made():
    """Review: with the registry full of registrations of high steps, a new one of a lower
    step was evicted as it was made, and the step could be registered again differently."""
    registry = GenesisRegistry(min_votes=1)
    high = Frontier(10**6, "far", frozenset(BIG))
    for parent in ("p0", "p1"):
        registry.registered[10**6 + 1, parent] = Candidate(10**6 + 1, "x", plan_of(BIG))
    for now in (T0, T0 + SETTLE_SECONDS):
        for member in BIG[:4]:
            answer = claim(registry, member, first_step("big", BIG), now)
    assert answer == first_step("big", BIG)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("peer.training.notary.MAX_REGISTERED", 2)
        for now in (T0, T0 + SETTLE_SECONDS):
            for member in BIG[:4]:
                claim(
                    registry,
                    member,
                    Candidate(10**6 + 1, "y", plan_of(BIG)),
                    now,
                    frontier=high,
                    parent="far",
                )
    assert list(registry.registered) == [(1, "d0"), (10**6 + 1, "far")]


def test_a_retry_claims_its_genesis_at_once_whatever_the_last_claim_was_told():
    """The notary told a claim to come back in `CLAIM_SECONDS`, and the election ended
    (stalled) meanwhile: the next try's genesis is claimed as soon as it is certified, not
    when the old claim's wait runs out (up to 30 s of a retry's election lost)."""
    policy, _ = genesis_policy(BIG[0], BIG, [])
    policy.election(T0)
    assert policy.claim_due(T0) is not None
    policy.notarized(CLAIM_SECONDS, T0)
    policy.elected(Outcome.STALLED)
    retry = first_step(f"retry-{BIG[0]}", BIG)
    now = T0 + 2.0
    policy.elect(retry, frozenset(BIG), now)
    read(policy, *(other(p, vote=VoteRecord.of(Vote(p, retry, retry.plan))) for p in BIG[1:]))
    assert policy.election(now) == (Outcome.WAITING, None)
    assert policy.claim_due(now) == (retry, frozenset(BIG), "d0")
