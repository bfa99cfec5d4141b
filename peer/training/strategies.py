"""The two collaborative optimizers as local numerics, with no network.

Both turn local work into one flat float32 vector to average (the gradient part, then the
values of the averaged buffers, `layout.py`), and apply the average:

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

Gradients accumulate and pseudo-gradients are taken in float32 whatever the parameters' dtype;
`training.clip_grad_norm` clips the averaged (pseudo-)gradient, which every peer holds
bit-identical, so every peer clips it by the same factor.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from peer.training.precision import Precision
from peer.training.schedule import Schedule
from peer.training.task import Task

#: Elements per block of the clipping norm's sum (bounds its float64 temporary).
_NORM_BLOCK = 1 << 20


def _host(count: int, device: torch.device) -> torch.Tensor:
    """A float32 host buffer, pinned where it exchanges with a GPU: copies to and from pinned
    memory run asynchronously (`non_blocking`), from pageable memory they block."""
    return torch.empty(count, dtype=torch.float32, pin_memory=device.type == "cuda")


def _flat_into(tensors: Iterable[torch.Tensor], out: torch.Tensor) -> None:
    """Copy `tensors` one after another into the float32 host buffer `out` (no whole-model
    temporary; from a GPU, non-blocking copies, waited for once at the end)."""
    offset, cuda = 0, False
    for tensor in tensors:
        n = tensor.numel()
        out[offset : offset + n].copy_(tensor.detach().reshape(-1), non_blocking=True)  # casts
        offset += n
        cuda = cuda or tensor.is_cuda
    assert offset == len(out), (offset, len(out))
    if cuda:
        torch.cuda.synchronize()  # the host reads `out` next


def _tensor(values: np.ndarray, *, like: torch.Tensor) -> torch.Tensor:
    """A slice of an averaged vector as a tensor shaped, typed and placed like `like`."""
    if not like.is_cuda:
        # A view where numpy lets us write (the optimizers read gradients, never write them):
        # a copy of every gradient at once cost another model's worth of memory per step.
        own = values if values.flags.writeable else values.copy()
        return torch.from_numpy(own).view_as(like).to(dtype=like.dtype)
    staging = _host(len(values), like.device)  # torch's caching host allocator reuses these
    staging.numpy()[:] = values
    return staging.view_as(like).to(device=like.device, dtype=like.dtype, non_blocking=True)


def _pieces(
    vector: np.ndarray, like: Sequence[torch.Tensor]
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """(tensor, its slice of the flat vector as a tensor like it), in order."""
    offset = 0
    for tensor in like:
        n = tensor.numel()
        yield tensor, _tensor(vector[offset : offset + n], like=tensor)
        offset += n


def _numel(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() for t in tensors)


def load_buffers(values: np.ndarray, buffers: Sequence[torch.Tensor]) -> None:
    """Set `buffers` to their averaged `values` (integer buffers rounded: every peer holds the
    same float32 average, so every peer rounds it the same way)."""
    with torch.no_grad():
        offset = 0
        for buffer in buffers:
            n = buffer.numel()
            part = torch.from_numpy(values[offset : offset + n]).view(buffer.shape)
            if not buffer.is_floating_point():
                part = part.round()
            buffer.copy_(part)  # casts to the buffer's dtype and device
            offset += n


def clip_by_norm(gradient: np.ndarray, max_norm: float) -> np.ndarray:
    """`gradient` scaled to an L2 norm of at most `max_norm` (as `clip_grad_norm_` does), a new
    array if scaled. The norm is summed in float64, block by block in a fixed order, from the
    averaged bits every peer holds, so every peer scales by the same factor."""
    squares = 0.0
    for start in range(0, len(gradient), _NORM_BLOCK):
        block = gradient[start : start + _NORM_BLOCK]
        squares += float(np.square(block, dtype=np.float64).sum())
    norm = math.sqrt(squares)
    if not norm > max_norm:  # also a NaN norm: the finite checks upstream own that case
        return gradient
    return (gradient * np.float32(max_norm / (norm + 1e-6))).astype(np.float32, copy=False)


def unscaled_finite(scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer) -> bool:
    """Unscale the gradients in .grad of `optimizer`'s parameters (AMP), unless the training
    loop already did (to clip them, say); whether all are finite (one device sync)."""
    try:
        scaler.unscale_(optimizer)
    except RuntimeError as error:
        if "unscale_() has already been called" not in str(error):
            raise
    flags = [
        torch.isfinite(p.grad).all()
        for group in optimizer.param_groups
        for p in group["params"]
        if p.grad is not None
    ]
    if not flags:
        return True
    return bool(torch.stack([flag.to(flags[0].device) for flag in flags]).all())


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


class Shared:
    """What both strategies do alike: the vector's layout (the gradient part, then the averaged
    buffers' values), precision, and clipping of the averaged gradient."""

    def __init__(
        self,
        model: nn.Module,
        *,
        buffers: Sequence[torch.Tensor],
        precision: Precision | None,
        clip_grad_norm: float,
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.buffers = list(buffers)
        self.precision = precision or Precision("fp32", torch.device("cpu"))
        self.clip_grad_norm = clip_grad_norm
        self.gradient_size = _numel(self.params)
        self.vector_size = self.gradient_size + _numel(self.buffers)

    def vector(self, gradient: Iterable[torch.Tensor], samples: int) -> np.ndarray:
        """The flat float32 vector: `gradient` divided by `samples` (if > 1), then the buffers."""
        host = _host(
            self.vector_size, self.params[0].device if self.params else torch.device("cpu")
        )
        _flat_into(gradient, host[: self.gradient_size])
        _flat_into(self.buffers, host[self.gradient_size :])
        vector = host.numpy()
        if samples > 1:
            vector[: self.gradient_size] /= samples
        return vector

    def gradient(self, average: np.ndarray) -> np.ndarray:
        """The averaged gradient part of `average`, clipped if `training.clip_grad_norm`."""
        gradient = average[: self.gradient_size]
        return clip_by_norm(gradient, self.clip_grad_norm) if self.clip_grad_norm else gradient

    def load_buffers(self, average: np.ndarray) -> None:
        load_buffers(average[self.gradient_size :], self.buffers)


class LargeBatch(Shared):
    """DeDLOC: synchronous large-batch training; every peer applies the same averaged gradient."""

    #: Optimizers every member of an averaging holds bit-identical (what a step certifies).
    shared = ("optimizer",)

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        *,
        buffers: Sequence[torch.Tensor] = (),
        precision: Precision | None = None,
        clip_grad_norm: float = 0.0,
        delayed: bool = False,
        own_sums: bool = False,
    ) -> None:
        super().__init__(
            model,
            buffers=buffers,
            precision=precision,
            clip_grad_norm=clip_grad_norm,
        )
        self.task = task
        self.optimizer = task.make_optimizer(self.params)
        self.schedule = Schedule(task, self.optimizer)
        # Where the gradient sums live: in .grad, where backward() adds each micro-batch's
        # gradient in place, freed once taken; or in float32 accumulators of their own (a
        # model's worth of memory more, and autograd.grad's outputs beside them) where .grad
        # cannot serve: a delayed step uses it while we accumulate the next one, bf16 sums of
        # many micro-batches lose the small ones, fp16 unscales .grad micro-batch by micro-batch.
        # `own_sums`: a training loop of the user's own backpropagates into .grad between our
        # calls (`add_gradients`), so the sums cannot live there.
        self.in_grad = (
            not delayed
            and not own_sums
            and self.precision.scaler is None
            and all(p.dtype == torch.float32 for p in self.params)
        )
        self.sums = (
            [] if self.in_grad else [torch.zeros_like(p, dtype=torch.float32) for p in self.params]
        )
        self.samples = 0

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"optimizer": self.optimizer}

    def schedule_epochs(self, step: int) -> int:
        """Scheduler steps by global `step`: one per step."""
        return step

    def accumulate(self, batch: Any, size: int) -> float:
        """Add the gradient of this micro-batch's summed loss; return its mean loss. With fp16,
        a micro-batch whose gradients overflow adds nothing (its samples do not count)."""
        with self.precision.autocast():
            loss = self.task.loss(self.model, batch)
        if self.in_grad:
            (loss * size).backward()
            self.samples += size
            return float(loss.detach())
        grads = self._gradients(loss, size)
        if grads is not None:
            with torch.no_grad():
                for total, grad in zip(self.sums, grads, strict=True):
                    if grad is not None:  # a parameter the loss does not use
                        total.add_(grad)
            self.samples += size
        return float(loss.detach())

    def add_gradients(self, size: int) -> None:
        """Add the gradient a training loop of its own left in .grad, that of its micro-batch's
        mean loss, as the sum over its `size` samples; .grad is cleared (`own_sums` only)."""
        assert not self.in_grad, "own_sums=True: .grad belongs to the training loop"
        with torch.no_grad():
            for total, p in zip(self.sums, self.params, strict=True):
                if p.grad is not None:  # a parameter the loss does not use
                    total.add_(p.grad, alpha=size)
                p.grad = None
        self.samples += size

    def _gradients(self, loss: torch.Tensor, size: int) -> list[torch.Tensor | None] | None:
        """d (loss * size) / d params, unscaled; None if fp16 overflowed."""
        if self.precision.scaler is None:
            return list(torch.autograd.grad(loss * size, self.params))
        # The scaler unscales .grad in place; apply() never runs meanwhile (one worker thread).
        # The mean loss is scaled (not the sum: the scale would grow with the micro-batch).
        for p in self.params:
            p.grad = None
        finite = self.precision.backward(loss, self.optimizer)
        grads = [None if p.grad is None else p.grad * size for p in self.params]
        for p in self.params:
            p.grad = None
        return grads if finite else None

    def take(self) -> tuple[np.ndarray, int]:
        """The mean gradient of the local samples (zeros if none), the buffers, and the count."""
        samples, self.samples = self.samples, 0
        vector = self.vector(self._handed_over() if self.in_grad else self.sums, samples)
        self.drop_local_work()
        return vector, samples

    def _handed_over(self) -> Iterator[torch.Tensor]:
        """Each parameter's gradient sum, freed once the vector has its copy: all of them and
        the vector at once were the peak of a step's memory."""
        for p in self.params:
            grad = torch.zeros_like(p) if p.grad is None else p.grad
            p.grad = None
            yield grad

    def gradient_sums(self) -> list[torch.Tensor]:
        """The gradient sums of the local samples not yet taken (zeros where none yet)."""
        if not self.in_grad:
            return self.sums
        return [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]

    def give_back(self, vector: np.ndarray, samples: int) -> None:
        totals = self.gradient_sums()
        with torch.no_grad():
            for total, part in _pieces(vector[: self.gradient_size], totals):
                total.add_(part * samples)
        if self.in_grad:
            for p, total in zip(self.params, totals, strict=True):
                p.grad = total
        self.samples += samples

    def apply(self, average: np.ndarray) -> None:
        """One optimizer step with `average`'s gradient part as the gradient of every parameter;
        the buffers take their averaged values."""
        for p, grad in _pieces(self.gradient(average), self.params):
            p.grad = grad
        self.optimizer.step()
        self.schedule.step()
        for p in self.params:
            p.grad = None
        self.load_buffers(average)

    def drop_local_work(self) -> None:
        for total in self.sums:
            total.zero_()
        if self.in_grad:
            for p in self.params:
                p.grad = None
        self.samples = 0


class LocalSGD(Shared):
    """DiLoCo: inner AdamW steps locally, outer Nesterov SGD on the averaged pseudo-gradient."""

    #: The outer optimizer is shared; the inner one's moments are each peer's own.
    shared = ("outer",)

    def __init__(
        self,
        task: Task,
        model: nn.Module,
        *,
        outer_lr: float,
        momentum: float,
        inner_steps: int,
        buffers: Sequence[torch.Tensor] = (),
        precision: Precision | None = None,
        clip_grad_norm: float = 0.0,
    ) -> None:
        super().__init__(
            model,
            buffers=buffers,
            precision=precision,
            clip_grad_norm=clip_grad_norm,
        )
        self.task = task
        self.inner_steps = inner_steps
        self.inner = task.make_optimizer(self.params)
        # The inner learning rate, stepped with every inner step (as in the DiLoCo paper):
        # every peer takes exactly H of them per outer step, so all hold the same schedule.
        self.schedule = Schedule(task, self.inner)
        # The shared parameters as of the last outer step, in float32 whatever the parameters'
        # dtype (the pseudo-gradient is their difference); the outer optimizer moves these.
        self.anchor = [p.detach().to(torch.float32, copy=True) for p in self.params]
        # Nesterov needs momentum; outer_momentum = 0 is plain averaging (lr 1) or SGD on it.
        self.outer = torch.optim.SGD(
            self.anchor, lr=outer_lr, momentum=momentum, nesterov=momentum > 0
        )
        self.samples = 0

    def optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {"inner": self.inner, "outer": self.outer}

    def anchored_parameters(self) -> dict[str, torch.Tensor] | None:
        """The parameters as of the last outer step, by name: the anchor, which holds them
        exactly where they are float32 (None otherwise). Inner steps leave it alone, so a
        peer serves and checkpoints the step it holds from it without a copy."""
        if any(p.dtype != torch.float32 for p in self.params):
            return None
        anchor = {id(p): a for p, a in zip(self.params, self.anchor, strict=True)}
        return {
            name: anchor[id(p)]
            for name, p in self.model.named_parameters(remove_duplicate=False)
            if id(p) in anchor
        }

    def schedule_epochs(self, step: int) -> int:
        """Scheduler steps by global `step`: every peer takes exactly H inner steps a step."""
        return step * self.inner_steps

    def accumulate(self, batch: Any, size: int) -> float:
        """One inner step on this micro-batch; return its loss. With fp16, a step the scaler
        skips (an overflow) does not count toward the H inner steps."""
        with self.precision.autocast():
            loss = self.task.loss(self.model, batch)
        if self.precision.step(loss, self.inner):
            self.schedule.step()
            self.samples += size
        return float(loss.detach())

    def inner_step(self, size: int, *, scaler: torch.amp.GradScaler | None = None) -> None:
        """One inner step with the gradient a training loop of its own left in .grad, over
        `size` samples (through its AMP `scaler`, which skips a step that overflowed: it
        does not count toward the H inner steps); .grad is cleared."""
        stepped = True
        if scaler is None:
            self.inner.step()
        else:
            stepped = unscaled_finite(scaler, self.inner)
            scaler.step(self.inner)  # skipped if not finite (the unscale recorded it)
            scaler.update()
        self.inner.zero_grad(set_to_none=True)
        if stepped:
            self.schedule.step()
            self.samples += size

    def take(self) -> tuple[np.ndarray, int]:
        """The pseudo-gradient (anchor - local), the buffers, and the inner samples behind it.
        The local work stays in place until `apply` (a failed averaging continues from it)."""
        # One parameter's difference at a time: a list of them all was a model's worth more.
        pseudo = (a - p.detach().float() for a, p in zip(self.anchor, self.params, strict=True))
        return self.vector(pseudo, 1), self.samples

    def give_back(self, vector: np.ndarray, samples: int) -> None:
        pass  # take() left everything in place

    def apply(self, average: np.ndarray) -> None:
        for a, grad in _pieces(self.gradient(average), self.anchor):
            a.grad = grad
        self.outer.step()
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.grad = None
                p.copy_(a)
        self.load_buffers(average)
        self.samples = 0

    def drop_local_work(self) -> None:
        """Back to the shared parameters (after a state download replaced them)."""
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params, strict=True):
                a.copy_(p)
        self.samples = 0


#: By `training.mode`: what a step certifies besides the parameters (the keeper has no strategy).
SHARED_OPTIMIZERS = {"dedloc": LargeBatch.shared, "diloco": LocalSGD.shared}
