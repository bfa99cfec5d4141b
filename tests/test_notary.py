"""The genesis notary (`peer.training.notary`): one registered genesis per step whatever the
views, as two plans with disjoint views play it (the fork it exists for), its checks on a
claim, its registry across a restart, and its client's caps on the answer."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.errors import ConfigError, RemoteError, RpcError
from peer.training.notary import (
    CLAIM_SECONDS,
    SETTLE_SECONDS,
    Claim,
    GenesisRegistry,
    NotaryService,
    Verdict,
    claim_genesis,
    notary_of,
)
from peer.training.policy import Outcome, StepPolicy
from peer.training.progress import VoteRecord
from peer.training.steprule import Candidate, Vote, plan_of
from tests.test_policy import T0, make_policy, other, read


def peer_id(seed: int) -> ID:
    return ID.from_pubkey(create_new_key_pair(bytes([seed]) * 32).public_key)


def first_step(name: str, members: list[str]) -> Candidate:
    return Candidate(1, name, plan_of(members))


BIG = [f"b{i}" for i in range(9)]
SMALL = [f"s{i}" for i in range(3)]


def test_two_plans_each_certified_in_their_view_get_one_registration():
    """The fork a genesis had (300 simulated peers, 60 % of reads covered: a plan of 39 that
    saw 42 trainers and one of 147 each took step 1): both claim; after the settle time the
    plan with the most claimants is the step's, and every later claim is answered with it."""
    registry = GenesisRegistry(min_votes=2)
    big, small = first_step("big", BIG), first_step("small", SMALL)
    # The small plan's claims come first: 2 of 3 are more than a third.
    assert registry.claim("s0", small, T0) == SETTLE_SECONDS
    assert registry.claim("s1", small, T0 + 1) == SETTLE_SECONDS  # ready: settling from now
    for i, member in enumerate(BIG[:5]):
        assert isinstance(registry.claim(member, big, T0 + 2 + i), float)
    # Settled: 5 claimants against 2; everyone hears the same from now on, whatever it claims.
    assert registry.claim("s2", small, T0 + SETTLE_SECONDS) == 1.0  # a second to go
    assert registry.claim("s2", small, T0 + 1 + SETTLE_SECONDS) == big
    assert registry.claim("b8", big, T0 + SETTLE_SECONDS + 2) == big
    assert registry.claim("s0", small, T0 + 10 * CLAIM_SECONDS) == big
    assert registry.registered == {1: big}


def test_a_candidate_needs_a_third_of_its_plan_and_min_votes():
    registry = GenesisRegistry(min_votes=2)
    big = first_step("big", BIG)
    for member in BIG[:3]:  # 3 of 9: not more than a third
        assert registry.claim(member, big, T0) == SETTLE_SECONDS
    assert registry.claim(BIG[3], big, T0) == SETTLE_SECONDS  # 4 of 9: settling from now
    assert registry.claim(BIG[3], big, T0 + SETTLE_SECONDS) == big
    # min_votes: one member of a plan of one does not register it.
    alone = GenesisRegistry(min_votes=2)
    one = first_step("one", ["x"])
    assert alone.claim("x", one, T0) == SETTLE_SECONDS
    assert alone.claim("x", one, T0 + SETTLE_SECONDS) == SETTLE_SECONDS


def test_a_claimant_counts_once_with_its_latest_claim():
    """A member counts for one candidate: its retry's claim replaces its first (else a plan that
    stalled held its members' claims, and the retry could not gather them)."""
    registry = GenesisRegistry(min_votes=1)
    first, retry = first_step("first", BIG), first_step("retry", BIG)
    for member in BIG[:4]:
        registry.claim(member, first, T0)
    for member in BIG[:4]:
        registry.claim(member, retry, T0 + 1)
    assert registry.claim(BIG[0], retry, T0 + 1 + SETTLE_SECONDS) == retry
    # The same claimant claiming again does not count twice.
    twice = GenesisRegistry(min_votes=1)
    for _ in range(9):
        twice.claim("b0", first, T0)
    assert twice.claim("b0", first, T0 + SETTLE_SECONDS) == SETTLE_SECONDS


class FakeHost:
    def __init__(self) -> None:
        self.handlers: dict[str, object] = {}

    def set_stream_handler(self, protocol: str, handler: object) -> None:
        self.handlers[protocol] = handler


def service(path: Path | None, clock: list[float]) -> NotaryService:
    return NotaryService(
        FakeHost(),  # type: ignore[arg-type]
        GenesisRegistry(min_votes=1),
        path=path,
        clock=lambda: clock[0],
        max_message_bytes=1 << 20,
    )


def claim_of(candidate: Candidate, members: list[str]) -> Claim:
    plan = candidate.plan
    return Claim(candidate.step, candidate.average, plan.digest, plan.size, members)


async def test_only_a_member_of_the_plan_it_names_may_claim(tmp_path: Path):
    ids = [peer_id(i) for i in range(3)]
    members = [p.to_base58() for p in ids]
    ours = first_step("ours", members)
    notary = service(tmp_path / "genesis.json", [T0])
    stranger = peer_id(9)
    with pytest.raises(RpcError, match="only a member"):
        await notary._on_claim(stranger, claim_of(ours, members))
    with pytest.raises(RpcError, match="do not make the claimed plan"):
        await notary._on_claim(ids[0], claim_of(ours, members[:2]))  # a plan padded in name
    verdict = await notary._on_claim(ids[0], claim_of(ours, members))
    assert not verdict.registered and verdict.retry_after == SETTLE_SECONDS
    assert notary.registry._claims.keys() == {members[0]}  # the refused claims hold nothing


async def test_a_restarted_notary_answers_what_it_registered(tmp_path: Path):
    """The registry is written before the registration is told: a notary that restarts (or
    fails) answers as before, never a second genesis of the step."""
    path, clock = tmp_path / "genesis.json", [T0]
    ids = [peer_id(i) for i in range(3)]
    members = [p.to_base58() for p in ids]
    first, second = first_step("first", members), first_step("second", members)
    notary = service(path, clock)
    for claimant in ids[:2]:  # two of three: more than a third
        await notary._on_claim(claimant, claim_of(first, members))
    clock[0] += SETTLE_SECONDS
    verdict = await notary._on_claim(ids[1], claim_of(first, members))
    assert verdict == Verdict(True, "first", first.plan.digest, first.plan.size)
    restarted = service(path, clock)
    for claimant in ids:  # all three claim another candidate now: still the first
        verdict = await restarted._on_claim(claimant, claim_of(second, members))
    clock[0] += SETTLE_SECONDS
    assert (await restarted._on_claim(ids[0], claim_of(second, members))).average == "first"
    # A registry it cannot read stops it with a one-line error, rather than starting empty.
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot read the genesis registry"):
        service(path, clock)
    path.write_text(json.dumps({"registered": [[0, "x", "y", 1]]}))  # step 0 is no genesis
    with pytest.raises(ConfigError):
        service(path, clock)


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
    answer = await claim_genesis(rpc, notary, ours, SMALL, timeout=1)  # type: ignore[arg-type]
    assert answer == CLAIM_SECONDS
    assert rpc.sent[0].members == sorted(SMALL)
    with pytest.raises(RemoteError, match="registered no candidate"):
        await claim_genesis(
            FakeRpc(Verdict(True)),  # type: ignore[arg-type]
            notary,
            ours,
            SMALL,
            timeout=1,
        )
    theirs = first_step("theirs", BIG)
    rpc = FakeRpc(Verdict(True, "theirs", theirs.plan.digest, theirs.plan.size))
    assert await claim_genesis(rpc, notary, ours, SMALL, timeout=1) == theirs  # type: ignore[arg-type]


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


def play(policy: StepPolicy, registry: GenesisRegistry, now: float) -> tuple[Outcome, object]:
    """The trainer's loop (`Trainer._elect`): count, claim where due, count again."""
    outcome, certified = policy.election(now)
    claim = policy.claim_due(now)
    if outcome is Outcome.WAITING and claim is not None:
        policy.notarized(registry.claim(policy.me, claim[0], now), now)
        outcome, certified = policy.election(now)
    return outcome, certified


def test_two_genesis_plans_with_disjoint_views_take_one_step_1():
    """Each plan's members see only their own plan (their reads cover that part of the
    collaboration): each view certifies its own first step. Without the notary both are
    applied (the fork); with it, one wins and the other's members download it."""
    big_members, small_members = BIG, SMALL
    # Without a notary: both win in their views.
    for members in (big_members, small_members):
        policy, candidate = genesis_policy(members[0], members, [])
        policy.notary = False
        assert policy.election(T0) == (Outcome.WON, candidate)
    registry = GenesisRegistry(min_votes=2)
    players = [genesis_policy(m, big_members, []) for m in big_members[:5]]
    players += [genesis_policy(m, small_members, []) for m in small_members]
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
    assert registry.registered == {1: big}
    assert {m: o for m, o in outcomes.items()} == {
        **{m: (Outcome.WON, big) for m in big_members[:5]},
        **{m: (Outcome.LOST, big) for m in small_members},
    }


def test_a_genesis_waits_for_an_unreachable_notary():
    """No answer (the notary backbone down): no step, and the claim is made again a vote turn
    later, never at once in a loop."""
    policy, candidate = genesis_policy(BIG[0], BIG, [])
    assert policy.election(T0) == (Outcome.WAITING, None)
    assert policy.claim_due(T0) == (candidate, frozenset(BIG))
    policy.notarized(None, T0)
    assert policy.claim_due(T0) is None
    assert policy.claim_at >= T0 + 1.0
    assert policy.election(policy.claim_at) == (Outcome.WAITING, None)
    assert policy.claim_due(policy.claim_at) is not None
    policy.notarized(candidate, policy.claim_at)
    assert policy.election(policy.claim_at) == (Outcome.WON, candidate)
