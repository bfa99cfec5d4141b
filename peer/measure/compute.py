"""Compute throughput: samples/s of the task's forward + backward on this machine.

At start, `measure_compute` runs a few warm-up steps (allocator, kernel selection, lazy init)
and then times steps for at least `min_seconds`. Once training runs, the real rate refines it
(`Measurements.observe_training`). This is blocking torch code: the daemon runs it in a worker
thread, never on the trio loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil
import torch

from peer.errors import ConfigError
from peer.training.task import Task


@dataclass(frozen=True)
class ComputeMeasurement:
    samples_per_s: float
    device: str
    free_memory_bytes: int
    """Free memory of that device (host RAM for the CPU)."""
    gradient_bytes: int
    """Bytes of one full gradient of the task's model."""


class _Stopped(Exception):
    pass


def pick_device(setting: str) -> torch.device:
    """`auto` (CUDA when there is one, else CPU), `cpu`, `cuda` or `cuda:N`."""
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(setting)
    except RuntimeError:
        raise ConfigError(
            f"task.device = {setting!r}: expected auto, cpu, cuda or cuda:N"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(
            f"task.device = {setting!r}: this machine has no CUDA device; use auto or cpu"
        )
    return device


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(psutil.virtual_memory().available)


def to_device(batch: Any, device: torch.device) -> Any:
    """Move the tensors of a (nested) batch to `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(item, device) for item in batch)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    return batch


def measure_compute(
    task: Task,
    *,
    micro_batch: int,
    device: torch.device,
    min_seconds: float = 1.0,
    warmup_steps: int = 2,
    min_steps: int = 3,
    stop: threading.Event | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> ComputeMeasurement | None:
    """Samples/s of sampling + forward + backward at `micro_batch` (blocking; use a thread).
    Returns None, within one step, once `stop` is set. `clock` is injectable so that a test's
    comparison of two speeds does not depend on how busy the machine is."""
    model = task.build_model().to(device)
    generator = torch.Generator().manual_seed(0)

    def step() -> None:
        if stop is not None and stop.is_set():
            raise _Stopped
        model.zero_grad(set_to_none=True)
        task.loss(model, to_device(task.sample_batch(micro_batch, generator), device)).backward()

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # kernels run asynchronously: wait before timing

    try:
        for _ in range(warmup_steps):
            step()
        synchronize()
        steps, start = 0, clock()
        while True:
            step()
            steps += 1
            if steps >= min_steps:
                synchronize()
                elapsed = clock() - start
                if elapsed >= min_seconds:
                    break
    except _Stopped:
        return None
    return ComputeMeasurement(
        steps * micro_batch / elapsed, str(device), free_memory(device), gradient_bytes(model)
    )


def gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of one full gradient of `model` (its trainable parameters)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
