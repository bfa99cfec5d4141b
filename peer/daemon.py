"""The long-lived node that `peer join` and `backbone start` run.

    identity key (locked) -> libp2p host -> DHT (server mode) -> join through backbones
    -> (a backbone) circuit relay v2 for peers behind NAT; (a peer not reachable inbound)
       relay slots on the backbones, announced; relayed connections punched to direct ones
    -> (a peer) clock offset to the backbones measured, then every minute
    -> presence record kept fresh -> ... until cancelled -> presence withdrawn, connections closed

A peer must reach at least one backbone to join; a backbone may be the first of its
collaboration and then starts alone.
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer import __version__
from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import ConfigError, Unreachable
from peer.files import state_folder
from peer.loopwatch import LoopWatch, log_statistics_on_stop
from peer.measure.clock import CollaborationClock, keep_clock
from peer.measure.probe import ProbeServer
from peer.measure.reachability import DialBackServer, open_dialer
from peer.measure.service import Measurements
from peer.metrics import Sources, registry_for, serve_metrics
from peer.net.holepunch import HolePuncher
from peer.net.host import Node, open_node, parse_addrs, split_peer_addr
from peer.net.identity import ephemeral_identity, hold_identity, load_or_create_identity
from peer.net.inbound import InboundLimits
from peer.net.network_key import load_network_key
from peer.net.relay import (
    RelayClientConfig,
    RelayLimits,
    RelayService,
    RelaySlots,
    route_through_relays,
)
from peer.presence import PresenceRecord, Role, decode_presence, keep_present, presence_key
from peer.training.notary import GenesisRegistry, NotaryService, read_progress

if TYPE_CHECKING:  # torch takes a second or two to import; backbones never need it
    import torch

    from peer.training.task import Task
    from peer.training.trainer import Trainer
    from peer.training.worker import WorkerFactory

log = logging.getLogger("peertrain.daemon")

JOIN_BACKOFF = (0.5, 1.0, 2.0, 4.0)
#: Seconds between measurements of our clock's offset to the backbones'.
CLOCK_INTERVAL = 60.0


def parse_backbones(addrs: Sequence[str]) -> list[tuple[ID, Multiaddr]]:
    return [split_peer_addr(text, what="backbone address") for text in addrs]


async def join(
    dht: DHT, seeds: list[tuple[ID, Multiaddr]], *, backoff: Sequence[float] = JOIN_BACKOFF
) -> list[ID]:
    """Bootstrap through any seed that answers, retrying with backoff; raise Unreachable if none does."""
    for delay in (*backoff, None):
        reached = await dht.bootstrap(seeds)
        if reached:
            return reached
        if delay is not None:
            log.debug("no backbone answered; retrying in %.3gs", delay)
            await trio.sleep(delay)
    tried = ", ".join(f"{addr}/p2p/{peer_id}" for peer_id, addr in seeds)
    raise Unreachable(
        f"no backbone answered (tried {tried}); check the addresses `backbone start` printed "
        "and that a backbone is running and reachable (a private collaboration also needs "
        "its --network-key)"
    )


async def run_daemon(
    config: PeerConfig,
    stop: trio.Event,
    *,
    role: Role,
    on_ready: Callable[[Node], None] = lambda node: None,
    on_trainer: Callable[[Trainer], None] = lambda trainer: None,
    own_loop: OwnLoop | None = None,
    task_status: trio.TaskStatus[Node] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run a node until `stop` is set. `on_ready` sees it once it has joined and published presence.
    A peer trains (`on_trainer` sees its trainer) and stops by itself when training is done:
    the task `config` names, or (`own_loop`) a training loop of the user's own.

    Stopping is two-phase: the node's own tasks end first (presence is withdrawn) while the
    host still runs, then the host closes. Cancelling from outside also stops it, but then
    the host's connections are gone before the withdrawal can be sent.
    """
    seeds = parse_backbones(config.collaboration.backbones)
    if role == "peer" and not seeds:
        raise Unreachable("no backbone given; pass --backbone MADDR (printed by `backbone start`)")
    workload = None
    if role == "peer":  # config errors come first
        workload = (own_loop.task, own_loop.device) if own_loop else load_workload(config)
        from peer.training.tracking import check_tracking

        check_tracking(config.log.tensorboard_dir)
    identity = load_or_create_identity(Path(config.identity.path).expanduser())
    network_key = load_network_key(config.collaboration.network_key)
    inbound = inbound_limits(config)
    limits = relay_limits(config)
    raise_descriptor_limit()
    with hold_identity(identity):  # first: a key a running backbone holds says so
        if role == "peer" and all(peer_id == identity.peer_id for peer_id, _ in seeds):
            # It would join a DHT of its own and average alone for ever.
            raise ConfigError(
                f"--backbone {config.collaboration.backbones[0]} is this peer's own address; "
                "pass a backbone's (printed by `backbone start`)"
            )
        async with open_node(
            identity,
            listen=config.net.listen,
            announce=config.net.announce,
            max_message_bytes=config.net.max_message_bytes,
            network_key=network_key,
            inbound=inbound,
        ) as node:
            # A peer reads the time as the backbones do (peer.measure.clock); a backbone is
            # the reference and keeps its own.
            clock = CollaborationClock()
            dht = DHT(
                node, config.dht, server=True, rpc_timeout=config.net.rpc_timeout, clock=clock
            )
            if role == "peer":
                # A DHT client until a backbone could dial it (below): a peer behind NAT that
                # announced itself while joining stayed in the backbone's table, and every
                # lookup that met it waited out a dial its home router dropped (5 s).
                dht.announcing = lambda: False
            started_at = clock()
            watch = LoopWatch()
            async with (
                open_backbone_services(node, config, role) as probe_server,
                log_statistics_on_stop(watch),  # once the nursery below has closed
                trio.open_nursery() as nursery,
            ):
                await nursery.start(watch.run)  # first: it sees the joining too
                # Relayed addresses in records are dialed only through the backbones we were
                # given, at the addresses we were given (peer.net.relayed).
                node.relayed.relays = {peer_id: addr for peer_id, addr in seeds}
                route_through_relays(node, timeout=config.net.connect_timeout)
                puncher = HolePuncher(node) if config.relay.holepunch else None
                if puncher is not None:
                    await nursery.start(puncher.run)
                if role == "backbone" and config.relay.serve:
                    await nursery.start(RelayService(node, limits).run)
                if role == "backbone":  # peers ask the smallest of their backbones
                    await nursery.start(notary_service(node, dht, config).run)
                await nursery.start(dht.run)
                seeds = [(p, addr) for p, addr in seeds if p != node.peer_id]
                reached: list[ID] = []
                if seeds:
                    dht.seeds = seeds
                    if role == "peer":
                        reached = await join(dht, seeds)
                    elif not (reached := await dht.bootstrap(seeds)):
                        log.warning(
                            "no other backbone answered; starting alone, will retry in the "
                            "background"
                        )

                if role == "peer":  # in the background: a silent backbone delays nothing
                    # Only the backbones this machine was told to trust keep its time: anyone
                    # can announce a "backbone" in presence, and a few could move the median.
                    nursery.start_soon(
                        partial(
                            keep_clock,
                            node,
                            clock,
                            [peer_id for peer_id, _ in seeds],
                            interval=CLOCK_INTERVAL,
                            timeout=config.net.rpc_timeout,
                        )
                    )
                measurements = Measurements(
                    node,
                    config,
                    find_backbones=lambda: find_backbones(
                        dht, config.collaboration.name, first=reached
                    ),
                    workload=workload,
                    benchmark=own_loop is None,
                    probe_server=probe_server,
                )
                if role == "peer":  # a DHT server once a backbone could dial it
                    dht.announcing = lambda: measurements.verdict is True
                await nursery.start(measurements.run)
                slots = None
                if role == "peer" and config.relay.reserve:
                    slots = RelaySlots(
                        node,
                        [f"{addr}/p2p/{peer_id}" for peer_id, addr in seeds],
                        RelayClientConfig(retry_seconds=config.relay.retry_seconds),
                        # Only once found unreachable: a peer that is reachable (most, on a
                        # LAN) would otherwise be dialled through the relay until its verdict.
                        reachable=lambda: measurements.verdict is not False,
                        wait_reachability=measurements.wait_changed,
                    )
                    await nursery.start(slots.run)
                sources = Sources(
                    role, node.peer_id.to_base58(), __version__, dht, measurements, loop=watch
                )
                if config.metrics.port:
                    await nursery.start(
                        serve_metrics,
                        registry_for(sources),
                        config.metrics.host,
                        config.metrics.port,
                    )
                if role == "backbone" and config.dashboard.port:
                    from peer.dashboard.service import run_dashboard
                    from peer.status import read_report

                    read = partial(read_report, dht, config, [], assign=False)
                    await nursery.start(run_dashboard, config, read)
                if role == "backbone" and config.log.collaboration_interval:
                    from peer.training.collablog import log_collaboration

                    await nursery.start(log_collaboration, dht, config)
                if role == "backbone" and config.state.keep:
                    from peer.training.keeper import run_keeper

                    await nursery.start(run_keeper, node, dht, config)
                aggregator = None
                if role == "backbone" and config.averaging.backbone_aggregates:
                    from peer.training.aggregator import run_aggregator

                    aggregator = await nursery.start(
                        partial(run_aggregator, capabilities=measurements.capabilities),
                        node,
                        dht,
                        config,
                    )

                def presence() -> PresenceRecord:
                    return PresenceRecord(
                        node.peer_id.to_base58(),
                        role,
                        node.public_addrs(),
                        __version__,
                        started_at,
                        clock(),
                        measurements.capabilities(),
                        aggregator=aggregator is not None,
                        reduced=aggregator.tally.reduced if aggregator else 0.0,
                    )

                await nursery.start(
                    lambda task_status: keep_present(
                        dht,
                        presence,
                        collaboration=config.collaboration.name,
                        ttl=config.presence.ttl,
                        refresh=config.presence.refresh,
                        wait_changed=(
                            measurements.wait_changed
                            if slots is None
                            else partial(first_of, measurements.wait_changed, slots.wait_changed)
                        ),
                        task_status=task_status,
                    )
                )
                on_ready(node)
                task_status.started(node)
                async with trio.open_nursery() as running:
                    if workload is not None:
                        running.start_soon(
                            train_then_stop,
                            node,
                            dht,
                            config,
                            workload,
                            measurements,
                            lambda trainer: on_trainer(sources.add_trainer(trainer)),
                            stop,
                            own_loop.make_worker if own_loop else None,
                        )
                    await stop.wait()
                    running.cancel_scope.cancel()
                nursery.cancel_scope.cancel()


async def train_then_stop(
    node: Node,
    dht: DHT,
    config: PeerConfig,
    workload: tuple[Task, torch.device],
    measurements: Measurements,
    on_trainer: Callable[[Trainer], None],
    stop: trio.Event,
    make_worker: WorkerFactory | None,
) -> None:
    from peer.training.service import run_training
    from peer.training.worker import TorchWorker

    task, device = workload
    await run_training(
        node,
        dht,
        config,
        task,
        device,
        measurements,
        on_trainer=on_trainer,
        make_worker=make_worker or TorchWorker,
    )
    log.info("training finished")
    stop.set()


@dataclass(frozen=True)
class OwnLoop:
    """A peer whose training loop is the user's own (`peertrain.Optimizer`): its task describes
    the user's model and optimizer, and `make_worker` builds the worker that loop feeds."""

    task: Task
    device: torch.device
    make_worker: WorkerFactory


async def find_backbones(dht: DHT, collaboration: str, *, first: Sequence[ID]) -> list[ID]:
    """`first` (the seeds that answered), then every other backbone in presence, dialable."""
    others = []
    for record in decode_presence(await dht.get(presence_key(collaboration))):
        if record.role == "backbone":
            peer_id = ID.from_base58(record.peer_id)  # a checked peer id: decode_presence
            dht.node.remember_addrs(peer_id, parse_addrs(record.addrs))
            others.append(peer_id)
    return list(dict.fromkeys([*first, *others]))


def load_workload(config: PeerConfig) -> tuple[Task, torch.device]:
    """The task and device a peer computes on (imports torch; raises ConfigError)."""
    # Imported here, before the event loop has work: in `train_then_stop` the import held
    # the loop for 0.1-0.2 s while the node was joining.
    import peer.training.service  # noqa: F401
    from peer.measure.compute import pick_device
    from peer.training.task import load_task

    task = load_task(config.task.name, config.task.args)
    device = pick_device(config.task.device)
    warm_imports(task)
    return task, device


def warm_imports(task: Task) -> None:
    """The first optimizer torch builds imports hundreds of modules (a fused AdamW: ~820 of
    them, sympy among them, 0.9 s), holding the GIL for long stretches: built in a thread while
    the node ran, they stalled its event loop 0.1-0.3 s at a time. A throwaway optimizer over
    one parameter, built now, before the loop has work, imports them."""
    import torch

    with suppress(Exception):  # the task's real optimizer is built, and checked, later
        task.make_optimizer([torch.nn.Parameter(torch.zeros(1))])


@asynccontextmanager
async def open_backbone_services(
    node: Node, config: PeerConfig, role: Role
) -> AsyncIterator[ProbeServer | None]:
    """On a backbone: the probe and dial-back services (and the second host dial-backs use)."""
    if role != "backbone":
        yield None
        return
    probe_server = ProbeServer(node.host, config.probe)
    async with open_dialer(ephemeral_identity(), node.network_key) as dialer:
        DialBackServer(node.host, dialer)
        yield probe_server


def notary_service(node: Node, dht: DHT, config: PeerConfig) -> NotaryService:
    """The genesis notary (`peer.training.notary`), as every backbone serves it (a peer asks
    the one with the smallest peer id of its backbones; review: served only on the smallest
    of a backbone's own list, peers given another backbone had none): its registry beside the
    collaboration's checkpoints (kept across restarts, gone with them when a collaboration
    starts over), its frontier from its own reads."""
    return NotaryService(
        node.host,
        GenesisRegistry(min_votes=config.averaging.min_group_size),
        read_records=read_progress(dht, config.collaboration.name),
        directory=state_folder(
            config.training.checkpoint_dir,
            config.collaboration.name,
            f"genesis-{node.peer_id.to_base58()}",  # this notary's: another key, another one
        ),
        clock=time.monotonic,
        max_message_bytes=node.rpc.max_message_bytes,
    )


async def first_of(*waits: Callable[[], Awaitable[None]]) -> None:
    """Until the first of `waits` returns."""
    async with trio.open_nursery() as nursery:
        for wait in waits:

            async def one(wait: Callable[[], Awaitable[None]] = wait) -> None:
                await wait()
                nursery.cancel_scope.cancel()

            nursery.start_soon(one)


def relay_limits(config: PeerConfig) -> RelayLimits:
    """The relay limits of `config.relay`; ConfigError if they contradict each other."""
    relay = config.relay
    try:
        return RelayLimits(
            max_reservations=relay.max_reservations,
            max_reservations_per_source=relay.max_reservations_per_source,
            reservation_seconds=relay.reservation_seconds,
            max_circuits=relay.max_circuits,
            max_circuits_per_peer=relay.max_circuits_per_peer,
            max_circuits_per_source=relay.max_circuits_per_source,
            max_circuits_per_source_to_peer=min(
                RelayLimits().max_circuits_per_source_to_peer, relay.max_circuits_per_peer
            ),
            circuit_bytes=relay.circuit_bytes,
            circuit_seconds=relay.circuit_seconds,
        )
    except ValueError as error:
        raise ConfigError(f"relay.*: {error}") from None


def inbound_limits(config: PeerConfig) -> InboundLimits:
    """The libp2p inbound limits of `config.net`; ConfigError if they contradict each other."""
    net = config.net
    try:
        return InboundLimits(
            max_pending=net.inbound_max_pending,
            max_pending_per_source=net.inbound_max_pending_per_source,
            handshake_seconds=net.inbound_handshake_seconds,
            max_established=net.inbound_max_established,
            accept_rate=net.inbound_accept_rate,
            accept_burst=net.inbound_accept_burst,
        )
    except ValueError as error:
        raise ConfigError(f"net.inbound_*: {error}") from None


def raise_descriptor_limit(target: int = 65536) -> None:
    """Lift the soft limit on open files toward the hard one: the connection caps (libp2p
    inbound, two data ports, each TLS connection holding two descriptors) add up to several
    hundred, near the common soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
