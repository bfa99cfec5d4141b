"""What of a model the collaboration shares: the tensors averaged and certified, and the task's
fingerprint that peers compare before training together (pure; torch only for names and shapes).

Averaged with every step, in this order in the flat vector:
- the trainable parameters' gradients (dedloc) or pseudo-gradients (diloco), `named_parameters()`
  order (a tied parameter once);
- with `training.average_buffers` (the default), the model's persistent buffers of a floating or
  integer dtype (BatchNorm's running statistics and its batch counter), as values: every peer
  applies their weighted mean, integers rounded, so all hold them bit-identical (before, after
  20 steps the parameters were bit-identical and `running_mean` differed by 0.014).

A step certifies the parameters and these buffers (`state.state_digest`). Other buffers (bool
masks, non-persistent ones) are each peer's own, like diloco's inner optimizer.

The fingerprint names the task, the training mode, the optimizer's type and every shared tensor's
name, shape and dtype. It is the averaging fingerprint (peers with different ones never meet) and
travels in every progress record with a one-line description, so a peer started with another
`--task` than the collaboration's says what differs instead of downloading states it cannot load.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from peer.training.task import Task


@dataclass(frozen=True)
class Layout:
    parameters: tuple[tuple[str, tuple[int, ...], str], ...]
    """(name, shape, dtype) of each trainable parameter, in `named_parameters()` order."""
    buffers: tuple[tuple[str, tuple[int, ...], str], ...]
    """(name, shape, dtype) of each averaged buffer, in `state_dict()` order."""

    @property
    def certified(self) -> list[str]:
        """Model tensor names a step certifies (parameters, then averaged buffers)."""
        return [name for name, _, _ in self.parameters + self.buffers]

    @property
    def parameter_count(self) -> int:
        return sum(_numel(shape) for _, shape, _ in self.parameters)

    @property
    def vector_size(self) -> int:
        """Elements of the averaged vector."""
        return self.parameter_count + sum(_numel(shape) for _, shape, _ in self.buffers)


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def is_averaged_buffer(tensor: torch.Tensor) -> bool:
    """Floating and integer buffers are averaged; bool and complex ones are not."""
    return not tensor.is_complex() and tensor.dtype != torch.bool


def averaged_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(state_dict name, tensor) of the buffers averaged with the parameters, each once."""
    buffers = {id(b) for b in model.buffers()}
    seen: set[int] = set()
    result = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        # state_dict holds persistent buffers only; a tied buffer appears under two names
        if id(tensor) in buffers and id(tensor) not in seen and is_averaged_buffer(tensor):
            seen.add(id(tensor))
            result.append((name, tensor))
    return result


def layout(model: nn.Module, *, average_buffers: bool) -> Layout:
    def describe(name: str, tensor: torch.Tensor) -> tuple[str, tuple[int, ...], str]:
        return name, tuple(tensor.shape), str(tensor.dtype)

    parameters = tuple(describe(n, p) for n, p in model.named_parameters() if p.requires_grad)
    buffers = tuple(describe(n, b) for n, b in averaged_buffers(model)) if average_buffers else ()
    return Layout(parameters, buffers)


@dataclass(frozen=True)
class Fingerprint:
    digest: str
    """24 hex digits over everything below (the averaging fingerprint)."""
    description: str
    """One line a user reads: task, mode, optimizer, size."""


def fingerprint(task: str, mode: str, optimizer: str, shape: Layout) -> Fingerprint:
    digest = hashlib.blake2b(digest_size=12)
    digest.update(f"task={task};mode={mode};optimizer={optimizer};".encode())
    for kind, tensors in (("p", shape.parameters), ("b", shape.buffers)):
        for name, size, dtype in tensors:
            digest.update(f"{kind}:{name}:{size}:{dtype};".encode())
    millions = shape.parameter_count / 1e6
    size = f"{millions:.3g} M" if millions >= 0.1 else f"{shape.parameter_count:,}"
    description = (
        f"task {task!r} ({mode}, {optimizer}, {size} parameters in {len(shape.parameters)} "
        f"tensors, {len(shape.buffers)} averaged buffers)"
    )
    return Fingerprint(digest.hexdigest(), description[:_DESCRIPTION_CHARS])


def task_fingerprint(
    task: Task, model: nn.Module, *, mode: str, average_buffers: bool
) -> Fingerprint:
    """The fingerprint of `task` trained in `mode` (`model` may live on the meta device: a
    backbone computes it without the memory)."""
    shared = layout(model, average_buffers=average_buffers)
    optimizer = task.make_optimizer([p for p in model.parameters() if p.requires_grad])
    return fingerprint(task.name, mode, type(optimizer).__name__, shared)


#: What a progress record carries of a description (a peer's text, shown to users).
_DESCRIPTION_CHARS = 200
