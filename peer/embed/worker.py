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
from peer.training.strategies import LargeBatch, LocalSGD
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


class _Steps:
    """The loop's steps since the engine last asked (`LoopWorker.compute`)."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._samples = 0
        self._losses: list[float] = []
        self._since = time.perf_counter()
        self.closed = False

    def add(self, samples: int, loss: float | None) -> None:
        with self._changed:
            self._samples += samples
            if loss is not None and math.isfinite(loss):
                self._losses.append(loss)
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self.closed = True
            self._changed.notify_all()

    def wait(self) -> Computed:
        """Once the loop has stepped: its samples, mean loss and seconds since the last call
        (0 samples if it has ended)."""
        with self._changed:
            while not self._samples and not self.closed:
                self._changed.wait()
            now = time.perf_counter()
            losses, self._losses = self._losses, []
            done = Computed(
                self._samples,
                sum(losses) / len(losses) if losses else math.nan,
                now - self._since,
            )
            self._samples, self._since = 0, now
            return done


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
        self.steps = _Steps()

    async def compute(self) -> Computed:
        # Only a wait (nothing of the model's): a cancelled one is left to end by itself.
        return await trio.to_thread.run_sync(self.steps.wait, abandon_on_cancel=True)

    async def start_take(self) -> tuple[int, Pending[tuple[Any, int]]]:
        # Between two of the loop's steps, so that no samples are added between the count
        # and the take (which runs first thing in the loop's next step).
        lock = self.rendezvous.step_lock
        await trio.to_thread.run_sync(lock.acquire)
        try:
            return self.samples, self.take_soon()
        finally:
            lock.release()

    def step(self, samples: int, loss: float | None) -> None:
        """The loop's step (its thread): the engine's work queued since the last one, then the
        gradient the loop left in .grad as `samples` samples of local work."""
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
                    strategy.add_gradients(samples)
                else:  # DiLoCo: an inner step (a donor serves the anchor, not these)
                    assert isinstance(strategy, LocalSGD)
                    strategy.inner_step(samples)
            self.model.zero_grad(set_to_none=True)
        self.steps.add(samples, loss)


__all__ = ["LoopTask", "LoopWorker", "SchedulerFactory"]
