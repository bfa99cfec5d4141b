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

- **Which backbone.** Every backbone serves; a peer asks the one with the smallest peer id
  among those it was given (`notary_of`), so peers given the same backbones ask the same one
  (peers given different ones are not defended). While it is down, no genesis is applied
  (its claimants wait, then retry); nothing else waits on it.
- **What it registers.** A claim names the step, the candidate, its plan's members (their
  digest is the plan's) and the state it was made from (`parent`: the step before). It comes
  from a member of the plan (the connection's authenticated peer id). The notary reads the
  progress records itself (`Frontier`, in its own task: `run`): a claim counts only for the
  step after the state most trainers hold (no step can be claimed ahead of the records),
  from a claimant it reads as a trainer, for a plan whose members it reads as trainers are
  more than half of the trainers at that step or the next (a plan's members are names only):
  the rule a member's own view applies (`StepPolicy._most_trainers_voted`), in one view. Once a
  candidate has the claims of more than a third of its plan (and `min_votes`), the notary
  waits `settle` seconds for other plans' claims, then registers the candidate with the most
  claimants (ties: the smaller digest). A claim counts for `CLAIM_SECONDS`; claimants renew
  theirs while their election waits, so a claim of a plan that gave up goes with it.
- **For good.** The registry is written to a file before it changes (`NotaryService`): a
  restarted notary answers as before, and one that cannot write registers nothing. It lives
  beside the collaboration's checkpoints (`training.checkpoint_dir`, folder
  `<collaboration>-genesis-<its peer id>`). A registration is keyed by its step and parent
  state (another group's registration from a state of its own blocks no honest one), so a
  collaboration started over from step 0 under the same name and notary meets its old
  registration of step 1 (the initial state is the same): remove the folder with the
  checkpoints.

Safety rests on one registration per step and parent, whatever the views (honest peers hold
one state of a step: by induction, one registered or certified); `docs/SECURITY.md` says what
a dishonest notary can do (register two candidates to two halves: a fork; or none: a halt).
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, NamedTuple

import msgspec
import trio
from libp2p.abc import IHost
from libp2p.peer.id import ID

from peer.errors import ConfigError, RemoteError, RpcError
from peer.files import write_atomically
from peer.net.rpc import RpcClient, RpcServer
from peer.training.progress import ProgressRecord
from peer.training.publisher import ProgressReader
from peer.training.steprule import Candidate, Electorate, plan_of

if TYPE_CHECKING:
    from peer.dht.node import DHT

log = logging.getLogger("peertrain.notary")

SERVICE = "genesis"
SETTLE_SECONDS = 5.0
"""After a candidate of a step first has its claims, how long other plans may still claim it."""
NOT_READY_SECONDS = 2.0
"""When a claimant asks again while no candidate has its claims yet."""
CLAIM_SECONDS = 30.0
"""How long a claim counts: its claimant renews it while its election waits (every answer's
wait, at most this)."""
FRONTIER_SECONDS = 5.0
"""How old the notary's read of the progress records may be when it judges a claim."""
MAX_MEMBERS = 4096
"""Members a claim may list (a plan's)."""
MAX_PENDING = 4096
"""Claimants whose claims are not decided yet: past it, a new one is answered "busy"."""
MAX_REGISTERED = 4096
"""Registrations the registry keeps (the oldest go first: claims count only at the
collaboration's frontier, which has moved on from a registration that old)."""
READ_WAIT = 5.0
"""How long a claim waits for the notary's read of the records (then: "ask again")."""
HANDLER_SECONDS = 30.0

_Step = Annotated[int, msgspec.Meta(ge=1, le=2**53)]
_Count = Annotated[int, msgspec.Meta(ge=1, le=MAX_MEMBERS)]
_Digest = Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
_PeerId = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]


class Claim(msgspec.Struct, frozen=True):
    """A member's claim that its plan certified `average` as the genesis of `step`, made from
    the state `parent` (of step `step - 1`)."""

    step: _Step
    average: _Digest
    plan: _Digest
    plan_size: _Count
    parent: Annotated[str, msgspec.Meta(max_length=64)]
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


class Frontier(NamedTuple):
    """The collaboration as the notary's read shows it: the state most trainers hold (`step`,
    `digest`), and the trainers at that step or the next."""

    step: int
    digest: str
    trainers: frozenset[str]


def frontier_of(records: Iterable[ProgressRecord]) -> Frontier | None:
    """The frontier of a read (None: no trainer in it): the (step, digest) held by the most
    trainers that are neither leaving nor downloading (ties: the higher step, then the
    smaller digest)."""
    trainers = [r for r in records if r.role == "trainer" and not r.leaving]
    held = Counter((r.step, r.digest) for r in trainers if not r.downloading)
    if not held:
        return None
    (step, digest), _ = min(held.items(), key=lambda item: (-item[1], -item[0][0], item[0][1]))
    around = frozenset(r.peer_id for r in trainers if r.step in (step, step + 1))
    return Frontier(step, digest, around)


@dataclass
class GenesisRegistry:
    """The notary's decisions (pure, on the caller's clock): one candidate per step, for good."""

    min_votes: int = 1
    settle: float = SETTLE_SECONDS
    save: Callable[[dict[str, object]], None] | None = None
    """Writes the registry's next state before it is taken (None: kept in memory)."""
    # (step, the parent state it was made from) -> the registered candidate
    registered: dict[tuple[int, str], Candidate] = field(default_factory=dict)
    # claimant -> (its latest claim's candidate and parent, when made)
    _claims: dict[str, tuple[Candidate, str, float]] = field(default_factory=dict)
    _ready_at: dict[int, float] = field(default_factory=dict)  # step -> a candidate had claims

    def needed(self, plan_size: int) -> int:
        """Claimants a candidate needs: more than a third of its plan, and `min_votes`."""
        return max(self.min_votes, plan_size // 3 + 1)

    def claim(
        self,
        claimant: str,
        candidate: Candidate,
        parent: str,
        members: frozenset[str],
        frontier: Frontier | None,
        now: float,
    ) -> Candidate | float:
        """`claimant`'s claim (a member of the candidate's plan, `members`: the service checks
        it), judged against `frontier` (the notary's read): the step's registered candidate,
        or how many seconds to wait before asking again. RpcError where it does not count: a
        claim off the frontier, a claimant or plan the notary does not read as trainers (or
        not a majority of them), too many claims held, a registry that cannot be saved."""
        step = candidate.step
        if (step, parent) in self.registered:
            return self.registered[step, parent]
        if frontier is None or (frontier.step + 1, frontier.digest) != (step, parent):
            raise RpcError(
                "unavailable",
                "the notary reads another state than this claim's parent as the one most "
                f"trainers hold (step {frontier.step if frontier else '-'}); ask again later",
            )
        # Only trainers the notary reads count, the claimant among them: a claim's members
        # are names, and a plan padded with names nobody runs was a majority (review).
        if claimant not in frontier.trainers:
            raise RpcError("bad_request", "the notary reads no progress record of the claimant")
        counted = len(members & frontier.trainers)
        if 2 * counted <= len(frontier.trainers):
            raise RpcError(
                "bad_request",
                f"a plan of {counted} trainers is no majority of the "
                f"{len(frontier.trainers)} the notary reads",
            )
        self._forget_old(now)
        if claimant not in self._claims and len(self._claims) >= MAX_PENDING:
            raise RpcError("unavailable", "the genesis notary holds too many claims; ask later")
        self._claims[claimant] = (candidate, parent, now)  # its latest claim counts
        counts = Counter(c for c, p, _ in self._claims.values() if (c.step, p) == (step, parent))
        ready = [c for c, n in counts.items() if n >= self.needed(c.plan.size)]
        if not ready:
            return NOT_READY_SECONDS
        since = self._ready_at.setdefault(step, now)
        if now < since + self.settle:
            return since + self.settle - now
        winner = min(ready, key=lambda c: (-counts[c], c.average, c.plan))
        self._register(winner, parent)
        log.info(
            "genesis of step %d registered: %s, claimed by %d of %d members",
            step,
            winner.average[:12],
            counts[winner],
            winner.plan.size,
        )
        return winner

    def _register(self, winner: Candidate, parent: str) -> None:
        """Saved first: a registration that cannot be saved is none (a restart would register
        another)."""
        step = winner.step
        registered = {**self.registered, (step, parent): winner}
        while len(registered) > MAX_REGISTERED:  # the oldest first: never the one just made
            del registered[next(iter(registered))]
        if self.save is not None:
            try:
                self.save(_state_of(registered))
            except OSError as error:
                log.error("cannot save the genesis registry: %s; registering nothing", error)
                raise RpcError("unavailable", "the genesis notary cannot save; ask later") from None
        self.registered = registered
        self._claims = {p: c for p, c in self._claims.items() if c[0].step != step}
        self._ready_at.pop(step, None)

    def forget_claims(self) -> None:
        """What a restart loses: the claims not decided yet (the registrations stay)."""
        self._claims.clear()
        self._ready_at.clear()

    def _forget_old(self, now: float) -> None:
        self._claims = {p: c for p, c in self._claims.items() if now - c[2] < CLAIM_SECONDS}
        steps = {c.step for c, _, _ in self._claims.values()}
        self._ready_at = {s: t for s, t in self._ready_at.items() if s in steps}

    def load_state_dict(self, state: object) -> None:
        rows = msgspec.convert(state, _Saved).registered
        self.registered = {
            (step, parent): Candidate(step, average, Electorate(plan, size))
            for step, parent, average, plan, size in rows
        }


class _Saved(msgspec.Struct):
    registered: list[tuple[_Step, str, _Digest, _Digest, _Count]]


def _state_of(registered: dict[tuple[int, str], Candidate]) -> dict[str, object]:
    return {
        "registered": [
            [step, parent, c.average, c.plan.digest, c.plan.size]
            for (step, parent), c in registered.items()  # oldest first
        ]
    }


REGISTRY_FILE = "registry.json"


def read_progress(dht: DHT, collaboration: str) -> Callable[[], Awaitable[list[ProgressRecord]]]:
    """A notary's reads of every progress record (`NotaryService.read_records`), as the
    daemon and the simulation serve it: not hot reads (each shard from every replica its
    lookup meets, not from two of them), so that its one view is as full as a read gets."""
    reader = ProgressReader(dht, collaboration, hot=False)

    async def read_records() -> list[ProgressRecord]:
        return (await reader.read()).records

    return read_records


class NotaryService:
    """Serves `/peertrain/genesis/1` on a backbone: a claim's plan and claimant checked, the
    frontier read (`read_records`, at most every `FRONTIER_SECONDS`), then `GenesisRegistry`;
    the registry saved in `directory` (None: kept in memory)."""

    def __init__(
        self,
        host: IHost,
        registry: GenesisRegistry,
        *,
        read_records: Callable[[], Awaitable[list[ProgressRecord]]],
        directory: Path | None,
        clock: Callable[[], float],
        max_message_bytes: int,
    ) -> None:
        self.registry = registry
        self.read_records = read_records
        self.clock = clock
        self._frontier: tuple[float, Frontier | None] | None = None  # (read at, frontier)
        self._read_done: trio.Event | None = None  # a read runs (`_read`) until it is set
        self._nursery: trio.Nursery | None = None  # `run`'s: where reads run
        if directory is not None:
            path = directory / REGISTRY_FILE
            if path.exists():
                try:
                    registry.load_state_dict(json.loads(path.read_text()))
                except (OSError, ValueError) as error:  # msgspec's errors are ValueErrors
                    # Starting empty could register a second genesis of a step: refuse to.
                    raise ConfigError(
                        f"cannot read the genesis registry {path} ({error}); restore it from "
                        "a backup, or remove it only if this collaboration has not stepped"
                    ) from None

            def save(state: dict[str, object]) -> None:
                directory.mkdir(parents=True, exist_ok=True)
                write_atomically(directory, REGISTRY_FILE, json.dumps(state).encode())

            registry.save = save
        server = RpcServer(
            host, SERVICE, max_message_bytes=max_message_bytes, call_deadline=HANDLER_SECONDS
        )
        server.add_unary("claim", Claim, self._on_claim)

    async def _on_claim(self, caller: ID, request: Claim) -> Verdict:
        members = frozenset(request.members)
        if plan_of(members) != Electorate(request.plan, request.plan_size):
            raise RpcError("bad_request", "the members listed do not make the claimed plan")
        claimant = caller.to_base58()
        if claimant not in members:
            raise RpcError("bad_request", "only a member of the plan may claim its genesis")
        frontier = None
        if (request.step, request.parent) not in self.registry.registered:
            if not await self._read_fresh():
                return Verdict(False, retry_after=NOT_READY_SECONDS)  # still reading
            assert self._frontier is not None
            frontier = self._frontier[1]
        outcome = self.registry.claim(
            claimant, request.candidate, request.parent, members, frontier, self.clock()
        )
        if isinstance(outcome, float):
            return Verdict(False, retry_after=outcome)
        return Verdict(True, outcome.average, outcome.plan.digest, outcome.plan.size)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Until cancelled: the reads of the records run here, not in a claim's handler (a
        read slower than a claimant's deadline was cancelled with it, and never done)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    async def _read_fresh(self) -> bool:
        """Whether a read at most `FRONTIER_SECONDS` old is in `_frontier`, waiting `READ_WAIT`
        for one where there is none (False: none yet; the read goes on for the next claim)."""
        if not self._fresh():
            if self._read_done is None:
                if self._nursery is None:
                    raise RpcError("unavailable", "the genesis notary is not running")
                self._read_done = trio.Event()
                self._nursery.start_soon(self._read, self._read_done)
            with trio.move_on_after(READ_WAIT):
                await self._read_done.wait()
        return self._fresh()

    def _fresh(self) -> bool:
        return self._frontier is not None and self.clock() - self._frontier[0] < FRONTIER_SECONDS

    async def _read(self, done: trio.Event) -> None:
        try:
            records = await self.read_records()
        except RemoteError as error:
            log.info("the genesis notary could not read the progress records: %s", error)
        else:
            self._frontier = (self.clock(), frontier_of(records))
        finally:
            self._read_done = None
            done.set()


def notary_of(backbones: Iterable[ID]) -> ID | None:
    """The genesis notary among the backbones a peer was given: the smallest peer id."""
    return min(backbones, key=lambda peer_id: peer_id.to_bytes(), default=None)


async def claim_genesis(
    rpc: RpcClient,
    notary: ID,
    candidate: Candidate,
    parent: str,
    members: Sequence[str],
    *,
    timeout: float,
) -> Candidate | float:
    """Ask `notary` for the genesis of `candidate`'s step, claiming `candidate` (our plan's,
    `members`, made from the state `parent`): the registered candidate, or seconds to wait
    before asking again (at most `CLAIM_SECONDS`). Raises RemoteError (the notary
    unreachable or refusing, or a reply that names no candidate)."""
    request = Claim(
        candidate.step,
        candidate.average,
        candidate.plan.digest,
        candidate.plan.size,
        parent,
        sorted(members),
    )
    verdict = await rpc.call(notary, SERVICE, "claim", request, Verdict, timeout=timeout)
    if not verdict.registered:
        return min(verdict.retry_after, CLAIM_SECONDS)  # a cap: not its word alone
    if not verdict.average or not verdict.plan or verdict.plan_size < 1:
        raise RemoteError("the genesis notary registered no candidate it could name")
    return Candidate(candidate.step, verdict.average, Electorate(verdict.plan, verdict.plan_size))
