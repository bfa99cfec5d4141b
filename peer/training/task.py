"""Tasks: what a collaboration trains. A task builds the model, samples micro-batches, and
computes the loss; everything else (measurement, averaging, optimizers) only sees this.

Built in: `tiny`, a small MLP on a fixed synthetic regression problem, fast enough for tests
and for measuring a machine in a second. A user's own task is `package.module:factory`, where
`factory()` returns an object with the `Task` methods.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from peer.errors import ConfigError


@runtime_checkable
class Task(Protocol):
    name: str

    def build_model(self) -> nn.Module:
        """A freshly initialised model (every peer seeds it identically)."""
        ...

    def sample_batch(self, micro_batch: int, generator: torch.Generator) -> Any:
        """One micro-batch of `micro_batch` samples, drawn with `generator`."""
        ...

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Scalar training loss of `model` on `batch`."""
        ...


class TinyTask:
    """Regression of a fixed random linear map through a 2-layer MLP (64 -> 128 -> 16)."""

    name = "tiny"
    inputs, hidden, outputs = 64, 128, 16

    def __init__(self) -> None:
        generator = torch.Generator().manual_seed(1234)
        self.target = torch.randn(self.inputs, self.outputs, generator=generator)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(
            nn.Linear(self.inputs, self.hidden), nn.GELU(), nn.Linear(self.hidden, self.outputs)
        )

    def sample_batch(self, micro_batch: int, generator: torch.Generator) -> Any:
        x = torch.randn(micro_batch, self.inputs, generator=generator)
        return x, x @ self.target

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(model(x), y)


BUILT_IN = {"tiny": TinyTask}


def load_task(name: str) -> Task:
    """A built-in task by name, or `package.module:factory`; a bad name is a ConfigError."""
    if name in BUILT_IN:
        return BUILT_IN[name]()
    module_name, _, factory_name = name.partition(":")
    if not factory_name:
        raise ConfigError(
            f"task.name = {name!r}: expected one of {', '.join(BUILT_IN)} or package.module:factory"
        )
    try:
        factory = getattr(importlib.import_module(module_name), factory_name)
    except (ImportError, AttributeError) as error:
        raise ConfigError(f"task.name = {name!r}: cannot load it ({error})") from None
    task = factory()
    if not isinstance(task, Task):
        raise ConfigError(
            f"task.name = {name!r}: {factory_name}() returned {type(task).__name__}, which lacks "
            "name, build_model, sample_batch or loss"
        )
    return task
