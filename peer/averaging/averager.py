"""Averaging a vector with the collaboration: gather, then Moshpit rounds of grouped all-reduce.

    result = await averager.average(vector, weight=..., epoch=..., fingerprint=...,
                                    gather_until=...)
    if result.average is not None: ...  # the exact weighted mean, the same bits on every peer

declares this peer's ticket, waits until just after `gather_until` (a wall-clock time every peer of the
epoch uses, read on the DHT's clock: the backbones' time, peer.measure.clock), reads every
ticket declared by then (its view), and follows the Moshpit plan of that view (`moshpit.py`):
in each round its group forms (`matchmaking.py`) and runs one all-reduce (`allreduce.py`) with
deadlines derived from the bytes each member moves and its measured bandwidth
(`group.round_timeouts`), each member weighted by the samples its value stands for.

The result is exact over a set of peers, or nothing. In every round one peer cannot veto
(`reduce_in_group`): a round exact over the members that took part (`RoundReport.exact_over`)
counts, for those members, and one whose reducers dropped different members or failed is
retried at once without them. With a single group, `average` is the mean over the members of
that round (`members`; `dropped` says who was left out and why). With several rounds every
value carries its basis, the peers it is the exact mean of (`moshpit.py`): a member missing
from a group, or a round that failed for us (we go back to the value we entered it with),
makes the bases smaller, not the step void; `average` is the mean over our last basis (`members`,
`weight`; `dropped`: the planned peers it lacks). Peers that end on the same basis hold the
same bits; the step's certificate settles which of the averages applied is the
collaboration's. Without one (alone in every round) `average` is None and `skipped` says why;
the caller's vector is never touched (the rounds work on a copy).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
from collections import Counter
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from peer.averaging.allreduce import (
    DataServer,
    RoundReport,
    RoundSpec,
    allreduce,
    check_spec,
    retry_spec,
)
from peer.averaging.compression import CODECS
from peer.averaging.group import (
    Joined,
    Ticket,
    able_to_reduce,
    attested_bandwidth,
    longest_round,
    placed,
    round_timeouts,
    stated_size,
    view_digest,
)
from peer.averaging.matchmaking import GroupPlan, Matchmaker, RoundShape, TooFewPeers
from peer.averaging.moshpit import Plan, Seat, basis_mask, basis_of, plan, rounds_for
from peer.averaging.probation import Probation, seated
from peer.config import AveragingConfig, PeerConfig
from peer.dht.node import DHT
from peer.errors import ProtocolError, peer_fault
from peer.measure.attestation import MAX_BANDWIDTH, Evidence
from peer.measure.capabilities import Capabilities
from peer.net.host import Node, data_plane_hosts
from peer.net.tls import DataIdentity
from peer.roles import share_cap

log = logging.getLogger("peertrain.averager")
#: Seconds past the close of a gathering before the tickets are read, at least.
READ_GRACE = 0.1


async def _ready(vector: np.ndarray) -> np.ndarray:
    return vector


def fingerprint(tensors: Sequence[tuple[str, Sequence[int], str]]) -> str:
    """A model's identity for matchmaking: names, shapes and dtypes of its tensors, in order.
    Peers with different fingerprints never meet, so never average incompatible vectors."""
    digest = hashlib.blake2b(digest_size=12)
    for name, shape, dtype in tensors:
        digest.update(f"{name}:{tuple(shape)}:{dtype};".encode())
    return digest.hexdigest()


@dataclass
class AveragingResult:
    peers_seen: int
    """Contributions in the tickets this peer read when the gathering closed (its own
    included): aggregator-only tickets do not count."""
    rounds: list[RoundReport] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Why there is no result, round by round (a group too small, a member missing, ...)."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Peers that `average` leaves out, and why (a single group: members that failed its round;
    a plan of several: planned peers missing from our last basis)."""
    setbacks: list[str] = field(default_factory=list)
    """Rounds of a plan of several that failed for us, and why: `average` stands for fewer."""
    average: np.ndarray | None = None
    """The exact weighted mean over `members` peers (a single group: those that took part; a
    plan of several: our last basis); None when there is none."""
    weight: float = 0.0
    """The total weight (samples) behind `average`."""
    members: int = 0
    """How many peers' contributions `average` holds (the view's, or those of the members of a
    single group it is exact over)."""
    plan: tuple[str, ...] = ()
    """Who the average came from, the same for every peer that holds these bits: the view of a
    plan of several rounds, or the members a single group's average is exact over. It names
    who votes on the next step if this average is certified (`peer.training.steprule`)."""
    ends_by: float = -math.inf
    """When our averaging ends at the latest, on the collaboration's clock: its outer deadline
    from the view's bandwidths, which the other members of the view derive about alike (each
    from its own start and evidence)."""


@dataclass
class GroupOutcome:
    """What `reduce_in_group` made of a group's round (and of its retry)."""

    reports: list[RoundReport] = field(default_factory=list)
    included: tuple[str, ...] = ()
    """The members the values are the exact weighted mean over (spec order); () if none."""
    dropped: dict[str, str] = field(default_factory=dict)
    """Computing members of the spec left out of `included`, and why."""
    problem: str = ""
    """Why the values are not exact."""


async def reduce_in_group(
    spec: RoundSpec,
    values: np.ndarray,
    server: DataServer,
    *,
    timeouts: Callable[[RoundSpec], tuple[float, float]],
    min_members: int,
    single: bool,
    norm_factor: float | None = None,
    original: np.ndarray | None = None,
) -> GroupOutcome:
    """One all-reduce round of `spec` on `values` (see `allreduce`); `timeouts` gives a spec's
    (round length, stall timeout). `original`: `values` as they are now, kept whole by the
    caller, for a retry (None: a copy is made here, where a retry may come).

    A planned round of several (`single` False) counts only if complete. A single group counts
    if its result is exact over a set S of at least max(2, `min_members`) members (us among
    them). If not, it is retried once, at once, from our original values: without the members
    we saw fail (`RoundReport.excluded`), under a round id derived from them (`retry_spec`), so
    the members that saw the same failures meet, and one that saw others meets nobody. The
    retry counts only if every member left in it took part: those that accepted the first
    round do not come, so a retry never makes a second, different average beside theirs."""
    me = server.identity.peer_id
    contributes = any(m.computes for m in spec.members if m.peer_id == me)
    # A failed round leaves `values` half-written; an aggregator-only member never retries
    # (and copying its zeros would touch every page of a vector it never reads).
    if original is None and single and contributes:
        original = await trio.to_thread.run_sync(values.copy)
    outcome = GroupOutcome()
    report = await _run_round(spec, values, server, timeouts, norm_factor, single=single)
    outcome.reports.append(report)
    computing = tuple(m.peer_id for m in spec.members if m.computes)
    if not contributes:
        # Aggregator-only: we reduced our part and hold no values. We sit out any retry: we
        # see only our own part, so we could not tell whom the others leave out of it
        # (`retry_spec` leaves us out too).
        if report.complete:
            outcome.included = computing
        else:
            failed = {**report.dropped_senders, **report.failed_reducers}
            outcome.problem = f"incomplete ({_first_reasons(failed)})"
        return outcome
    included = report.exact_over
    if not single:  # a group of a planned round: other groups hold its blocks (module doc)
        if not report.complete:
            failed = {**report.dropped_senders, **report.failed_reducers}
            outcome.problem = f"incomplete ({_first_reasons(failed)})"
        elif any(chunk.included != frozenset(computing) for chunk in report.chunks):
            outcome.problem = "a reducer averaged a chunk without every member's contribution"
        else:
            outcome.included = computing
        return outcome
    floor = max(2, min_members)
    # Receipts matter only where the members that may lack our part could retry without us:
    # with fewer than `floor` of them, no second average can come of it, and refusing ours
    # only split the group (2 peers under load: one stepped, the other could not follow; a
    # member killed after sending, its receipt never coming: we retried alone, 5 s, while
    # the others stepped on, and fell 4 steps behind).
    agreed = report.agreed
    if agreed is not None and len(_could_leave_us_out(spec, report, agreed, me)) < floor:
        included = agreed
    if included is not None and me in included and len(included) >= floor:
        outcome.included = tuple(p for p in computing if p in included)
        outcome.dropped = _why_left_out(set(computing) - included, report)
        return outcome
    why = _not_exact(report, floor)
    excluded = report.excluded()
    derived = retry_spec(spec, excluded)
    left = tuple(m.peer_id for m in derived.members if m.computes)
    if not excluded:
        outcome.problem = f"{why}, and we saw nobody fail to leave out of a retry"
        return outcome
    if me in excluded:
        outcome.problem = f"{why}, and we are out of it ourselves"
        return outcome
    if len(left) < floor:
        outcome.problem = f"{why}; a retry without {_names(excluded)} would hold {len(left)}"
        return outcome
    try:
        check_spec(derived, me)
    except ProtocolError as error:
        outcome.problem = f"{why}; a retry without {_names(excluded)} {error}"
        return outcome
    if trio.current_time() + _timeouts(derived, timeouts, single=True)[0] > (
        trio.current_effective_deadline()
    ):
        outcome.problem = f"{why}; no time is left to retry without {_names(excluded)}"
        return outcome
    log.info("a round not exact (%s): retrying at once without %s", why, _names(excluded))
    assert original is not None
    await trio.to_thread.run_sync(np.copyto, values, original)
    retried = await _run_round(derived, values, server, timeouts, norm_factor, single=True)
    # Each member's retry leaves out the failures it saw: one that saw others is in another
    # round id and never comes, through no fault of its own. Its silence is no evidence.
    retried.silent = set()
    outcome.reports.append(retried)
    if retried.exact_over != frozenset(left):
        outcome.problem = (
            f"{why}; the retry without {_names(excluded)} was not exact either "
            f"({_not_exact(retried, len(left))})"
        )
        return outcome
    outcome.included = left
    outcome.dropped = _why_left_out(set(computing) - set(left), report)
    return outcome


def _could_leave_us_out(
    spec: RoundSpec, report: RoundReport, agreed: frozenset[str], me: str
) -> set[str]:
    """The members of `agreed` that may retry without us: those that did not confirm our part,
    and the other reducers (our receipt of theirs may not have reached them). The rest got our
    whole part and gave us theirs: honest, they never leave us out, and a retry counts only if
    every member it keeps comes, so only a retry among these few could make a second average.
    (A lying member can join a retry without us whatever it confirmed: it could before too,
    joining both retries. Every member must use the same `min_group_size`, as before.)"""
    reducing = {
        m.peer_id for m, (lo, hi) in zip(spec.members, spec.parts(), strict=True) if hi > lo
    }
    return (set(report.undelivered) | reducing) & (agreed - {me})


async def _run_round(
    spec: RoundSpec,
    values: np.ndarray,
    server: DataServer,
    timeouts: Callable[[RoundSpec], tuple[float, float]],
    norm_factor: float | None,
    *,
    single: bool,
) -> RoundReport:
    duration, stall = _timeouts(spec, timeouts, single=single)
    return await allreduce(
        spec,
        values,
        server,
        deadline=trio.current_time() + duration,
        stall_timeout=stall,
        norm_factor=norm_factor,
    )


def _timeouts(
    spec: RoundSpec, timeouts: Callable[[RoundSpec], tuple[float, float]], *, single: bool
) -> tuple[float, float]:
    duration, stall = timeouts(spec)
    if single:
        # Room for a drop: a member that never shows up is given up after a stall timeout
        # (a reducer checks every quarter of one), one that answers nothing after 2.5; with
        # a small vector the round's own length may be barely one.
        duration = max(duration, 3 * stall)
    return duration, stall


def _not_exact(report: RoundReport, floor: int) -> str:
    """Why a round's values are not exact over enough members."""
    failed = {**report.failed_reducers, **report.dropped_senders}
    if failed:
        return f"incomplete ({_first_reasons(failed)})"
    if report.undelivered:
        return f"our part did not reach every member ({_first_reasons(report.undelivered)})"
    included = report.exact_over
    if included is None:
        return "the reducers averaged their chunks over different members"
    return f"exact over {len(included)} members only, fewer than {floor}"


def _why_left_out(left_out: set[str], report: RoundReport) -> dict[str, str]:
    """Why each of `left_out` is not in the result, as far as this member saw it."""
    out = {}
    for peer_id in sorted(left_out):
        seen = [
            f"{role}: {reasons[peer_id]}"
            for role, reasons in (
                ("as a sender", report.dropped_senders),
                ("as a reducer", report.failed_reducers),
                ("as a receiver", report.undelivered),
            )
            if peer_id in reasons
        ]
        out[peer_id] = "; ".join(seen) or "left out of a reducer's average"
    return out


def _names(peers: set[str] | frozenset[str]) -> str:
    shown = sorted(peers)[:3]
    return ", ".join(shown) + (f" and {len(peers) - len(shown)} more" if len(peers) > 3 else "")


def wire_bytes_per_element(config: AveragingConfig) -> float:
    return CODECS[config.codec].wire_bytes(1 << 20) / (1 << 20)


def bandwidths(
    view: Sequence[Ticket], config: AveragingConfig, *, evidence: Evidence
) -> dict[str, float]:
    """Each ticket's bandwidth (bytes/s, the lower of up and down) for deadlines: what trusted
    backbones measured of it (`group.attested_bandwidth`, clamped), or its own figure where
    that is lower (a slower link only lengthens waits), never below `averaging.min_bandwidth`;
    without a valid attestation, that floor. A claim of 10 GB/s used to shrink the median
    that bounds a later round's patience below what honest members need."""
    rates = {}
    for t in view:
        measured = attested_bandwidth(t, evidence)
        rate = min(measured) if measured is not None else config.min_bandwidth
        if t.capabilities is not None:
            rate = min(rate, t.capabilities.upload_bps, t.capabilities.download_bps)
        rates[t.peer_id] = max(config.min_bandwidth, rate)
    return rates


def planned_view(view: list[Ticket], group_size: int) -> list[Ticket]:
    """The tickets the Moshpit plan is made of: all of them in a single group; only the
    computing ones when the plan has several rounds (a later round averages the blocks its
    members hold, and an aggregator-only member holds none). Every reader gets the same."""
    if len(plan(len(view), group_size).rounds) > 1:
        return [t for t in view if t.computes]
    return view


def patience(size: int, bandwidth: Sequence[float], config: AveragingConfig) -> float:
    """How long a leader of a later round waits for members still in the previous one: a
    round's length at the slowest member's measured bandwidth, but at most 4 times its
    length at the median's (a single ticket claiming a crawl cannot stretch every wait;
    a member that died meanwhile is found out sooner, `Matchmaker`)."""

    def longest(rates: list[float]) -> float:
        return longest_round(
            size,
            rates,
            wire_bytes_per_element=wire_bytes_per_element(config),
            floor=config.timeout_floor,
            multiplier=config.timeout_multiplier,
        )

    known = sorted(b for b in bandwidth if b > 0)
    if not known:
        return longest([])
    return min(longest(known), 4 * longest([known[len(known) // 2]]))


def longest_averaging(
    size: int, peers: int, bandwidth: Sequence[float], config: AveragingConfig
) -> float:
    """A bound on one averaging of `size` elements among `peers` after its gathering: per
    round of the plan, a member's join (its leader search, the gathering and a later round's
    leader's patience: 3 `join_timeout` + 2 `patience`, `Matchmaker`) and the round itself
    with its retry (at most 2 `patience` at these bandwidths)."""
    rounds = rounds_for(max(peers, 2), config.group_size)
    return rounds * (3 * config.join_timeout + 4 * patience(size, bandwidth, config))


class Averager:
    def __init__(
        self,
        dht: DHT,
        config: AveragingConfig,
        *,
        collaboration: str,
        data_server: DataServer,
        data_host: str,
        data_port: int,
        trusted: frozenset[str] | None = None,
    ) -> None:
        """`trusted`: peer ids whose attestations of members' links count for shares and
        deadlines (`peer.measure.attestation`); None: the backbones this peer was given
        (`dht.seeds`, from `collaboration.backbones`), read at each call."""
        self.dht = dht
        self.config = config
        self.trusted = trusted
        self.collaboration = collaboration
        self.data_server = data_server
        self.data_host = data_host
        self.data_port = data_port
        self.me = dht.node.peer_id.to_base58()
        self._store_seconds = 0.0  # recent ticket stores: the slowest, decaying
        self.probation = Probation()
        """Members we saw send nothing, named in our tickets (`peer.averaging.probation`)."""
        self.matchmaker = Matchmaker(
            dht,
            data_host=data_host,
            group_size=config.group_size,
            min_group_size=config.min_group_size,
            join_timeout=config.join_timeout,
        )

    def namespace(self, fingerprint: str, epoch: int) -> str:
        """Where the tickets of an averaging live: one per model and call."""
        return f"{self.collaboration}/avg/{fingerprint}/{epoch}"

    @property
    def store_seconds(self) -> float:
        """How long our recent ticket stores took (the slowest, decaying)."""
        return self._store_seconds

    def evidence(self, gather_until: float) -> Evidence:
        """What counts as a measurement of a member's link in the averaging closing at
        `gather_until`: attestations by our trusted backbones, fresh at the close."""
        trusted = self.trusted
        if trusted is None:
            # The backbones we were given, and ourselves: an aggregating backbone signs its own
            # link (`Measurements._attest_self`) and is not among its own seeds.
            seeds = (peer_id.to_base58() for peer_id, _ in self.dht.seeds)
            trusted = frozenset([*seeds, self.me])
        return Evidence(
            trusted=trusted,
            at=gather_until,
            max_age=self.config.attestation_max_age,
            floor=self.config.min_bandwidth,
            ceiling=max(MAX_BANDWIDTH, self.config.min_bandwidth),
        )

    async def average(
        self,
        vector: np.ndarray | Callable[[], Awaitable[np.ndarray]],
        *,
        weight: float,
        epoch: int,
        fingerprint: str,
        gather_until: float,
        size: int | None = None,
        capabilities: Capabilities | None = None,
        on_round: Callable[[int, RoundReport, np.ndarray], None] = lambda i, report, values: None,
    ) -> AveragingResult:
        """Average `vector` (float32; left as it is) with every peer of the epoch.

        `vector` may be a function that makes it (then `size` says its length): our ticket is
        declared first and the function awaited while the gathering is open, so that making
        the vector (a trainer taking 400 MB of gradients) does not make the ticket late. It
        is not called if the gathering closed before we declared. `weight` is the samples
        behind it; with weight 0 this member adds nothing and still gets the average (a
        trainer that has no samples yet). `on_round` sees each round's report and our values
        after it.
        """
        make: Callable[[], Awaitable[np.ndarray]]
        if isinstance(vector, np.ndarray):
            size, make = len(vector), functools.partial(_ready, vector)
        elif size is None:
            raise TypeError("average: a vector still to be made needs its size")
        else:
            make = vector
        namespace = self.namespace(fingerprint, epoch)
        ticket = self._ticket(capabilities, computes=True, weight=weight, size=size)
        if ticket.declared_at > gather_until:  # every reader leaves such a ticket out: so do we
            return AveragingResult(0, skipped=["the gathering closed before we declared"])
        made: list[np.ndarray] = []

        async def make_it() -> None:
            made.append(await make())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(make_it)
            view = await self._gather(namespace, epoch, ticket, gather_until)
        (values,) = made
        if len(values) != size:
            raise ValueError(f"average: a vector of {len(values)} values, declared {size}")
        if view is None:
            return AveragingResult(0, skipped=["the gathering closed before we declared"])
        return await self._average_view(
            namespace, epoch, view, ticket, values, gather_until, on_round
        )

    async def aggregate(
        self,
        *,
        epoch: int,
        fingerprint: str,
        gather_until: float,
        contributors: Collection[str],
        capabilities: Capabilities | None = None,
    ) -> AveragingResult:
        """Join the epoch's averaging as an aggregator-only member (a backbone): reduce the
        share the leader's spec gives us of the vector (of the size the tickets of
        `contributors` in our view state, `stated_size`: the trainers that hold the
        collaboration's certified state, not any ticket), contribute nothing, apply nothing.
        Only in a single group: a Moshpit plan's later rounds average the blocks members
        hold, and we hold none (`planned_view` leaves aggregator-only tickets out of a plan
        of several rounds)."""
        namespace = self.namespace(fingerprint, epoch)
        ticket = self._ticket(capabilities, computes=False, weight=0.0, size=0)
        view = await self._gather(namespace, epoch, ticket, gather_until)
        if view is None:
            return AveragingResult(0, skipped=["the gathering closed before we declared"])
        known = [t for t in view if t.peer_id in contributors]
        size = stated_size(known, quorum=self.config.min_group_size)
        if size is None:  # the leader goes on without us after its join timeout
            self.matchmaker.forget(namespace)
            return AveragingResult(
                len(view), skipped=["the computing tickets state no common vector size"]
            )
        # Zeros we never read (a non-computing member sends nothing): calloc'ed pages are
        # only touched where our part's averages land.
        return await self._average_view(
            namespace, epoch, view, ticket, np.zeros(size, np.float32), gather_until
        )

    def _ticket(
        self, capabilities: Capabilities | None, *, computes: bool, weight: float, size: int
    ) -> Ticket:
        return Ticket(
            peer_id=self.me,
            rpc_addrs=self.dht.node.public_addrs(),
            data_host=self.data_host,
            data_port=self.data_port,
            computes=computes,
            weight=weight,
            capabilities=capabilities,
            declared_at=self.dht.clock(),
            aggregation="centered_clip" if self.config.aggregation == "centered_clip" else "mean",
            size=size,
            probation=self.probation.named(now=self.dht.clock()),
        )

    async def _gather(
        self, namespace: str, epoch: int, ticket: Ticket, gather_until: float
    ) -> list[Ticket] | None:
        """Declare `ticket`, then read the view of the gathering closing at `gather_until`
        (sorted by peer id, ours in it); None if it closed before we declared."""
        if ticket.declared_at > gather_until:
            return None
        started = trio.current_time()
        await self.matchmaker.declare(namespace, ticket, expiration=gather_until + 600)
        stored = trio.current_time() - started
        self._store_seconds = max(stored, 0.8 * self._store_seconds)
        if self.dht.clock() > gather_until:
            log.info(
                "our ticket for epoch %d was stored %.1fs after the gathering closed (a longer "
                "gathering window helps)",
                epoch,
                self.dht.clock() - gather_until,
            )
        # Read once the tickets declared before the close have landed: a store takes about
        # what ours took. Tickets declared after the close are left out by every reader (and
        # their declarer), so a late ticket cannot make views differ; one still in flight can.
        grace = min(max(READ_GRACE, 2 * self._store_seconds), self.config.join_timeout / 2)
        await trio.sleep(max(0.0, gather_until + grace - self.dht.clock()))
        view = [
            t
            for t in await self.matchmaker.read_tickets(namespace)
            if t.declared_at <= gather_until and t.peer_id != self.me
        ]
        return sorted([*view, ticket], key=lambda t: t.peer_id)

    async def _average_view(
        self,
        namespace: str,
        epoch: int,
        view: list[Ticket],
        ticket: Ticket,
        vector: np.ndarray,
        gather_until: float,
        on_round: Callable[[int, RoundReport, np.ndarray], None] = lambda i, report, values: None,
    ) -> AveragingResult:
        # Members that others saw send nothing sit out, by the same rule in every view.
        view, out = seated(view)
        self.matchmaker.sit_out(namespace, out)
        # Contributions, not tickets: an aggregator-only ticket beside a lone trainer leaves it
        # alone (nothing to average; where min_group_size = 1 it may step by itself).
        contributions = sum(t.computes for t in view)
        result = AveragingResult(peers_seen=contributions)
        try:
            if self.me in out:
                result.skipped.append(
                    "other members saw us send nothing in a recent round: we sit this "
                    "gathering out (probation; see peer.averaging.probation)"
                )
                return result
            view = planned_view(view, self.config.group_size)
            if ticket not in view:
                result.skipped.append(
                    "the collaboration is larger than one group: aggregator-only members sit out"
                )
                return result
            if contributions < 2:
                return result
            # The outer deadline: twice the bound from the peers' (attested, floored)
            # bandwidths, and never more than max_averaging_seconds, whatever a peer does.
            evidence = self.evidence(gather_until)
            rates = list(bandwidths(view, self.config, evidence=evidence).values())
            limit = min(
                self.config.max_averaging_seconds,
                2 * longest_averaging(len(vector), len(view), rates, self.config),
            )
            result.ends_by = self.dht.clock() + limit
            with trio.move_on_after(limit) as scope:
                await self._follow_plan(
                    namespace, epoch, view, ticket, vector, result, on_round, evidence
                )
            if scope.cancelled_caught:
                result.average = None
                result.skipped.append(f"the averaging took longer than its limit of {limit:.0f} s")
            return result
        finally:
            self.matchmaker.forget(namespace)
            self._judge(result)

    def _judge(self, result: AveragingResult) -> None:
        """Strike the members that sent us nothing at all in this averaging's rounds while
        others did (`RoundReport.silent`): our tickets name them (probation)."""
        silent = {p for report in result.rounds for p in report.silent} - {self.me}
        now = self.dht.clock()
        for peer_id in sorted(silent):
            until = self.probation.strike(peer_id, now=now)
            log.info(
                "%s sent us nothing: our tickets name it for %.0f s (probation)",
                peer_id,
                until - now,
            )

    async def _follow_plan(
        self,
        namespace: str,
        epoch: int,
        view: list[Ticket],
        ticket: Ticket,
        vector: np.ndarray,
        result: AveragingResult,
        on_round: Callable[[int, RoundReport, np.ndarray], None],
        evidence: Evidence,
    ) -> None:
        """Our rounds of the view's Moshpit plan, on a copy of `vector`; sets `result.average`
        to the mean over our last basis (module doc)."""
        moshpit = plan(len(view), self.config.group_size)
        several = len(moshpit.rounds) > 1
        digest = view_digest(epoch, view) if several else b""
        if several:  # where each sits: every group with someone its members can dial
            view = placed(view, self.config.group_size, salt=digest)
        ids = [t.peer_id for t in view]
        number = ids.index(self.me)
        weights = [t.weight if t.computes else 0.0 for t in view]
        rules = Counter(t.aggregation for t in view)
        if several and len(rules) > 1:
            result.skipped.append(
                "the peers reduce differently ("
                + ", ".join(f"{n} {rule}" for rule, n in sorted(rules.items()))
                + "): over several rounds that gives different values in different groups; "
                "set the same averaging.aggregation on every peer"
            )
            return
        bandwidth = bandwidths(view, self.config, evidence=evidence)
        # A member still in the previous round may be in its retry (`reduce_in_group`): a
        # leader waits for it as long as a round and its retry may take.
        wait = 2 * patience(len(vector), list(bandwidth.values()), self.config)
        self.matchmaker.expect_rounds(namespace, wait, view=digest)
        shape = RoundShape(
            epoch=epoch,
            size=len(vector),
            codec=self.config.codec,
            chunk_elements=self.config.chunk_elements,
            view=digest,
            evidence=evidence,
        )
        # Never the caller's: a failed round must leave it whole (and a retry, or a failed
        # round of several, starts again from it). An aggregator-only member's is its own
        # zeros, which it never reads: copying would touch every page. Off the event loop:
        # 400 MB took 1-1.7 s there.
        values = await trio.to_thread.run_sync(vector.copy) if ticket.computes else vector
        # What a round starts from, for its retry and to go back to if it fails: our own
        # contribution until a round changed `values`, then a copy of them (a plan of several).
        original: np.ndarray | None = vector if ticket.computes else None
        before: np.ndarray | None = None
        basis = frozenset([number])  # the peers `values` stand for (`moshpit.py`)
        total, members = weights[number], 1
        for index in range(len(moshpit.rounds)):
            group_numbers = moshpit.group(index, number)
            if len(group_numbers) == 1:
                continue  # nobody to meet this round: our value stands as it is
            numbers = {ids[i]: i for i in group_numbers}
            group = GroupPlan(
                members=tuple(numbers),
                seating=(
                    functools.partial(_seats, moshpit, index, numbers, weights) if several else None
                ),
                basis=basis_mask(basis, len(view)) if several else b"",
                # The first round's members start when their reads of the tickets end: 1.5 s
                # after the close (median) and up to 10 s at 300 simulated peers; leaders
                # that waited one join_timeout from their own start left 38 of 263 alone.
                patience=wait if index > 0 else self.config.join_timeout,
            )
            reports = len(result.rounds)
            outcome = await self._round(
                namespace, index, group, view, ticket, values, shape, result, original=original
            )
            if outcome is None:
                if original is not None and len(result.rounds) > reports:
                    # The all-reduce left `values` half-written: back to where the round began.
                    await trio.to_thread.run_sync(np.copyto, values, original)
                continue
            spec, included, total = outcome
            if several:
                seats = _seating(moshpit, index, numbers, weights, _bases_of(spec))
                basis = frozenset(
                    j
                    for m in spec.members
                    if m.peer_id in included and seats[m.peer_id].contributes
                    for j in basis_of(m.basis, len(view))
                )
                total, members = math.fsum(weights[j] for j in basis), len(basis)
                if ticket.computes and index + 1 < len(moshpit.rounds):
                    if before is None:
                        before = await trio.to_thread.run_sync(np.empty_like, values)
                    await trio.to_thread.run_sync(np.copyto, before, values)
                    original = before
            else:  # a single group: whoever took part
                members = len(included)
                result.plan = tuple(sorted(included))
            if len(result.rounds) > reports:  # an all-reduce ran
                on_round(index, result.rounds[-1], values)
        if several:
            result.plan = tuple(ids)
            result.setbacks, result.skipped = result.skipped, []
            missing = [ids[j] for j in range(len(view)) if j not in basis]
            result.dropped.update(dict.fromkeys(missing, "not in the average our last group made"))
            if missing:
                log.info(
                    "averaged over %d of %d planned peers (%d rounds failed for us)",
                    len(basis), len(view), len(result.setbacks),
                )  # fmt: skip
        if several and members < len(view) and len(view) < self.config.partial_from:
            # A small plan is called again rather than split (`averaging.partial_from`).
            result.skipped = [
                f"averaged over {members} of the {len(view)} planned peers; below "
                f"averaging.partial_from = {self.config.partial_from} a step needs all of them",
                *result.setbacks,
            ]
        elif members >= 2:
            result.average, result.weight, result.members = values, total, members
        elif several:
            result.skipped = result.setbacks or ["nobody averaged with us"]

    async def _round(
        self,
        namespace: str,
        index: int,
        group: GroupPlan,
        view: list[Ticket],
        ticket: Ticket,
        values: np.ndarray,
        shape: RoundShape,
        result: AveragingResult,
        *,
        original: np.ndarray | None,
    ) -> tuple[RoundSpec, frozenset[str], float] | None:
        """One round on `values`: its spec, the members `values` are now exact over and their
        total weight, or None if the round gave nothing (why: in `result.skipped`; `values`
        are half-written if an all-reduce ran). `original`: `values` as the round begins,
        kept whole (a retry starts from them)."""
        certificate = self.data_server.identity.certificate
        declared = {t.peer_id: t for t in view}
        try:
            spec = await self.matchmaker.form_group(
                namespace,
                index,
                group,
                view,
                Joined(ticket, certificate),
                shape,
                check=lambda spec: _spec_problem(spec, shape, group, self.me, declared=declared),
            )
        except TooFewPeers as error:
            result.skipped.append(f"round {index}: {error}")
            return None
        problem = _spec_problem(spec, shape, group, self.me, declared=declared)
        if problem:
            result.skipped.append(f"round {index}: the leader's spec {problem}")
            return None
        result.groups.append([m.peer_id for m in spec.members])
        total = math.fsum(m.weight for m in spec.members if m.computes)
        if total <= 0:
            # Nobody here stands for any sample: nothing to average, and no step comes of it
            # (`StepPolicy.averaged`); in a later round, weight 0 adds nothing to any mean.
            return spec, frozenset(m.peer_id for m in spec.members if m.computes), 0.0
        assert shape.evidence is not None  # set by _follow_plan
        bandwidth = bandwidths(view, self.config, evidence=shape.evidence)

        def timeouts(spec: RoundSpec) -> tuple[float, float]:
            return round_timeouts(
                spec,
                bandwidth,
                wire_bytes_per_element=wire_bytes_per_element(self.config),
                floor=self.config.timeout_floor,
                multiplier=self.config.timeout_multiplier,
            )

        several = group.seating is not None
        outcome = await reduce_in_group(
            spec,
            values,
            self.data_server,
            timeouts=timeouts,
            # A group of a plan of several may be any two of its members (`moshpit.py`).
            min_members=2 if several else self.config.min_group_size,
            single=True,
            norm_factor=(
                self.config.norm_factor if self.config.aggregation == "centered_clip" else None
            ),
            original=original,
        )
        result.rounds.extend(outcome.reports)
        if not outcome.included:
            result.skipped.append(f"round {index}: {outcome.problem}")
            return None
        result.groups[-1] = list(outcome.included)  # whom `values` stand for now
        if outcome.dropped:
            if not several:
                result.dropped.update(outcome.dropped)
            log.info(
                "round %d: averaged over %d of %d members, without %s",
                index,
                len(outcome.included),
                len(spec.members),
                _first_reasons(outcome.dropped),
            )
        weights = {m.peer_id: m.weight for m in spec.members}
        total = math.fsum(weights[peer_id] for peer_id in outcome.included)
        return spec, frozenset(outcome.included), total


def _bases_of(spec: RoundSpec) -> dict[str, bytes]:
    return {m.peer_id: m.basis for m in spec.members}


def _seating(
    moshpit: Plan,
    index: int,
    numbers: dict[str, int],
    weights: Sequence[float],
    bases: Mapping[str, bytes],
) -> dict[str, Seat]:
    """`Plan.seating` by peer id and basis mask: the seat of each member of our group in
    round `index` (`numbers`: their peer numbers) that came with a valid mask."""
    present = {}
    for peer_id, mask in bases.items():
        if peer_id not in numbers:
            continue
        try:
            present[numbers[peer_id]] = basis_of(mask, moshpit.count)
        except ProtocolError:
            continue
    seats = moshpit.seating(index, present, weights)
    names = {i: peer_id for peer_id, i in numbers.items()}
    return {names[i]: seat for i, seat in seats.items()}


def _seats(
    moshpit: Plan,
    index: int,
    numbers: dict[str, int],
    weights: Sequence[float],
    bases: Mapping[str, bytes],
) -> dict[str, tuple[int, float]]:
    """(block, weight) of each member `_seating` seats: what a leader's spec must say."""
    seats = _seating(moshpit, index, numbers, weights, bases)
    return {peer_id: (s.block, s.weight) for peer_id, s in seats.items()}


def _spec_problem(
    spec: RoundSpec,
    shape: RoundShape,
    group: GroupPlan,
    me: str,
    *,
    declared: dict[str, Ticket] | None = None,
) -> str | None:
    """What is wrong with a leader's spec for us, or None. `declared`: the DHT tickets we read
    (our view), for the share cap."""
    ours = (shape.size, shape.codec, shape.chunk_elements)
    if (spec.size, spec.codec, spec.chunk_elements) != ours:
        return f"does not match our vector: {spec.size} values, {spec.codec}, {spec.chunk_elements}"
    try:
        with peer_fault("it"):
            check_spec(spec, me)
    except ProtocolError as error:
        return str(error)
    declared = declared or {}
    for m in spec.members:
        # A member's ticket says whether it contributes: a leader that marked one of us
        # aggregator-only would have it apply its own vector as the average (and count fewer
        # contributions against the share cap).
        if m.peer_id in declared and declared[m.peer_id].computes != m.computes:
            return f"says {m.peer_id} {'contributes' if m.computes else 'does not'}, its ticket not"
    if (problem := _share_over_cap(spec, declared)) is not None:
        return problem
    if group.seating is not None:
        if not all(m.computes for m in spec.members):
            return "leaves a member's value out (every member of a plan contributes)"
        ours = next(m for m in spec.members if m.peer_id == me)  # check_spec: we are listed
        if ours.basis != group.basis:
            return "misstates the peers our value stands for"
        seats = {m.peer_id: (m.block, m.weight) for m in spec.members}
        if spec.view != shape.view or seats != group.seating(_bases_of(spec)):
            return (
                "is not our plan's (another view of the tickets, another group, or other weights)"
            )
    return None


def _share_over_cap(spec: RoundSpec, declared: dict[str, Ticket]) -> str | None:
    """Whether the leader gave a member more than `share_cap` of the vector, m counting the
    members whose DHT ticket in our view lets them reduce (`group.able_to_reduce`). The leader
    counts at least those (`group.reducers`), so an honest spec always passes; a lying leader
    cannot hand itself, or anyone, more than the cap (it could hand itself all of it before).
    With one contribution or none there is nothing to steer (`group.shares_for`)."""
    if sum(m.computes for m in spec.members) <= 1:
        return None
    able = sum(able_to_reduce([declared.get(m.peer_id) for m in spec.members]))
    cap = share_cap(able)
    total = math.fsum(m.share for m in spec.members)
    for m in spec.members:
        # Relative slack for the last bits of the leader's float arithmetic.
        if m.share > cap * total * (1 + 1e-9):
            return (
                f"gives {m.peer_id} {m.share / total:.3g} of the vector; at most {cap:.3g} "
                f"among {able} members that can reduce"
            )
    return None


def _first_reasons(failed: dict[str, str]) -> str:
    shown = [f"{who}: {why}" for who, why in sorted(failed.items())[:2]]
    more = len(failed) - len(shown)
    return "; ".join(shown) + (f"; {more} more" if more > 0 else "")


async def start_averager(
    nursery: trio.Nursery, node: Node, dht: DHT, config: PeerConfig
) -> Averager:
    """A daemon's averager: its data plane (TLS under the node's identity, on
    `averaging.data_port`) served in `nursery`, and the averager over it."""
    bind, advertised = data_plane_hosts(node, config.net.listen)
    identity = DataIdentity(node.identity.key_pair.private_key, node.peer_id.to_base58())
    # `node`: members with no direct path reach us (and we them) over libp2p streams.
    data_server = DataServer(identity, network_key=node.network_key_bytes, node=node)
    data_port = await nursery.start(data_server.serve, bind, config.averaging.data_port)
    return Averager(
        dht,
        config.averaging,
        collaboration=config.collaboration.name,
        data_server=data_server,
        data_host=advertised,
        data_port=data_port,
    )
