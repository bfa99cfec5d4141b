"""A whole collaboration in one process on trio's virtual clock: backbones and N trainers, each
the real `DHT`, `Averager` (matchmaking, Moshpit plan) and `Trainer` (`StepPolicy`, progress
records, catch-up), over `network.SimNetwork`, with `worker.SimWorker` for torch and
`dataplane.SimDataPlane` for the bulk transfers; volunteers leave and join at a given rate.

Sizes: the trainers average a short vector, and the times come from the simulated model's
bytes. Deadlines that the code derives from a vector's size and a link's bandwidth see the
bandwidths divided by `Collaboration.factor` (model bytes / vector bytes): every such deadline
comes out as it would for the real model on the real link.

A share of the volunteers can be behind NAT (`Scenario.nat_share`, `symmetric_share`;
`simulation.nat`): each advertises what the real daemon would once a backbone's dial-back
judged it (`Capabilities.reachable`, `punchable`), stays a DHT client, and is reached through
the backbones' relays and hole punches.

Run it with `python -m simulation` (`simulation/__main__.py`); `run_collaboration` is the API
the tests use.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import inspect
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, TextIO

import torch
import trio
from libp2p.peer.id import ID

from peer.averaging.averager import Averager, AveragingResult
from peer.averaging.matchmaking import TooFewPeers
from peer.config import (
    AveragingConfig,
    CollaborationConfig,
    PeerConfig,
    TaskConfig,
    TrainingConfig,
)
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.measure.attestation import attest
from peer.measure.capabilities import Capabilities
from peer.net import tls
from peer.roles import PeerCapacity, assign_roles
from peer.training.notary import GenesisRegistry, NotaryService, read_progress
from peer.training.progress import CollaborationView, ProgressRecord
from peer.training.statesync import Snapshot
from peer.training.trainer import Trainer
from simulation import cpu, memo
from simulation.clock import VirtualClock
from simulation.dataplane import SimDataPlane, SimDataServer, SimIdentity, simulated
from simulation.determinism import deterministic_trio
from simulation.nat import Nat, NatDraw, NatTally
from simulation.network import (
    MBIT,
    Link,
    LinkDistribution,
    SimNetwork,
    SimNode,
    Traffic,
    log_uniform,
)
from simulation.safety import SafetyCheck, Violation
from simulation.windows import Window, WindowWatch
from simulation.worker import ComputeNoise, SimWorker

log = logging.getLogger(__name__)

EPOCH = 1.8e9  # the simulated wall clock at virtual time 0
BACKBONES = 2
VECTOR = 64  # values a simulated trainer averages


@dataclass(frozen=True)
class Scenario:
    peers: int
    minutes: float = 30.0
    """Virtual minutes measured, after the warm-up."""
    warmup_minutes: float = 3.0
    """Virtual minutes after the peers joined (all at once) before anything counts: the first
    steps, and no churn yet."""
    churn_per_hour: float = 0.10
    """The share of the peers that leaves per hour; as many new ones join."""
    model_bytes: float = 4 * 17.7e6
    """The gradient on the wire: ALBERT-large in float32, as DeDLOC's volunteers trained."""
    state_factor: float = 3.0
    """A state download moves this many model-sizes (parameters and Adam's two moments)."""
    samples_per_second: tuple[float, float] = (4.0, 40.0)
    """Each volunteer's speed is drawn log-uniformly from this range."""
    micro_batch: int = 4
    target_batch: int = 4096
    group_size: int = 4
    seed: int = 0
    backbone_failures_per_hour: float = 1.0
    """How often one of the backbones fails (while measured); it restarts after a downtime
    drawn log-uniformly from `backbone_downtime` seconds, its DHT records lost."""
    backbone_downtime: tuple[float, float] = (30.0, 300.0)
    links: LinkDistribution = field(default_factory=LinkDistribution)
    noise: ComputeNoise = field(default_factory=ComputeNoise)
    """How each volunteer's speed varies over time: jitter, slow spells, pauses."""
    nat_share: float = 0.0
    """The share of the volunteers behind NAT (the backbones never are)."""
    symmetric_share: float = 0.0
    """Of those, the share behind a symmetric NAT (client-only); the rest can be punched."""
    partial_from: int = AveragingConfig().partial_from
    """`averaging.partial_from`: from this many peers in a Moshpit plan, an averaging that
    some of them missed gives the others a candidate (the step rule counts it) instead of
    being called again."""


@dataclass(frozen=True)
class RoundTime:
    """One round of an averaging call, virtual seconds: where a round's time goes (at 300
    simulated peers the all-reduce took 3.5 s at the median, and a late round's group up to
    53 s to form: its members waited for those still in earlier rounds)."""

    index: int
    started: float
    formed: float
    """Its group formed, or formed without us (too few came, a leader's spec refused)."""
    ended: float
    averaged: bool
    """It gave our values a new basis (an all-reduce that included us)."""
    planned: tuple[str, ...] = ()
    """Its group in our view's plan (peer ids, ours included)."""
    alone: bool = False
    """No group formed: too few of its planned members came (`TooFewPeers`)."""


@dataclass
class Attempt:
    """One peer's averaging call."""

    peer: str
    epoch: int
    """Its gathering's close (`int(gather_until * 1000)`): the calls of one gathering share it."""
    step: int
    """The step it averaged for."""
    started: float
    peers_seen: int
    """Contributions in its view of the gathering."""
    members: int
    """Peers its average is the exact mean of (0: it got none)."""
    average: bytes
    """A digest of its average's bits (b"": none): peers with equal ones apply one step."""
    why: str
    ended: float = 0.0
    """When the call returned (virtual seconds)."""
    rounds: tuple[RoundTime, ...] = ()
    """Its Moshpit rounds that met a group (those where its plan seats it alone are skipped)."""

    @property
    def complete(self) -> bool:
        """Its average holds every contribution of its view."""
        return self.members > 0 and self.members == self.peers_seen


@dataclass
class Volunteer:
    """One trainer's time in the collaboration."""

    joined_at: float
    """Virtual seconds."""
    late: bool
    """It joined after the start (a replacement for one that left)."""
    trainer: Trainer
    nat: Nat = Nat.PUBLIC
    left_at: float | None = None
    step_at_end: int = 0


@dataclass
class Report:
    scenario: Scenario
    wall_seconds: float
    attempts: list[Attempt]
    cut: frozenset[int]
    """Epochs with calls still in progress when the run ended: rounds not over, neither failed
    nor complete."""
    volunteers: list[Volunteer]
    digests_agree: bool
    """Every trainer that holds the collaboration's newest step holds the same bits."""
    newest_step: int
    steps: int
    """Steps the collaboration took while measured (after the warm-up)."""
    ended_at: float
    """Virtual seconds at the end."""
    dht_seconds: dict[str, list[float]]
    """How long each DHT "store" and "get" of a trainer took."""
    views: list[tuple[int, int]]
    """(progress records a trainer read, trainers alive then): how much of the collaboration
    each read saw."""
    traffic: Traffic
    departures: int
    backbone_failures: int
    backbone_restarts: int
    """Restarts that joined the DHT again (a backbone may still be down at the end)."""
    arrivals: int
    downloads: int
    ideal_step_seconds: float
    violations: list[Violation]
    """States taken as a step other than the first taken as that step (`simulation.safety`)."""
    taken_at: dict[int, float]
    """Step -> virtual seconds: when the first peer took it."""
    taken_by: dict[int, str]
    """Step -> the first peer that took it (the round that yielded it: `report.rounds_of`)."""
    elections: Counter[str]
    """How the trainers' candidates fared (`Trainer._elect`: won, lost, stalled)."""
    election_seconds: float
    """Mean seconds a trainer waited for its candidate's election."""
    nat: NatTally
    """Connections by path, relayed bytes, data-plane pairs and planned reducers behind NAT
    (the whole run)."""
    busiest_window: Window | None = None
    """The measured window whose busiest node sent the most replies (`simulation.windows`)."""


def scale_factor(model_bytes: float) -> float:
    """The simulated model's bytes per byte of the short vector: what bandwidths (and the
    averaging's chunk) are divided by, so deadlines come out as for the real model."""
    return model_bytes / (VECTOR * 4)


def peer_config(scenario: Scenario, factor: float) -> PeerConfig:
    """Every simulated peer's config: the scenario's task and averaging parameters."""
    return PeerConfig(
        collaboration=CollaborationConfig(name="sim"),
        task=TaskConfig(
            name="sim", micro_batch=scenario.micro_batch, target_batch=scenario.target_batch
        ),
        averaging=AveragingConfig(
            group_size=scenario.group_size,
            min_bandwidth=AveragingConfig().min_bandwidth / factor,
            # A chunk of the short vector stands for a real chunk's bytes, as the bandwidths
            # do: unscaled, 262,144 elements were one unit of the 64-value vector, so a
            # round's parts gave one member the whole vector (twice a balanced member's
            # bytes) and a stall timeout 15,625 times the real one's (4 MB model).
            chunk_elements=max(1, round(AveragingConfig().chunk_elements / factor)),
            partial_from=scenario.partial_from,
        ),
        training=TrainingConfig(validation_interval=0, checkpoint_dir="/nonexistent"),
    )


class Collaboration:
    def __init__(self, scenario: Scenario) -> None:
        self.scenario = scenario
        self.rng = random.Random(scenario.seed)
        self.network = SimNetwork(self.rng)
        # Its own draws: a run without NAT draws the same links and keys as before.
        self.nats = NatDraw(scenario.nat_share, scenario.symmetric_share, seed=scenario.seed)
        self.plane = SimDataPlane(self.network, model_bytes=scenario.model_bytes)
        self.factor = scale_factor(scenario.model_bytes)
        self.config = peer_config(scenario, self.factor)
        self.backbones: list[SimNode] = []
        self.backbone_scopes: dict[ID, trio.CancelScope] = {}
        self.registries: dict[ID, GenesisRegistry] = {}  # each backbone's genesis notary's
        self.backbone_failures = self.backbone_restarts = 0
        self.trainers: dict[str, Trainer] = {}
        self.attempts: list[Attempt] = []
        self.in_flight: Counter[int] = Counter()  # epoch -> averaging calls in progress
        self.cut: frozenset[int] = frozenset()
        self.dht_seconds: dict[str, list[float]] = {"store": [], "get": []}
        self.views: list[tuple[int, int]] = []
        self.safety = SafetyCheck()
        self.departures = self.arrivals = 0
        self.volunteers: list[Volunteer] = []
        self.ended = self.measuring = False
        self.measured_from = self.ended_at = 0.0
        self.step_at_start = self.downloads_at_start = 0

    def clock(self) -> float:
        return EPOCH + trio.current_time()

    # ------------------------------------------------------------------ peers

    def _dht(self, node: SimNode) -> DHT:
        dht = DHT(
            node,  # type: ignore[arg-type]
            self.config.dht,
            server=True,
            rpc_timeout=self.config.net.rpc_timeout,
            clock=self.clock,
        )
        dht.rng = random.Random(self.rng.getrandbits(64))  # its hot reads' replicas: seeded
        # Every read goes through `get_many` (`get` too): a read of many keys at once (a
        # progress read of every shard) counts as one get. At d7e7817 only `get` was timed:
        # the figures showed ticket reads alone.
        dht.store = self._timed("store", dht.store)  # type: ignore[method-assign]
        dht.get_many = self._timed("get", dht.get_many)  # type: ignore[method-assign]
        return dht

    def _timed(self, name: str, call: Callable[..., Awaitable[Any]]) -> Callable[..., Any]:
        async def timed(*args: Any, **kwargs: Any) -> Any:
            started = trio.current_time()
            try:
                return await call(*args, **kwargs)
            finally:
                self.dht_seconds[name].append(trio.current_time() - started)

        return timed

    async def start_backbones(self, nursery: trio.Nursery) -> None:
        fast = self.scenario.links.max_mbit * MBIT
        link = Link(upload=fast, download=fast, rtt=self.scenario.links.min_rtt)
        for _ in range(BACKBONES):
            node = self.network.node(link)
            await nursery.start(self._run_backbone, node)
            self.backbones.append(node)
        self.network.nat.set_relays([b.peer_id for b in self.backbones])

    async def _run_backbone(
        self, node: SimNode, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """A backbone's DHT node, from its (re)start until its failure (`_fail_backbones`:
        its scope cancelled). A restart keeps its identity and loses what it held."""
        cpu.CURRENT.set(self.network.cpus[node.peer_id])  # its tasks' checks
        with trio.CancelScope() as self.backbone_scopes[node.peer_id]:
            dht = self._dht(node)
            others = [b for b in self.backbones if b is not node and not self._down(b)]
            seeds = [(b.peer_id, b.announce[0]) for b in others]
            if not seeds and self.trainers:  # the other backbone is down too: any trainer
                trainer = self.trainers[min(self.trainers)]
                seeds = [(trainer.dht.node.peer_id, trainer.dht.node.announce[0])]
            if seeds:
                await dht.bootstrap(seeds)
            async with trio.open_nursery() as nursery:
                await nursery.start(dht.run)
                await nursery.start(self._notary(node, dht).run)  # every backbone serves one
                task_status.started()

    def _notary(self, node: SimNode, dht: DHT) -> NotaryService:
        """The genesis notary, as `peer.daemon.notary_service` makes it: its registry outlives
        a restart (the real one is a file), its claims not yet decided do not."""
        registry = self.registries.setdefault(
            node.peer_id, GenesisRegistry(min_votes=self.config.averaging.min_group_size)
        )
        registry.forget_claims()
        return NotaryService(
            node.host,  # type: ignore[arg-type]
            registry,
            read_records=read_progress(dht, self.config.collaboration.name),
            directory=None,
            clock=trio.current_time,
            max_message_bytes=node.rpc.max_message_bytes,
        )

    def _down(self, node: SimNode) -> bool:
        return node.peer_id in self.network.gone

    async def _fail_backbones(self, nursery: trio.Nursery, until: float) -> None:
        """Backbones fail at `Scenario.backbone_failures_per_hour` (one that is up, at random)
        and restart after a downtime drawn from `Scenario.backbone_downtime`."""
        rate = self.scenario.backbone_failures_per_hour / 3600
        rng = random.Random(self.scenario.seed + 1)  # churn's draws stay as they were
        while rate > 0:
            wait = rng.expovariate(rate)
            if trio.current_time() + wait >= until:
                return
            await trio.sleep(wait)
            up = [b for b in self.backbones if not self._down(b)]
            if not up:
                continue
            node = rng.choice(up)
            self.backbone_scopes[node.peer_id].cancel()
            self.network.leave(node.peer_id)
            self.backbone_failures += 1
            downtime = log_uniform(rng, *self.scenario.backbone_downtime)
            log.info(
                "backbone %s down at %.1fs for %.0fs", node.peer_id, trio.current_time(), downtime
            )
            nursery.start_soon(self._restart_backbone, node, downtime)

    async def _restart_backbone(self, node: SimNode, downtime: float) -> None:
        await trio.sleep(downtime)
        self.network.rejoin(node.peer_id)
        async with trio.open_nursery() as nursery:
            await nursery.start(self._run_backbone, node)
            self.backbone_restarts += 1

    def _capabilities(self, node: SimNode, speed: float) -> Capabilities:
        link = self.network.links[node.peer_id]
        up, down = link.upload / self.factor, link.download / self.factor
        signer = self.backbones[0]
        attestation = attest(
            signer.identity.key_pair.private_key,
            signer=signer.peer_id.to_base58(),
            subject=node.peer_id.to_base58(),
            upload_bps=up,
            download_bps=down,
            issued_at=self.clock(),
        )
        nat = self.network.nat.kind(node.peer_id)
        return Capabilities(
            samples_per_s=speed,
            upload_bps=up,
            download_bps=down,
            rtt_s=link.rtt,
            reachable=nat is Nat.PUBLIC,  # the dial-back's verdict
            punchable=nat is Nat.CONE,
            device="sim",
            free_memory_bytes=0,
            measured_at=self.clock(),
            task="sim",
            gradient_bytes=VECTOR * 4,
            target_batch=self.scenario.target_batch,
            attestations=(attestation,),
        )

    async def run_peer(
        self, *, late: bool, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """One volunteer, from its join until it leaves (`_leave`: its scope cancelled)."""
        scenario = self.scenario
        nat = self.nats.next()
        node = self.network.node(scenario.links.draw(self.rng), nat=nat)
        me = node.peer_id.to_base58()
        cpu.CURRENT.set(self.network.cpus[node.peer_id])  # this task's and its children's checks
        self.plane.register(node.peer_id)
        speed = log_uniform(self.rng, *scenario.samples_per_second)
        dht = self._dht(node)
        if nat is not Nat.PUBLIC:  # a DHT client, as `peer.daemon` keeps one no backbone reached
            dht.announcing = lambda: False
        certificate, _ = tls._build_certificate(
            node.identity.key_pair.private_key, seed=self.rng.getrandbits(256)
        )
        averager = Averager(
            dht,
            self.config.averaging,
            collaboration=self.config.collaboration.name,
            data_server=SimDataServer(SimIdentity(me, certificate)),  # type: ignore[arg-type]
            data_host=node.data_host,
            data_port=4002,
            trusted=frozenset(b.peer_id.to_base58() for b in self.backbones),
        )
        capabilities = self._capabilities(node, speed)
        worker = SimWorker(
            vector_size=VECTOR,
            samples_per_second=speed,
            micro_batch=scenario.micro_batch,
            seed=self.rng.getrandbits(32),
            model_bytes=scenario.model_bytes,
            state_bytes=scenario.model_bytes * scenario.state_factor,
            on_hold=lambda step, digest: self.safety.held(step, me, digest, trio.current_time()),
            noise=scenario.noise,
        )
        trainer = Trainer(
            dht=dht,
            averager=averager,
            config=self.config,
            task=SimpleNamespace(name="sim"),  # type: ignore[arg-type]
            device=torch.device("cpu"),
            download=self._download(node.peer_id),
            capabilities=lambda: capabilities,
            clock=self.clock,
            monotonic=trio.current_time,
            worker=worker,  # type: ignore[arg-type]
        )
        self._record_attempts(me, averager, lambda: trainer.step + 1)
        observe = trainer.progress.on_read

        def observed(view: CollaborationView) -> None:
            self.views.append((len(view.records), len(self.trainers)))
            observe(view)

        trainer.progress.on_read = observed
        dht.seeds = [(b.peer_id, b.announce[0]) for b in self.backbones]
        await dht.bootstrap(dht.seeds)
        self.trainers[me] = trainer
        volunteer = Volunteer(joined_at=trio.current_time(), late=late, trainer=trainer, nat=nat)
        self.volunteers.append(volunteer)
        task_status.started()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(dht.run)
                await trainer.run()
        finally:
            volunteer.step_at_end = trainer.step
            if not self.ended:
                volunteer.left_at = trio.current_time()
            self.network.leave(node.peer_id)
            self.trainers.pop(me, None)

    def _record_attempts(self, me: str, averager: Averager, step: Callable[[], int]) -> None:
        """Each averaging call of `averager` recorded as it returns (`step`: the step it is for,
        read as it starts); while it runs, counted as in flight (`cut` at the end)."""
        average = averager.average
        rounds: dict[int, list[RoundTime]] = {}  # by epoch: the calls in flight
        # (epoch, round) -> when its group formed, or it ended alone (True: too few came)
        formed: dict[tuple[int, int], tuple[float, bool]] = {}
        run_round, form_group = averager._round, averager.matchmaker.form_group
        round_args = inspect.signature(run_round).bind
        form_args = inspect.signature(form_group).bind

        async def timed_form(*args: Any, **kwargs: Any) -> Any:
            named = form_args(*args, **kwargs).arguments
            lonely = False
            try:
                return await form_group(*args, **kwargs)
            except TooFewPeers:
                lonely = True
                raise
            finally:
                formed[(named["shape"].epoch, named["round_index"])] = (
                    trio.current_time(),
                    lonely,
                )

        async def timed_round(*args: Any, **kwargs: Any) -> Any:
            named = round_args(*args, **kwargs).arguments
            started, index, epoch = trio.current_time(), named["index"], named["shape"].epoch
            outcome = None
            try:
                outcome = await run_round(*args, **kwargs)
                return outcome
            finally:
                now = trio.current_time()
                when, lonely = formed.pop((epoch, index), (now, False))
                planned = named["group"].members
                if epoch in rounds:  # a recorded call's (not an aggregator's)
                    rounds[epoch].append(
                        RoundTime(index, started, when, now, outcome is not None, planned, lonely)
                    )

        averager._round = timed_round  # type: ignore[method-assign]
        averager.matchmaker.form_group = timed_form  # type: ignore[method-assign]

        async def recorded(*args: Any, **kwargs: Any) -> AveragingResult:
            started, epoch, for_step = trio.current_time(), kwargs["epoch"], step()
            self.in_flight[epoch] += 1
            rounds[epoch] = []
            try:
                result = await average(*args, **kwargs)
            finally:
                self.in_flight[epoch] -= 1
                timings = tuple(rounds.pop(epoch, ()))
            self.attempts.append(
                Attempt(
                    peer=me,
                    epoch=epoch,
                    step=for_step,
                    started=started,
                    peers_seen=result.peers_seen,
                    members=result.members if result.average is not None else 0,
                    average=(
                        hashlib.blake2b(result.average.tobytes(), digest_size=8).digest()
                        if result.average is not None
                        else b""
                    ),
                    why="; ".join(result.skipped or result.setbacks)[:200],
                    ended=trio.current_time(),
                    rounds=timings,
                )
            )
            return result

        averager.average = recorded  # type: ignore[method-assign]

    def _download(self, me: ID) -> Callable[[list[ProgressRecord], int], Awaitable[Any]]:
        async def download(donors: list[ProgressRecord], target: int) -> Any:
            holding = [
                self.trainers[d.peer_id]
                for d in donors
                if d.peer_id in self.trainers and self.trainers[d.peer_id].step == target
            ]
            if not holding:
                raise RemoteError(f"no donor holds step {target}")
            donor_ids = [t.dht.node.peer_id for t in holding]
            await self.plane.download(
                me,
                donor_ids,
                self.scenario.model_bytes * self.scenario.state_factor,
                parallel=self.config.state.parallel_donors,
            )
            for donor in holding:
                if donor.step == target and donor.dht.node.peer_id not in self.network.gone:
                    snapshot = await donor.worker.serialize()  # its own: a download frees it
                    assert snapshot is not None and isinstance(snapshot.blob, bytes)
                    members = donor.policy.members_of_held()
                    return Snapshot(snapshot.step, snapshot.blob, disposable=True, members=members)
            raise RemoteError(f"the donors moved past step {target} during the download")

        return download

    # ------------------------------------------------------------------ churn

    async def run(self) -> None:
        scenario = self.scenario
        async with trio.open_nursery() as nursery:
            await self.start_backbones(nursery)
            scopes: dict[int, trio.CancelScope] = {}

            async def volunteer(
                index: int, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
            ) -> None:
                with trio.CancelScope() as scope:
                    scopes[index] = scope
                    await self.run_peer(late=index >= scenario.peers, task_status=task_status)

            async with trio.open_nursery() as peers:
                async with trio.open_nursery() as joining:  # all at once, as at a launch
                    for index in range(scenario.peers):
                        joining.start_soon(peers.start, volunteer, index)
                log.info("%d peers joined at %.1fs", scenario.peers, trio.current_time())
                await trio.sleep(scenario.warmup_minutes * 60)
                self._start_measuring()
                end = trio.current_time() + scenario.minutes * 60
                nursery.start_soon(self._fail_backbones, nursery, end)
                rate = scenario.peers * scenario.churn_per_hour / 3600  # departures per second
                next_index = scenario.peers
                while trio.current_time() < end:
                    wait = self.rng.expovariate(rate) if rate > 0 else math.inf
                    if trio.current_time() + wait >= end:
                        await trio.sleep_until(end)
                        break
                    await trio.sleep(wait)
                    index = self.rng.choice(sorted(scopes))
                    self._leave(scopes.pop(index))
                    peers.start_soon(volunteer, next_index)
                    next_index += 1
                    self.arrivals += 1
                self.final = self._final_state()
                self.cut = frozenset(epoch for epoch, calls in self.in_flight.items() if calls)
                self.ideal = ideal_step_seconds(scenario, self)
                self.ended = True
                self.ended_at = trio.current_time()
                peers.cancel_scope.cancel()
            nursery.cancel_scope.cancel()

    def _start_measuring(self) -> None:
        """What happened so far was the warm-up: counting starts now."""
        self.measured_from = trio.current_time()
        self.measuring = True
        self.network.traffic = Traffic()
        for seconds in self.dht_seconds.values():
            seconds.clear()
        self.views.clear()
        self.step_at_start = max((t.step for t in self.trainers.values()), default=0)
        self.downloads_at_start = sum(v.trainer.tally.downloads for v in self.volunteers)

    def dht_servers(self) -> int:
        """DHT servers alive now: the backbones up and the volunteers not behind NAT."""
        up = sum(not self._down(b) for b in self.backbones)
        return up + sum(v.left_at is None and v.nat is Nat.PUBLIC for v in self.volunteers)

    def _leave(self, scope: trio.CancelScope) -> None:
        self.departures += 1
        scope.cancel()

    def _final_state(self) -> tuple[bool, int]:
        steps: dict[int, set[bytes]] = {}
        for trainer in self.trainers.values():
            worker = trainer.worker
            assert isinstance(worker, SimWorker)
            steps.setdefault(trainer.step, set()).add(worker.parameters.tobytes())
        newest = max(steps, default=0)
        return len(steps.get(newest, set())) <= 1, newest


def ideal_step_seconds(scenario: Scenario, collaboration: Collaboration) -> float:
    """DeDLOC's ideal step for the trainers alive at the end: the role solver's optimum
    (`peer.roles.assign_roles`: who computes, one all-reduce with bandwidth-optimal shares,
    no gathering, no groups, nobody leaving), each at its mean speed over spells and pauses.
    Only reachable peers aggregate, unless none is (then all: `reducers`' fallback)."""
    peers = []
    slowdown = scenario.noise.mean_slowdown()  # the speeds as a measurement over time sees them
    nat = collaboration.network.nat
    alive = [(me, t, t.dht.node.peer_id) for me, t in collaboration.trainers.items()]
    anyone = any(nat.kind(peer_id) is Nat.PUBLIC for _, _, peer_id in alive)
    for me, trainer, peer_id in alive:
        link = collaboration.network.links[peer_id]
        worker = trainer.worker
        assert isinstance(worker, SimWorker)
        peers.append(
            PeerCapacity(
                peer_id=me,
                samples_per_s=worker.samples_per_second / slowdown,
                upload_bps=link.upload,
                download_bps=link.download,
                reachable=nat.kind(peer_id) is Nat.PUBLIC or not anyone,
            )
        )
    best = assign_roles(
        peers,
        gradient_bytes=scenario.model_bytes,
        target_batch=scenario.target_batch,
        delayed=False,
    )
    return scenario.target_batch / best.samples_per_s


#: The cyclic garbage collector's thresholds while a simulation runs. A simulation holds
#: millions of live objects (every peer's tables, records and tasks), each full collection walks
#: them all, and the default thresholds ran one every 1.7 s: 27 of 93 s of a 100-peer virtual
#: minute. Collections still run: the youngest ~140x and the full ones ~7,000x less often
#: (100,000 allocations against 700; x50 x100 against x10 x10); memory freed by reference
#: counting is freed as ever (what a run reaches is the same: only cycles wait longer).
GC_THRESHOLDS = (100_000, 50, 100)


@contextlib.contextmanager
def rare_collections() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)


#: Virtual seconds between two lines of a run's progress (`run_collaboration(progress=...)`).
PROGRESS_SECONDS = 30.0


def progress_printer(scenario: Scenario, out: TextIO) -> Callable[[float], None]:
    """A clock's `on_jump` that writes a line to `out` every `PROGRESS_SECONDS` of virtual time:
    how far the run is and the wall time it took (1,000 peers run for hours)."""
    started, total = time.perf_counter(), 60 * (scenario.warmup_minutes + scenario.minutes)
    due = PROGRESS_SECONDS

    def on_jump(now: float) -> None:
        nonlocal due
        if now >= due:
            due = (now // PROGRESS_SECONDS + 1) * PROGRESS_SECONDS
            wall = time.perf_counter() - started
            out.write(
                f"{scenario.peers:,} peers, {scenario.model_bytes / 1e6:g} MB, seed {scenario.seed}: "
                f"{now:.0f} of {total:.0f} "
                f"virtual s in {wall:.0f} s of wall time\n"
            )
            out.flush()

    return on_jump


def both(*calls: Callable[[float], None]) -> Callable[[float], None]:
    def each(now: float) -> None:
        for call in calls:
            call(now)

    return each


def run_collaboration(scenario: Scenario, *, progress: TextIO | None = None) -> Report:
    """Run `scenario` to its end; `progress`: where to write how far it is, every
    `PROGRESS_SECONDS` of virtual time (the run is the same either way)."""
    # The DHT draws its refresh targets from `random`: seeded too; trio's scheduling is made
    # deterministic (`simulation.determinism`).
    random.seed(scenario.seed)
    collaboration = Collaboration(scenario)
    started = time.perf_counter()
    with (
        simulated(collaboration.plane),
        deterministic_trio(scenario.seed),
        memo.widened(scenario.peers),  # before `cpu.charged`, which wraps a memo
        cpu.charged(),
        rare_collections(),
    ):
        windows = WindowWatch(
            lambda: collaboration.network.traffic,
            collaboration.dht_servers,
            lambda: collaboration.measuring and not collaboration.ended,
        )
        on_jump = windows.on_jump
        if progress is not None:
            on_jump = both(on_jump, progress_printer(scenario, progress))
        trio.run(collaboration.run, clock=VirtualClock(on_jump))
    agree, newest = collaboration.final
    everyone = [v.trainer for v in collaboration.volunteers]
    return Report(
        scenario=scenario,
        wall_seconds=time.perf_counter() - started,
        attempts=[a for a in collaboration.attempts if a.started >= collaboration.measured_from],
        cut=collaboration.cut,
        volunteers=collaboration.volunteers,
        digests_agree=agree,
        newest_step=newest,
        steps=newest - collaboration.step_at_start,
        ended_at=collaboration.ended_at,
        dht_seconds=collaboration.dht_seconds,
        views=collaboration.views,
        traffic=collaboration.network.traffic,
        departures=collaboration.departures,
        backbone_failures=collaboration.backbone_failures,
        backbone_restarts=collaboration.backbone_restarts,
        arrivals=collaboration.arrivals,
        downloads=sum(t.tally.downloads for t in everyone) - collaboration.downloads_at_start,
        ideal_step_seconds=collaboration.ideal,
        violations=collaboration.safety.violations,
        taken_at=collaboration.safety.taken_at,
        taken_by={step: peer for step, (_, peer) in collaboration.safety.first.items()},
        elections=sum((t.tally.elections for t in everyone), Counter()),
        election_seconds=sum(t.tally.election_seconds for t in everyone)
        / max(1, sum(sum(t.tally.elections.values()) for t in everyone)),
        nat=collaboration.network.nat.tally,
        busiest_window=windows.busiest,
    )
