"""`peertrain.Optimizer`: collaborative training from a training loop of one's own.

    model = Net()
    opt = peertrain.Optimizer(model, torch.optim.AdamW(model.parameters()),
                              backbones=["/ip4/.../tcp/.../p2p/..."], target_batch=4096)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step(batch_size=len(x), loss=loss)
        opt.zero_grad()
    opt.shutdown()

It wraps the user's optimizer as hivemind.Optimizer does. DeDLOC (`mode="dedloc"`): each
`step()` adds the loop's gradient to this peer's share of the collaboration's global batch of
`target_batch` samples; once the peers together have it, the averaged gradient is applied by
the user's optimizer, the same step on every peer. DiLoCo (`mode="diloco"`): each `step()` is
an inner step of the user's optimizer; every `inner_steps` of them the peers average their
progress and take an outer Nesterov step. Everything else is `peer join`'s: state download
on joining late, checkpoints, status records and metrics (`config`, dotted keys as in the
config file).
"""

from __future__ import annotations

import logging
import math
import os
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from peer.config import load_config
from peer.embed.engine import Engine
from peer.embed.worker import LoopTask, SchedulerFactory
from peer.errors import ConfigError
from peer.training.tracking import user_metrics

log = logging.getLogger("peertrain.optimizer")


class Optimizer:
    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        backbones: Sequence[str],
        mode: str = "dedloc",
        target_batch: int = 4096,
        batch_size: int = 32,
        inner_steps: int | None = None,
        name: str | None = None,
        collaboration: str | None = None,
        network_key: str | None = None,
        scheduler: SchedulerFactory | None = None,
        config: Mapping[str, Any] | None = None,
        startup_timeout: float = 300.0,
    ) -> None:
        """Join the collaboration whose backbones are `backbones` and return once this peer
        can train (after a state download if the collaboration is ahead).

        `model` and `optimizer` are the loop's own; every peer gives the same `name` (default:
        the model's class), model and optimizer type. `batch_size`: the samples of a typical
        `step()` (the engine's unit of work). `scheduler(optimizer)`: a learning-rate scheduler,
        stepped once per collaborative step. Raises a `peer.errors.PeertrainError` whose
        one-line message says what to do (a wrong setting, no backbone answering)."""
        if not isinstance(model, nn.Module):
            raise ConfigError("peertrain.Optimizer(model, ...): model must be a torch.nn.Module")
        if isinstance(backbones, str):
            backbones = [backbones]
        name = name or f"{type(model).__module__}.{type(model).__qualname__}"
        overrides: dict[str, Any] = {
            "collaboration.backbones": list(backbones),
            "collaboration.name": collaboration,
            "collaboration.network_key": network_key,
            "task.name": name,
            "task.target_batch": target_batch,
            "task.micro_batch": batch_size,
            "training.mode": mode,
            "training.inner_steps": inner_steps,
            "training.validation_interval": 0,  # the loop validates, on its own data
            **(config or {}),
        }
        self.config = load_config(env=os.environ, overrides=overrides).config
        training = self.config.training
        if training.precision != "fp32":  # the loop runs its own forward: autocast is its own
            raise ConfigError(
                f"training.precision = {training.precision!r} is the daemon's own autocast; "
                "with peertrain.Optimizer use torch.autocast in your loop and leave it fp32 "
                "(and pass your GradScaler to opt.step(grad_scaler=...))"
            )
        if training.validation_interval:
            raise ConfigError(
                "training.validation_interval: the engine has no validation data of a loop "
                "of its own; validate in your loop and leave it 0"
            )
        if training.delayed_updates:
            raise ConfigError(
                "training.delayed_updates is not supported with peertrain.Optimizer yet"
            )
        first = next(iter(model.parameters()), None)
        if first is None:
            raise ConfigError("peertrain.Optimizer: the model has no parameters to train")
        self.model = model
        self.optimizer = optimizer
        self._batch_size = batch_size
        task = LoopTask(name, model, optimizer, scheduler)
        self._engine = Engine(self.config, task, first.device)
        # Dropped without shutdown() (a notebook cell run again), it still leaves cleanly.
        self._finalizer = weakref.finalize(self, self._engine.stop)
        try:
            self._engine.start(startup_timeout)
        except BaseException:  # Ctrl+C while joining too: leave, and say why
            self._finalizer()
            raise

    @property
    def global_step(self) -> int:
        """The collaboration's step this peer holds (each one a global batch applied)."""
        trainer = self._engine.trainer
        return trainer.step if trainer is not None else 0

    def step(
        self,
        batch_size: int | None = None,
        loss: float | torch.Tensor | None = None,
        *,
        grad_scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        """After `loss.backward()`: this micro-batch's gradient (of its mean loss over
        `batch_size` samples) joins the collaboration's batch (DeDLOC), or takes an inner
        step (DiLoCo); the engine's work on the model since the last step runs first (a step
        applied, a state loaded). Returns when the engine wants the next micro-batch: while
        the peers average (our share of the batch is in) it waits, as `peer join` does.
        `loss` (optional) feeds the status and logs. `grad_scaler`: the AMP scaler the loop's
        backward used (`grad_scaler.scale(loss).backward()`): the gradient is unscaled before
        it counts, a micro-batch whose gradient overflowed adds nothing, and the scaler is
        updated (DiLoCo: the scaler steps the inner optimizer)."""
        self._engine.check()
        samples = self._batch_size if batch_size is None else int(batch_size)
        if samples < 1:
            raise ValueError(f"batch_size must be at least 1, not {batch_size!r}")
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(
                    f"loss must be one number, not a tensor of shape {tuple(loss.shape)}"
                )
            value: float | None = float(loss.detach())
        else:
            value = None if loss is None else float(loss)
        worker = self._engine.worker
        assert worker is not None  # built before `start` returned
        worker.step(
            samples, value if value is None or math.isfinite(value) else None, scaler=grad_scaler
        )

    def log(self, metrics: Mapping[str, Any], *, step: int | None = None) -> None:
        """Record metrics of your own (an accuracy, a learning rate) at the collaboration's
        step (or `step`): as TensorBoard scalars `user/<name>` (`log.tensorboard_dir`) and in
        the log (`user_metrics` in JSON). ValueError on a value that is not a finite number."""
        values = user_metrics(metrics)
        at = self.global_step if step is None else int(step)
        trainer = self._engine.trainer
        if trainer is not None:
            trainer.tracker.scalars(at, values)
        named = {name.removeprefix("user/"): value for name, value in values.items()}
        log.info(
            "metrics at step %d: %s",
            at,
            ", ".join(f"{name} {value:.6g}" for name, value in named.items()),
            extra={"user_metrics": {"step": at, "values": named}},
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none=set_to_none)

    @property
    def finished(self) -> bool:
        """The collaboration's training is done (`training.max_steps` or the target reached):
        `step()` raises from now on."""
        return self._engine.finished

    def shutdown(self) -> None:
        """Leave the collaboration: the final checkpoint is written, records withdrawn."""
        self._finalizer()

    def __enter__(self) -> Optimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["Optimizer"]
