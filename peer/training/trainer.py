"""The trainer: executes what the step protocol decides (`peer.training.policy.StepPolicy`),
with the torch work in a worker thread (`peer.training.worker.TorchWorker`).

One step, as `run` executes it (the policy's docstring says why each action comes when):

    while the policy does not say Stop:
        Compute   one micro-batch (in the worker thread)
        Call      publish our record: it calls the next step, gathering at `gather_until`
        Declare   read the records once more; if the policy still says so, take our
                  contribution and average it (dedloc with delayed updates: in the
                  background, its result applied between two micro-batches)
        CatchUp   download a certified state, check it and load it (in the worker thread)
        Wait      until the records change, or our background averaging ends

A step is applied only when this peer's averaging completed: then every peer that applies it
applies the same average to the same state, so states stay bit-identical. When averaging fails
the contribution is kept for the next try; peers that did step meanwhile are ahead, and the
others download their state (only a certified one: `peer.training.certificate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch
import trio
from libp2p.peer.id import ID

from peer.averaging.averager import Averager, AveragingResult
from peer.config import PeerConfig
from peer.dht.node import DHT, MAX_REJOIN, direct_addrs
from peer.errors import ConfigError, RemoteError
from peer.files import state_folder
from peer.heap import releaser
from peer.measure.capabilities import Capabilities
from peer.net.streamio import STREAM_PATH
from peer.training.catchup import InPlaceCatchUp
from peer.training.certificate import sign_step
from peer.training.notary import claim_genesis, notary_of
from peer.training.policy import (
    Call,
    CatchUp,
    Compute,
    Declare,
    Local,
    Outcome,
    Phase,
    StepPolicy,
    Stop,
    Verdict,
    Wait,
)
from peer.training.progress import (
    HISTORY,
    CollaborationView,
    ProgressRecord,
)
from peer.training.publisher import (
    ProgressPublisher,
    check_certified,
    fetch_certified,
    remember_donors,
)
from peer.training.steprule import Candidate, Electorate, plan_of
from peer.training.task import Task
from peer.training.tracking import Tracker
from peer.training.worker import BatchSource, TorchWorker

if TYPE_CHECKING:
    from peer.training.statesync import Snapshot
    from peer.training.statesync.inplace import Sink

log = logging.getLogger("peertrain.trainer")

#: Fetches the state of `step` (or newer) from the given holders.
Download = Callable[[list[ProgressRecord], int], Awaitable["Snapshot"]]
#: ...or straight into a sink (`statesync.inplace`), returning its step.
DownloadInto = Callable[[list[ProgressRecord], int, "Sink"], Awaitable[int]]


def remember_contacts(
    known: OrderedDict[str, list[str]],
    records: list[ProgressRecord],
    me: str,
    limit: int = MAX_REJOIN,
) -> None:
    """Move the peers of `records` that publish addresses (all but `me`) to the end of `known`,
    in the records' order and with their newest addresses, keeping the last `limit`: the
    contacts a peer out of touch joins the DHT again through. Only the last `limit` of the
    records can stay, so only they are moved: moving every one was most of
    `Trainer._observe`'s 4 % of py-spy's samples at 1,000 simulated peers."""
    newest: dict[str, ProgressRecord] = {}
    for r in reversed(records):
        if len(newest) == limit:
            break
        if r.peer_id != me and r.addrs and r.peer_id not in newest:
            newest[r.peer_id] = r
    for peer_id, r in reversed(newest.items()):
        known.pop(peer_id, None)
        known[peer_id] = list(r.addrs)
    while len(known) > limit:
        known.popitem(last=False)


@dataclass(frozen=True)
class TrainerStatus:
    """What `peer join` shows and the metrics export: a snapshot (`Trainer.status()`)."""

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
    global_batches: tuple[float, ...] = ()
    """The samples behind each step this peer applied (its averaging's total weight)."""


@dataclass
class Tally:
    """What the executor counts (the source of `TrainerStatus`'s figures, not a copy)."""

    loss: float | None = None  # moving average
    samples_per_second: float = 0.0  # moving average
    batch_seconds: float = 0.0  # moving average
    validation: tuple[int, float] | None = None
    last_step_seconds: float | None = None
    averaged_bytes: int = 0
    step_bytes: int = 0  # the last step's
    reduced: float = 0.0  # the fraction of the vector we reduced in the last averaging
    reducing: int = 0  # averagings in which we reduced a part of the vector
    stream_senders: int = 0  # members that sent us a part over a libp2p stream (no direct path)
    averaging_seconds: float = 0.0
    averagings: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    elections: Counter[str] = field(default_factory=Counter)  # outcomes of our candidates'
    election_seconds: float = 0.0  # spent waiting for them
    steps_applied: int = 0
    downloads: int = 0
    compute_seconds: float = 0.0
    samples_computed: int = 0
    micro_batches: int = 0
    #: The trainer's monotonic clock when training began (no default: a default factory
    #: would read the real clock, not the one the trainer was given).
    started_at: float = field(kw_only=True)
    #: (monotonic time, compute_seconds) when the first step was applied: utilisation from
    #: there on leaves out start-up (measurements, the first gathering, any download).
    first_step: tuple[float, float] | None = None
    ended_at: float | None = None
    global_batches: deque[float] = field(default_factory=lambda: deque(maxlen=1024))
    recent_losses: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))
    recent_validation: deque[float] = field(default_factory=lambda: deque(maxlen=HISTORY))


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
        download_into: DownloadInto | None = None,
        batches: BatchSource | None = None,
        capabilities: Callable[[], Capabilities | None] = lambda: None,
        observe_training: Callable[[int, float], None] = lambda samples, seconds: None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        worker: TorchWorker | None = None,
        tracker: Tracker | None = None,
    ) -> None:
        """`worker`: the model and optimizers, built beforehand off the event loop (the
        daemon builds it in a thread); built here, on the calling thread, if not given.
        `clock`: wall time (deadlines shared with other peers); `monotonic`: durations here
        (step timings, the checkpoint interval, the stop's budget), injectable for tests.
        `download_into`: a catch-up downloads into our own tensors (`catchup`), not beside
        them (`download`)."""
        self.dht = dht
        self.averager = averager
        self.config = config
        self.training = config.training
        self.download = download
        self.download_into = download_into
        self.capabilities = capabilities
        self.observe_training = observe_training
        self.clock = clock
        self.monotonic = monotonic
        #: TensorBoard's scalars (`log.tensorboard_dir`), or nothing.
        self.tracker = tracker or Tracker()
        self.me = dht.node.peer_id.to_base58()
        self.worker = worker or TorchWorker(
            task, config, device=device, peer_id=self.me, batches=batches
        )
        self.policy = StepPolicy(me=self.me, config=config, vector_size=self.worker.vector_size)
        self.timing = self.policy.timing
        self.tally = Tally(started_at=monotonic())
        self._saving = False  # a periodic checkpoint is being written
        self._catching_up = False  # a download is under way: a periodic save gives way
        self._snapshot: Snapshot | None = None
        # Our candidate whose election stalled, and its average: the rounds of a retry may
        # still certify it (`_finish`).
        self._stalled: tuple[Candidate, np.ndarray] | None = None
        self._stop_began: float | None = None  # self.monotonic(), when we were told to stop
        self._serializing = trio.Lock()
        # A delayed averaging in flight (dedloc, delayed_updates) and its result when done.
        self._background: trio.Event | None = None
        self._background_result: tuple[np.ndarray, int, AveragingResult, float] | None = None
        self._background_scope = trio.CancelScope()
        self._validate_due = False
        self._foreign: ProgressRecord | None = None
        self._view_changed = trio.Event()
        # Peers whose records we read (direct addresses, the latest last): whom a `rejoin`
        # dials besides the backbones, when we see nobody.
        self._known: OrderedDict[str, list[str]] = OrderedDict()
        self.progress = ProgressPublisher(
            dht,
            config,
            record=self.record,
            on_read=self._observe,
            interval=self.training.progress_interval,
            longest_read_interval=self.timing.longest_read_interval,
            ttl=self.timing.progress_ttl,
            on_store_time=self.policy.note_store_time,
            on_read_time=self.policy.note_read_time,
            clock=clock,
        )
        self.finished = trio.Event()
        self._last_checkpoint = self.monotonic()
        self.checkpoint_dir: Path | None = state_folder(
            self.training.checkpoint_dir, config.collaboration.name, task.name
        )

    # ------------------------------------------------------------------ what others see

    @property
    def step(self) -> int:
        return self.policy.held.step

    @property
    def digest(self) -> str:
        return self.policy.held.digest

    def status(self) -> TrainerStatus:
        tally = self.tally
        return TrainerStatus(
            step=self.policy.held.step,
            phase=self.policy.phase.value,
            loss=tally.loss,
            samples_per_second=tally.samples_per_second,
            local_samples=self.worker.samples,
            view=self.policy.view,
            validation=tally.validation,
            last_step_seconds=tally.last_step_seconds,
            averaged_bytes=tally.averaged_bytes,
            averaging_seconds=tally.averaging_seconds,
            averagings=tally.averagings,
            failures=Counter(tally.failures),
            steps_applied=tally.steps_applied,
            downloads=tally.downloads,
            compute_seconds=tally.compute_seconds,
            samples_computed=tally.samples_computed,
            global_batches=tuple(tally.global_batches),
        )

    def local(self) -> Local:
        capabilities = self.capabilities()
        return Local(
            samples=self.worker.samples,
            samples_per_second=self.tally.samples_per_second,
            batch_seconds=self.tally.batch_seconds,
            averaging=self._background is not None,
            validation=self.tally.validation,
            bandwidth=(
                min(capabilities.upload_bps, capabilities.download_bps) if capabilities else None
            ),
            torn=self.worker.torn,
        )

    def record(self) -> ProgressRecord:
        tally = self.tally
        return msgspec.structs.replace(
            self.policy.own_record(self.local(), self.clock()),
            addrs=self.dht.node.public_addrs(),
            loss=tally.loss,
            recent_losses=list(tally.recent_losses),
            recent_validation=list(tally.recent_validation),
            step_bytes=tally.step_bytes,
            fingerprint=self.worker.fingerprint,
            task=self.worker.task_fingerprint.description,
            reduced=tally.reduced,
        )

    def view(self) -> CollaborationView:
        """The last read of the collaboration, with our own figures as they are now."""
        return self.policy.view_with(self.local(), self.clock())

    async def snapshot(self) -> Snapshot | None:
        """The state of our current step as bytes (serialized in the worker on first request
        after each step)."""
        async with self._serializing:
            if self._snapshot is None:
                snapshot = await self.worker.serialize()
                if snapshot is not None and snapshot.step == self.step:  # not replaced meanwhile
                    # A downloader counts the next step's votes among these (`steprule`).
                    members = self.policy.members_of_held()
                    self._snapshot = dataclasses.replace(snapshot, members=members)
            return self._snapshot

    async def _hold(
        self, step: int, *, digest: str | None = None, electorate: Electorate | None = None
    ) -> None:
        """Capture the state as of now as `step` (what donors serve and checkpoints hold) and
        sign it: we sign only what we hold (`peer.training.certificate`). `digest`: that of
        a state just restored, as checked when it was parsed. `electorate`: who votes on the
        next step (`StepPolicy.hold`)."""
        self._snapshot = None  # the state it reads goes now (a copy: before the next is made)
        if self._stalled is not None and self._stalled[0].step <= step:
            self._stalled = None  # that step is decided: its average is no longer a candidate
        digest = await self.worker.hold(step, digest=digest)
        self._snapshot = None  # one made meanwhile, of no state
        if digest is None:
            return  # we are stopping: the final checkpoint writes it, nobody signs it
        key = self.dht.node.identity.key_pair.private_key
        name = self.config.collaboration.name
        signature = sign_step(key, self.me, name, step, digest)
        self.policy.hold(step, digest, signature, electorate=electorate)
        self.progress.publish_now()

    # ------------------------------------------------------------------ progress

    def _observe(self, view: CollaborationView) -> None:
        self._foreign = view.foreign_task(self.worker.fingerprint)
        remember_contacts(self._known, view.records, self.me)
        self.policy.timing = self.policy.timing.reading_every(self.progress.read_interval)
        # Peers of another task never average with us and serve states we cannot load.
        self.policy.observe(view.training(self.worker.fingerprint), self.clock())
        self._view_changed.set()
        self._view_changed = trio.Event()

    def _refusal(self, theirs: ProgressRecord) -> str:
        ours = self.worker.task_fingerprint.description
        name = self.config.collaboration.name
        # A peer's words on our terminal: no control characters (escape sequences).
        task = "".join(c if c.isprintable() else "?" for c in theirs.task)
        return (
            f"collaboration {name!r} trains {task} (step {theirs.step}), this peer "
            f"{ours}: join with the collaboration's task, model and training.mode, or name "
            "another collaboration"
        )

    # ------------------------------------------------------------------ the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        await self.prepare()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._note_stop)
                await nursery.start(self.progress.run)
                nursery.start_soon(self._keep_in_touch)
                with trio.move_on_after(self.timing.first_read):
                    await self._view_changed.wait()  # the first read, to know if we are behind
                if self._foreign is not None:
                    raise ConfigError(self._refusal(self._foreign))
                self.policy.started()
                # Given backbones, a genesis waits for the notary's registration (one per step,
                # whatever the views): the one with the smallest peer id is every peer's.
                self.policy.notary = notary_of(p for p, _ in self.dht.seeds) is not None
                task_status.started()
                self.tally.started_at = self.monotonic()
                await self._train(nursery)
                if self._validate_due:  # the last step's evaluation, e.g. at max_steps
                    await self._validate()
                self._report()
                self.finished.set()
                nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                await self._checkpoint(force=True)

    async def _keep_in_touch(self) -> None:
        """Join the DHT again whenever the policy finds us out of touch (`out_of_touch`: no
        other participant in our reads for a while, or our averagings reading no ticket but
        ours): a survivor whose contacts died under its calls read only itself for minutes
        while the others trained on. The next read then shows where they are, and the
        policy catches up by download. Logged once per spell out of touch (a peer alone in
        its collaboration is out of touch for as long as it stays alone)."""
        spell = 0
        while True:
            await trio.sleep(self.training.progress_interval)
            now = self.clock()
            if any(r.peer_id != self.me for r in self.policy.view.records):
                spell = 0
            if not self.policy.out_of_touch(now):
                continue
            known = [
                (peer, addrs[0])
                for text, texts in reversed(self._known.items())
                if (addrs := direct_addrs(texts)) and (peer := _peer_id(text)) is not None
            ]
            reached: list[ID] = []
            with trio.move_on_after(2 * self.config.net.rpc_timeout):
                with contextlib.suppress(RemoteError):
                    reached = await self.dht.rejoin(known)
            spell += 1
            (log.info if spell == 1 else log.debug)(
                "no other peer in our reads: joined the DHT again (%d of the backbones, our "
                "contacts and %d peers whose records we read answered)",
                len(reached),
                len(known),
            )
            self.policy.rejoined(self.clock())
            self.progress.publish_now()

    async def _note_stop(self) -> None:
        """Note when we are told to stop: at once, while the training task may still wait for
        the torch thread's work in hand (a wait that comes out of the final save's time)."""
        try:
            await trio.sleep_forever()
        finally:
            self._stop_began = self.monotonic()
            self.worker.stopping.set()  # a digest in hand ends now

    async def _train(self, nursery: trio.Nursery) -> None:
        while True:
            if self._background_result is not None:
                await self._finish(*self._background_result)
                self._background = self._background_result = None
            if self._validate_due and self.policy.phase is not Phase.SETTLING:
                await self._validate()
            await self._checkpoint(nursery)
            settling = self.policy.phase is Phase.SETTLING
            action = self.policy.next_action(self.local(), self.clock())
            if self.policy.phase is Phase.SETTLING and not settling:
                self.tally.ended_at = self.monotonic()  # the last step (before settling)
                self._background_scope.cancel()  # a step we no longer take
                self._background = self._background_result = None
            if self.policy.take_changed():
                self.progress.publish_now()
            match action:
                case Compute():
                    await self._compute()
                case Call():
                    pass  # published above
                case Declare(gather_until, read_for):
                    await self._declare(gather_until, read_for, nursery)
                case CatchUp(donors, target, within):
                    await self._catch_up(donors, target, within=within)
                case Wait(seconds, for_averaging):
                    with trio.move_on_after(seconds):
                        if for_averaging and self._background is not None:
                            await self._background.wait()
                        else:
                            await self._view_changed.wait()
                case Stop(reason):
                    if reason:
                        log.info("%s", reason)
                    return

    async def _compute(self) -> None:
        done = await self.worker.compute()
        tally = self.tally
        tally.compute_seconds += done.seconds
        tally.samples_computed += done.samples
        tally.micro_batches += 1
        self.observe_training(done.samples, done.seconds)  # time-weighted: a blip counts little
        # The first micro-batch is torch's warm-up (8.7 ms against 0.2 ms for the tiny task,
        # far longer on a GPU). Published as our speed, it dealt a restarted peer no quota,
        # and so no micro-batch to measure again (`deal.REMEASURE_STEPS`): the rate starts
        # at the second. Its time stands for a micro-batch's until the second's replaces it
        # (an overestimate only makes us declare a little early).
        if tally.micro_batches <= 2:
            tally.batch_seconds = done.seconds
        else:
            tally.batch_seconds = ema(tally.batch_seconds, done.seconds, 0.2)
        if tally.micro_batches > 1:
            rate = done.samples / done.seconds if done.seconds > 0 else 0.0
            tally.samples_per_second = ema(tally.samples_per_second, rate, 0.2)
        if math.isfinite(done.loss):
            tally.loss = done.loss if tally.loss is None else ema(tally.loss, done.loss, 0.1)

    # ------------------------------------------------------------------ steps

    async def _declare(self, gather_until: float, read_for: float, nursery: trio.Nursery) -> None:
        """A fresh read (an earlier call may have come), then our contribution into the
        averaging if the policy still says so."""
        with trio.move_on_after(read_for), contextlib.suppress(RemoteError):
            await self.progress.read()
        background = self.training.delayed_updates and self.training.mode == "dedloc"
        if not self.policy.declare(gather_until, self.clock(), in_background=background):
            return
        self.progress.publish_now()
        # Queued before any later micro-batch, awaited while our ticket is stored: at 100 M
        # the copy of the gradients took longer than the margin before the close, and made
        # our ticket late (the first try of every step failed).
        samples, taking = await self.worker.start_take()

        async def taken() -> np.ndarray:
            vector, took = await taking.result()
            assert took == samples, (took, samples)  # nothing computes before the take
            return vector

        step = self.step
        if not background:
            result = await self._run_averaging(taken, samples, step, gather_until)
            vector, _ = await taking.result()
            await self._finish(vector, samples, result, gather_until)
            return
        done = self._background = trio.Event()
        self._background_scope = trio.CancelScope()

        async def in_background() -> None:
            try:
                with self._background_scope:
                    result = await self._run_averaging(taken, samples, step, gather_until)
                    vector, _ = await taking.result()
                    self._background_result = (vector, samples, result, gather_until)
            finally:
                done.set()

        nursery.start_soon(in_background)

    async def _run_averaging(
        self,
        vector: Callable[[], Awaitable[np.ndarray]],
        samples: int,
        step: int,
        gather_until: float,
    ) -> AveragingResult:
        started = self.monotonic()
        log.debug(
            "averaging toward step %d: %d samples, gathering until %.3f (in %.3fs)",
            step + 1,
            samples,
            gather_until,
            gather_until - self.clock(),
        )
        result = await self.averager.average(
            vector,
            weight=float(samples > 0) if self.policy.uniform else float(samples),
            # Unique per call, shared by everyone who answers it: a retried step never meets
            # the tickets of an earlier, failed attempt.
            epoch=int(gather_until * 1000),
            fingerprint=self.worker.fingerprint,
            gather_until=gather_until,
            size=self.worker.vector_size,
            capabilities=self.capabilities(),
        )
        tally = self.tally
        tally.last_step_seconds = self.monotonic() - started
        tally.averaging_seconds += tally.last_step_seconds
        tally.averagings += 1
        tally.step_bytes = sum(r.bytes_sent + r.bytes_received for r in result.rounds)
        if result.rounds:
            tally.reduced = result.rounds[-1].reduced
        tally.reducing += any(r.reduced > 0 for r in result.rounds)
        tally.stream_senders += sum(
            path == STREAM_PATH for r in result.rounds for path in r.sender_paths.values()
        )
        tally.averaged_bytes += tally.step_bytes
        return result

    async def _finish(
        self, vector: np.ndarray, samples: int, result: AveragingResult, gather_until: float
    ) -> None:
        """Apply the averaging's result if the policy says it is a step; else give our
        contribution back for the next try."""
        verdict = self.policy.averaged(result, samples, gather_until, self.clock())
        self.progress.publish_now()  # others wait for us to be done with this gathering
        if not verdict.step:
            await self.worker.give_back(vector, samples)
            if not verdict.reason:  # routine: e.g. peers that had just started or downloaded
                log.info("no sample in our group for step %d; joining the next", self.step + 1)
                return
            self.tally.failures["averaging_incomplete"] += 1
            log.log(
                logging.WARNING if verdict.warn else logging.INFO,
                "averaging for step %d did not complete (%s); keeping our %d samples for "
                "the next try (%d failed in a row)",
                self.step + 1,
                verdict.reason,
                samples,
                verdict.failed_in_a_row,
            )
            return
        if verdict.alone:
            await self.worker.apply(vector)
            await self._hold(self.step + 1, electorate=plan_of([self.me]))
            self._note_step(verdict, samples, result)
            return
        assert result.average is not None  # a candidate
        candidate = Candidate(
            self.step + 1,
            await self.worker.average_digest(result.average, result.weight),
            plan_of(result.plan),
        )
        outcome, certified = await self._elect(
            candidate, frozenset(result.plan), result.members, gather_until, result.ends_by
        )
        if outcome is Outcome.WON:
            await self.worker.apply(result.average)
            await self._hold(self.step + 1, electorate=candidate.plan)
            self._note_step(verdict, samples, result)
            return
        if outcome is Outcome.LOST and await self._apply_stalled(certified):
            return
        if outcome is Outcome.LOST:
            # Its basis holds our samples if ours had them (a larger average than ours, made
            # from the same rounds): given back, they would count twice. We download it.
            if certified is None:  # we cannot count this step's votes (`election`)
                log.info("step %d is counted by the peers we downloaded from", candidate.step)
            else:
                log.info(
                    "step %d went to another average than ours (%s, from %d peers): downloading it",
                    candidate.step,
                    certified.average[:12],
                    certified.plan.size,
                )
            return
        await self.worker.give_back(vector, samples)
        self._stalled = (candidate, result.average)
        log.info(
            "no average of step %d was certified (%s); keeping our %d samples for the next try",
            candidate.step,
            self.policy.stall_count,
            samples,
        )

    async def _apply_stalled(self, certified: Candidate | None) -> bool:
        """The step went to our candidate of an earlier try whose election had stalled for
        us: the rounds carry on across a step's tries, so a retry can still certify it (review:
        its holders had dropped it, and every peer tried to download what nobody held). We
        apply the average we kept; our samples since are in the retry's basis, which lost.
        Whether it was ours."""
        kept = self._stalled
        if certified is None or kept is None or kept[0] != certified:
            return False
        log.info("step %d went to our average of an earlier try: applying it", certified.step)
        await self.worker.apply(kept[1])
        await self._hold(certified.step, electorate=certified.plan)
        self.tally.steps_applied += 1
        return True

    async def _elect(
        self,
        candidate: Candidate,
        members: frozenset[str],
        basis: int,
        gather_until: float,
        ends_by: float,
    ) -> tuple[Outcome, Candidate | None]:
        """Vote where we may (for `candidate`, or the leader of its plan where ours is partial:
        `basis` of the plan's contributions) and wait for the step rule to certify one (our
        reads of the votes in the others' records): `election_patience` after our vote, and
        while members are still in the averaging (until its deadline `ends_by` at most)."""
        self.policy.elect(
            candidate,
            members,
            self.clock(),
            basis=basis,
            gathering=gather_until,
            others_until=ends_by,
        )
        self.progress.publish_now()
        started = self.monotonic()
        while True:
            outcome, certified = self.policy.election(self.clock())
            if self.policy.take_changed():  # a deferred vote was cast
                self.progress.publish_now()
            if outcome is not Outcome.WAITING:
                break
            claim = self.policy.claim_due(self.clock())
            if claim is not None:
                await self._claim_genesis(*claim)
                continue  # counted again with the notary's answer
            wait = min(self.training.progress_interval, self.policy.claim_at - self.clock())
            ballot = self.policy.ballot
            if ballot is not None and ballot.vote_at is not None:
                wait = min(wait, ballot.vote_at - self.clock())
            wait = max(0.0, wait)
            with trio.move_on_after(wait):
                await self._view_changed.wait()
        self.policy.elected(outcome)
        self.tally.elections[outcome.value] += 1
        self.tally.election_seconds += self.monotonic() - started
        return outcome, certified

    async def _claim_genesis(
        self, candidate: Candidate, members: frozenset[str], parent: str
    ) -> None:
        """Claim the genesis our view certified at the notary (`peer.training.notary`), and
        tell the policy its answer (none, where it is unreachable: asked again later)."""
        notary = notary_of(p for p, _ in self.dht.seeds)
        answer: Candidate | float | None = None
        if notary is not None:
            try:
                answer = await claim_genesis(
                    self.dht.node.rpc,
                    notary,
                    candidate,
                    parent,
                    members,
                    # The notary may read the progress records first (a DHT read or two).
                    timeout=3 * self.dht.rpc_timeout,
                )
            except RemoteError as error:
                log.info(
                    "the genesis notary refused or missed our claim of step %d: %s",
                    candidate.step,
                    error,
                )
        if isinstance(answer, Candidate):
            log.info(
                "the notary registered %s as the genesis of step %d%s",
                answer.average[:12],
                answer.step,
                "" if answer == candidate else f" (ours: {candidate.average[:12]})",
            )
        self.policy.notarized(answer, self.clock())

    def _note_step(self, verdict: Verdict, samples: int, result: AveragingResult) -> None:
        tally = self.tally
        if verdict.global_batch is not None:
            tally.global_batches.append(verdict.global_batch)
        tally.steps_applied += 1
        if tally.first_step is None:
            tally.first_step = (self.monotonic(), tally.compute_seconds)
        if tally.loss is not None:
            tally.recent_losses.append(tally.loss)
        batch = verdict.global_batch
        log.info(
            "step %d: %d peers, %d local samples %s, loss %.4f",
            self.step,
            verdict.members,
            samples,
            "(peers weighted equally)" if batch is None else f"of {batch:.0f}",
            tally.loss or math.nan,
            extra={
                "applied": {
                    "step": self.step,
                    "peers": verdict.members,
                    "samples": samples,
                    "global_batch": batch,
                    # Seconds: the all-reduce rounds alone, and the whole averaging call
                    # (gathering, matchmaking and rounds); bytes on the data plane.
                    "allreduce_s": round(sum(r.seconds for r in result.rounds), 3),
                    "averaging_s": (
                        None
                        if tally.last_step_seconds is None
                        else round(tally.last_step_seconds, 3)
                    ),
                    "bytes": sum(r.bytes_sent + r.bytes_received for r in result.rounds),
                }
            },
        )
        self.tracker.scalars(
            self.step,
            {
                "train/loss": tally.loss,
                "train/samples_per_s": tally.samples_per_second or None,
                "step/peers": verdict.members,
                "step/global_batch": batch,
                "step/allreduce_s": sum(r.seconds for r in result.rounds),
                "step/averaging_s": tally.last_step_seconds,
            },
        )
        interval = self.training.validation_interval
        self._validate_due = bool(interval) and self.step % interval == 0

    # ------------------------------------------------------------------ catching up

    async def _catch_up(
        self, donors: list[ProgressRecord], target: int, *, within: float | None = None
    ) -> None:
        """Download the state of `target` (within `within` seconds, if given), adopt it if
        it is certified, and tell the policy; after a failure, wait as it says."""
        self.progress.publish_now()  # our record says we are downloading
        problem = "cut short"
        phases: dict[str, float] = {}
        self._catching_up = True
        try:
            await self.worker.before_download()
            with trio.move_on_after(math.inf if within is None else within):
                problem = await self._download(donors, target, phases)
        finally:
            self._catching_up = False
        delay = self.policy.fetched(ok=not problem, now=self.clock())
        self.progress.publish_now()
        if not problem:
            self.tally.downloads += 1
            log.info(
                "downloaded the state of step %d from %d donors",
                self.step,
                len(donors),
                extra={
                    "catch_up": {"step": self.step} | {k: round(v, 3) for k, v in phases.items()}
                },
            )
            return
        self.tally.failures["state_download"] += 1
        log.warning("state download failed: %s; retrying in %.3gs", problem, delay)
        await trio.sleep(delay)

    async def _download(
        self, donors: list[ProgressRecord], target: int, phases: dict[str, float]
    ) -> str:
        """Fetch, check and load a certified state; what went wrong ("" if nothing). Seconds
        go into `phases`: the download and check, the load, and the total (the hold too)."""
        # Not older than we hold, unless we go back from a stranded step (`stranded`).
        lowest = target if target < self.step else max(target, self.step)
        started = self.monotonic()
        if self.download_into is not None:
            return await self._download_into(donors, target, lowest, phases)
        try:
            snapshot, state, digest = await fetch_certified(
                self.dht,
                self.download,
                donors,
                target,
                view=self.view,
                parse=self.worker.parse,
                lowest=lowest,
            )
            phases["fetch_and_check_s"] = self.monotonic() - started
            # Its tensors are about to be replaced: they go with our state, not after the hold.
            self._snapshot = None
            # A download's buffer is read no more once loaded: given back as it is (a fresh
            # 100 M joiner peaked with the optimizer state cloned beside the whole download).
            blob, snapshot_members = snapshot.blob, snapshot.members
            release = releaser(blob) if snapshot.disposable and isinstance(blob, bytes) else None
            del snapshot, blob
            await self.worker.restore(state, from_donor=True, release=release)
        except RemoteError as error:
            return str(error)
        phases["load_s"] = self.monotonic() - started - phases["fetch_and_check_s"]
        await self._hold_download(state.step, digest, snapshot_members)
        phases["total_s"] = self.monotonic() - started
        return ""

    async def _download_into(
        self, donors: list[ProgressRecord], target: int, lowest: int, phases: dict[str, float]
    ) -> str:
        """`_download`, straight into our own tensors (`catchup.InPlaceCatchUp`)."""
        assert self.download_into is not None
        started = self.monotonic()
        remember_donors(self.dht, donors)
        began = self.view()

        def certify(step: int, digest: str) -> None:
            check_certified(began, self.view(), step, digest, lowest=lowest, target=target)
            self._snapshot = None  # its tensors are about to be overwritten

        sink = InPlaceCatchUp(self.worker, certify)
        try:
            await self.download_into(donors, target, sink)
            phases["fetch_and_check_s"] = self.monotonic() - started
            step, digest = await sink.finish()
        except RemoteError as error:
            return f"{error}; {await self._mend()}" if self.worker.torn else str(error)
        phases["load_s"] = self.monotonic() - started - phases["fetch_and_check_s"]
        await self._hold_download(step, digest, sink.members)
        phases["total_s"] = self.monotonic() - started
        return ""

    async def _hold_download(self, step: int, digest: str, members: tuple[str, ...]) -> None:
        """Hold a downloaded state. Who votes on the next step is the plan its holders name
        (`steprule`); its members come from the donor, taken only if they make that plan: a
        peer that cannot count the votes loses its first step and downloads again."""
        electorate = self.policy.view.electorate(step, digest)
        await self._hold(step, digest=digest, electorate=electorate)
        self.policy.learn_members(members)

    async def _mend(self) -> str:
        """After a download into our tensors failed part-way (`TorchWorker.torn`): our latest
        checkpoint back, if there is one; what became of it."""
        torn = "our state was partly replaced"
        state = None
        if self.checkpoint_dir is not None:
            state = await self.worker.load_checkpoint(self.checkpoint_dir)
        if state is None:
            return f"{torn} and no checkpoint holds it: training waits for the next download"
        try:
            await self.worker.restore(state)
        except RemoteError as error:
            return f"{torn} and the checkpoint cannot be loaded ({error}): training waits"
        await self._hold(state.step)
        return f"{torn}: back to the checkpoint of step {state.step}"

    # ------------------------------------------------------------------ validation, checkpoints

    async def _validate(self) -> None:
        self._validate_due = False
        loss = await self.worker.validation_loss()
        self.tally.validation = (self.step, loss)
        if math.isfinite(loss):
            self.tally.recent_validation.append(loss)
        self.progress.publish_now()
        self.tracker.scalars(self.step, {"validation/loss": loss})
        log.info("step %d: validation loss %.4f", self.step, loss)

    async def _checkpoint(
        self, nursery: trio.Nursery | None = None, *, force: bool = False
    ) -> None:
        """A periodic checkpoint of the state we hold, written in the background (`nursery`);
        `force`: the final one, now (nothing is written if the state we hold is saved)."""
        if self.checkpoint_dir is None or self.step == 0:
            return
        if not force:
            due = self.monotonic() - self._last_checkpoint >= self.training.checkpoint_interval
            if due and not self._saving and nursery is not None:
                self._last_checkpoint = self.monotonic()
                self._saving = True
                # It gives way to a stop: a DiLoCo save that had waited for the torch thread's
                # copy of its inner optimizer, then wrote 1.6 GB, made a stop take 7-9 s; the
                # final save writes the newest state within the stop's budget instead.
                nursery.start_soon(partial(self._save, gives_way=self._save_gives_way))
            return
        # What is left of the stop's budget: waiting for the torch thread's work in hand (a
        # micro-batch, a digest: 1-2 s at 100 M on a busy machine) came out of it.
        began = self._stop_began
        spent = 0.0 if began is None else self.monotonic() - began
        await self._save(within=max(0.0, min(FINAL_SAVE_SECONDS, FINAL_SAVE_BY - spent)))

    def _save_gives_way(self) -> bool:
        """A periodic save gives way to a stop, and to a catch-up (the state it writes is
        behind, and it held the tensors a download into them must wait for: past the donors'
        ticket lifetime, and the download failed with our state torn)."""
        return self.worker.stopping.is_set() or self._catching_up

    async def _save(
        self, *, within: float = math.inf, gives_way: Callable[[], bool] = lambda: False
    ) -> None:
        assert self.checkpoint_dir is not None
        try:
            await self.worker.save_checkpoint(
                self.checkpoint_dir, within=within, gives_way=gives_way
            )
        finally:
            self._saving = False

    async def prepare(self) -> None:
        """Load our latest checkpoint, or take the task's initial state (step 0)."""
        state = None
        if self.checkpoint_dir is not None:
            state = await self.worker.load_checkpoint(self.checkpoint_dir)
        if state is not None:
            try:
                await self.worker.restore(state)
                await self._hold(state.step)
                log.info("resumed from the checkpoint of step %d", self.step)
                return
            except RemoteError as error:
                log.warning("ignoring checkpoint in %s: %s", self.checkpoint_dir, error)
        await self._hold(0)

    # ------------------------------------------------------------------ the end

    def utilisation(self, *, after_first_step: bool = False) -> float:
        """Share of wall time spent computing micro-batches, since training began or since
        the first step was applied, until training ended."""
        tally = self.tally
        since, computed = tally.started_at, 0.0
        if after_first_step:
            if tally.first_step is None:
                return 0.0
            since, computed = tally.first_step
        wall = (tally.ended_at or self.monotonic()) - since
        return (tally.compute_seconds - computed) / wall if wall > 0 else 0.0

    def _report(self) -> None:
        tally = self.tally
        figures = {
            "step": self.step,
            "steps_applied": tally.steps_applied,
            "samples": tally.samples_computed,
            "compute_s": round(tally.compute_seconds, 3),
            "wall_s": round((tally.ended_at or self.monotonic()) - tally.started_at, 3),
            "utilisation": round(self.utilisation(), 4),
            "utilisation_after_first_step": round(self.utilisation(after_first_step=True), 4),
            "averaged_bytes": tally.averaged_bytes,
            # averagings it reduced a part in, and parts it took over libp2p streams
            "reducing": tally.reducing,
            "stream_senders": tally.stream_senders,
            "downloads": tally.downloads,
            # (step, loss) of the latest evaluation on this peer, or None
            "validation": tally.validation,
        }
        log.info(
            "training finished at step %d: utilisation %.1f%%, %d bytes averaged",
            self.step,
            100 * figures["utilisation"],
            tally.averaged_bytes,
            extra={"training": figures},
        )


#: Seconds the checkpoint written on the way out may take: a stop has 2.5 s of grace
#: (`cli.common.run_until_signal`) and systemd's TimeoutStopSec SIGKILLs a slow one. A save cut
#: short leaves the last periodic checkpoint (and the collaboration holds the newer state).
FINAL_SAVE_SECONDS = 1.5
#: ...and it ends this many seconds after the stop began at the latest (the time spent waiting
#: for the torch thread's work in hand counts): the rest of the grace is the daemon's teardown.
FINAL_SAVE_BY = 2.0


def ema(average: float, value: float, weight: float) -> float:
    """A moving average that starts at the first value (0 or None: none yet)."""
    return value if not average else (1 - weight) * average + weight * value


def _peer_id(text: str) -> ID | None:
    """A record's peer id (checked when its record was decoded), or None."""
    try:
        return ID.from_base58(text)
    except ValueError:
        return None
