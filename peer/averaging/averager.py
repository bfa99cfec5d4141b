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

The result is all or nothing. `average` is set only when every round of ours was complete:
every planned member took part from the same view, every reducer returned every chunk with
every member's contribution in it. Otherwise it is None and `skipped` says why; the caller's
vector is never touched (the rounds work on a copy), so a failed averaging leaves exactly the
peer's own contribution. Peers whose last group completed hold the same bits; a peer whose
group failed applies nothing and catches up by download.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from peer.averaging.allreduce import DataServer, RoundReport, RoundSpec, allreduce, check_spec
from peer.averaging.compression import CODECS
from peer.averaging.group import Joined, Ticket, longest_round, round_timeouts, view_digest
from peer.averaging.matchmaking import GroupPlan, Matchmaker, NotExact, RoundShape, TooFewPeers
from peer.averaging.moshpit import plan, rounds_for
from peer.config import AveragingConfig
from peer.dht.node import DHT
from peer.errors import ProtocolError, peer_fault
from peer.measure.capabilities import Capabilities

log = logging.getLogger("peertrain.averager")
#: Seconds past the close of a gathering before the tickets are read, at least.
READ_GRACE = 0.1


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
    """Tickets this peer read when the gathering closed (itself included)."""
    rounds: list[RoundReport] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Why the result is not exact, round by round (a group too small, a member missing, ...)."""
    average: np.ndarray | None = None
    """The exact weighted mean over every peer of the plan; None when not every round was."""
    weight: float = 0.0
    """The total weight (samples) behind `average`."""
    members: int = 0
    """How many peers' contributions `average` holds (the view's, or a single group's)."""


def wire_bytes_per_element(config: AveragingConfig) -> float:
    return CODECS[config.codec].wire_bytes(1 << 20) / (1 << 20)


def bandwidths(view: Sequence[Ticket], config: AveragingConfig) -> dict[str, float]:
    """Each ticket's bandwidth (bytes/s, the lower of up and down) for deadlines: its claim,
    but never below `averaging.min_bandwidth`. Tickets without figures are left out."""
    return {
        t.peer_id: max(
            config.min_bandwidth, min(t.capabilities.upload_bps, t.capabilities.download_bps)
        )
        for t in view
        if t.capabilities is not None
    }


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
    leader's patience: 3 `join_timeout` + `patience`, `Matchmaker`) and the round itself (at
    most `patience` at these bandwidths)."""
    rounds = rounds_for(max(peers, 2), config.group_size)
    return rounds * (3 * config.join_timeout + 2 * patience(size, bandwidth, config))


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
    ) -> None:
        self.dht = dht
        self.config = config
        self.collaboration = collaboration
        self.data_server = data_server
        self.data_host = data_host
        self.data_port = data_port
        self.me = dht.node.peer_id.to_base58()
        self._store_seconds = 0.0  # recent ticket stores: the slowest, decaying
        self.matchmaker = Matchmaker(
            dht,
            data_host=data_host,
            group_size=config.group_size,
            min_group_size=config.min_group_size,
            join_timeout=config.join_timeout,
        )

    async def average(
        self,
        vector: np.ndarray,
        *,
        weight: float,
        epoch: int,
        fingerprint: str,
        gather_until: float,
        capabilities: Capabilities | None = None,
        on_round: Callable[[int, RoundReport, np.ndarray], None] = lambda i, report, values: None,
    ) -> AveragingResult:
        """Average `vector` (float32; left as it is) with every peer of the epoch.

        `weight` is the samples behind it; with weight 0 this member adds nothing and still
        gets the average (a trainer that has no samples yet). `on_round` sees each round's
        report and our values after it.
        """
        namespace = f"{self.collaboration}/avg/{fingerprint}/{epoch}"
        declared_at = self.dht.clock()
        if declared_at > gather_until:  # every reader leaves such a ticket out: so do we
            return AveragingResult(0, skipped=["the gathering closed before we declared"])
        ticket = Ticket(
            peer_id=self.me,
            rpc_addrs=self.dht.node.public_addrs(),
            data_host=self.data_host,
            data_port=self.data_port,
            computes=True,  # every member of a plan holds a value and gets the average
            weight=weight,
            capabilities=capabilities,
            declared_at=declared_at,
            aggregation="centered_clip" if self.config.aggregation == "centered_clip" else "mean",
        )
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
        view = sorted([*view, ticket], key=lambda t: t.peer_id)
        result = AveragingResult(peers_seen=len(view))
        # The outer deadline: twice the bound from the peers' (floored) bandwidths, and never
        # more than max_averaging_seconds, whatever a peer does.
        rates = list(bandwidths(view, self.config).values())
        limit = min(
            self.config.max_averaging_seconds,
            2 * longest_averaging(len(vector), len(view), rates, self.config),
        )
        try:
            with trio.move_on_after(limit) as scope:
                if len(view) > 1:
                    await self._follow_plan(
                        namespace, epoch, view, ticket, vector, result, on_round
                    )
        finally:
            self.matchmaker.forget(namespace)
        if scope.cancelled_caught:
            result.average = None
            result.skipped.append(f"the averaging took longer than its limit of {limit:.0f} s")
        return result

    async def _follow_plan(
        self,
        namespace: str,
        epoch: int,
        view: list[Ticket],
        ticket: Ticket,
        vector: np.ndarray,
        result: AveragingResult,
        on_round: Callable[[int, RoundReport, np.ndarray], None],
    ) -> None:
        """Our rounds of the view's Moshpit plan, on a copy of `vector`; sets `result.average`
        only if every one of them was exact."""
        ids = [t.peer_id for t in view]
        number = ids.index(self.me)
        weights = [t.weight if t.computes else 0.0 for t in view]
        moshpit = plan(len(view), self.config.group_size)
        several = len(moshpit.rounds) > 1
        rules = Counter(t.aggregation for t in view)
        if several and len(rules) > 1:
            result.skipped.append(
                "the peers reduce differently ("
                + ", ".join(f"{n} {rule}" for rule, n in sorted(rules.items()))
                + "): over several rounds that gives different values in different groups; "
                "set the same averaging.aggregation on every peer"
            )
            return
        bandwidth = bandwidths(view, self.config)
        wait = patience(len(vector), list(bandwidth.values()), self.config)
        self.matchmaker.expect_rounds(namespace, wait)
        shape = RoundShape(
            epoch=epoch,
            size=len(vector),
            codec=self.config.codec,
            chunk_elements=self.config.chunk_elements,
            view=view_digest(epoch, view) if several else b"",
        )
        values = vector.copy()  # never the caller's: a failed round must leave it whole
        exact, total, covered = True, weights[number], len(view)
        for index in range(len(moshpit.rounds)):
            members = moshpit.group(index, number)
            if len(members) == 1:
                continue  # nobody to meet this round: our value stands as it is
            group = GroupPlan(
                members=tuple(ids[i] for i in members),
                seats=(
                    {
                        ids[s.member]: (s.block, s.weight)
                        for s in moshpit.seats(index, number, weights)
                    }
                    if several
                    else None
                ),
                patience=wait if index > 0 else 0.0,
            )
            reports = len(result.rounds)
            weight = await self._round(
                namespace, index, group, view, ticket, values, shape, result, exact=exact
            )
            if weight is None:
                exact = False
                continue
            total = weight
            if not several:  # a single group: whoever joined it
                covered = len(result.groups[-1])
            if len(result.rounds) > reports:  # an all-reduce ran
                on_round(index, result.rounds[-1], values)
        if exact:
            result.average, result.weight, result.members = values, total, covered

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
        exact: bool,
    ) -> float | None:
        """One round on `values`: the total weight they stand for afterwards, or None if the
        round was not exact (why: in `result.skipped`)."""
        certificate = self.data_server.identity.certificate
        try:
            spec = await self.matchmaker.form_group(
                namespace,
                index,
                group,
                view,
                Joined(ticket, certificate),
                shape,
                check=lambda spec: _spec_problem(spec, shape, group, self.me),
                exact=exact,
            )
        except (TooFewPeers, NotExact) as error:
            result.skipped.append(f"round {index}: {error}")
            return None
        problem = _spec_problem(spec, shape, group, self.me)
        if problem:
            result.skipped.append(f"round {index}: the leader's spec {problem}")
            return None
        result.groups.append([m.peer_id for m in spec.members])
        total = math.fsum(m.weight for m in spec.members if m.computes)
        if not exact or total <= 0:
            # Off the plan already (we only joined to say so), or nobody here stands for any
            # sample: there is nothing to average.
            return total if exact else None
        bandwidth = bandwidths(view, self.config)
        duration, stall = round_timeouts(
            spec,
            bandwidth,
            wire_bytes_per_element=wire_bytes_per_element(self.config),
            floor=self.config.timeout_floor,
            multiplier=self.config.timeout_multiplier,
        )
        report = await allreduce(
            spec,
            values,
            self.data_server,
            deadline=trio.current_time() + duration,
            stall_timeout=stall,
            norm_factor=(
                self.config.norm_factor if self.config.aggregation == "centered_clip" else None
            ),
        )
        result.rounds.append(report)
        senders = sum(m.computes for m in spec.members)
        if not report.complete:
            failed = {**report.dropped_senders, **report.failed_reducers}
            result.skipped.append(f"round {index}: incomplete ({_first_reasons(failed)})")
            return None
        if any(chunk.senders != senders for chunk in report.chunks):
            result.skipped.append(
                f"round {index}: a reducer averaged a chunk without every member's contribution"
            )
            return None
        return total


def _spec_problem(spec: RoundSpec, shape: RoundShape, group: GroupPlan, me: str) -> str | None:
    """What is wrong with a leader's spec for us, or None."""
    ours = (shape.size, shape.codec, shape.chunk_elements)
    if (spec.size, spec.codec, spec.chunk_elements) != ours:
        return f"does not match our vector: {spec.size} values, {spec.codec}, {spec.chunk_elements}"
    try:
        with peer_fault("it"):
            check_spec(spec, me)
    except ProtocolError as error:
        return str(error)
    if group.seats is not None:
        seats = {m.peer_id: (m.block, m.weight) for m in spec.members}
        if spec.view != shape.view or seats != group.seats:
            return "is not our plan's (another view of the tickets, or other weights)"
        if not all(m.computes for m in spec.members):
            return "leaves a member's value out (every member of a plan contributes)"
    return None


def _first_reasons(failed: dict[str, str]) -> str:
    shown = [f"{who}: {why}" for who, why in sorted(failed.items())[:2]]
    more = len(failed) - len(shown)
    return "; ".join(shown) + (f"; {more} more" if more > 0 else "")
