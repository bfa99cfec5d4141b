"""The model, its optimizers and every torch operation on them, behind one worker thread.

`TorchWorker` owns the model and the collaborative optimizer (`Strategy`); its public methods
are coroutines that run the work in a thread of its own (one operation at a time: they mutate
the same tensors), at a lower scheduling priority than the event loop (`priority.NICENESS`).
Some run elsewhere: `parse` reads only a downloaded blob and `serialize` only takes views of
the held state; `restore`, and a DiLoCo checkpoint's write of the inner optimizer, run in a
thread at the loop's priority while the torch thread is held still, so still one at a time
(a checkpoint lets it go once those tensors are written). The trainer holds no tensor, so
no torch work can land on the trio event loop by mistake: an optimizer step, a state capture
and digest of a 1 B-parameter model takes seconds, and yamux resets a stream whose reader
stalls 5 s.

A call that is cancelled still finishes its work in the thread (trio abandons no thread that
mutates the model), so the state is never left half-stepped; once the peer is stopping, a
micro-batch in hand ends at its next layer instead (`_cut_short_on`), adding nothing.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, ParamSpec, Protocol, TypeVar

import numpy as np
import torch
import trio

from peer.config import PeerConfig
from peer.heap import return_free_memory
from peer.priority import lower_priority
from peer.training import checkpoint as checkpoints
from peer.training import state as states
from peer.training.layout import averaged_buffers, layout, task_fingerprint
from peer.training.precision import Precision
from peer.training.statesync.wire import Snapshot
from peer.training.steprule import average_digest
from peer.training.strategies import LargeBatch, LocalSGD, Strategy
from peer.training.task import Task

#: Told each loaded tensor's (address, size): `heap.releaser`.
Releaser = Callable[[int, int], None]

log = logging.getLogger("peertrain.trainer")

#: One micro-batch: (batch, samples in it). The default draws from the task.
BatchSource = Callable[[], tuple[Any, int]]

P = ParamSpec("P")
R = TypeVar("R")


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


class WorkerFactory(Protocol):
    """What builds a peer's worker (`TorchWorker` itself, or `peer.embed`'s)."""

    def __call__(
        self, task: Task, config: PeerConfig, *, device: torch.device, peer_id: str
    ) -> TorchWorker: ...


@dataclass(frozen=True, eq=False)
class Held:
    state: states.TrainingState
    digest: str | None
    """None: the stop came before it was digested (the final checkpoint still writes it)."""
    live: bool
    """The state's tensors are the model's and optimizer's own (valid until the next change)."""
    pieces: Mapping[str, Sequence[bytes]] = field(default_factory=dict)
    """The digest's hashes of the certified tensors' pieces (`states.Certified`), if it took
    them: a donor serves those chunks without hashing them again."""


@dataclass(frozen=True)
class Pending(Generic[R]):
    """Work queued on the torch thread, to be awaited (as often as wanted)."""

    future: Future[R]

    async def result(self) -> R:
        # Waits without using CPU; a cancelled caller still waits for the end (trio abandons
        # no thread that mutates the model).
        return await trio.to_thread.run_sync(self.future.result)


@dataclass(frozen=True)
class Computed:
    samples: int
    loss: float
    seconds: float


#: The longest a checkpoint holds training still to write DiLoCo's inner optimizer as it is.
HOLD_SECONDS = 10.0


class _CutShort(Exception):
    """A micro-batch ended at a layer because the peer is stopping."""


def _cut_short_on(model: torch.nn.Module, cut: Callable[[], bool]) -> None:
    """Make the model's forward (before each module) and backward (at each parameter's
    gradient) raise `_CutShort` once `cut()`. A stop waited for the micro-batch in hand: 1-3 s
    at 100 M beside three training peers, out of the 3 s a stop may take (one stop took 3.8 s).
    Measured cost: within the noise for a GPT of 50 modules, +0.01 ms on the tiny task's
    0.12 ms micro-batch."""

    def check(*_: object) -> None:
        if cut():
            raise _CutShort

    for module in model.modules():
        module.register_forward_pre_hook(check)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.register_hook(check)  # returns None: the gradient as it is


def _ignore(name: str) -> None:
    pass


def _never() -> bool:
    return False


def _waited(done: threading.Event, cancelled: Callable[[], bool]) -> bool:
    """Wait (in a thread, never the event loop's) until `done` is set; False if `cancelled()`
    came first (asked every 20 ms)."""
    while not done.wait(0.02):
        if cancelled():
            return False
    return True


class TorchWorker:
    def __init__(
        self,
        task: Task,
        config: PeerConfig,
        *,
        device: torch.device,
        peer_id: str,
        batches: BatchSource | None = None,
        executor: Executor | None = None,
        own_loop: bool = False,
    ) -> None:
        """`executor`: where torch work runs (default: a thread of its own). `own_loop`: a
        training loop of the user's own computes (`peer.embed`): no micro-batch is ours to
        cut short, and DeDLOC keeps its gradient sums out of .grad."""
        training = config.training
        self.task = task
        self.device = device
        self.micro_batch = config.task.micro_batch
        self.validation_count = training.validation_batches
        model = task.build_model().to(device)
        # Not for the trainer: tests, and this worker's own thread, touch these.
        self.model = model
        shared = layout(model, average_buffers=training.average_buffers)
        numerics: dict[str, Any] = {
            "buffers": [b for _, b in averaged_buffers(model)] if training.average_buffers else [],
            "precision": Precision(training.precision, device),
            "clip_grad_norm": training.clip_grad_norm,
        }
        self.strategy: Strategy = (
            LocalSGD(
                task,
                model,
                outer_lr=training.outer_lr,
                momentum=training.outer_momentum,
                inner_steps=training.inner_steps,
                **numerics,
            )
            if training.mode == "diloco"
            else LargeBatch(
                task, model, delayed=training.delayed_updates, own_sums=own_loop, **numerics
            )
        )
        #: Model tensors a step certifies: the parameters and the averaged buffers.
        self.certified_names = shared.certified
        self.vector_size = shared.vector_size
        self.task_fingerprint = task_fingerprint(
            task, model, mode=training.mode, average_buffers=training.average_buffers
        )
        #: The averaging fingerprint: peers training anything else never meet us.
        self.fingerprint = self.task_fingerprint.digest
        samples = task_batches(task, self.micro_batch, data_seed(training.seed, peer_id))
        self.next_batch: BatchSource = batches or (lambda: next(samples))
        self._validation_batches: list[Any] | None = None
        # One thread of its own for all torch work (the operations share tensors), run at a
        # lower priority than the event loop's (`NICENESS`).
        self._thread: Executor = executor or ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="peertrain-torch", initializer=lower_priority
        )
        self._writer = trio.CapacityLimiter(1)  # checkpoints, one at a time
        #: The state of the step we hold (None: none yet, or stepping past it).
        self.held: Held | None = None
        # The last state written, weakly: a live one's tensors must not outlive it (a restore
        # replaces the optimizer's tensors; kept here, the old ones were 0.8 GB at 100 M).
        self._saved: weakref.ref[Held] | None = None
        #: A DiLoCo checkpoint copies the inner optimizer first (a disk too slow: `_completed`).
        self._copy_lacking = False
        # Taken by whatever changes a live held state and by the checkpoint writer reading it.
        self._state_lock = threading.Lock()
        #: Set when the peer is told to stop: a hold's digest then ends early (`_hold`), and
        #: so does a micro-batch (`_compute`).
        self.stopping = threading.Event()
        self._computing = False  # written by the torch thread alone
        #: A download into our own tensors began and did not finish: they hold parts of two
        #: states, nothing to train, serve or save (`take_in_place`).
        self.torn = False
        #: States loaded so far (restored or downloaded): a gradient computed before one
        #: belongs to no state we hold (`peer.embed`).
        self.loads = 0
        if not own_loop:
            _cut_short_on(model, lambda: self._computing and self.stopping.is_set())

    @property
    def samples(self) -> int:
        """Samples of local work not yet taken (an int the strategy keeps)."""
        return self.strategy.samples

    async def _run(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        return await Pending(self._thread.submit(fn, *args, **kwargs)).result()

    # ---------------------------------------------------------------- local work and steps

    def _compute(self) -> Computed:
        batch, size = self.next_batch()
        started = time.perf_counter()
        self._computing = True
        try:
            loss = self.strategy.accumulate(to_device(batch, self.device), size)
        except _CutShort:
            # DeDLOC's sums are partly added to: nobody's sum (a stop drops local work anyway).
            # A backward cut short leaves part of a gradient in .grad (DeDLOC with fp16; DiLoCo
            # clears its own), a model's worth of memory; neither moved any parameter.
            if isinstance(self.strategy, LargeBatch):
                self.strategy.drop_local_work()
            self.model.zero_grad(set_to_none=True)
            return Computed(0, math.nan, time.perf_counter() - started)
        finally:
            self._computing = False
        return Computed(size, loss, time.perf_counter() - started)

    async def compute(self) -> Computed:
        """One micro-batch: drawn, moved to the device and accumulated. Once `stopping`, one
        under way ends at its next layer, adding nothing (0 samples)."""
        return await self._run(self._compute)

    async def take(self) -> tuple[np.ndarray, int]:
        return await self.take_soon().result()

    async def start_take(self) -> tuple[int, Pending[tuple[np.ndarray, int]]]:
        """The samples of local work a take now will hand over, and that take, queued (`take_soon`)."""
        return self.samples, self.take_soon()

    def take_soon(self) -> Pending[tuple[np.ndarray, int]]:
        """Queue the take now (before any micro-batch asked for later), to be awaited later:
        a trainer declares its ticket while its gradients are copied out."""
        return Pending(self._thread.submit(self._take))

    def _take(self) -> tuple[np.ndarray, int]:
        taken = self.strategy.take()
        return_free_memory()  # the gradients just freed: the averaging's copies come next
        return taken

    async def give_back(self, vector: np.ndarray, samples: int) -> None:
        await self._run(self.strategy.give_back, vector, samples)

    async def average_digest(self, average: np.ndarray, weight: float) -> str:
        """A candidate's digest (`steprule.average_digest`), in our thread: 0.08 s at 100 M."""
        return await self._run(average_digest, average, weight)

    def _apply(self, average: np.ndarray) -> None:
        with self._changing():
            self.strategy.apply(average)

    async def apply(self, average: np.ndarray) -> None:
        await self._run(self._apply, average)

    # ---------------------------------------------------------------- states

    def certify(
        self,
        state: states.TrainingState,
        *,
        cancelled: Callable[[], bool] = lambda: False,
        known: Callable[[str, int], bytes | None] = lambda name, index: None,
    ) -> states.Certified:
        """What a step certifies of `state` (thread: it hashes every certified tensor not
        `known`; see `states.state_digest`)."""
        return states.state_digest(
            state, self.certified_names, self.strategy.shared, cancelled=cancelled, known=known
        )

    def _hold(self, step: int, digest: str | None) -> str | None:
        # The held state is the live tensors where they stay put until the next change
        # (`_changing`): DeDLOC moves parameters and optimizer state only in apply(); DiLoCo's
        # inner steps move the parameters and the inner optimizer, so it holds its anchor
        # (the parameters as of the outer step) and outer optimizer, and leaves the inner one,
        # each peer's own, to checkpoints (`_save`). Otherwise (GPU tensors, or parameters
        # not in float32 beside a DiLoCo anchor): a copy. A copy of 1.6 GB per DiLoCo step at
        # 100 M put its peers at 3.6x the state.
        strategy, optimizers = self.strategy, self.strategy.optimizers()
        anchored = strategy.anchored_parameters() if isinstance(strategy, LocalSGD) else None
        diloco_live = anchored is not None  # its inner optimizer stays out (each peer's own)
        live = self.device.type == "cpu" and (isinstance(strategy, LargeBatch) or diloco_live)
        if live and diloco_live:
            optimizers = {name: optimizers[name] for name in strategy.shared}
        if not live:
            # The copy we held goes before the new one is made: both at once were 3.2 GB at
            # 100 M in DiLoCo (a download in flight from it is told to ask again).
            with self._state_lock:
                self.held = None
        state = states.capture(
            step,
            self.model,
            optimizers,
            scheduler_state=strategy.schedule.state(),
            copy=not live,
            parameters=anchored if live else None,
        )
        pieces: Mapping[str, Sequence[bytes]] = {}
        if digest is None:
            # 1.2 s at 100 M, more on a busy machine: a stop does not wait for it.
            with contextlib.suppress(states.DigestCancelled):
                certified = self.certify(state, cancelled=self.stopping.is_set)
                digest, pieces = certified.digest, certified.pieces
        held = Held(state, digest, live, pieces)
        with self._state_lock:
            self.held = held
        return held.digest

    async def hold(self, step: int, *, digest: str | None = None) -> str | None:
        """Hold the state as of now as `step` (what donors serve and checkpoints write); its
        digest (None if `stopping` came first). `digest`: that of the state just restored
        (`restore`), computed when it was parsed: restoring copies its certified tensors
        exactly, and another pass over a state of 1.2 GB took 1.2 s (3 s or more on a busy
        machine) of a late joiner's wait."""
        return await self._run(self._hold, step, digest)

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Around a change of the parameters or optimizer state: a live held state ends here
        (after a checkpoint being written from it is done)."""
        with self._state_lock:
            if self.held is not None and self.held.live:
                self.held = None
            yield

    def _restore(
        self, state: states.TrainingState, from_donor: bool, release: Releaser | None
    ) -> None:
        with self._torch_thread_still(), self._changing():
            self._load(state, from_donor, release)
            self.torn = False  # a whole state, wherever from

    def _load(
        self, state: states.TrainingState, from_donor: bool, release: Releaser | None
    ) -> None:
        strategy = self.strategy
        self.loads += 1
        if from_donor:
            optimizers = {name: strategy.optimizers()[name] for name in strategy.shared}
            states.restore(state, self.model, optimizers, from_donor=True, release=release)
            strategy.schedule.replay(strategy.schedule_epochs(state.step))
        else:
            strategy.schedule.check(state.scheduler_state)  # before anything changes
            states.restore(state, self.model, strategy.optimizers())
            strategy.schedule.load(state.scheduler_state)
        strategy.drop_local_work()

    def _take_in_place(
        self,
        state: states.TrainingState,
        early: Mapping[int, tuple[int, memoryview]],
        spans: Mapping[str, tuple[int, int]],
    ) -> dict[str, torch.Tensor]:
        with self._torch_thread_still():
            strategy = self.strategy
            optimizers = {name: strategy.optimizers()[name] for name in strategy.shared}
            receivers = states.receivers(state, self.model, optimizers)  # checks: may raise
            ours = {t.data_ptr() for t in self.model.state_dict().values() if t.numel()}
            ours |= {
                value.data_ptr()
                for optimizer in optimizers.values()
                for values in optimizer.state.values()
                for value in values.values()
                if isinstance(value, torch.Tensor) and value.numel()
            }
            if any(r.numel() and r.data_ptr() in ours for r in receivers.values()):
                with self._changing():  # no donor or checkpoint reads the state we held now
                    self.torn = True
                strategy.drop_local_work()  # a torn state has no local work to offer
            states.fill(receivers, spans, early)  # no later chunk writes these bytes
            return receivers

    async def take_in_place(
        self,
        state: states.TrainingState,
        early: Mapping[int, tuple[int, memoryview]],
        spans: Mapping[str, tuple[int, int]],
    ) -> dict[str, torch.Tensor]:
        """Where a download of a donor's `state` (shapes and dtypes: `states.parse_header`) is
        received (`states.receivers`), with the bytes of its tensors that came `early` (chunk
        -> (where it starts, bytes); `spans`: where the blob keeps each tensor) copied in: on
        a CPU, our own tensors, so from here on the state we held is given up (`torn` until a
        state is loaded); on a GPU, new CPU tensors, and our state stays whole. StateMismatch,
        with nothing changed, if it does not fit our model."""
        return await trio.to_thread.run_sync(self._take_in_place, state, early, spans)

    def _finish_in_place(
        self, state: states.TrainingState, receivers: dict[str, torch.Tensor]
    ) -> None:
        with self._torch_thread_still():
            received = states.TrainingState(state.step, receivers, state.metadata)
            # The tensors are ours: loading them keeps them where they are (no release).
            with self._changing():  # (GPU: the copy we held until now)
                self._load(received, from_donor=True, release=lambda address, size: None)
            self.torn = False

    async def finish_in_place(
        self, state: states.TrainingState, receivers: dict[str, torch.Tensor]
    ) -> None:
        """Load a state received into `receivers` (`take_in_place`). StateMismatch (a
        certified state with NaN in it, say) leaves the state `torn`."""
        await trio.to_thread.run_sync(self._finish_in_place, state, receivers)

    def _before_download(self) -> None:
        if isinstance(self.strategy, LargeBatch):
            self.strategy.drop_local_work()  # not the state we hold: that stays servable
        return_free_memory()

    async def before_download(self) -> None:
        """Make room for a state download (its bytes, then the state they hold): a DeDLOC
        peer's gradient sums are for a step the collaboration has passed (a restore drops
        them anyway), so they go now, and freed memory goes back to the system. A DiLoCo
        peer keeps its inner steps until a download replaces them."""
        await self._run(self._before_download)

    async def restore(
        self,
        state: states.TrainingState,
        *,
        from_donor: bool = False,
        release: Releaser | None = None,
    ) -> None:
        """Load a state: our checkpoint, or (`from_donor`) a downloaded one, of which only the
        certified part is taken (`states.restore`): the learning-rate schedule is replayed
        from our own task, and diloco's inner optimizer stays ours. Local work is dropped.
        In a thread at the event loop's priority, the torch thread held still meanwhile: a
        peer catching up has nothing else to do, and at the torch thread's nice +10 beside
        three training peers a 100 M joiner's load took 6 s. `release`: the download's buffer
        that `state` is a view of, given back as it is loaded (`states.restore`)."""
        await trio.to_thread.run_sync(self._restore, state, from_donor, release)

    def _parse(self, snapshot: Snapshot) -> tuple[states.TrainingState, str]:
        state, layout = states.parse_blob(bytes(snapshot.blob))
        if state.step != snapshot.step:  # the step certified is the manifest's
            raise states.StateMismatch(f"a state of step {state.step} offered as {snapshot.step}")
        return state, self.certify(state, known=layout.known(snapshot.hashes)).digest

    async def parse(self, snapshot: Snapshot) -> tuple[states.TrainingState, str]:
        """A downloaded state, and its digest (StateMismatch if it is no state): the pieces
        its chunks' checks hashed are not hashed again. In a thread of its own, not the torch
        thread: it reads only the blob, and so runs at the event loop's priority, as the
        download did, not behind the training peers' torch threads at `NICENESS` (a late
        joiner has nothing else to do meanwhile)."""
        return await trio.to_thread.run_sync(self._parse, snapshot)

    def _serialize(self) -> Snapshot | None:
        held = self.held
        if held is None:
            return None
        # Valid while we hold it: live tensors change at the next step, and a copy is let go
        # then (`_hold`).
        blob = states.StateBytes(held.state, lambda: self.held is held)
        hashes = blob.layout.piece_hashes(held.pieces)
        return Snapshot(held.state.step, blob, parts=blob.layout.parts, hashes=hashes)

    async def serialize(self) -> Snapshot | None:
        """The held state as bytes read from its tensors when sliced (no blob), valid while we
        hold it; None if we hold none (between an apply and its hold). Not on the torch
        thread: it only takes views of the held tensors, and there a donor's answer to a
        late joiner waited behind a training step (seconds at 100 M beside three peers)."""
        return await trio.to_thread.run_sync(self._serialize)

    def _save(
        self, directory: Path, late: Callable[[], bool], gives_way: Callable[[], bool]
    ) -> int | None:
        def cancelled() -> bool:
            return late() or gives_way()

        held = self.held
        if held is None or (self._saved is not None and held is self._saved()):
            return None
        # A live state stays as it is while we write it: apply() waits for the lock.
        with (
            self._completed(held.state, cancelled) as (state, written, too_slow),
            self._state_lock if held.live else contextlib.nullcontext(),
        ):
            if held is not self.held:
                return None  # stepped meanwhile: the next save writes the new step
            try:
                if state is None:
                    raise states.WriteCancelled("cut short before the torch thread was free")
                checkpoints.save_checkpoint(
                    directory,
                    state,
                    cancelled=lambda: cancelled() or too_slow(),
                    written=written,
                )
            except states.WriteCancelled as error:
                if gives_way():
                    log.info("the checkpoint of step %d gave way (%s)", held.state.step, error)
                else:
                    log.warning(
                        "the checkpoint of step %d was not written in time (%s); the previous "
                        "one stands",
                        held.state.step,
                        error,
                    )
                return None
        self._saved = weakref.ref(held)
        return held.state.step

    @contextlib.contextmanager
    def _completed(
        self, state: states.TrainingState, cancelled: Callable[[], bool]
    ) -> Iterator[tuple[states.TrainingState | None, Callable[[str], None], Callable[[], bool]]]:
        """`state` with the optimizers it lacks, as they are now (DiLoCo's inner one: each
        peer's own, moved by every inner step, so not held), for a checkpoint; what the writer
        calls as each tensor is written; and when the write must stop. None if `cancelled()`
        came first. The torch thread is held still (once its inner step in hand is done)
        until the lacking optimizer's tensors are written, which come first in the file (a
        float32 optimizer's "inner." sorts before "model." and "outer."): no copy of them
        (0.8 GB at 100 M, made while training went on, put DiLoCo peers at 2.35-2.53x the
        state), for a pause of the time it takes to write them. A disk
        that takes over HOLD_SECONDS for them lets training go on, gives that save up, and
        later saves copy them first instead. Its moments are a few inner steps past the held
        step (they are running averages; the schedule is the held step's)."""
        optimizers = self.strategy.optimizers()
        lacking = {n: o for n, o in optimizers.items() if n not in state.metadata["optimizers"]}
        if not lacking:
            yield state, _ignore, _never
            return
        if self._copy_lacking and not self.stopping.is_set():
            done = threading.Event()
            copied = self._thread.submit(states.with_optimizers, state, lacking)
            copied.add_done_callback(lambda _: done.set())
            if _waited(done, cancelled):
                yield copied.result(), _ignore, _never
            else:
                copied.cancel()  # not started yet: the torch thread need not copy for nobody
                yield None, _ignore, _never
            return
        go_on, expired = threading.Event(), threading.Event()
        limit = math.inf if self.stopping.is_set() else HOLD_SECONDS  # a stop has its deadline
        with self._torch_thread_still(cancelled, go_on, limit=limit, expired=expired) as ready:
            if not ready:
                yield None, _ignore, _never
                return
            completed = states.with_optimizers(state, lacking, copy=False)
            unwritten = set(completed.tensors) - set(state.tensors)

            def written(name: str) -> None:
                unwritten.discard(name)
                if not unwritten:
                    go_on.set()  # training goes on while the held state is written

            def too_slow() -> bool:
                if not expired.is_set():
                    return False
                if not self._copy_lacking:
                    self._copy_lacking = True
                    log.warning(
                        "writing the inner optimizer held training still for %.0f s: this "
                        "checkpoint is given up, and later ones copy it first (more memory "
                        "while they are written); a faster disk for training.checkpoint_dir "
                        "avoids both",
                        HOLD_SECONDS,
                    )
                return True

            yield completed, written, too_slow

    @contextlib.contextmanager
    def _torch_thread_still(
        self,
        cancelled: Callable[[], bool] = lambda: False,
        go_on: threading.Event | None = None,
        *,
        limit: float = math.inf,
        expired: threading.Event | None = None,
    ) -> Iterator[bool]:
        """Hold the torch thread still (once its work in hand is done) for the block, which
        may then do torch work in the calling thread: still one operation at a time. True once
        it is still; False if `cancelled()` came first. Setting `go_on` lets it go before the
        block ends (the block then touches its tensors no more). After `limit` seconds still
        it goes on by itself, having set `expired` first (the block must then stop touching
        its tensors)."""
        still, go_on = threading.Event(), go_on or threading.Event()

        def hold_still() -> None:
            still.set()
            if not go_on.wait(None if math.isinf(limit) else limit) and expired is not None:
                expired.set()

        self._thread.submit(hold_still)
        try:
            yield _waited(still, cancelled)
        finally:
            go_on.set()

    async def save_checkpoint(
        self,
        directory: Path,
        *,
        within: float = math.inf,
        gives_way: Callable[[], bool] = lambda: False,
    ) -> int | None:
        """Write the held state to a checkpoint in a thread of its own, beside the training
        thread: training goes on while it is written (DeDLOC: a step that completes meanwhile
        waits for the end of the write to apply). Given up after `within` seconds, or once
        `gives_way()` (a periodic save at a stop); the old checkpoints stand. The step saved;
        None if nothing new was saved."""
        late = threading.Event()
        if within <= 0:  # no time at all: a deadline task could lose the race to the thread
            late.set()
        async with trio.open_nursery() as nursery:

            async def deadline() -> None:
                await trio.sleep(within)
                late.set()

            if math.isfinite(within):
                nursery.start_soon(deadline)
            saved = await trio.to_thread.run_sync(
                self._save, directory, late.is_set, gives_way, limiter=self._writer
            )
            nursery.cancel_scope.cancel()
        return saved

    async def load_checkpoint(self, directory: Path) -> states.TrainingState | None:
        """Our latest checkpoint in `directory` (None: none usable)."""
        return await self._run(checkpoints.load_latest, directory)

    # ---------------------------------------------------------------- validation

    def _validation_loss(self) -> float:
        """Mean loss over held-out batches (the model as of the current step)."""
        if self._validation_batches is None:
            self._validation_batches = self.task.validation_batches(
                self.micro_batch, self.validation_count
            )
        model = self.model
        model.eval()
        try:
            with torch.no_grad():
                losses = [
                    float(self.task.loss(model, to_device(b, self.device)))
                    for b in self._validation_batches
                ]
        finally:
            model.train()
        return sum(losses) / len(losses)

    async def validation_loss(self) -> float:
        return await self._run(self._validation_loss)
