"""`peer status`: a view of the collaboration from any machine that can reach a backbone.

It runs a short-lived DHT *client* with a throw-away identity: it asks, never stores, and no
routing table adds it. The result is plain data (`StatusReport`) that the CLI renders as a
table or JSON.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

import msgspec

from peer.config import PeerConfig
from peer.daemon import join, parse_backbones
from peer.dht.node import DHT
from peer.errors import RoleAssignmentError, Unreachable
from peer.measure.capabilities import Capabilities, to_capacity
from peer.net.host import open_node
from peer.net.identity import ephemeral_identity
from peer.net.network_key import load_network_key
from peer.presence import PresenceRecord, decode_presence, presence_key
from peer.roles import aggregators, assign_roles
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
    published_quorum,
)
from peer.training.publisher import ProgressReader

STATUS_JOIN_BACKOFF = (0.5, 1.0)


@dataclass(frozen=True)
class PeerRow:
    peer_id: str
    role: str
    """Node kind: peer or backbone."""
    addrs: list[str]
    version: str
    started_at: float
    uptime_s: float
    last_seen_s: float  # seconds since the peer last refreshed its presence
    expires_in_s: float
    # Measured figures (None until the peer's first measurement).
    samples_per_s: float | None
    upload_bps: float | None
    download_bps: float | None
    rtt_s: float | None
    reachable: bool | None
    device: str | None
    free_memory_bytes: int | None
    measured_at: float | None
    # What it did, not what the solver advises: it computes if it trains (not downloading),
    # aggregates if it reduced a part of its last averaging (None: a node that takes no part).
    work: str | None
    """compute, aggregate, compute+aggregate or idle."""
    share: float | None
    """The fraction of the vector it reduced in its last averaging."""
    client_only: bool | None
    """Not reachable inbound, not even by hole punching, so it never aggregates (None: not
    checked yet)."""
    # From its progress record (None for a node that does not train or keep state).
    progress_role: str | None
    """trainer or keeper."""
    step: int | None
    contribution: int | None
    """Samples it has accumulated toward step + 1."""
    training_samples_per_s: float | None
    loss: float | None


@dataclass(frozen=True)
class TrainingSummary:
    """The collaboration's training as its progress records show it (pure data)."""

    global_step: int
    trainers: int
    """Trainers at the global step."""
    trainers_behind: int
    keepers: int
    samples: int
    """Samples accumulated toward global_step + 1."""
    target_batch: int | None
    samples_per_s: float
    eta_s: float | None
    """Seconds until the next step's batch is full (None: nobody is computing)."""
    loss: float | None
    """Mean training loss of the trainers at the global step."""
    loss_trend: list[float]
    """Their mean loss at each of the last few steps, oldest first."""
    validation: tuple[int, float] | None
    """(step, loss) of the newest validation."""
    validation_trend: list[float]
    bytes_per_step: int
    """Bytes the trainers at the global step sent and received averaging their last step."""


@dataclass(frozen=True)
class GroupAssignment:
    """The role solver's answer for the whole collaboration, as `peer status` shows it."""

    task: str
    gradient_bytes: int
    target_batch: int
    samples_per_s: float
    step_time_s: float
    compute_time_s: float
    comm_time_s: float
    exact: bool
    work: dict[str, tuple[str, float]]
    """peer id -> (work, share)."""


@dataclass(frozen=True)
class CollaborationSummary:
    name: str
    peers_online: int
    backbones_online: int
    backbones_reached: list[str]
    queried_at: float
    assignment: GroupAssignment | None
    assignment_note: str | None
    """Why there is no assignment (nothing measured yet, no aggregator, ...)."""
    training: TrainingSummary | None
    """None until some peer publishes progress."""


@dataclass(frozen=True)
class StatusReport:
    collaboration: CollaborationSummary
    peers: list[PeerRow]
    progress: list[ProgressRecord] = field(default_factory=list)
    """Every trainer's (and state keeper's) signed progress record."""
    quorum: int = 1
    """Signers a step needs to count: the collaboration's (`published_quorum`)."""

    @property
    def training(self) -> CollaborationView:
        return CollaborationView(self.progress, self.quorum)

    def to_json(self) -> dict:
        collaboration = asdict(self.collaboration)
        if collaboration["assignment"] is not None:
            del collaboration["assignment"]["work"]  # per peer in `peers` already
        return {
            "collaboration": collaboration,
            "peers": [asdict(row) for row in self.peers],
            "progress": [msgspec.to_builtins(record) for record in self.progress],
        }


def assign_group(records: list[PresenceRecord]) -> tuple[GroupAssignment | None, str | None]:
    """Run the role solver over the measured records (pure).

    The task is the one most compute-capable peers train (its P and B feed the solver); peers
    training another task stay out. Returns (assignment, None) or (None, why not).
    """
    # A backbone takes part only if it aggregates (`backbone start --aggregate`): the solver
    # must not hand a share to one that never reduces.
    measured = [
        (r.peer_id, r.capabilities)
        for r in records
        if r.capabilities is not None and (r.role != "backbone" or r.aggregator)
    ]
    main_task = _main_task(records)
    if main_task is None:
        return None, "no peer has measured its compute yet"
    task, gradient_bytes, target_batch = main_task
    taking_part = [
        (capacity, c)
        for peer_id, c in measured
        if (_task_of(c) == main_task or not c.task)  # the task's peers, and backbones
        and (capacity := to_capacity(peer_id, c)) is not None
    ]
    # A peer behind NAT aggregates by hole punching only where everyone reaches it.
    able = aggregators([c.reachable for _, c in taking_part], [c.punchable for _, c in taking_part])
    capacities = [
        dataclasses.replace(capacity, reachable=reachable)
        for (capacity, _), reachable in zip(taking_part, able, strict=True)
    ]
    try:
        result = assign_roles(
            capacities, gradient_bytes=gradient_bytes, target_batch=target_batch, delayed=False
        )
    except RoleAssignmentError as error:
        return None, str(error)
    work = {
        role.peer_id: (_work_name(role.computes, role.share > 0), role.share)
        for role in result.roles
    }
    return GroupAssignment(
        task=task,
        gradient_bytes=gradient_bytes,
        target_batch=target_batch,
        samples_per_s=result.samples_per_s,
        step_time_s=result.step_time,
        compute_time_s=result.compute_time,
        comm_time_s=result.comm_time,
        exact=result.exact,
        work=work,
    ), None


def _main_task(records: list[PresenceRecord]) -> tuple[str, int, int] | None:
    """(task, gradient bytes, target batch) that most measured peers train, or None."""
    tasks = Counter(
        _task_of(c)
        for r in records
        if (c := r.capabilities) is not None
        and c.samples_per_s > 0
        and c.gradient_bytes > 0
        and c.target_batch > 0
    )
    return max(tasks.items(), key=lambda kv: (kv[1], kv[0]))[0] if tasks else None


def summarise_training(
    progress: list[ProgressRecord], target_batch: int | None, *, quorum: int = 1
) -> TrainingSummary | None:
    """What the progress records say about the collaboration's training (pure). The global
    step is the highest one `quorum` peers signed (`CollaborationView.global_step`)."""
    if not progress:
        return None
    view = CollaborationView(progress, quorum)
    step = view.global_step
    at_step = view.trainers(step)
    trainers = [r for r in progress if r.role == "trainer"]
    losses = [r.loss for r in at_step if r.loss is not None]
    eta = view.eta(step, target_batch) if target_batch else math.inf
    validation = view.validation_loss()
    newest = [r for r in progress if validation and r.validation_step == validation[0]]
    return TrainingSummary(
        global_step=step,
        trainers=len(at_step),
        trainers_behind=len(trainers) - len(at_step),
        keepers=sum(r.role == "keeper" for r in progress),
        samples=view.samples(step),
        target_batch=target_batch,
        samples_per_s=view.throughput(step),
        eta_s=eta if math.isfinite(eta) else None,
        loss=sum(losses) / len(losses) if losses else None,
        loss_trend=mean_tail([r.recent_losses for r in at_step]),
        validation=validation,
        validation_trend=list(newest[0].recent_validation) if newest else [],
        bytes_per_step=sum(r.step_bytes for r in at_step),
    )


def mean_tail(series: list[list[float]]) -> list[float]:
    """Element-wise mean of series aligned at their ends (peers that joined later have fewer
    past steps): [[1, 2, 3], [4, 5]] -> [1, 3, 4]."""
    length = max((len(s) for s in series), default=0)
    out = []
    for back in range(length, 0, -1):
        values = [s[-back] for s in series if len(s) >= back]
        out.append(sum(values) / len(values))
    return out


def _task_of(c: Capabilities) -> tuple[str, int, int]:
    """Peers train together only with the same task, gradient size and target batch."""
    return (c.task, c.gradient_bytes, c.target_batch)


def _work_name(computes: bool, aggregates: bool) -> str:
    return {
        (True, True): "compute+aggregate",
        (True, False): "compute",
        (False, True): "aggregate",
        (False, False): "idle",
    }[computes, aggregates]


@asynccontextmanager
async def status_client(config: PeerConfig) -> AsyncIterator[Callable[[], Awaitable[StatusReport]]]:
    """A DHT client joined through the backbones, yielding `poll()`: one fresh report per call
    (`peer status --watch` polls the same client instead of joining again each time)."""
    seeds = parse_backbones(config.collaboration.backbones)
    if not seeds:
        raise Unreachable("no backbone given; pass --backbone MADDR (printed by `backbone start`)")
    async with open_node(
        ephemeral_identity(),
        listen=[],
        announce=[],
        max_message_bytes=config.net.max_message_bytes,
        network_key=load_network_key(config.collaboration.network_key),
    ) as node:
        dht = DHT(node, config.dht, server=False, rpc_timeout=config.net.rpc_timeout)
        reached = await join(dht, seeds, backoff=STATUS_JOIN_BACKOFF)

        async def poll() -> StatusReport:
            return await read_report(dht, config, [str(peer_id) for peer_id in reached])

        yield poll


async def read_report(
    dht: DHT, config: PeerConfig, reached: list[str], *, assign: bool = True
) -> StatusReport:
    """The collaboration as its presence and progress records say now, read through `dht`
    (a status client's, or a backbone's own). `assign=False`: without the group's role
    assignment (a solve of 20-45 ms that a dashboard does not show)."""
    name = config.collaboration.name
    entries = await dht.get(presence_key(name))
    progress = (await ProgressReader(dht, name, hot=False).read()).records
    return _report(config, entries, progress, reached, assign=assign)


async def collect_status(config: PeerConfig) -> StatusReport:
    async with status_client(config) as poll:
        return await poll()


def _report(
    config: PeerConfig,
    entries: dict,
    progress: list[ProgressRecord],
    reached: list[str],
    *,
    assign: bool = True,
) -> StatusReport:
    now = time.time()
    records = decode_presence(entries)
    assignment, note = assign_group(records) if assign else (None, "not computed here")
    by_peer = {r.peer_id: r for r in progress}
    rows = [
        _row(
            r,
            now=now,
            expires_at=entries[r.peer_id].expiration,
            progress=by_peer.get(r.peer_id),
        )
        for r in records
    ]
    main_task = _main_task(records)
    # Steps count by the collaboration's rule, as its trainers state it, not by our config.
    quorum = published_quorum(progress, config.averaging.min_group_size)
    summary = CollaborationSummary(
        name=config.collaboration.name,
        peers_online=sum(row.role == "peer" for row in rows),
        backbones_online=sum(row.role == "backbone" for row in rows),
        backbones_reached=reached,
        queried_at=now,
        assignment=assignment,
        assignment_note=note,
        training=summarise_training(progress, main_task[2] if main_task else None, quorum=quorum),
    )
    return StatusReport(summary, rows, progress, quorum)


def _row(
    r: PresenceRecord,
    *,
    now: float,
    expires_at: float,
    progress: ProgressRecord | None,
) -> PeerRow:
    c = r.capabilities
    trainer = progress if progress is not None and progress.role == "trainer" else None
    reduced = trainer.reduced if trainer is not None else r.reduced
    takes_part = progress is not None or r.aggregator
    computes = trainer is not None and not trainer.downloading
    work = _work_name(computes, reduced > 0) if takes_part else None
    # A peer publishes its compute figure before its first link probe and dial-back: until
    # then its record says 0 B/s and not reachable, which means "not measured yet" (a real
    # probe never gives 0 for all three). A backbone is reachable by definition.
    linked = c is not None and (r.role == "backbone" or c.upload_bps or c.download_bps or c.rtt_s)
    return PeerRow(
        peer_id=r.peer_id,
        role=r.role,
        addrs=r.addrs,
        version=r.version,
        started_at=r.started_at,
        uptime_s=max(0.0, now - r.started_at),
        last_seen_s=max(0.0, now - r.updated_at),
        expires_in_s=expires_at - now,
        samples_per_s=c.samples_per_s if c else None,
        upload_bps=c.upload_bps if c and linked else None,
        download_bps=c.download_bps if c and linked else None,
        rtt_s=c.rtt_s if c and linked else None,
        reachable=c.reachable if c and linked else None,
        device=c.device if c else None,
        free_memory_bytes=c.free_memory_bytes if c else None,
        measured_at=c.measured_at if c else None,
        work=work,
        share=reduced if takes_part else None,
        client_only=not (c.reachable or c.punchable) if c and linked else None,
        progress_role=progress.role if progress else None,
        step=progress.step if progress else None,
        contribution=progress.samples if progress else None,
        training_samples_per_s=progress.samples_per_second if progress else None,
        loss=progress.loss if progress else None,
    )
