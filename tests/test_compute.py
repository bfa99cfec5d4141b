"""Compute measurement, the throughput average, tasks and devices (CPU; CUDA when present)."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.errors import ConfigError
from peer.measure.compute import measure_compute, pick_device, to_device
from peer.training.task import TinyTask, load_task


def test_measure_compute_times_real_steps_and_sizes_the_gradient():
    task = TinyTask()
    result = measure_compute(task, micro_batch=16, device=torch.device("cpu"), min_seconds=0.2)
    assert result.samples_per_s > 0 and result.device == "cpu"
    params = sum(p.numel() for p in task.build_model().parameters())
    assert result.gradient_bytes == 4 * params  # fp32
    assert result.free_memory_bytes > 0


def test_a_slower_step_measures_slower():
    # Each step costs a fixed time on an injected clock, so a busy machine cannot flip the order
    # (a 20 ms sleep per step on the real clock did, in CI: the unslowed task measured slower).
    now = [0.0]

    class Costed(TinyTask):
        def __init__(self, seconds_per_step: float) -> None:
            super().__init__()
            self.seconds_per_step = seconds_per_step

        def loss(self, model, batch):
            now[0] += self.seconds_per_step
            return super().loss(model, batch)

    cpu = torch.device("cpu")

    def measured(seconds_per_step: float) -> float:
        result = measure_compute(
            Costed(seconds_per_step),
            micro_batch=64,
            device=cpu,
            min_seconds=0.3,
            clock=lambda: now[0],
        )
        assert result is not None
        return result.samples_per_s

    fast, slow = measured(0.01), measured(0.03)
    assert slow < fast
    assert slow == pytest.approx(64 / 0.03) and fast == pytest.approx(64 / 0.01)


def test_a_stopped_measurement_returns_none_within_a_step():
    # Without the stop flag this would time steps for an hour; a stopping daemon waits for it.
    stop = threading.Event()
    results: list = []
    worker = threading.Thread(
        target=lambda: results.append(
            measure_compute(
                TinyTask(), micro_batch=16, device=torch.device("cpu"), min_seconds=3600, stop=stop
            )
        )
    )
    worker.start()
    stop.set()
    worker.join(timeout=60)
    assert not worker.is_alive() and results == [None]


def test_devices():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ConfigError, match=r"task\.device = 'tpu'"):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            pick_device("cuda")
    batch = {"x": (torch.zeros(2), [torch.ones(1)]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["n"] == 3 and isinstance(moved["x"], tuple) and isinstance(moved["x"][1], list)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")
def test_measure_compute_on_cuda():
    result = measure_compute(
        TinyTask(), micro_batch=64, device=pick_device("cuda"), min_seconds=0.2
    )
    assert result.device.startswith("cuda") and result.samples_per_s > 0


def make_tiny() -> TinyTask:
    return TinyTask()


def make_nothing() -> object:
    return object()


def test_tasks_load_by_name_or_factory_path_and_bad_names_are_config_errors():
    assert load_task("tiny").name == "tiny"
    assert isinstance(load_task("tests.test_compute:make_tiny"), TinyTask)
    with pytest.raises(ConfigError, match=r"expected one of gpt, tiny or package\.module:factory"):
        load_task("huge")
    with pytest.raises(ConfigError, match="cannot load it"):
        load_task("tests.test_compute:missing")
    with pytest.raises(ConfigError, match="returned object, which lacks"):
        load_task("tests.test_compute:make_nothing")
