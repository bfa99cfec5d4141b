"""When an averaging result becomes an optimizer step (no network: the trainer's decision on
a result it is handed)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.averaging.allreduce import RoundReport
from peer.averaging.averager import AveragingResult
from peer.averaging.reduce import ChunkResult
from peer.config import PeerConfig, TaskConfig, TrainingConfig
from peer.training import state as states
from peer.training.task import TinyTask
from peer.training.trainer import Trainer


def make_trainer(tmp_path) -> Trainer:
    peer_id = ID.from_pubkey(create_new_key_pair().public_key)
    return Trainer(
        dht=SimpleNamespace(node=SimpleNamespace(peer_id=peer_id)),  # type: ignore[arg-type]
        averager=None,  # type: ignore[arg-type]
        config=PeerConfig(
            task=TaskConfig(name="tiny", micro_batch=8, target_batch=64),
            training=TrainingConfig(checkpoint_dir=str(tmp_path)),
        ),
        task=TinyTask(),
        device=torch.device("cpu"),
        download=None,  # type: ignore[arg-type]
    )


def group_result(size: int, senders: int, *, complete: bool = True) -> AveragingResult:
    report = RoundReport(chunks=[ChunkResult(0, size, senders)])
    if not complete:
        report.dropped_senders["someone"] = "timed out"
    return AveragingResult(peers_seen=3, rounds=[report])


@pytest.mark.parametrize(
    ("samples", "senders", "complete", "steps"),
    [
        (8, 3, True, True),  # an ordinary step
        (0, 3, True, True),  # we had nothing, others did: the group's average still applies
        (0, 0, True, False),  # nobody had samples: every chunk kept its zeros
        (8, 3, False, False),  # a member failed: our work waits for the next try
    ],
)
def test_a_group_result_is_a_step_only_if_complete_and_someone_contributed(
    tmp_path, samples, senders, complete, steps
):
    trainer = make_trainer(tmp_path)
    before = states.parameters_digest(trainer.model)
    size = sum(p.numel() for p in trainer.model.parameters())
    average = np.full(size, 0.5, dtype=np.float32)
    trainer._finish_step(average, samples, group_result(size, senders, complete=complete), 1.0)
    assert trainer.step == (1 if steps else 0)
    assert (states.parameters_digest(trainer.model) != before) == steps
    if not steps:
        assert trainer.strategy.samples == samples  # the work is kept for the next try
