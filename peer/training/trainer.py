"""The training loop of a peer: local work, progress, steps with the collaboration, catching up.

    loop:
        behind (a higher global step) or diverged (not the consensus digest)?  download the state
        a step called and its gathering about to close?  take our contribution and average it
        enough samples in the collaboration?  call the step (gather_until = now + window)
        otherwise: one micro-batch of local work (in a worker thread)

A step is applied only when this peer's averaging completed: then every peer that applies it
applies the same average to the same state, so states stay bit-identical. When averaging fails
the contribution is kept for the next try; peers that did step meanwhile are ahead, and the
others download their state (only a certified one: `peer.training.certificate`). The local
step only grows, except from a step nobody else signed (`_stranded`) back to the certified one.

With `delayed_updates` (DeDLOC mode) the averaging of step t runs in the background while the
micro-batches of step t + 1 are computed on the parameters of step t, and its result is applied
between two micro-batches.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import trio

from peer.averaging.averager import Averager, AveragingResult, fingerprint, longest_averaging
from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.files import state_folder
from peer.measure.capabilities import Capabilities
from peer.net.host import parse_addrs
from peer.training import checkpoint as checkpoints
from peer.training import state as states
from peer.training.certificate import StepSignature, merge_signatures, sign_step
from peer.training.progress import (
    HISTORY,
    CollaborationView,
    Moves,
    ProgressRecord,
    company,
    decode_progress,
    encode_progress,
    progress_key,
    should_call,
)
from peer.training.strategies import LargeBatch, LocalSGD, Strategy
from peer.training.task import Task
from peer.training.timing import Timing

if TYPE_CHECKING:
    from peer.training.statesync import Snapshot

log = logging.getLogger("peertrain.trainer")
#: Failed averagings in a row before the trainer logs a warning (fewer are routine, at INFO).
WARN_AFTER_FAILURES = 3
#: Longest wait between two failed state downloads (the wait doubles from progress_interval).
MAX_DOWNLOAD_BACKOFF = 30.0
#: Seconds at most that a peer holds its calls for others still in a failed averaging.
MAX_WAIT_FOR_OTHERS = 600.0

#: Fetches the state of `step` (or newer) from the given holders.
Download = Callable[[list[ProgressRecord], int], Awaitable["Snapshot"]]
#: One micro-batch: (batch, samples in it). The default draws from the task.
BatchSource = Callable[[], tuple[Any, int]]


@dataclass
class TrainerStatus:
    """What `peer join` shows live; updated by the trainer, read by the renderer."""

    step: int = 0
    phase: str = "starting"
    loss: float | None = None
    samples_per_second: float = 0.0
    local_samples: int = 0
    view: CollaborationView = field(default_factory=lambda: CollaborationView([]))
    validation: tuple[int, float] | None = None
    last_step_seconds: float | None = None
    averaged_bytes: int = 0
    averaging_seconds: float = 0.0
    """Total time spent in averaging calls (`averagings` of them)."""
    averagings: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    """Failures by kind: averaging_incomplete, state_download."""
    steps_applied: int = 0
    downloads: int = 0
    compute_seconds: float = 0.0
    samples_computed: int = 0
    started_at: float = field(default_factory=time.monotonic)
    #: (monotonic time, compute_seconds) when the first step was applied: utilisation from
    #: there on leaves out start-up (measurements, the first gathering, any download).
    first_step: tuple[float, float] | None = None
    ended_at: float | None = None
    """When the last step was reached (before settling with the others)."""
    global_batches: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    """The samples behind each step this peer applied (its averaging's total weight)."""


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, tuple | list):
        return type(batch)(to_device(item, device) for item in batch)
    return batch


def data_seed(seed: int, peer_id: str) -> int:
    """The seed of a peer's micro-batches: `training.seed` mixed with its peer id, so that every
    peer draws its own samples whatever the seed (before, a non-zero seed gave every peer the
    same micro-batches: 10 of 10 compared were identical)."""
    digest = hashlib.blake2b(f"peertrain/data/{seed}/{peer_id}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1  # torch takes up to 2^63 - 1


def task_batches(task: Task, micro_batch: int, seed: int) -> Iterator[tuple[Any, int]]:
    generator = torch.Generator().manual_seed(seed)
    while True:
        yield task.sample_batch(micro_batch, generator), micro_batch


class Trainer:
    def __init__(
        self,
        *,
        dht: DHT,
        averager: Averager,
        config: PeerConfig,
        task: Task,
        device: torch.device,
        download: Download,
        batches: BatchSource | None = None,
        capabilities: Callable[[], Capabilities | None] = lambda: None,
        observe_training: Callable[[int, float], None] = lambda samples, seconds: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht = dht
        self.averager = averager
        self.config = config
        self.training = config.training
        self.task = task
        self.device = device
        self.download = download
        self.capabilities = capabilities
        self.observe_training = observe_training
        self.clock = clock
        self.me = dht.node.peer_id.to_base58()
        self.timing = Timing.of(config)
        # Distinct signers a (step, digest) needs before we download it or count it.
        self.quorum = config.averaging.min_group_size
        model = task.build_model().to(device)
        self.strategy: Strategy = (
            LocalSGD(
                task,
                model,
                outer_lr=self.training.outer_lr,
                momentum=self.training.outer_momentum,
                inner_steps=self.training.inner_steps,
            )
            if self.training.mode == "diloco"
            else LargeBatch(task, model)
        )
        self.model = model
        self._parameter_names = [name for name, _ in model.named_parameters()]
        self._vector_size = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.fingerprint = fingerprint(
            [(name, tuple(t.shape), str(t.dtype)) for name, t in model.named_parameters()]
        )
        samples = task_batches(
            task, config.task.micro_batch, data_seed(self.training.seed, self.me)
        )
        self.next_batch: BatchSource = batches or (lambda: next(samples))
        self.status = TrainerStatus()
        self.step = 0
        self._snapshot: Snapshot | None = None
        self._captured: states.TrainingState | None = None
        self.digest = ""
        self._signatures: list[StepSignature] = []  # of (step, digest): ours, then others'
        self._uncertified_since: float | None = None  # (clock) our state lacks a quorum since
        self._capture()
        self._call: tuple[int, float] | None = None  # (step, gather_until) we called
        self._failed_before = -math.inf  # calls gathering at or before this failed for us
        self._failed_in_a_row = 0
        # When the others' steps last moved, when someone to average with was last in view
        # (monotonic; None: never) and the highest step anyone reported: whether we may step
        # alone (`_on_our_own`).
        self._moves = Moves()
        self._company_at: float | None = None
        self._highest_seen = 0
        self._store_seconds = 0.0  # moving average of how long our progress store takes
        self._download_failures = 0  # in a row
        self._downloading = False
        self._holding = False  # our part of the next step is done: we compute no more for it
        self._ready_since: float | None = None  # (monotonic) when the step could first be called
        self._pending: trio.Event | None = None  # delayed averaging in flight
        self._pending_result: tuple[np.ndarray, int, AveragingResult, float] | None = None
        self._validate_due = False
        self._validation_batches: list[Any] | None = None
        self._loss_ema: float | None = None
        self._recent_losses: deque[float] = deque(maxlen=HISTORY)
        self._recent_validation: deque[float] = deque(maxlen=HISTORY)
        self._step_bytes = 0
        self._rate_ema: float = 0.0
        self._batch_seconds = 0.0
        self._view_changed = trio.Event()
        self._publish_now = trio.Event()
        self.finished = trio.Event()
        self._last_checkpoint = time.monotonic()
        self.checkpoint_dir: Path | None = state_folder(
            self.training.checkpoint_dir, config.collaboration.name, task.name
        )

    # ------------------------------------------------------------------ state for donors

    def snapshot(self) -> Snapshot | None:
        """The state of our current step as bytes (built on first request after each step)."""
        from peer.training.statesync import Snapshot

        if self._snapshot is None and self._captured is not None:
            self._snapshot = Snapshot(self._captured.step, states.to_bytes(self._captured))
        return self._snapshot

    def _capture(self) -> None:
        """Remember the state at a step boundary (what donors serve and checkpoints hold)."""
        self._captured = states.capture(
            self.step,
            self.model,
            self.strategy.optimizers(),
            scheduler_state=self.strategy.schedule.state(),
        )
        self._snapshot = None
        self.digest = self._digest(self._captured)
        self._uncertified_since = None  # a new state: the next read starts its clock
        # We sign only what we hold: the state our averaging produced, a certified download or
        # our own checkpoint (`peer.training.certificate`).
        self._signatures = [
            sign_step(
                self.dht.node.identity.key_pair.private_key,
                self.me,
                self.config.collaboration.name,
                self.step,
                self.digest,
            )
        ]

    def _digest(self, state: states.TrainingState) -> str:
        return states.state_digest(state, self._parameter_names, self.strategy.shared)

    def _restore(self, state: states.TrainingState, *, from_donor: bool = False) -> None:
        """Load a state: our checkpoint, or (`from_donor`) a downloaded one, of which only the
        certified part is taken (`states.restore`): the learning-rate schedule is replayed
        from our own task, and diloco's inner optimizer stays ours."""
        strategy = self.strategy
        if from_donor:
            optimizers = {name: strategy.optimizers()[name] for name in strategy.shared}
            states.restore(state, self.model, optimizers, from_donor=True)
            strategy.schedule.replay(strategy.schedule_epochs(state.step))
        else:
            strategy.schedule.check(state.scheduler_state)  # before anything changes
            states.restore(state, self.model, strategy.optimizers())
            strategy.schedule.load(state.scheduler_state)
        strategy.drop_local_work()
        self._holding = False
        self.step = state.step
        self._capture()

    # ------------------------------------------------------------------ progress

    def record(self) -> ProgressRecord:
        validation = self.status.validation
        if validation and not math.isfinite(validation[1]):
            validation = None  # others would drop the whole record (ProgressRecord.problem)
        call_step, gather_until = self._call or (-1, 0.0)
        return ProgressRecord(
            peer_id=self.me,
            role="trainer",
            addrs=self.dht.node.public_addrs(),
            step=self.step,
            digest=self.digest,
            samples=self.strategy.samples,
            samples_per_second=self._rate_ema,
            updated_at=self.clock(),
            loss=self._loss_ema,
            validation_loss=validation[1] if validation else None,
            validation_step=validation[0] if validation else 0,
            call_step=call_step,
            gather_until=gather_until,
            recent_losses=list(self._recent_losses),
            recent_validation=list(self._recent_validation),
            step_bytes=self._step_bytes,
            downloading=self._downloading,
            holding=self._holding,
            signatures=list(self._signatures),
        )

    def view(self) -> CollaborationView:
        """The last read of the collaboration, with our own figures as they are now."""
        return self.status.view.with_record(self.record())

    def _read(self, entries: dict[str, object]) -> CollaborationView:
        name = self.config.collaboration.name
        return CollaborationView(decode_progress(entries, collaboration=name), self.quorum)

    def _note_view(self, view: CollaborationView) -> None:
        self.status.view = view
        # The others who hold our step and digest signed it too: carry their signatures, so
        # that our record certifies the state after they leave (decode checked them).
        theirs = [
            signature
            for r in view.records
            if r.peer_id != self.me and r.step == self.step and r.digest == self.digest
            for signature in r.signatures
        ]
        if theirs and self._signatures:
            self._signatures = merge_signatures(self._signatures[0], theirs)
        mine = view.with_record(self.record())
        if mine.certified(self.step, self.digest):
            self._uncertified_since = None
        elif self._uncertified_since is None:
            self._uncertified_since = self.clock()
        self._highest_seen = max(self._highest_seen, view.global_step)
        now = time.monotonic()
        self._moves.note(view, now)
        if self._company(now):
            self._company_at = now

    def _company(self, now: float) -> list[ProgressRecord]:
        return company(
            self.status.view,
            self.step,
            self.me,
            self._moves,
            within=self.timing.solo_wait,
            now=now,
        )

    def _on_our_own(self) -> bool:
        """Nobody is left to average with (`progress.company`: no other trainer at our step or
        beyond, or behind and catching up), nor has been for `solo_after` seconds. Only then is
        a step of our samples alone no step apart from anyone's: sooner, a peer cut off from the
        others (or one whose clock made it miss their gathering) would run ahead alone, the
        others chasing it by download, and their work be dropped when the highest step wins
        after the heal; or it would end on parameters nobody else holds."""
        now = time.monotonic()
        if self._company(now):
            return False
        since = self._company_at
        return since is None or now - since >= self.timing.solo_wait

    async def _keep_progress(self) -> None:
        """Publish our record and read everyone's, every progress_interval (or when asked)."""
        key = progress_key(self.config.collaboration.name)
        interval = self.training.progress_interval
        ttl = self.timing.progress_ttl
        try:
            while True:
                record = self.record()
                started, stored = trio.current_time(), False
                try:
                    with trio.move_on_after(max(interval, self.config.net.rpc_timeout)):
                        await self.dht.store(
                            key,
                            self.me,
                            encode_progress(record),
                            expiration=record.updated_at + ttl,
                        )
                        stored = True
                        self.note_store_time(trio.current_time() - started)
                        self._note_view(self._read(await self.dht.get(key)))
                        self._view_changed.set()
                        self._view_changed = trio.Event()
                except RemoteError as error:
                    log.debug("progress exchange failed: %s", error)
                if not stored:  # cut short or failed: it took at least this long (testbed, 4 s+)
                    self.note_store_time(trio.current_time() - started)
                with trio.move_on_after(interval):
                    await self._publish_now.wait()
                self._publish_now = trio.Event()
        finally:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(1.0),
                contextlib.suppress(RemoteError),
            ):
                await self.dht.withdraw(key, self.me, expiration=self.clock() + ttl + 1)

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._resume()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._keep_progress)
                with trio.move_on_after(self.timing.first_read):
                    await self._view_changed.wait()  # the first read, to know if we are behind
                task_status.started()
                self.status.started_at = time.monotonic()
                while not self._done():
                    await self._iteration(nursery)
                self.status.ended_at = time.monotonic()
                if self._left_behind():
                    log.warning(
                        "the collaboration finished at step %d and nobody holding that state is "
                        "left to download it from; stopping at step %d",
                        self._highest_seen,
                        self.step,
                    )
                await self._settle()
                if self._validate_due:  # the last step's evaluation, e.g. at max_steps
                    await self._validate()
                self._report()
                self.finished.set()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._checkpoint(force=True)

    async def _settle(self) -> None:
        """Before stopping: stay (publishing progress, serving the state) until every trainer
        in view holds our step and digest, so that a peer that ended on another digest (a
        group that averaged apart) or a step behind catches up from us; we catch up likewise.
        Bounded: a silent peer's record may take a while to expire. While a trainer behind us
        or downloading is in view we stay longer, up to a state download's deadline: it would
        be left without a donor (a large state over a slow link takes minutes), or end on
        other parameters than ours. After a download of our own we read the view again."""
        interval = self.training.progress_interval
        patience = trio.current_time() + self.timing.settle_patience(self._store_seconds)
        with trio.move_on_at(patience + self.timing.download_timeout):
            while True:
                view = self.view()
                if donors := self._should_download(view):
                    await self._catch_up(donors, view)
                    # Our digest changed: others may have changed theirs meanwhile (a swap).
                    patience = max(patience, trio.current_time() + 4 * interval)
                elif view.settled(self.step, self.digest):
                    return
                elif trio.current_time() > patience and not view.catching_up(self.step):
                    break
                else:
                    self.status.phase = "waiting for the others to finish"
                    await trio.sleep(interval / 2)
        log.info("stopping at step %d before every peer in view agreed", self.step)

    def utilisation(self, *, after_first_step: bool = False) -> float:
        """Share of wall time spent computing micro-batches, since training began or since
        the first step was applied, until training ended."""
        since, computed = self.status.started_at, 0.0
        if after_first_step:
            if self.status.first_step is None:
                return 0.0
            since, computed = self.status.first_step
        wall = (self.status.ended_at or time.monotonic()) - since
        return (self.status.compute_seconds - computed) / wall if wall > 0 else 0.0

    def _report(self) -> None:
        figures = {
            "step": self.step,
            "steps_applied": self.status.steps_applied,
            "samples": self.status.samples_computed,
            "compute_s": round(self.status.compute_seconds, 3),
            "wall_s": round((self.status.ended_at or time.monotonic()) - self.status.started_at, 3),
            "utilisation": round(self.utilisation(), 4),
            "utilisation_after_first_step": round(self.utilisation(after_first_step=True), 4),
            "averaged_bytes": self.status.averaged_bytes,
            "downloads": self.status.downloads,
            # (step, loss) of the latest evaluation on this peer, or None
            "validation": self.status.validation,
        }
        log.info(
            "training finished at step %d: utilisation %.1f%%, %d bytes averaged",
            self.step,
            100 * figures["utilisation"],
            self.status.averaged_bytes,
            extra={"training": figures},
        )

    def _done(self) -> bool:
        if self.training.max_steps and self.step >= self.training.max_steps:
            return True
        if self._left_behind():
            return True
        # Our own validation, or `quorum` peers' reports: one peer's word stops nobody.
        target = self.training.target_validation_loss
        own = self.status.validation
        return bool(target) and (
            (own is not None and own[1] <= target) or self.view().target_reached(target)
        )

    async def _iteration(self, nursery: trio.Nursery) -> None:
        if self._pending_result is not None:
            self._apply_pending()
        if self._validate_due:
            await self._validate()
        await self._checkpoint()
        view = self.view()
        if self._pending is None and (donors := self._should_download(view)):
            await self._catch_up(donors, view)
            return
        call = self._current_call(view)
        free = call is None and self._pending is None and not self._others_still_averaging(view)
        if free and self._ready(view):
            if self._ready_since is None:  # the fallback caller's wait starts now
                self._ready_since = time.monotonic()
        else:
            self._ready_since = None
        if self._may_call(view):
            self._call = (self.step, self.clock() + self.timing.window(self._store_seconds))
            self._publish_now.set()
            call = self._call[1]
            log.info("calling step %d: averaging at +%.1fs", self.step + 1, call - self.clock())
        # With delayed updates too: the micro-batches computed while our averaging runs are our
        # part of the step after it, so they stop at our quota (before, they did not: 3 peers
        # applied 3,280 samples a step for a target of 64).
        full = self._batch_is_full(view)
        if full != self._holding:
            self._holding = full
            self._publish_now.set()  # the others' projections take our count as final
        if call is not None and self._pending is None:
            now, margin = self.clock(), self.timing.declare_margin(self._store_seconds)
            if now > call - margin / 2:
                # Too late for our ticket to be seen: this step goes on without us, and we
                # catch up on the next (one that arrives mid-step waits for the next step).
                log.info("missed the gathering of step %d; joining the next", self.step + 1)
                self._failed_before = call
            elif (full and now >= call - self.timing.window(self._store_seconds) / 2) or (
                self.training.mode == "dedloc" and now + self._batch_seconds >= call - margin
            ):
                # Our part is done, half the window is left (time for an earlier call of the
                # step to show: it wins, and a ticket in ours would pin us here), and our
                # ticket lands well before the close; or (dedloc) the gathering is about to
                # close. A diloco peer averages only with exactly its H inner steps.
                if not await self._call_overtaken(call, margin):
                    await self._average(call, nursery)
                return
        if full:  # done: wait for the call, for its time to declare, or for our averaging
            wait = self.training.progress_interval / 2
            if self._pending is not None:
                with trio.move_on_after(wait):
                    await self._pending.wait()
                return
            if call is not None:
                window = self.timing.window(self._store_seconds)
                wait = min(wait, max(0.0, call - window / 2 - self.clock()))
            with trio.move_on_after(wait):
                await self._view_changed.wait()
            return
        await self._compute()

    def _left_behind(self) -> bool:
        """The collaboration reached max_steps without us, and its holders left: stepping on
        alone would end on parameters nobody else holds."""
        last = self.training.max_steps
        return bool(last) and self.step < last <= self._highest_seen and self._on_our_own()

    def _batch_is_full(self, view: CollaborationView) -> bool:
        """Our part of the next step is done. diloco: our `inner_steps` (each peer takes
        exactly H). dedloc: our quota of the target batch (`_quota`), or the samples of the
        collaboration as we project them (ours exactly) are within half a micro-batch of the
        target, so one more would overshoot by more than it would fall short. The quotas bound
        the batch whatever the records' staleness; the projection stops us early where others
        did more than their quota."""
        micro_batch = self.config.task.micro_batch
        if self.training.mode == "diloco":
            return self.strategy.samples >= self.training.inner_steps * micro_batch
        if self.strategy.samples >= self._quota(view) * micro_batch:
            return True
        projected = view.projected_samples(
            self.step, now=self.clock(), horizon=self.timing.projection_horizon
        )
        return projected >= self.config.task.target_batch - micro_batch / 2

    def _quota(self, view: CollaborationView) -> int:
        """Our micro-batches of the next step: the target's micro-batches dealt out among the
        trainers about to take the step in proportion to their samples/s (equally while a
        speed is unknown: a peer just started), by largest remainder, ties by peer id. Every peer with the same
        view deals the same way, so the quotas add up to the target (to a micro-batch: peers
        with other micro-batch sizes count in ours); with more peers than micro-batches some
        get none and only receive the average."""
        micro_batch = self.config.task.micro_batch
        units = max(1, round(self.config.task.target_batch / micro_batch))
        rates = {r.peer_id: r.samples_per_second for r in self._step_company(view)}
        # Our rate as the others read it (our last stored record), not as it is now: with our
        # fresh rate against their published ones, each peer of a warming-up collaboration
        # took itself for the faster one and the quotas added up to more than the target.
        published = [r for r in self.status.view.records if r.peer_id == self.me]
        rates[self.me] = published[0].samples_per_second if published else self._rate_ema
        if not all(rate > 0 for rate in rates.values()):
            rates = dict.fromkeys(rates, 1.0)
        total = sum(rates.values())
        exact = {peer: units * rate / total for peer, rate in rates.items()}
        quota = {peer: int(share) for peer, share in exact.items()}
        left = units - sum(quota.values())
        by_remainder = sorted(exact, key=lambda peer: (quota[peer] - exact[peer], peer))
        for peer in by_remainder[:left]:
            quota[peer] += 1
        return quota[self.me]

    def _step_company(self, view: CollaborationView) -> list[ProgressRecord]:
        """The trainers about to take our next step with us: at our step, or one behind (a
        record published just before its step), not downloading."""
        return [
            r
            for r in view.records
            if r.role == "trainer" and r.step in (self.step, self.step - 1) and not r.downloading
        ]

    def _current_call(self, view: CollaborationView) -> float | None:
        # Not the call we missed: with it still earliest in view, a peer that missed it would
        # call the step again on every iteration, and its calls would never take effect.
        return view.call(
            self.step, after=self._failed_before, latest=self.timing.latest_call(self.clock())
        )

    def _ready(self, view: CollaborationView) -> bool:
        """The step can be called: everyone about to take it holds (diloco: a barrier, each
        peer did its H steps; dedloc: or computes nothing), or (dedloc) the samples projected
        to the end of the gathering window reach the target (a caller done with its own part
        is not enough: the others would declare half-way through their quotas)."""
        if self.training.mode == "diloco":
            return self._batch_is_full(view) and all(
                r.holding for r in view.trainers(self.step) if r.peer_id != self.me
            )
        # Nobody computes more: all hold, or compute nothing (a peer at 0 samples/s).
        done = all(
            r.holding or r.samples_per_second <= 0
            for r in self._step_company(view)
            if r.peer_id != self.me
        )
        return (done and self._batch_is_full(view)) or should_call(
            view,
            self.step,
            target_batch=self.config.task.target_batch,
            window=self.timing.window(self._store_seconds),
            now=self.clock(),
            horizon=self.timing.projection_horizon,
        )

    def _may_call(self, view: CollaborationView) -> bool:
        """Whether we call the step now. One caller, so that two calls of a step made at
        nearly the same moment do not split it (each call's peers averaging apart, one part
        downloading the other's state: 8 peers in one process split 5-3 that way): the trainer
        at our step with the lowest peer id calls; another only if no call came for a while
        after it was ready (the lowest may be gone)."""
        if self._ready_since is None or self._others_still_averaging(view):
            return False
        company = {r.peer_id: r for r in self._step_company(view)}
        lowest = min(company, default=self.me)
        if self.me <= lowest:
            return True
        # Another calls only where the lowest looks silent: its record is stale, or it is done
        # and no call came; or, whatever its record says, after a long wait.
        waited = time.monotonic() - self._ready_since
        fallback = self.timing.fallback_caller_wait(self._store_seconds)
        record = company[lowest]
        stale = self.clock() - record.updated_at > self.timing.stale_record
        return waited >= fallback and (
            stale
            or record.holding
            or waited >= fallback + 4 * self.timing.window(self._store_seconds)
        )

    async def _call_overtaken(self, call: float, margin: float) -> bool:
        """Read the progress records once more before declaring for `call`: a call of the step
        that gathers earlier wins (declaring in ours would leave us out of it), and a peer
        already past our step took it without us (we download instead: averaging it again
        would make a second version of the step)."""
        with trio.move_on_after(margin / 4), contextlib.suppress(RemoteError):
            entries = await self.dht.get(progress_key(self.config.collaboration.name))
            self._note_view(self._read(entries))
        view = self.view()
        earliest = self._current_call(view)
        return view.global_step > self.step or (earliest is not None and earliest < call)

    def _majority(self, result: AveragingResult) -> bool:
        """Whether the peers behind `result` are more than half of the trainers at this step
        (or one step around it: a record lags its peer's step). Two groups that averaged the
        same step apart (a call seen too late by some) cannot both hold a majority, so at most
        one of them steps; without this both did, and the smaller downloaded the other's state
        and lost its samples. (A peer killed without withdrawing its record counts until the
        record expires.)"""
        around = [
            r
            for r in self.status.view.records
            if r.role == "trainer"
            and abs(r.step - self.step) <= 1
            and not r.downloading
            and r.peer_id != self.me
        ]
        if 2 * result.members > len(around) + 1:
            return True
        result.skipped.append(
            f"it holds {result.members} of the {len(around) + 1} trainers at this step, not a "
            "majority: another group may step without us"
        )
        return False

    def _others_still_averaging(self, view: CollaborationView) -> bool:
        """After an averaging that failed (or that we missed), others at our step may still be
        in it, waiting out a dead member: a call of ours now would close before they are free,
        they would miss it, and the step would split (each part stepping with fewer peers, the
        rest downloading). Wait until they are done (their record shows no call at or before
        it), at most as long as an averaging may take."""
        if self._failed_before == -math.inf:
            return False
        now, longest = self.clock(), self._longest_averaging(view)
        return any(
            r.call_step == self.step
            and r.gather_until <= self._failed_before
            and now - r.gather_until < longest
            for r in view.trainers(self.step)
            if r.peer_id != self.me
        )

    def _longest_averaging(self, view: CollaborationView) -> float:
        """A bound on an averaging's length after its gathering (`longest_averaging`: its
        rounds' joins, waits and transfers of our vector at our measured bandwidth; at least
        the fixed bound it replaces, 30 s by default, which was shorter than one round of a
        400 MB vector at 50 MB/s). A failed one ends sooner: its members learn it at once.
        At most MAX_WAIT_FOR_OTHERS: a record that goes on claiming to be in the failed
        averaging holds every call only that long. A slower member's transfers are not in the
        bound (records carry no bandwidth): a call made while it is still in the averaging can
        go on without it (it then downloads the state)."""
        capabilities = self.capabilities()
        averaging = self.config.averaging
        bandwidth = (
            [max(averaging.min_bandwidth, min(capabilities.upload_bps, capabilities.download_bps))]
            if capabilities
            else []
        )
        peers = len(view.trainers(self.step))
        floor = 4 * averaging.join_timeout + 2 * averaging.timeout_floor
        bound = longest_averaging(self._vector_size, peers, bandwidth, averaging)
        return min(MAX_WAIT_FOR_OTHERS, max(floor, bound))

    def note_store_time(self, seconds: float) -> None:
        """How long a DHT store of ours took (the progress loop times each one)."""
        first = self._store_seconds == 0.0
        self._store_seconds = seconds if first else 0.7 * self._store_seconds + 0.3 * seconds

    def _should_download(self, view: CollaborationView) -> list[ProgressRecord]:
        """Holders of the state to fetch when we are behind, hold a minority digest, or are
        stranded ahead (`_stranded`)."""
        target = view.global_step
        if target == self.step:
            consensus = view.consensus(self.step)
            if consensus is None or consensus == self.digest:
                return []
        elif target < self.step and not self._stranded():
            return []
        return [r for r in view.donors(target) if r.peer_id != self.me]

    def _stranded(self) -> bool:
        """We applied a step that fewer than `quorum` peers signed (the others' averaging
        failed where ours completed: two peers under load, one stepped and one did not), and
        it stayed so for `Timing.settle_patience`. Nobody can download it and the others
        cannot average with us a step apart: we go back to the certified step they hold (a
        step nobody else holds is not the collaboration's), losing that step's samples."""
        since = self._uncertified_since
        patience = self.timing.settle_patience(self._store_seconds)
        return since is not None and self.step > 0 and self.clock() - since >= patience

    async def _compute(self) -> None:
        batch, size = self.next_batch()
        started = time.perf_counter()
        loss = await trio.to_thread.run_sync(
            self.strategy.accumulate, to_device(batch, self.device), size
        )
        seconds = time.perf_counter() - started
        self.status.compute_seconds += seconds
        self.status.samples_computed += size
        self.observe_training(size, seconds)
        self._batch_seconds = (
            seconds if not self._batch_seconds else 0.8 * self._batch_seconds + 0.2 * seconds
        )
        rate = size / seconds if seconds > 0 else 0.0
        self._rate_ema = rate if not self._rate_ema else 0.8 * self._rate_ema + 0.2 * rate
        if math.isfinite(loss):
            self._loss_ema = loss if self._loss_ema is None else 0.9 * self._loss_ema + 0.1 * loss
        self.status.loss = self._loss_ema
        self.status.samples_per_second = self._rate_ema
        self.status.local_samples = self.strategy.samples
        self.status.phase = "training"

    # ------------------------------------------------------------------ steps

    async def _average(self, gather_until: float, nursery: trio.Nursery) -> None:
        vector, samples = self.strategy.take()
        step = self.step
        self._call = (step, gather_until)  # our record shows the call we are in
        self._publish_now.set()
        if self.training.delayed_updates and self.training.mode == "dedloc":
            done = self._pending = trio.Event()

            async def in_background() -> None:
                try:
                    result = await self._run_averaging(vector, samples, step, gather_until)
                    self._pending_result = (vector, samples, result, gather_until)
                finally:
                    done.set()

            nursery.start_soon(in_background)
            return
        self.status.phase = "averaging"
        result = await self._run_averaging(vector, samples, step, gather_until)
        self._finish_step(vector, samples, result, gather_until)

    async def _run_averaging(
        self, vector: np.ndarray, samples: int, step: int, gather_until: float
    ) -> AveragingResult:
        started = time.monotonic()
        log.debug(
            "averaging toward step %d: %d samples, gathering until %.3f (in %.3fs)",
            step + 1,
            samples,
            gather_until,
            gather_until - self.clock(),
        )
        result = await self.averager.average(
            vector,
            weight=float(samples > 0) if self._uniform() else float(samples),
            # Unique per call, shared by everyone who answers it: a retried step never meets
            # the tickets of an earlier, failed attempt.
            epoch=int(gather_until * 1000),
            fingerprint=self.fingerprint,
            gather_until=gather_until,
            capabilities=self.capabilities(),
        )
        self.status.last_step_seconds = time.monotonic() - started
        self.status.averaging_seconds += self.status.last_step_seconds
        self.status.averagings += 1
        self._step_bytes = sum(r.bytes_sent + r.bytes_received for r in result.rounds)
        self.status.averaged_bytes += self._step_bytes
        return result

    def _uniform(self) -> bool:
        """Peers weighted equally in the average (the DiLoCo paper's), not by samples."""
        return self.training.mode == "diloco" and self.training.outer_weighting == "uniform"

    def _apply_pending(self) -> None:
        assert self._pending_result is not None
        vector, samples, result, gather_until = self._pending_result
        self._pending_result = None
        self._pending = None
        self._finish_step(vector, samples, result, gather_until)

    def _finish_step(
        self, vector: np.ndarray, samples: int, result: AveragingResult, gather_until: float
    ) -> None:
        # Alone only if nobody is left to average with: with others at our step or beyond,
        # our read of the tickets missed theirs (or we missed their gathering), and a step of
        # our own would part from theirs.
        # A step of one peer certifies nothing (`peer.training.certificate`): only where
        # averaging.min_group_size = 1 says one peer is enough.
        alone = (
            self.quorum <= 1 and result.peers_seen == 1 and not result.rounds and self._on_our_own()
        )
        # Only an exact average is a step (`Averager`: of everyone in a planned round, of the
        # members that took part in a single group): then every peer that steps applies the
        # same bits. `vector` is still our own contribution.
        complete = alone or (result.average is not None and self._majority(result))
        # Peers that all had 0 samples average nothing: an optimizer step on that would still
        # move the weights (momentum, weight decay), so it is no step.
        contributed = samples > 0 if alone else result.weight > 0
        self._call = None
        self._publish_now.set()  # others wait for us to be done with this gathering
        if not complete or not contributed:
            self._failed_before = gather_until
            self.strategy.give_back(vector, samples)
            if complete:  # routine: e.g. peers that had just started or downloaded
                log.info("no sample in our group for step %d; joining the next", self.step + 1)
            else:
                self.status.failures["averaging_incomplete"] += 1
                self._failed_in_a_row += 1
                in_a_row = self._failed_in_a_row
                # One failure is routine (a late ticket, a peer that just left) and the next
                # try heals it: a warning once failures persist, then every tenth one.
                warn = (
                    in_a_row >= WARN_AFTER_FAILURES and (in_a_row - WARN_AFTER_FAILURES) % 10 == 0
                )
                log.log(
                    logging.WARNING if warn else logging.INFO,
                    "averaging for step %d did not complete (%s); keeping our %d samples for "
                    "the next try (%d failed in a row)",
                    self.step + 1,
                    "; ".join(result.skipped)
                    or ("we read no other ticket" if result.peers_seen == 1 else "a member failed"),
                    samples,
                    in_a_row,
                )
            return
        self._failed_in_a_row = 0
        average = vector if alone else result.average
        assert average is not None  # complete
        self.strategy.apply(average)
        # The average's total weight is the global batch, unless the peers were weighted
        # equally (diloco, outer_weighting = "uniform"): then it counts peers, not samples.
        global_batch = float(samples) if alone else None if self._uniform() else result.weight
        if global_batch is not None:
            self.status.global_batches.append(global_batch)
        self._holding = False
        self.step += 1
        self.status.steps_applied += 1
        if self.status.first_step is None:
            self.status.first_step = (time.monotonic(), self.status.compute_seconds)
        self._capture()
        self.status.step = self.step
        if self._loss_ema is not None:
            self._recent_losses.append(self._loss_ema)
        self._publish_now.set()
        log.info(
            "step %d: %d peers, %d local samples %s, loss %.4f",
            self.step,
            result.members if not alone else 1,
            samples,
            "(peers weighted equally)" if global_batch is None else f"of {global_batch:.0f}",
            self._loss_ema or math.nan,
            extra={
                "applied": {
                    "step": self.step,
                    "peers": result.members if not alone else 1,
                    "samples": samples,
                    "global_batch": global_batch,
                }
            },
        )
        interval = self.training.validation_interval
        self._validate_due = bool(interval) and self.step % interval == 0

    # ------------------------------------------------------------------ catching up

    async def _catch_up(self, donors: list[ProgressRecord], view: CollaborationView) -> None:
        target = view.global_step
        if not donors:
            return
        self.status.phase = f"downloading step {target}"
        self._downloading = True
        self._publish_now.set()  # others must not take our old digest for settled
        try:
            await self._download(donors, target)
        finally:
            self._downloading = False
            self._publish_now.set()

    async def _download(self, donors: list[ProgressRecord], target: int) -> None:
        for record in donors:
            from libp2p.peer.id import ID

            self.dht.node.remember_addrs(ID.from_base58(record.peer_id), parse_addrs(record.addrs))
        try:
            snapshot = await self.download(donors, target)
            state, digest = await trio.to_thread.run_sync(self._parse, snapshot.blob)
            # Not older than we hold, unless we go back from a stranded step (`_stranded`).
            if state.step < (target if target < self.step else max(target, self.step)):
                raise RemoteError(f"donors sent step {state.step}, expected {target}")
            # Only a certified (step, digest): a donor cannot hand us a state of its own making,
            # whatever its record claims (donors that stepped since our read: the next try).
            if not self.view().certified(state.step, digest):
                raise RemoteError(
                    f"donors sent step {state.step} with digest {digest[:12]}, which fewer than "
                    f"{self.quorum} peers signed"
                )
            self._restore(state, from_donor=True)
        except RemoteError as error:
            self.status.failures["state_download"] += 1
            # Back off: busy or budget-limited donors refuse again if asked at once.
            self._download_failures += 1
            delay = min(
                self.training.progress_interval * 2 ** (self._download_failures - 1),
                MAX_DOWNLOAD_BACKOFF,
            )
            log.warning("state download failed: %s; retrying in %.3gs", error, delay)
            await trio.sleep(delay)
            return
        self._download_failures = 0
        self.status.downloads += 1
        self.status.step = self.step
        log.info("downloaded the state of step %d from %d donors", self.step, len(donors))

    def _parse(self, blob: bytes) -> tuple[states.TrainingState, str]:
        state = states.from_bytes(blob)
        return state, self._digest(state)

    # ------------------------------------------------------------------ validation, checkpoints

    async def _validate(self) -> None:
        self._validate_due = False
        if self._validation_batches is None:
            self._validation_batches = await trio.to_thread.run_sync(
                self.task.validation_batches,
                self.config.task.micro_batch,
                self.training.validation_batches,
            )
        loss = await trio.to_thread.run_sync(self.validation_loss, self._validation_batches)
        self.status.validation = (self.step, loss)
        if math.isfinite(loss):
            self._recent_validation.append(loss)
        self._publish_now.set()
        log.info("step %d: validation loss %.4f", self.step, loss)

    def validation_loss(self, batches: list[Any]) -> float:
        """Mean loss over held-out batches (the model as of the current step)."""
        self.model.eval()
        try:
            with torch.no_grad():
                losses = [
                    float(self.task.loss(self.model, to_device(b, self.device))) for b in batches
                ]
        finally:
            self.model.train()
        return sum(losses) / len(losses)

    async def _checkpoint(self, *, force: bool = False) -> None:
        if self.checkpoint_dir is None or self._captured is None or self.step == 0:
            return
        if (
            not force
            and time.monotonic() - self._last_checkpoint < self.training.checkpoint_interval
        ):
            return
        self._last_checkpoint = time.monotonic()
        state = self._captured
        with trio.move_on_after(30):
            await trio.to_thread.run_sync(checkpoints.save_checkpoint, self.checkpoint_dir, state)

    def _resume(self) -> None:
        self._capture()
        if self.checkpoint_dir is None:
            return
        state = checkpoints.load_latest(self.checkpoint_dir)
        if state is None:
            return
        try:
            self._restore(state)
            log.info("resumed from the checkpoint of step %d", self.step)
        except RemoteError as error:
            log.warning("ignoring checkpoint in %s: %s", self.checkpoint_dir, error)
