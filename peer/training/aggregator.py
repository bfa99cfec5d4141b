"""A backbone's part in averaging (`averaging.backbone_aggregates`, `backbone start --aggregate`):
it joins each step's averaging as an aggregator-only member, as DeDLOC's backbones do.

    read the progress records -> the earliest call of the certified global step (ignoring
    calls further ahead than the widest gathering window) -> declare an aggregator-only
    ticket at once -> at the close, the vector size the computing tickets state
    (`group.stated_size`) -> reduce the share the leader's spec gives us (the shares LP over
    attested bandwidth, capped), contribute nothing, apply nothing (`Averager.aggregate`)

It trains nothing and holds no model. What it believes comes from the trainers that hold the
collaboration's certified state (`CollaborationView.donors` of the global step), never from
any record: the fingerprint most of them state, and the vector size their tickets state (so
throw-away tickets cannot make it allocate a huge vector). It joins at most `MAX_JOINS`
gatherings at once, so one far-ahead call cannot keep it from an earlier one. Only while the
collaboration fits in one group: a Moshpit plan's later rounds average blocks that members
hold (`averager.planned_view`). It sits out retries (`allreduce.retry_spec`).
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import trio

from peer.averaging.averager import Averager, start_averager
from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.measure.capabilities import Capabilities
from peer.net.host import Node
from peer.training.progress import CollaborationView
from peer.training.publisher import ProgressReader, read_interval, received_bytes
from peer.training.timing import Timing

log = logging.getLogger("peertrain.aggregator")


MAX_JOINS = 2
"""Gatherings an aggregating backbone takes part in at once."""


@dataclass(frozen=True)
class Call:
    gather_until: float
    fingerprint: str
    contributors: frozenset[str]
    """The trainers holding the certified state: only their tickets state the vector size."""


def next_call(view: CollaborationView, *, after: float, now: float, timing: Timing) -> Call | None:
    """The call to join (pure): the earliest call of the certified global step gathering after
    `after` and not yet closed, with the fingerprint stated by most of the trainers that hold
    that step's consensus state."""
    step = view.global_step
    gather_until = view.call(step, after=max(after, now), latest=timing.latest_call(now))
    if gather_until is None:
        return None
    holders = [r for r in view.donors(step) if r.role == "trainer"]
    fingerprints = Counter(r.fingerprint for r in holders if r.fingerprint)
    if not fingerprints:
        return None
    fingerprint = min(fingerprints, key=lambda f: (-fingerprints[f], f))
    return Call(gather_until, fingerprint, frozenset(r.peer_id for r in holders))


@dataclass
class AggregatorTally:
    joined: int = 0
    completed: int = 0
    reduced: float = 0.0
    """The fraction of the vector we reduced in our last averaging."""


class BackboneAggregator:
    def __init__(
        self,
        dht: DHT,
        averager: Averager,
        config: PeerConfig,
        *,
        capabilities: Callable[[], Capabilities | None],
    ) -> None:
        self.dht = dht
        self.averager = averager
        self.config = config
        self.capabilities = capabilities
        self.timing = Timing.of(config)
        self.quorum = config.averaging.min_group_size
        self.tally = AggregatorTally()
        self._joined_until = -math.inf
        # Half our reads' interval: the configured one, stretched as for a trainer once the
        # records are many (`publisher.read_interval`).
        self._read_interval = self.config.training.progress_interval
        self._reader = ProgressReader(dht, config.collaboration.name)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async with trio.open_nursery() as nursery:
            pending: set[float] = set()  # the gatherings we are in

            async def join(call: Call) -> None:
                try:
                    await self._join(call)
                finally:
                    pending.discard(call.gather_until)

            while True:
                call = await self._next_call(before=min(pending, default=math.inf))
                if call is not None and len(pending) < MAX_JOINS:
                    self._joined_until = max(self._joined_until, call.gather_until)
                    pending.add(call.gather_until)
                    nursery.start_soon(join, call)
                await trio.sleep(max(self._read_interval / 2, 0.1))

    async def _next_call(self, *, before: float) -> Call | None:
        """A call to join: after the last we joined, or one earlier than those we are in (a
        far-ahead call must not keep us from the one the trainers answer)."""
        try:
            entries, records = await self._reader.read()
        except RemoteError as error:
            log.debug("could not read the progress records: %s", error)
            return None
        self._read_interval = read_interval(
            received_bytes(entries, records),
            interval=self.config.training.progress_interval,
            longest=self.timing.longest_read_interval,
        )
        view = CollaborationView(records, self.quorum)
        now = self.dht.clock()
        call = next_call(view, after=self._joined_until, now=now, timing=self.timing)
        if before < math.inf:
            earlier = next_call(view, after=now, now=now, timing=self.timing)
            if earlier is not None and earlier.gather_until < before:
                return earlier
        return call

    async def _join(self, call: Call) -> None:
        epoch = int(call.gather_until * 1000)  # as the trainers answer the call
        self.tally.joined += 1
        result = await self.averager.aggregate(
            epoch=epoch,
            fingerprint=call.fingerprint,
            gather_until=call.gather_until,
            contributors=call.contributors,
            capabilities=self.capabilities(),
        )
        if result.rounds:
            self.tally.reduced = result.rounds[-1].reduced
        if result.groups and not result.skipped:
            self.tally.completed += 1
            log.info(
                "aggregated %.1f%% of epoch %d's vector among %d members",
                100 * self.tally.reduced,
                epoch,
                len(result.groups[-1]),
            )
        else:
            log.info("aggregation of epoch %d: %s", epoch, "; ".join(result.skipped) or "alone")


async def run_aggregator(
    node: Node,
    dht: DHT,
    config: PeerConfig,
    *,
    capabilities: Callable[[], Capabilities | None],
    task_status: trio.TaskStatus[BackboneAggregator] = trio.TASK_STATUS_IGNORED,
) -> None:
    """A backbone's data plane and aggregator, owned by one nursery, until cancelled."""
    async with trio.open_nursery() as nursery:
        averager = await start_averager(nursery, node, dht, config)
        aggregator = BackboneAggregator(dht, averager, config, capabilities=capabilities)
        await nursery.start(aggregator.run)
        task_status.started(aggregator)
