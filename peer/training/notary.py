"""The genesis notary: the one place where a genesis of each step is decided.

A step after a certified one is counted in the electorate that step names, so every peer that
holds it counts the same votes (`peer.training.steprule`). A *genesis* has no such electorate:
the first step, and the next try of a step whose electorate is lost, are counted in their own
plan. Two plans whose members saw different parts of the collaboration could each certify their
own candidate: at 300 simulated peers with 60 % of reads covered, a plan of 39 peers that saw
42 trainers and one of 147 each took step 1 (142 safety violations). No rule over views that
may differ can prevent that, so a genesis also needs what every peer agrees on: the candidate
that one backbone registered for the step (`GenesisRegistry`), before any peer applies it.

    peer (its plan certified a genesis candidate in its view)  --claim-->  notary backbone
    notary: the step's registered candidate, or "ask again in N s"

- **Which backbone.** The notary is the backbone with the smallest peer id among those a peer
  was given (`notary_of`); peers given the same backbones ask the same one. While it is down,
  no genesis is applied (they wait, and retry); nothing else waits on it.
- **What it registers.** A claim comes from a member of the candidate's plan (the connection's
  authenticated peer id, among the members the claim lists, whose digest is the plan's). Once a
  candidate has the claims of more than a third of its plan (and `min_votes`), the notary waits
  `settle` seconds for other plans' claims, then registers the candidate with the most
  claimants (ties: the smaller digest) for good: a few identities that make a plan of their own
  win only against a smaller one. A member counts for one candidate at a time (its latest
  claim: a stalled plan's members claim their retry's).
- **For good.** The registry is written to a file before the answer leaves (`NotaryService`), so
  a restarted notary answers as before.

Safety rests on one registration per step, whatever the views; `docs/SECURITY.md` says what
a dishonest notary can do (register two candidates to two halves: a fork; or none: a halt).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import msgspec
from libp2p.abc import IHost
from libp2p.peer.id import ID

from peer.errors import ConfigError, RemoteError, RpcError
from peer.net.rpc import RpcClient, RpcServer
from peer.training.steprule import Candidate, Electorate, plan_of

log = logging.getLogger("peertrain.notary")

SERVICE = "genesis"
SETTLE_SECONDS = 10.0
"""After a candidate of a step first has its claims, how long other plans may still claim it."""
MAX_MEMBERS = 4096
"""Members a claim may list (a plan's)."""
MAX_PENDING = 4096
"""Claimants whose claims are not decided yet, all steps together: past it, a new one is busy."""
MAX_REGISTERED = 1024
"""Steps whose genesis the registry keeps (the lowest steps go first)."""
CLAIM_SECONDS = 600.0
"""A claim not decided within this is forgotten (its claimant asks again while it waits)."""
HANDLER_SECONDS = 10.0

_Step = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
_Digest = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class Claim(msgspec.Struct, frozen=True):
    """A member's claim that its plan certified `average` as the genesis of `step`."""

    step: _Step
    average: _Digest
    plan: _Digest
    plan_size: _Count
    members: Annotated[list[_PeerId], msgspec.Meta(max_length=MAX_MEMBERS)]

    @property
    def candidate(self) -> Candidate:
        return Candidate(self.step, self.average, Electorate(self.plan, self.plan_size))


class Verdict(msgspec.Struct, frozen=True):
    """The notary's answer: the registered candidate of the step (`registered`), or when to
    ask again (`retry_after` seconds)."""

    registered: bool
    average: Annotated[str, msgspec.Meta(max_length=64)] = ""
    plan: Annotated[str, msgspec.Meta(max_length=64)] = ""
    plan_size: Annotated[int, msgspec.Meta(ge=0, le=2**31)] = 0
    retry_after: Annotated[float, msgspec.Meta(ge=0)] = 0.0


@dataclass
class GenesisRegistry:
    """The notary's decisions (pure, on the caller's clock): one candidate per step, for good."""

    min_votes: int = 1
    settle: float = SETTLE_SECONDS
    registered: dict[int, Candidate] = field(default_factory=dict)
    # claimant -> (its candidate, when claimed): one claim per claimant, the first of its step.
    _claims: dict[str, tuple[Candidate, float]] = field(default_factory=dict)
    _ready_at: dict[int, float] = field(default_factory=dict)  # step -> a candidate had claims

    def needed(self, plan_size: int) -> int:
        """Claimants a candidate needs: more than a third of its plan, and `min_votes`."""
        return max(self.min_votes, plan_size // 3 + 1)

    def claim(self, claimant: str, candidate: Candidate, now: float) -> Candidate | float:
        """`claimant`'s claim (a member of the candidate's plan: the service checks it): the
        step's registered candidate, or how many seconds to wait before asking again. Raises
        `RpcError` ("unavailable") where the notary holds `MAX_PENDING` undecided claims."""
        step = candidate.step
        if step in self.registered:
            return self.registered[step]
        self._forget_old(now)
        held = self._claims.get(claimant)
        if held is None and len(self._claims) >= MAX_PENDING:
            raise RpcError("unavailable", "the genesis notary holds too many claims; ask later")
        self._claims[claimant] = (candidate, now)  # its latest claim counts (a retry's)
        counts = Counter(c for c, _ in self._claims.values() if c.step == step)
        ready = [c for c, n in counts.items() if n >= self.needed(c.plan.size)]
        if not ready:
            return self.settle
        since = self._ready_at.setdefault(step, now)
        if now < since + self.settle:
            return since + self.settle - now
        winner = min(ready, key=lambda c: (-counts[c], c.average, c.plan))
        self._register(winner)
        log.info(
            "genesis of step %d registered: %s, claimed by %d of %d members",
            step,
            winner.average[:12],
            counts[winner],
            winner.plan.size,
        )
        return winner

    def _register(self, winner: Candidate) -> None:
        step = winner.step
        self.registered[step] = winner
        self._claims = {p: c for p, c in self._claims.items() if c[0].step != step}
        self._ready_at.pop(step, None)
        for old in sorted(self.registered)[: max(0, len(self.registered) - MAX_REGISTERED)]:
            del self.registered[old]

    def forget_claims(self) -> None:
        """What a restart loses: the claims not decided yet (the registrations stay)."""
        self._claims.clear()
        self._ready_at.clear()

    def _forget_old(self, now: float) -> None:
        self._claims = {p: c for p, c in self._claims.items() if now - c[1] < CLAIM_SECONDS}
        steps = {c.step for c, _ in self._claims.values()}
        self._ready_at = {s: t for s, t in self._ready_at.items() if s in steps}

    def state_dict(self) -> dict[str, list[list[object]]]:
        return {
            "registered": [
                [c.step, c.average, c.plan.digest, c.plan.size]
                for c in sorted(self.registered.values())
            ]
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        rows = msgspec.convert(
            state.get("registered", []), list[tuple[_Step, _Digest, _Digest, int]]
        )
        self.registered = {
            step: Candidate(step, average, Electorate(plan, size))
            for step, average, plan, size in rows
        }


class NotaryService:
    """Serves `/peertrain/genesis/1` on a backbone: claims checked, then `GenesisRegistry`;
    the registry saved to `path` (None: kept in memory) before a new registration is told."""

    def __init__(
        self,
        host: IHost,
        registry: GenesisRegistry,
        *,
        path: Path | None,
        clock: Callable[[], float],
        max_message_bytes: int,
    ) -> None:
        self.registry = registry
        self.path = path
        self.clock = clock
        if path is not None and path.exists():
            try:
                registry.load_state_dict(json.loads(path.read_text()))
            except (OSError, ValueError, msgspec.ValidationError) as error:
                # Starting empty could register a second genesis of a step: refuse to serve.
                raise ConfigError(
                    f"cannot read the genesis registry {path} ({error}); restore it from a "
                    "backup, or remove it only if this collaboration has not stepped"
                ) from None
        server = RpcServer(
            host, SERVICE, max_message_bytes=max_message_bytes, call_deadline=HANDLER_SECONDS
        )
        server.add_unary("claim", Claim, self._on_claim)

    async def _on_claim(self, caller: ID, request: Claim) -> Verdict:
        members = set(request.members)
        if plan_of(members) != Electorate(request.plan, request.plan_size):
            raise RpcError("bad_request", "the members listed do not make the claimed plan")
        claimant = caller.to_base58()
        if claimant not in members:
            raise RpcError("bad_request", "only a member of the plan may claim its genesis")
        known = request.step in self.registry.registered
        outcome = self.registry.claim(claimant, request.candidate, self.clock())
        if isinstance(outcome, float):
            return Verdict(False, retry_after=outcome)
        if not known and self.path is not None:
            self._save()
        return Verdict(True, outcome.average, outcome.plan.digest, outcome.plan.size)

    def _save(self) -> None:
        """Atomically: a crash mid-write leaves the last registry, never half of one."""
        assert self.path is not None
        partial = self.path.with_name(self.path.name + ".partial")
        with open(partial, "w") as f:
            json.dump(self.registry.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, self.path)


def notary_of(backbones: Iterable[ID]) -> ID | None:
    """The genesis notary among the backbones a peer was given: the smallest peer id."""
    return min(backbones, key=lambda peer_id: peer_id.to_bytes(), default=None)


async def claim_genesis(
    rpc: RpcClient, notary: ID, candidate: Candidate, members: Sequence[str], *, timeout: float
) -> Candidate | float:
    """Ask `notary` for the genesis of `candidate`'s step, claiming `candidate` (our plan's,
    `members`): the registered candidate, or seconds to wait before asking again. Raises
    RemoteError (the notary unreachable, or a reply that names no candidate)."""
    request = Claim(
        candidate.step,
        candidate.average,
        candidate.plan.digest,
        candidate.plan.size,
        sorted(members),
    )
    verdict = await rpc.call(notary, SERVICE, "claim", request, Verdict, timeout=timeout)
    if not verdict.registered:
        return min(verdict.retry_after, CLAIM_SECONDS)  # a floor and a cap: not its word alone
    if not verdict.average or not verdict.plan or verdict.plan_size < 1:
        raise RemoteError("the genesis notary registered no candidate it could name")
    return Candidate(candidate.step, verdict.average, Electorate(verdict.plan, verdict.plan_size))
