"""The node's measurements, kept current: what its presence record advertises.

A peer measures its compute once at start: a trainer from its own first micro-batches (after
torch's warm-up, `TRAINED_MICRO_BATCHES` and `measure.compute_seconds` of them, or as many as
`TRAINED_WAIT` gave), otherwise by a benchmark of the task's model in a worker thread (torch
must not block the trio loop); then its links and reachability against up to
`measure.max_backbones` backbones, again every `measure.interval` seconds (sooner after a
failure). Figures from several backbones are combined by taking the best, because a probe
measures the slower end of the path. Between measurements, real work refines the figures:
training throughput (`observe_training`) and the transfer rates of averaging rounds
(`observe_transfer`), as time-weighted moving averages.
Those figures are our claims; what the backbones measured of us they sign, and we carry the
newest attestation of each in our capabilities (`peer.measure.attestation`): only those count
for others' shares and deadlines.

A backbone does not compute. Its bandwidth comes from the probes it serves (`ProbeServer.
capacity`) and from probing other backbones (those that start later too: the list is asked for
before every round); it is reachable by definition (peers joined by dialing it).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.errors import NoBackbone, NotABackbone, RemoteError
from peer.heap import return_free_memory
from peer.measure.attestation import MAX_ATTESTATIONS, Attestation, attest
from peer.measure.capabilities import Capabilities
from peer.measure.ema import RateEMA
from peer.measure.probe import LinkMeasurement, ProbeServer, measure_link
from peer.measure.reachability import (
    BUSY,
    DialBackResult,
    check_reachable,
    observed_from_listen_port,
    punch_address,
)
from peer.net.host import Node
from peer.priority import lower_priority

if TYPE_CHECKING:  # torch takes a second or two to import, and backbones never need it
    import torch

    from peer.measure.compute import ComputeMeasurement
    from peer.training.task import Task

log = logging.getLogger("peertrain.measure")
#: Seconds after which a backbone signs its own figures again, unchanged (readers take them
#: for averaging.attestation_max_age, an hour by default).
SELF_ATTEST_AGE = 1800.0

RETRY_AFTER_FAILURE = 30.0
# Seconds of real work after which a start-up figure counts half.
SPEED_HALF_LIFE = 60.0
# Seconds a stopping daemon waits for the compute benchmark's step in progress.
STOP_WAIT = 10.0
#: Seconds a peer's first measurements wait for its first micro-batch of training, at most.
TRAINING_WAIT = 120.0
#: Real micro-batches (after the first: torch's warm-up) that measure a trainer's compute.
TRAINED_MICRO_BATCHES = 3
#: Seconds after its first micro-batch after which a trainer's TRAINED_MICRO_BATCHES count
#: without `measure.compute_seconds` of them: a trainer whose share of each step is small
#: (most of a step averaging) added up 1 s of micro-batches in 60 s of 3 s steps (tiny task),
#: and its links, measured after, were unknown that long (status: client-only "?").
TRAINED_WAIT = 10.0
LINK_HALF_LIFE = 300.0
#: Measurements in a row in which every backbone we know answered as a peer does (it serves
#: no probe) after which a peer stops with a one-line error: with no backbone anywhere, no
#: peer is ever dialed back, so none becomes a DHT server or leads a group, and every one
#: averages alone for ever. Two: a backbone's presence record may be unread at the first.
NO_BACKBONE_MEASUREMENTS = 2


def best_link(links: Sequence[LinkMeasurement]) -> LinkMeasurement | None:
    if not links:
        return None
    return LinkMeasurement(
        upload_bps=max(m.upload_bps for m in links),
        download_bps=max(m.download_bps for m in links),
        rtt_s=min(m.rtt_s for m in links),
    )


class Measurements:
    """The latest measurements of one node; `run()` keeps them current."""

    def __init__(
        self,
        node: Node,
        config: PeerConfig,
        *,
        find_backbones: Callable[[], Awaitable[list[ID]]],
        workload: tuple[Task, torch.device] | None = None,
        benchmark: bool = True,
        probe_server: ProbeServer | None = None,
    ) -> None:
        """`find_backbones()` names the backbones to probe, best first (asked before every
        round, so backbones that start later count). A peer passes its task and device
        (`workload`); a backbone its `probe_server`. `benchmark=False`: the task cannot be run
        here (a training loop of the user's own computes it): compute is measured only from
        training, however long that takes to begin."""
        self.node = node
        self.config = config
        self.find_backbones = find_backbones
        self.workload = workload
        self.benchmark = benchmark
        self.probe_server = probe_server
        self.compute: ComputeMeasurement | None = None
        self.link: LinkMeasurement | None = None
        # Refined by real work between measurements (fed by training and averaging).
        self.speed: RateEMA | None = None
        self.upload: RateEMA | None = None
        self.download: RateEMA | None = None
        self.reachable = probe_server is not None
        self.verdict: bool | None = None
        """The last dial-back's verdict (None before the first): a peer announces itself to the
        DHT once it is True, and holds relay slots while it is False (`peer.daemon`)."""
        self.punchable = False
        """With the verdict False: peers can punch through its NAT (`Capabilities.punchable`)."""
        self.measured_at = 0.0
        self.attestations: dict[str, Attestation] = {}  # signer -> its newest of us
        self._changed = trio.Event()
        self._training = trio.Event()  # the first micro-batch of training is done
        self._gradient_bytes: int | None = None  # the trainer's model (`observe_model`)
        self._trained = (0, 0, 0.0)  # micro-batches, samples and seconds after the first
        self._trained_some = trio.Event()  # TRAINED_MICRO_BATCHES of them
        self._trained_enough = trio.Event()  # ...and `measure.compute_seconds` of them
        self._peers_as_backbones = 0  # measurements in a row: `_check_some_backbone`

    async def wait_changed(self) -> None:
        await self._changed.wait()

    def _announce_change(self) -> None:
        self.measured_at = time.time()
        self._changed.set()
        self._changed = trio.Event()

    def observe_model(self, gradient_bytes: int) -> None:
        """The trainer's model: once it trains, its compute is measured from its own
        micro-batches, not by a benchmark of a model of its own beside it (at 100 M, 0.8 GB of
        model and gradients on top of a late joiner's optimizer state: that joiner's peak)."""
        self._gradient_bytes = gradient_bytes

    def observe_training(self, samples: int, seconds: float) -> None:
        """Real training throughput: refines the compute figure (no republish of its own)."""
        if self._training.is_set():  # the first micro-batch is torch's warm-up
            count, total, spent = self._trained
            self._trained = count + 1, total + samples, spent + seconds
            if count + 1 >= TRAINED_MICRO_BATCHES and spent + seconds > 0:
                self._trained_some.set()
                if spent + seconds >= self.config.measure.compute_seconds:
                    self._trained_enough.set()
        self._training.set()
        if self.speed is not None:
            self.speed.observe(samples, seconds)

    def observe_transfer(self, *, sent: int, received: int, seconds: float) -> None:
        """Bytes moved in an averaging round that kept the link busy for `seconds`.

        A direction that moved nothing says nothing about its speed and is left alone.
        """
        if self.upload is not None and self.download is not None:
            for ema, count in ((self.upload, sent), (self.download, received)):
                if count > 0:
                    ema.observe(count, seconds)

    def capabilities(self) -> Capabilities | None:
        link = self.link
        if link is not None and self.upload is not None and self.download is not None:
            link = LinkMeasurement(self.upload.value, self.download.value, link.rtt_s)
        if self.probe_server is not None:  # what the probes it served showed, RTT unknown (0)
            up, down = self.probe_server.capacity(now=time.monotonic())
            self._attest_self(up, down)
            rtt = link.rtt_s if link else 0.0
            link = LinkMeasurement(
                max(up, link.upload_bps if link else 0.0),
                max(down, link.download_bps if link else 0.0),
                rtt,
            )
        if self.compute is None and link is None:
            return None
        compute = self.compute
        task = self.config.task
        return Capabilities(
            samples_per_s=self.speed.value if self.speed else 0.0,
            upload_bps=link.upload_bps if link else 0.0,
            download_bps=link.download_bps if link else 0.0,
            rtt_s=link.rtt_s if link else 0.0,
            reachable=self.reachable,
            punchable=self.punchable and not self.reachable,
            device=compute.device if compute else "",
            free_memory_bytes=compute.free_memory_bytes if compute else 0,
            measured_at=self.measured_at,
            task=task.name if compute else "",
            gradient_bytes=compute.gradient_bytes if compute else 0,
            target_batch=task.target_batch if compute else 0,
            attestations=tuple(self.attestations[signer] for signer in sorted(self.attestations)),
        )

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        if self.workload is not None:
            # Once training computes (a trainer is in step with the collaboration by then),
            # not beside a late joiner's state download and load, which the benchmark and
            # the link probes slowed down; a trainer that never gets there is measured anyway.
            with trio.move_on_after(TRAINING_WAIT if self.benchmark else math.inf):
                await self._training.wait()
                if self._gradient_bytes is not None:
                    with trio.move_on_after(TRAINED_WAIT):
                        await self._trained_enough.wait()
                    await self._trained_some.wait()
            if self._trained_some.is_set() and self._gradient_bytes is not None:
                self._measured_from_training(self.workload[1])
            else:
                await self._measure_compute(*self.workload)
        while True:
            ok = await self._measure_links()
            await trio.sleep(self.config.measure.interval if ok else RETRY_AFTER_FAILURE)

    def _measured_from_training(self, device: torch.device) -> None:
        import torch

        from peer.measure.compute import ComputeMeasurement, free_memory

        count, samples, seconds = self._trained
        assert self._gradient_bytes is not None and seconds > 0
        free = free_memory(torch.device(device))
        self._set_compute(
            ComputeMeasurement(samples / seconds, str(device), free, self._gradient_bytes),
            f"from {count} micro-batches of training",
        )

    def _set_compute(self, compute: ComputeMeasurement, how: str) -> None:
        self.compute = compute
        self.speed = RateEMA(compute.samples_per_s, half_life=SPEED_HALF_LIFE)
        task = self.workload[0].name if self.workload else "?"
        log.info(
            "compute: %.1f samples/s of task %r on %s (%s)",
            compute.samples_per_s,
            task,
            compute.device,
            how,
        )
        self._announce_change()

    async def _measure_compute(self, task: Task, device: torch.device) -> None:
        from peer.measure.compute import measure_compute  # torch: only peers import it

        # A stopping daemon must not wait for the whole benchmark, nor leave its thread inside
        # torch while the interpreter exits (torch aborts the process then): on cancel we tell
        # the benchmark to stop and wait for the step in progress.
        stop, finished = threading.Event(), threading.Event()

        def benchmark() -> ComputeMeasurement | None:
            try:
                return measure_compute(
                    task,
                    micro_batch=self.config.task.micro_batch,
                    device=device,
                    min_seconds=self.config.measure.compute_seconds,
                    stop=stop,
                )
            finally:
                # Its model and gradients, freed, stayed in glibc's heap (0.46 GB at 100 M)
                # on top of the trainer's own peak, since the benchmark now runs after the
                # trainer has allocated its state.
                return_free_memory()
                finished.set()

        # Torch work, so in a thread of its own at the torch thread's priority: at the
        # event loop's, a late joiner's benchmark took cores from its own state download
        # (and from the donors' loops serving it). It also measures what training will get.
        thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="peertrain-benchmark", initializer=lower_priority
        )
        try:
            running = thread.submit(benchmark)
            compute = await trio.to_thread.run_sync(running.result, abandon_on_cancel=True)
        finally:
            stop.set()
            thread.shutdown(wait=False)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(finished.wait, STOP_WAIT)
        assert compute is not None  # None only once stopped, and then we were cancelled
        self._set_compute(compute, "benchmark")

    async def _measure_links(self) -> bool:
        """Probe the backbones (and, on a peer, ask for a dial-back); True if done.

        Reachability changes only on a definite answer: a failed or busy check keeps the
        previous verdict, so roles do not flap.
        """
        try:
            backbones = [b for b in await self.find_backbones() if b != self.node.peer_id]
        except RemoteError as error:
            log.warning("could not look up the backbones: %s", error)
            self._peers_as_backbones = 0  # no evidence either way: the count is of a row
            return False
        links, verdict, observed = [], None, []
        peers: list[ID] = []  # told they were backbones; they answered as peers
        for backbone in backbones[: self.config.measure.max_backbones]:
            try:
                links.append(
                    await measure_link(
                        self.node, backbone, target_seconds=self.config.measure.probe_seconds
                    )
                )
                if self.probe_server is None and verdict is not True:
                    verdict = reachability_verdict(await check_reachable(self.node, backbone))
                    if verdict is False:  # behind NAT: can peers punch through it?
                        seen = await observed_from_listen_port(self.node, backbone)
                        if seen is not None:
                            observed.append(seen)
            except NotABackbone:
                peers.append(backbone)
            except RemoteError as error:
                log.warning("could not measure the link to backbone %s: %s", backbone, error)
        self._check_some_backbone(backbones, peers)
        if verdict is not None:
            self.reachable = self.verdict = verdict
            announced = [str(a) for a in self.node.announce]
            address = None if verdict else punch_address(observed, announced)
            self.punchable = address is not None
            # Where we learned it, not from --announce: hole punches offer it too.
            self.node.punch_observed = [address] if address and address not in announced else []
        self.keep_attestations(link.attestation for link in links)
        if links:
            self.link = best_link(links)
            # A probe is a direct measurement: it restarts the averages real transfers refine.
            self.upload = RateEMA(self.link.upload_bps, half_life=LINK_HALF_LIFE)
            self.download = RateEMA(self.link.download_bps, half_life=LINK_HALF_LIFE)
            log.info(
                "link: up %.2f MB/s, down %.2f MB/s, rtt %.1f ms, %s",
                self.link.upload_bps / 1e6,
                self.link.download_bps / 1e6,
                self.link.rtt_s * 1e3,
                reach_words(self.reachable, self.punchable),
            )
            self._announce_change()
        return bool(links) or not backbones

    def _check_some_backbone(self, backbones: Sequence[ID], peers: Sequence[ID]) -> None:
        """Raise `NoBackbone` once every backbone we know has answered as a peer
        `NO_BACKBONE_MEASUREMENTS` measurements in a row, where none ever answered as a
        backbone: a peer that joined through another and measured the backbone it found in
        presence keeps waiting while that backbone restarts (its record withdrawn)."""
        if self.link is not None:  # a backbone measured us once: it is only away
            return
        if self.probe_server is not None or not peers or len(peers) < len(backbones):
            self._peers_as_backbones = 0
            return
        self._peers_as_backbones += 1
        names = ", ".join(str(p) for p in peers[:3])
        if self._peers_as_backbones < NO_BACKBONE_MEASUREMENTS:
            log.warning("%s answered as a peer, not a backbone (it serves no probe)", names)
            return
        raise NoBackbone(
            f"no backbone in this collaboration ({names}: a peer, not a backbone); start one "
            "with `backbone start` and pass the address it prints to --backbone"
        )

    def _attest_self(self, upload_bps: float, download_bps: float) -> None:
        """A backbone signs what the probes it served showed of its own link, as it signs what
        it measures of others (readers trust it for both, or for neither): with a single
        backbone nobody else measures it, and unattested it would count at the floor and never
        get a share to aggregate. Signed again when the figures move by a tenth or it is
        half an hour old."""
        me = self.node.peer_id.to_base58()
        last = self.attestations.get(me)
        now = time.time()
        if (
            last is not None
            and now - last.issued_at < SELF_ATTEST_AGE
            and abs(last.upload_bps - upload_bps) <= 0.1 * last.upload_bps
            and abs(last.download_bps - download_bps) <= 0.1 * last.download_bps
        ):
            return
        self.attestations[me] = attest(
            self.node.host.get_private_key(),
            signer=me,
            subject=me,
            upload_bps=upload_bps,
            download_bps=download_bps,
            issued_at=now,
        )

    def keep_attestations(self, attestations: Iterable[Attestation | None]) -> None:
        """Keep the newest attestation per backbone, MAX_ATTESTATIONS newest in all (a
        backbone we could not reach this time keeps its last one until readers find it old)."""
        for attestation in attestations:
            if attestation is not None:
                self.attestations[attestation.signer] = attestation
        newest = sorted(self.attestations.values(), key=lambda a: a.issued_at, reverse=True)
        self.attestations = {a.signer: a for a in newest[:MAX_ATTESTATIONS]}


def reach_words(reachable: bool, punchable: bool) -> str:
    if reachable:
        return "reachable"
    if punchable:
        return "reachable by hole punching (its NAT keeps its address)"
    return "client-only (not reachable inbound)"


def reachability_verdict(result: DialBackResult) -> bool | None:
    """True if any address was dialed; None when the backbone was too busy to check."""
    if result.reachable:
        return True
    if result.unreachable and all(why.startswith(BUSY) for why in result.unreachable.values()):
        return None
    return False
