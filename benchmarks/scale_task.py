"""The default byte-level GPT task widened to ~10 M, ~40 M and ~100 M parameters, for
`benchmarks/scale.py`: `--task benchmarks.scale_task:gpt_10m` (or `PEERTRAIN_TASK_NAME`), run
from the repository root.

Same corpus, loss and AdamW as the built-in `gpt` task; only `GPTShape` is wider and deeper
(heads of 64 dims, as GPT-2). Parameters: 12 x layers x width^2 for the blocks plus
(256 + block) x width for the embeddings (the output layer is tied). Measured on this
machine class, one thread, forward + backward: 10 M at micro-batch 4 ~0.14 s, 40 M at 4
~0.55 s, 100 M at 2 ~0.8 s (AdamW's step over 100 M: ~2.3 s), so the real model stays cheap
enough to train on CPU and no stand-in with cheap compute is needed.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from peer.training.gpt import GPTShape
from peer.training.task import ByteGPTTask


@dataclass(frozen=True, kw_only=True)
class ScaleSize:
    name: str
    """The task's name (checkpoint folders are per name)."""
    shape: GPTShape
    micro_batch: int
    """Sequences of `shape.block` bytes per micro-batch: small, so a micro-batch takes at
    most a second or so on one thread."""


SIZES = {
    10: ScaleSize(name="gpt-10m", shape=GPTShape(width=384, layers=6, heads=6), micro_batch=4),
    40: ScaleSize(name="gpt-40m", shape=GPTShape(width=640, layers=8, heads=10), micro_batch=4),
    100: ScaleSize(name="gpt-100m", shape=GPTShape(width=768, layers=14, heads=12), micro_batch=2),
}


class ScaleGPTTask(ByteGPTTask):
    """`ByteGPTTask` with another shape and name, and GPT-2's learning rate: the default
    task's 3e-3 made the loss of the 100 M model rise over its first steps (5.33, 6.05, 7.37 in
    plain single-process training)."""

    def __init__(self, size: ScaleSize) -> None:
        super().__init__(size.shape)
        self.name = size.name

    def make_optimizer(self, parameters: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = super().make_optimizer(parameters)
        for group in optimizer.param_groups:
            group["lr"] = 6e-4
        return optimizer


def gpt_10m() -> ScaleGPTTask:
    return ScaleGPTTask(SIZES[10])


def gpt_40m() -> ScaleGPTTask:
    return ScaleGPTTask(SIZES[40])


def gpt_100m() -> ScaleGPTTask:
    return ScaleGPTTask(SIZES[100])
