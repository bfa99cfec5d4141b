"""HuggingFace `Trainer` with `peertrain.Optimizer`: the Trainer's own loop, collaborative.

    opt = peertrain.Optimizer(model, torch.optim.AdamW(model.parameters()), backbones=[...],
                              batch_size=args.per_device_train_batch_size
                              * args.gradient_accumulation_steps)
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      **peertrain.huggingface.trainer_kwargs(opt, max_global_steps=1000))
    trainer.train()

The Trainer (through accelerate) steps what `trainer_kwargs` hands it as its optimizer: each
of its optimizer steps is one `opt.step()` over `batch_size` samples (the micro-batches it
accumulated). Its learning-rate scheduler is a constant one: the collaboration's schedule is
`peertrain.Optimizer(scheduler=...)`, stepped once per global step on every peer alike. The
callback stops training at `max_global_steps` collaborative steps (or when the collaboration's
training is done), records the Trainer's logged figures with `opt.log`, and leaves the
collaboration at the end.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from transformers import TrainerCallback

from peer.embed.optimizer import Optimizer

log = logging.getLogger("peertrain.huggingface")


class TrainerOptimizer:
    """`opt` as the Trainer and accelerate step an optimizer (they also read and set its state
    and parameter groups: the user's optimizer's own)."""

    def __init__(self, opt: Optimizer) -> None:
        self.opt = opt
        self.inner = opt.optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> Any:
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.inner.load_state_dict(state_dict)

    def add_param_group(self, group: dict[str, Any]) -> None:
        raise ValueError("peertrain.Optimizer averages the parameters it was made with; no more")

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.opt.step(loss=loss)


class ConstantSchedule:
    """The Trainer's own learning-rate scheduler, held still: the collaboration's schedule is
    stepped by the engine at each global step (`peertrain.Optimizer(scheduler=...)`), not at
    each of this peer's micro-batches."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def step(self, *args: Any, **kwargs: Any) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class PeertrainCallback(TrainerCallback):
    def __init__(self, opt: Optimizer, *, max_global_steps: int = 0, shutdown: bool = True):
        self.opt = opt
        self.max_global_steps = max_global_steps
        self.shutdown = shutdown

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if getattr(args, "fp16", False):
            # accelerate's GradScaler only steps an optimizer it wraps, and ours is not one:
            # the gradient would join the collaboration still scaled.
            raise ValueError(
                "peertrain.huggingface: fp16 is not supported through the Trainer yet; use "
                "bf16=True (no scaler) or fp32"
            )
        if getattr(args, "max_grad_norm", 0):
            log.warning(
                "max_grad_norm = %s clips this peer's own gradient, not the averaged one: set "
                "max_grad_norm=0 and training.clip_grad_norm in the Optimizer's config",
                args.max_grad_norm,
            )
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        done = self.max_global_steps and self.opt.global_step >= self.max_global_steps
        if done or self.opt.finished:
            control.should_training_stop = True
        return control

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> Any:
        figures = {
            f"hf/{k}": v
            for k, v in (logs or {}).items()
            if isinstance(v, int | float) and math.isfinite(v)
        }
        if figures:
            self.opt.log(figures)
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self.shutdown:
            self.opt.shutdown()
        return control


def trainer_kwargs(
    opt: Optimizer, *, max_global_steps: int = 0, shutdown: bool = True
) -> dict[str, Any]:
    """`Trainer(...)` keyword arguments that make its training collaborative through `opt`:
    `optimizers` (ours, and a constant scheduler) and `callbacks`."""
    constant = ConstantSchedule(opt.optimizer)
    callback = PeertrainCallback(opt, max_global_steps=max_global_steps, shutdown=shutdown)
    return {"optimizers": (TrainerOptimizer(opt), constant), "callbacks": [callback]}


__all__ = ["ConstantSchedule", "PeertrainCallback", "TrainerOptimizer", "trainer_kwargs"]
