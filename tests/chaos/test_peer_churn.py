"""Chaos (a): a random peer is SIGKILLed every few seconds and restarted with the same identity
and checkpoint folder, for several rounds, while a backbone and 4 peers train the default task
(the byte-level GPT). Then one random peer is stopped gracefully (SIGINT, timed) and restarted.

Injected: ROUNDS SIGKILLs at seeded-random intervals (uniform 6-12 s) of a seeded-random peer,
each restarted 0.5-3 s later; one SIGINT stop and restart. Faults stop MARGIN_STEPS before the
end, so the last restarts can catch up and the run ends undisturbed.

Checked (tests/chaos/invariants.py): the global step never goes backwards; every peer's last
incarnation exits 0 at max_steps; the peers' final parameters are bit-identical (and so is the
final validation loss of those that evaluated the last step); every checkpoint folder passes the
independent check; the global step advances within every WINDOW seconds; every SIGINT stop ends
within 10 s; no log line carries an error or a traceback.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.chaos.harness import GPT_ENV, ChaosCollaboration, free_port
from tests.chaos.invariants import check_all, regressions

pytestmark = pytest.mark.chaos

SEED = 20240607
MAX_STEPS = 50
ROUNDS = 6
MARGIN_STEPS = 10
#: A step needs a batch (64 samples: ~1-3 s of 4 peers' compute here), a gathering window (1 s)
#: and an averaging (timeout_floor 2 s + join_timeout 2 s + a ~3 MB transfer); a failed averaging
#: costs that again. ~10 s in all, times 6 for 2 cores shared with other test runs.
WINDOW = 60.0


def test_random_peers_sigkilled_and_restarted(tmp_path):
    rng = random.Random(SEED)
    collab = ChaosCollaboration(
        tmp_path, {**GPT_ENV, "PEERTRAIN_TRAINING_MAX_STEPS": str(MAX_STEPS)}
    )
    kills, restarts, graceful = 0, 0, None
    figures: dict = {}
    failures = ["the run ended before its checks"]
    try:
        backbone = collab.start_backbone_on(free_port())
        peers = {i: collab.start_peer(i) for i in range(4)}
        collab.watch_global_step()
        assert collab.wait_for_step(1, timeout=180), "training never reached step 1"
        collab.note("step 1 reached")

        for _ in range(ROUNDS):
            time.sleep(rng.uniform(6.0, 12.0))
            if collab.global_step() >= MAX_STEPS - MARGIN_STEPS:
                break
            victim = rng.randrange(4)
            collab.kill(peers[victim])
            kills += 1
            time.sleep(rng.uniform(0.5, 3.0))
            peers[victim] = collab.start_peer(victim)  # same identity, same checkpoint folder
            restarts += 1
            collab.note(f"restarted peer{victim} at global step {collab.global_step()}")

        if collab.global_step() < MAX_STEPS - MARGIN_STEPS:
            graceful = rng.randrange(4)
            # a stop while it trains (not one during start-up, before its handler is set)
            assert collab.wait_until_training(peers[graceful], timeout=120), "no training"
            time.sleep(rng.uniform(1.0, 4.0))
            collab.stop(peers[graceful])
            peers[graceful] = collab.start_peer(graceful)
            restarts += 1
            collab.note(f"restarted peer{graceful} after its SIGINT stop")

        figures, failures = check_all(collab, peers, backbone, max_steps=MAX_STEPS, window=WINDOW)
        if kills < ROUNDS - 1:
            failures.append(f"only {kills} kills landed before the last {MARGIN_STEPS} steps")
    finally:
        collab.close()
        collab.report(
            "a: peer churn",
            seed=SEED,
            kills=kills,
            restarts=restarts,
            graceful_stop=f"peer{graceful}" if graceful is not None else None,
            failures=failures,
            regressions=regressions(collab),
            **figures,
        )
    assert not failures, failures
