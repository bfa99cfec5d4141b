"""Training numerics with parameters and gradients on a GPU: the same results as on the CPU,
through pinned host buffers. Skipped where torch sees no CUDA device (CI); run on a machine
with one (`docs/benchmarks.md` records where they ran)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from peer.config import PeerConfig, TaskConfig
from peer.training import state as states
from peer.training.layout import averaged_buffers
from peer.training.precision import Precision
from peer.training.strategies import LargeBatch, LocalSGD, _host
from peer.training.task import TinyTask
from peer.training.worker import TorchWorker
from tests.test_training_strategies import NormTask, batches, params

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
CUDA = torch.device("cuda")


def on(device: torch.device, batch):
    return tuple(t.to(device) for t in batch)


def test_host_buffers_for_a_gpu_are_pinned():
    assert _host(10, CUDA).is_pinned()
    assert not _host(10, torch.device("cpu")).is_pinned()


def large_batch(task, device: torch.device) -> LargeBatch:
    model = task.build_model().to(device)
    return LargeBatch(task, model, buffers=[b for _, b in averaged_buffers(model)])


def test_a_large_batch_step_on_the_gpu_matches_the_cpu():
    task = NormTask()
    cpu, gpu = large_batch(task, torch.device("cpu")), large_batch(task, CUDA)
    for x, y in batches(1, 3, 8):
        cpu.accumulate((x, y), 8)
        gpu.accumulate(on(CUDA, (x, y)), 8)
    (vector_cpu, _), (vector_gpu, _) = cpu.take(), gpu.take()
    np.testing.assert_allclose(vector_gpu, vector_cpu, rtol=1e-4, atol=1e-6)
    cpu.apply(vector_cpu)
    gpu.apply(vector_cpu)
    torch.testing.assert_close(params(gpu.model).cpu(), params(cpu.model), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gpu.model[1].running_mean.cpu(), cpu.model[1].running_mean)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_autocast_on_the_gpu_contributes_a_float32_gradient_close_to_fp32(precision):
    task = TinyTask()
    reference = LargeBatch(task, task.build_model().to(CUDA))
    mixed = LargeBatch(task, task.build_model().to(CUDA), precision=Precision(precision, CUDA))
    ((x, y),) = batches(2, 1, 16)
    reference.accumulate(on(CUDA, (x, y)), 16)
    mixed.accumulate(on(CUDA, (x, y)), 16)
    exact, ours = reference.take()[0], mixed.take()[0]
    assert ours.dtype == np.float32
    assert np.linalg.norm(ours - exact) < 0.05 * np.linalg.norm(exact)


def test_diloco_on_the_gpu_keeps_a_float32_anchor_and_steps_like_the_cpu():
    task = TinyTask()
    make = lambda device: LocalSGD(  # noqa: E731
        task, task.build_model().to(device), outer_lr=0.7, momentum=0.9, inner_steps=2
    )
    cpu, gpu = make(torch.device("cpu")), make(CUDA)
    for x, y in batches(3, 2, 8):
        cpu.accumulate((x, y), 8)
        gpu.accumulate(on(CUDA, (x, y)), 8)
    (vector_cpu, _), (vector_gpu, _) = cpu.take(), gpu.take()
    np.testing.assert_allclose(vector_gpu, vector_cpu, rtol=1e-3, atol=1e-5)
    cpu.apply(vector_cpu)
    gpu.apply(vector_cpu)
    assert gpu.anchor[0].dtype == torch.float32 and gpu.anchor[0].is_cuda
    torch.testing.assert_close(params(gpu.model).cpu(), params(cpu.model), rtol=1e-5, atol=1e-6)


async def test_a_gpu_worker_s_held_state_is_a_copy_that_a_cpu_worker_loads():
    config = PeerConfig(task=TaskConfig(name="tiny", micro_batch=8, target_batch=64))
    gpu = TorchWorker(TinyTask(), config, device=CUDA, peer_id="g")
    cpu = TorchWorker(TinyTask(), config, device=torch.device("cpu"), peer_id="c")
    await gpu.compute()
    vector, _ = await gpu.take()
    await gpu.apply(vector)
    digest = await gpu.hold(1)
    assert not gpu.held.live  # GPU tensors: the held state is a host copy
    snapshot = await gpu.serialize()
    state = states.from_bytes(snapshot.blob)
    await cpu.restore(state, from_donor=True)
    assert cpu.certify(state).digest == digest
    assert states.parameters_digest(cpu.model) == states.parameters_digest(gpu.model)
