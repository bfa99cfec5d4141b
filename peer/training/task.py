"""Tasks: what a collaboration trains. A task builds the model, samples micro-batches, and
computes the loss; everything else (measurement, averaging, optimizers) only sees this.

Built in: `gpt` (the default), a small byte-level GPT on Python's own standard library text;
and `tiny`, a small MLP on a fixed synthetic regression problem, fast enough for tests and for
measuring a machine in a second. A user's own task is `package.module:factory`, where
`factory()` returns an object with the `Task` methods, and optionally
`make_scheduler(optimizer)` for a learning-rate scheduler (stepped once per global step and
carried in the state: `schedule.py`).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import nn

from peer.errors import ConfigError
from peer.training.corpus import Corpus, load_corpus
from peer.training.gpt import GPT, GPTShape


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

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """The optimizer and its settings (every peer makes the same)."""
        ...

    def validation_batches(self, micro_batch: int, count: int) -> list[Any]:
        """`count` held-out batches, the same on every call and every peer."""
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

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.AdamW(parameters, lr=1e-2, weight_decay=0.0)

    def validation_batches(self, micro_batch: int, count: int) -> list[Any]:
        generator = torch.Generator().manual_seed(99)
        return [self.sample_batch(micro_batch, generator) for _ in range(count)]


class ByteGPTTask:
    """The default task: a small GPT predicting the next byte of Python's standard library
    (`corpus.py`: read at run time, no download, 5 % held out for validation)."""

    name = "gpt"

    def __init__(self, shape: GPTShape | None = None, corpus: Corpus | None = None) -> None:
        """`corpus`: another text than the standard library's (tests pass a small one)."""
        self.shape = shape or GPTShape()
        self._corpus = corpus

    @property
    def corpus(self) -> Corpus:
        if self._corpus is None:  # loaded on first use: 0.7 s, and not every process needs it
            self._corpus = load_corpus()
        return self._corpus

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)
        return GPT(self.shape)

    def _windows(self, data: np.ndarray, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        span = self.shape.block + 1
        rows = np.stack([data[s : s + span] for s in starts.tolist()]).astype(np.int64)
        tokens = torch.from_numpy(rows)
        return tokens[:, :-1], tokens[:, 1:]

    def sample_batch(self, micro_batch: int, generator: torch.Generator) -> Any:
        data = self.corpus.train
        starts = torch.randint(
            len(data) - self.shape.block - 1, (micro_batch,), generator=generator
        )
        return self._windows(data, starts)

    def loss(self, model: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        logits = model(x)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        # fused: one kernel per step, no temporaries (the default foreach AdamW made two
        # parameter-sized ones at every step: 0.4 GB at 100 M, and 4x the step time on CPU).
        return torch.optim.AdamW(
            parameters, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, fused=True
        )

    def validation_batches(self, micro_batch: int, count: int) -> list[Any]:
        data = self.corpus.validation
        generator = torch.Generator().manual_seed(7)
        starts = torch.randint(
            len(data) - self.shape.block - 1, (count, micro_batch), generator=generator
        )
        return [self._windows(data, row) for row in starts]


BUILT_IN = {"gpt": ByteGPTTask, "tiny": TinyTask}


def load_task(name: str, args: Mapping[str, Any] | None = None) -> Task:
    """A built-in task by name, or `package.module:factory` called with `args` (`[task.args]`);
    a bad name or argument is a ConfigError."""
    args = dict(args or {})
    if name in BUILT_IN:
        if args:
            raise ConfigError(
                f"task.args = {args!r}: the built-in task {name!r} takes no arguments "
                "(they are for a package.module:factory task)"
            )
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
    if not callable(factory):
        raise ConfigError(f"task.name = {name!r}: {factory_name} is not a factory (not callable)")
    try:  # the arguments checked against its signature first: a TypeError after is its own
        inspect.signature(factory).bind(**args)
    except TypeError as error:
        raise ConfigError(
            f"task.args = {args!r}: {factory_name}() does not take them ({error}); set "
            "[task.args] to its keyword arguments"
        ) from None
    except ValueError:
        pass  # no signature to read (some built-ins): the call itself will tell
    task = factory(**args)
    if not isinstance(task, Task):
        raise ConfigError(
            f"task.name = {name!r}: {factory_name}() returned {type(task).__name__}, which lacks "
            "name, build_model, sample_batch or loss"
        )
    return task
