"""What of a model is shared (averaged and certified) and the task fingerprint (pure)."""

from __future__ import annotations

import dataclasses

import torch

from peer.config import PeerConfig
from peer.training import state as states
from peer.training.layout import layout, task_fingerprint
from peer.training.strategies import LargeBatch
from peer.training.task import TinyTask
from peer.training.worker import TorchWorker
from tests.test_training_strategies import NormTask


def test_floating_and_integer_buffers_are_shared_and_bool_ones_are_not():
    model = NormTask().build_model()
    model.register_buffer("mask", torch.ones(3, dtype=torch.bool))
    model.register_buffer("scratch", torch.zeros(3), persistent=False)
    shared = layout(model, average_buffers=True)
    assert [name for name, _, _ in shared.buffers] == [
        "1.running_mean",
        "1.running_var",
        "1.num_batches_tracked",
    ]
    assert shared.certified[-3:] == [name for name, _, _ in shared.buffers]
    assert shared.vector_size == shared.parameter_count + 128 + 128 + 1
    assert layout(model, average_buffers=False).buffers == ()


def fingerprint_of(task, *, mode="dedloc", average_buffers=True):
    return task_fingerprint(task, task.build_model(), mode=mode, average_buffers=average_buffers)


class WiderTask(TinyTask):
    hidden = 256


class SGDTask(TinyTask):
    def make_optimizer(self, parameters):
        return torch.optim.SGD(parameters, lr=0.1)


def test_the_fingerprint_names_task_mode_optimizer_and_every_shared_tensor():
    base = fingerprint_of(TinyTask())
    assert base == fingerprint_of(TinyTask())
    assert base.description == (
        "task 'tiny' (dedloc, AdamW, 10,384 parameters in 4 tensors, 0 averaged buffers)"
    )
    others = [
        fingerprint_of(WiderTask()),
        fingerprint_of(SGDTask()),
        fingerprint_of(TinyTask(), mode="diloco"),
        fingerprint_of(NormTask()),
        fingerprint_of(NormTask(), average_buffers=False),
    ]
    assert len({base.digest, *(f.digest for f in others)}) == 6
    assert "SGD" in others[1].description and "diloco" in others[2].description


def test_a_step_certifies_the_averaged_buffers():
    config = PeerConfig()
    worker = TorchWorker(NormTask(), config, device=torch.device("cpu"), peer_id="p")
    assert isinstance(worker.strategy, LargeBatch)
    state = states.capture(0, worker.model, worker.strategy.optimizers())
    drifted = states.TrainingState(0, dict(state.tensors), state.metadata)
    drifted.tensors["model.1.running_mean"] = state.tensors["model.1.running_mean"] + 0.01
    assert worker.certify(drifted).digest != worker.certify(state).digest
    # Buffers kept apart (average_buffers = false) are each peer's own: not certified.
    apart = dataclasses.replace(
        config, training=dataclasses.replace(config.training, average_buffers=False)
    )
    own = TorchWorker(NormTask(), apart, device=torch.device("cpu"), peer_id="p")
    assert own.certify(drifted).digest == own.certify(state).digest
    assert own.vector_size == worker.vector_size - 257
