"""`peer status`: a view of the collaboration from any machine that can reach a backbone.

It runs a short-lived DHT *client* with a throw-away identity: it asks, never stores, and no
routing table adds it. The result is plain data (`StatusReport`) that the CLI renders as a
table or JSON.
"""

from __future__ import annotations

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
from peer.presence import PresenceRecord, decode_presence, presence_key
from peer.roles import assign_roles
from peer.training.progress import CollaborationView, ProgressRecord, decode_progress, progress_key

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
    # What the role solver assigns it (None without an assignment).
    work: str | None
    """compute, aggregate, compute+aggregate or idle."""
    share: float | None


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


@dataclass(frozen=True)
class StatusReport:
    collaboration: CollaborationSummary
    peers: list[PeerRow]
    progress: list[ProgressRecord] = field(default_factory=list)
    """Every trainer's (and state keeper's) signed progress record."""

    @property
    def training(self) -> CollaborationView:
        return CollaborationView(self.progress)

    def to_json(self) -> dict:
        collaboration = asdict(self.collaboration)
        if collaboration["assignment"] is not None:
            del collaboration["assignment"]["work"]  # per peer in `peers` already
        return {
            "collaboration": collaboration,
            "peers": [asdict(row) for row in self.peers],
            "progress": [msgspec.structs.asdict(record) for record in self.progress],
        }


def assign_group(records: list[PresenceRecord]) -> tuple[GroupAssignment | None, str | None]:
    """Run the role solver over the measured records (pure).

    The task is the one most compute-capable peers train (its P and B feed the solver); peers
    training another task stay out. Returns (assignment, None) or (None, why not).
    """
    measured = [(r.peer_id, r.capabilities) for r in records if r.capabilities is not None]
    tasks = Counter(
        _task_of(c)
        for _, c in measured
        if c.samples_per_s > 0 and c.gradient_bytes > 0 and c.target_batch > 0
    )
    if not tasks:
        return None, "no peer has measured its compute yet"
    main_task, _ = max(tasks.items(), key=lambda kv: (kv[1], kv[0]))
    task, gradient_bytes, target_batch = main_task
    capacities = [
        capacity
        for peer_id, c in measured
        if (_task_of(c) == main_task or not c.task)  # the task's peers, and backbones
        and (capacity := to_capacity(peer_id, c)) is not None
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
        ephemeral_identity(), listen=[], announce=[], max_message_bytes=config.net.max_message_bytes
    ) as node:
        dht = DHT(node, config.dht, server=False, rpc_timeout=config.net.rpc_timeout)
        reached = await join(dht, seeds, backoff=STATUS_JOIN_BACKOFF)

        async def poll() -> StatusReport:
            entries = await dht.get(presence_key(config.collaboration.name))
            progress = decode_progress(await dht.get(progress_key(config.collaboration.name)))
            return _report(config, entries, progress, [str(peer_id) for peer_id in reached])

        yield poll


async def collect_status(config: PeerConfig) -> StatusReport:
    async with status_client(config) as poll:
        return await poll()


def _report(
    config: PeerConfig, entries: dict, progress: list[ProgressRecord], reached: list[str]
) -> StatusReport:
    now = time.time()
    records = decode_presence(entries)
    assignment, note = assign_group(records)
    rows = [
        _row(r, now=now, expires_at=entries[r.peer_id].expiration, assignment=assignment)
        for r in records
    ]
    summary = CollaborationSummary(
        name=config.collaboration.name,
        peers_online=sum(row.role == "peer" for row in rows),
        backbones_online=sum(row.role == "backbone" for row in rows),
        backbones_reached=reached,
        queried_at=now,
        assignment=assignment,
        assignment_note=note,
    )
    return StatusReport(summary, rows, progress)


def _row(
    r: PresenceRecord, *, now: float, expires_at: float, assignment: GroupAssignment | None
) -> PeerRow:
    c = r.capabilities
    work, share = assignment.work.get(r.peer_id, (None, None)) if assignment else (None, None)
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
        upload_bps=c.upload_bps if c else None,
        download_bps=c.download_bps if c else None,
        rtt_s=c.rtt_s if c else None,
        reachable=c.reachable if c else None,
        device=c.device if c else None,
        free_memory_bytes=c.free_memory_bytes if c else None,
        measured_at=c.measured_at if c else None,
        work=work,
        share=share,
    )
