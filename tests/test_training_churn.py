"""Churn with real processes: peers SIGKILLed and restarted while the collaboration trains.
The run finishes, the global step never goes backwards, and the final validation loss is close
to an undisturbed run's (slow suite: two runs of ~1 minute each)."""

from __future__ import annotations

import random
import time

import pytest

from tests.collab_processes import Collaboration, kill, steps_went_back, wait_all

pytestmark = pytest.mark.slow

STEPS = 30
ENV = {
    "PEERTRAIN_TASK_MICRO_BATCH": "16",
    "PEERTRAIN_TASK_TARGET_BATCH": "256",
    "PEERTRAIN_TRAINING_GATHER_WINDOW": "1.0",
    "PEERTRAIN_TRAINING_PROGRESS_INTERVAL": "0.3",
    "PEERTRAIN_TRAINING_MAX_STEPS": str(STEPS),
    "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "5",
    "PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": "2.0",
    "PEERTRAIN_AVERAGING_TIMEOUT_FLOOR": "2.0",
    "PEERTRAIN_AVERAGING_JOIN_TIMEOUT": "2.0",
}


def final_validation(collab: Collaboration) -> float:
    """The validation loss at the last step, which every surviving peer evaluated alike."""
    figures = [p.finished() for p in collab.procs if p.name in ("peer0", "peer1", "peer2")]
    assert all(f is not None for f in figures)
    validations = {tuple(f["validation"]) for f in figures}  # type: ignore[index]
    assert len(validations) == 1, validations
    step, loss = validations.pop()
    assert step == STEPS
    return loss


def run(tmp_path, *, churn: bool) -> tuple[Collaboration, list[int]]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    collab = Collaboration(tmp_path, ENV)
    try:
        collab.start_backbone()
        peers = [collab.start_peer(i) for i in range(4)]
        collab.watch_global_step()
        if churn:
            rng = random.Random(7)
            for _ in range(3):
                time.sleep(rng.uniform(4.0, 7.0))
                victim = peers[3]
                kill(victim)
                time.sleep(1.0)
                peers[3] = collab.start_peer(3)  # same identity, same checkpoint folder
        wait_all(peers[:3], timeout=240)
        wait_all(peers[3:], timeout=60)
        codes = [p.popen.returncode for p in peers]
        return collab, codes
    finally:
        collab.close()


def test_churn_finishes_without_going_backwards_and_matches_the_undisturbed_run(tmp_path):
    calm, codes = run(tmp_path / "calm", churn=False)
    assert codes == [0, 0, 0, 0]
    stormy, codes = run(tmp_path / "stormy", churn=True)
    assert codes == [0, 0, 0, 0], [p.log.read_text()[-1500:] for p in stormy.procs]
    steps = stormy.global_steps
    assert steps and max(steps) >= STEPS - 1
    assert not steps_went_back(stormy), steps_went_back(stormy)
    # The restarted peer computes its part again: a slow first micro-batch once dealt it no
    # quota, and it contributed nothing in 19 of its last 22 steps.
    restarted = [p for p in stormy.procs if p.name == "peer3"][-1]
    applied = [r["applied"]["samples"] for r in restarted.records() if "applied" in r]
    assert sum(samples > 0 for samples in applied) >= len(applied) / 2, applied
    calm_loss, stormy_loss = final_validation(calm), final_validation(stormy)
    assert stormy_loss <= calm_loss * 1.2, (calm_loss, stormy_loss)
