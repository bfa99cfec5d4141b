"""The worker a training loop of the user's own feeds (`peertrain.Optimizer`).

`LoopTask` presents the user's model and optimizer to the engine as a `Task`: what it builds,
steps and fingerprints; it has no data, since the loop brings its own. `LoopWorker` is the
daemon's `TorchWorker` with two differences: its torch work runs in the loop's thread at the
loop's next `step()` (`Rendezvous`), and its micro-batches are the loop's: `compute()` returns
once the loop has stepped, with the samples it stepped over.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import trio
from torch import nn

from peer.config import PeerConfig
from peer.embed.rendezvous import Rendezvous
from peer.errors import ConfigError
from peer.training.strategies import LargeBatch, LocalSGD, unscaled_finite
from peer.training.worker import Computed, Pending, TorchWorker

#: Builds the learning-rate scheduler of an optimizer (again after a state download).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]


class LoopTask:
    """The user's model and optimizer, named `name` (peers that train together give the same
    name, model and optimizer type: `layout.task_fingerprint`)."""

    def __init__(
        self,
        name: str,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: SchedulerFactory | None = None,
    ) -> None:
        self.name = name
        self.model = model
        self.optimizer = optimizer
        if scheduler is not None:  # `Schedule` asks whether the task has one
            self.make_scheduler = scheduler

    def build_model(self) -> nn.Module:
        return self.model

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The user's optimizer, which must hold exactly `parameters` (the model's trainable
        ones: what the collaborative step averages)."""
        ours = {id(p) for group in self.optimizer.param_groups for p in group["params"]}
        wanted = [p for p in parameters]
        if ours != {id(p) for p in wanted}:
            raise ConfigError(
                f"the optimizer holds {len(ours)} tensors, the model {len(wanted)} trainable "
                "parameters: build the optimizer from model.parameters()"
            )
        return self.optimizer

    def sample_batch(self, micro_batch: int, generator: torch.Generator) -> Any:
        raise RuntimeError("a training loop of its own brings its data")

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        raise RuntimeError("a training loop of its own computes its loss")

    def validation_batches(self, micro_batch: int, count: int) -> list[Any]:
        return []


class Pacer:
    """The loop's micro-batches, paced as the daemon's worker thread is: the engine asks for
    one (`compute`), the loop computes it and steps, and its next micro-batch waits for the
    next ask. Without it a fast loop ran on while the peers averaged: 84-247 inner steps per
    DiLoCo outer step of 4, global batches of 1,552-2,560 against a target of 128."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self.asked = 0
        """Micro-batches the engine asked for."""
        self.delivered = 0
        """Steps the loop took."""
        self.closed = False
        self._samples = 0
        self._seconds = 0.0
        self._losses: list[float] = []
        self._released = time.perf_counter()

    # the engine's side (a worker thread)
    def compute(self) -> Computed:
        """Ask for a micro-batch; once the loop has stepped: its samples, mean loss and
        seconds of computing (0 samples if the loop has ended)."""
        with self._changed:
            self.asked += 1
            self._changed.notify_all()
            while self.delivered < self.asked and not self.closed:
                self._changed.wait()
            losses, self._losses = self._losses, []
            done = Computed(
                self._samples,
                sum(losses) / len(losses) if losses else math.nan,
                self._seconds,
            )
            self._samples, self._seconds = 0, 0.0
            return done

    # the loop's side
    def step(self, samples: int, loss: float | None, *, computed_at: float) -> None:
        """The loop stepped: `samples` computed by `computed_at` (perf_counter; its step's
        own work for the engine is not the loop's compute time)."""
        with self._changed:
            self.delivered += 1
            self._samples += samples
            self._seconds += max(0.0, computed_at - self._released)
            if loss is not None and math.isfinite(loss):
                self._losses.append(loss)
            self._changed.notify_all()

    def may_compute(self) -> bool:
        """Whether the engine wants the loop's next micro-batch (or has ended); if so, its
        time starts now."""
        with self._changed:
            if self.closed or self.asked > self.delivered:
                self._released = time.perf_counter()
                return True
            return False

    def wait(self, timeout: float) -> None:
        with self._changed:
            self._changed.wait(timeout)

    def wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()


#: How often a loop that waits for its turn checks for the engine's work (it is woken at once
#: when work is queued or a micro-batch asked for).
SERVE_INTERVAL = 0.05


class LoopWorker(TorchWorker):
    def __init__(
        self,
        task: LoopTask,
        config: PeerConfig,
        *,
        device: torch.device,
        peer_id: str,
        rendezvous: Rendezvous,
    ) -> None:
        super().__init__(
            task, config, device=device, peer_id=peer_id, executor=rendezvous, own_loop=True
        )
        self.rendezvous = rendezvous
        self.pacer = Pacer()
        rendezvous.on_submit = self.pacer.wake

    async def compute(self) -> Computed:
        # Only a wait (nothing of the model's): a cancelled one is left to end by itself.
        return await trio.to_thread.run_sync(self.pacer.compute, abandon_on_cancel=True)

    async def start_take(self) -> tuple[int, Pending[tuple[Any, int]]]:
        # Between two of the loop's steps, so that no samples are added between the count
        # and the take (which runs first thing in the loop's next step).
        lock = self.rendezvous.step_lock
        await trio.to_thread.run_sync(lock.acquire)
        try:
            return self.samples, self.take_soon()
        finally:
            lock.release()

    def serve(self) -> None:
        """Run the engine's work queued so far (the loop's thread)."""
        with self.rendezvous.step_lock:
            self.rendezvous.run_pending()

    def wait_turn(self, *, until: Callable[[], bool] = lambda: False) -> None:
        """Until the engine asks for the loop's next micro-batch (or ends, or `until()`),
        serving its work on the model meanwhile (the loop's thread)."""
        while not self.pacer.may_compute() and not until():
            self.serve()
            self.pacer.wait(SERVE_INTERVAL)
        self.serve()

    def step(
        self, samples: int, loss: float | None, *, scaler: torch.amp.GradScaler | None = None
    ) -> None:
        """The loop's step (its thread): the engine's work queued since the last one, then the
        gradient the loop left in .grad as `samples` samples of local work; returns when the
        engine wants the next micro-batch."""
        computed_at = time.perf_counter()
        with self.rendezvous.step_lock:
            strategy = self.strategy
            # The engine's work uses .grad (a step is applied through it): the loop's gradient
            # waits aside meanwhile, or the step would consume it.
            grads = [p.grad for p in strategy.params]
            for p in strategy.params:
                p.grad = None
            loads = self.loads
            self.rendezvous.run_pending()
            if self.torn or self.loads != loads:
                # Computed on a state we no longer hold (or hold only in part): dropped.
                samples = 0
            else:
                for p, grad in zip(strategy.params, grads, strict=True):
                    p.grad = grad
                if isinstance(strategy, LargeBatch):
                    if scaler is not None and not unscaled_finite(scaler, strategy.optimizer):
                        samples = 0  # overflowed: nothing of it counts (the scaler backs off)
                    else:
                        strategy.add_gradients(samples)
                    if scaler is not None:
                        scaler.update()
                else:  # DiLoCo: an inner step (a donor serves the anchor, not these)
                    assert isinstance(strategy, LocalSGD)
                    strategy.inner_step(samples, scaler=scaler)
            self.model.zero_grad(set_to_none=True)
        self.pacer.step(samples, loss, computed_at=computed_at)
        self.wait_turn()


__all__ = ["LoopTask", "LoopWorker", "Pacer", "SchedulerFactory"]
