"""The two collaborative optimizers as local numerics, with no network.

Both turn local work into one flat float32 vector to average, and apply the average:

    strategy.accumulate(batch)            one micro-batch of local work
    vector, samples = strategy.take()     what this peer contributes to the next step
    strategy.apply(average)               the identical step every peer takes
    strategy.give_back(vector, samples)   the averaging failed: keep the work for the next try

`LargeBatch` (DeDLOC): gradients of the sum of per-sample losses accumulate over micro-batches;
the contribution is their mean, so the samples-weighted average of all peers' contributions is
the gradient of the mean loss over the whole global batch, exactly what one big machine computes.

`LocalSGD` (DiLoCo): every micro-batch is an inner AdamW step on the local copy; the contribution
is the pseudo-gradient (parameters at the last outer step minus local parameters), and the outer
Nesterov SGD step moves the shared parameters, which then replace the local copy.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from peer.training.schedule import Schedule
from peer.training.task import Task


def _flat(tensors: list[torch.Tensor]) -> np.ndarray:
    return torch.cat([t.detach().reshape(-1).float().cpu() for t in tensors]).numpy()


def _tensor(values: np.ndarray, *, like: torch.Tensor) -> torch.Tensor:
    """A slice of an averaged vector as a tensor shaped, typed and placed like `like`."""
    return torch.from_numpy(values.copy()).view_as(like).to(device=like.device, dtype=like.dtype)


def _pieces(
    vector: np.ndarray, like: list[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its slice of the flat vector as a tensor like it), in order."""
    offset = 0
    for tensor in like:
        n = tensor.numel()
        yield tensor, _tensor(vector[offset : offset + n], like=tensor)
        offset += n


class Strategy(Protocol):
    model: nn.Module
    samples: int
    """Samples of local work not yet taken."""
    schedule: Schedule
    """The task's learning-rate scheduler (if any): LargeBatch steps it in `apply` (once per
    global step), LocalSGD in `accumulate` (once per inner step)."""

    shared: tuple[str, ...]
    """Names of the optimizers every member of an averaging holds bit-identical."""

    def optimizers(self) -> dict[str, torch.optim.Optimizer]: ...
    def schedule_epochs(self, step: int) -> int: ...
    def accumulate(self, batch: Any, size: int) -> float: ...
    def take(self) -> tuple[np.ndarray, int]: ...
    def give_back(self, vector: np.ndarray, samples: int) -> None: ...
    def apply(self, average: np.ndarray) -> None: ...
    def drop_local_work(self) -> None: ...


class LargeBatch:
    """DeDLOC: synchronous large-batch training; every peer applies the same averaged gradient."""

    #: Optimizers every member of an averaging holds bit-identical (what a step certifies).
    shared = ("optimizer",)

    def __init__(self, task: Task, model: nn.Module) -> None:
        self.task = task
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = task.make_optimizer(self.params)
        self.schedule = Schedule(task, self.optimizer)
        # Accumulators apart from p.grad, so a delayed step can use p.grad meanwhile.
        self.sums = [torch.zeros_like(p) for p in self.params]
        self.samples = 0

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    def schedule_epochs(self, step: int) -> int:
        """Scheduler steps by global `step`: one per step."""
        return step

    def accumulate(self, batch: Any, size: int) -> float:
        """Add the gradient of this micro-batch's summed loss; return its mean loss."""
        loss = self.task.loss(self.model, batch)
        grads = torch.autograd.grad(loss * size, self.params)
        with torch.no_grad():
            for total, grad in zip(self.sums, grads, strict=True):
                total.add_(grad)
        self.samples += size
        return float(loss.detach())

    def take(self) -> tuple[np.ndarray, int]:
        """The mean gradient of the local samples (zeros if none), and their count."""
        samples, self.samples = self.samples, 0
        vector = _flat(self.sums) / max(samples, 1)
        for total in self.sums:
            total.zero_()
        return vector.astype(np.float32, copy=False), samples

    def give_back(self, vector: np.ndarray, samples: int) -> None:
        with torch.no_grad():
            for total, part in _pieces(vector, self.sums):
                total.add_(part * samples)
        self.samples += samples

    def apply(self, average: np.ndarray) -> None:
        """One optimizer step with `average` as the gradient of every parameter."""
        for p, grad in _pieces(average, self.params):
            p.grad = grad
        self.optimizer.step()
        self.schedule.step()
        for p in self.params:
            p.grad = None

    def drop_local_work(self) -> None:
        for total in self.sums:
            total.zero_()
        self.samples = 0


class LocalSGD:
    """DiLoCo: inner AdamW steps locally, outer Nesterov SGD on the averaged pseudo-gradient."""

    #: The outer optimizer is shared; the inner one's moments are each peer's own.
    shared = ("outer",)

    def __init__(
        self, task: Task, model: nn.Module, *, outer_lr: float, momentum: float, inner_steps: int
    ) -> None:
        self.task = task
        self.inner_steps = inner_steps
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.inner = task.make_optimizer(self.params)
        # The inner learning rate, stepped with every inner step (as in the DiLoCo paper):
        # every peer takes exactly H of them per outer step, so all hold the same schedule.
        self.schedule = Schedule(task, self.inner)
        # The shared parameters as of the last outer step; the outer optimizer moves these.
        self.anchor = [p.detach().clone() for p in self.params]
        # Nesterov needs momentum; outer_momentum = 0 is plain averaging (lr 1) or SGD on it.
        self.outer = torch.optim.SGD(
            self.anchor, lr=outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.samples = 0

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"inner": self.inner, "outer": self.outer}

    def schedule_epochs(self, step: int) -> int:
        """Scheduler steps by global `step`: every peer takes exactly H inner steps a step."""
        return step * self.inner_steps

    def accumulate(self, batch: Any, size: int) -> float:
        """One inner step on this micro-batch; return its loss."""
        loss = self.task.loss(self.model, batch)
        self.inner.zero_grad(set_to_none=True)
        loss.backward()
        self.inner.step()
        self.schedule.step()
        self.samples += size
        return float(loss.detach())

    def take(self) -> tuple[np.ndarray, int]:
        """The pseudo-gradient (anchor - local) and the inner samples behind it. The local work
        stays in place until `apply` (a failed averaging simply continues from it)."""
        pseudo = [a - p.detach() for a, p in zip(self.anchor, self.params, strict=True)]
        return _flat(pseudo).astype(np.float32, copy=False), self.samples

    def give_back(self, vector: np.ndarray, samples: int) -> None:
        pass  # take() left everything in place

    def apply(self, average: np.ndarray) -> None:
        for a, grad in _pieces(average, self.anchor):
            a.grad = grad
        self.outer.step()
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.grad = None
                p.copy_(a)
        self.samples = 0

    def drop_local_work(self) -> None:
        """Back to the shared parameters (after a state download replaced them)."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)
        self.samples = 0


#: By `training.mode`: what a step certifies besides the parameters (the keeper has no strategy).
SHARED_OPTIMIZERS = {"dedloc": LargeBatch.shared, "diloco": LocalSGD.shared}
