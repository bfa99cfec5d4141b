"""Chaos (b): the backbone, the collaboration's only bootstrap node, is SIGKILLed and restarted
on the same port with the same identity (so at the same address) several times while 4 peers
train the default task.

Injected: ROUNDS stops of the backbone at seeded-random moments (uniform 8-14 s apart), SIGKILLs
but the last, a graceful SIGINT stop (an upgrade; its duration is checked like every stop), each
followed by a restart after a seeded-random outage of 1-8 s (longer than the 4 s presence TTL of
configs/debug.toml, so the backbone's own records expire meanwhile), on a fixed port picked free
by the test (`--port`) and the same key file.

Checked, besides the invariants every scenario checks (tests/chaos/invariants.py: the global step
never goes backwards, every peer exits 0 at max_steps, identical final parameters and
validation, sound checkpoint folders, a new step within every WINDOW seconds, SIGINT stops within
10 s, no error or traceback in any log): each restarted backbone announces the same address as
the first one, and a status client that knows only the backbone reads the collaboration's
progress again after the last restart (the peers found their way back to it). The steps the
peers logged while the backbone was down are reported (training needs no backbone once joined).
"""

from __future__ import annotations

import datetime
import random
import re
import time

import pytest

from tests.chaos.harness import GPT_ENV, ChaosCollaboration, free_port
from tests.chaos.invariants import check_all, one_per_log, regressions

pytestmark = pytest.mark.chaos

SEED = 4242
MAX_STEPS = 60
ROUNDS = 4
MARGIN_STEPS = 10
#: As in test_peer_churn: ~10 s per step at worst (batch, gathering, averaging with a retry),
#: times 6 for a shared 2-core machine. Status reads fail while the backbone is down (at most
#: 8 s here), which counts as no progress.
WINDOW = 60.0
_STEP = re.compile(r"^step (\d+): \d+ peers")


def steps_logged_between(collab: ChaosCollaboration, start: float, end: float) -> list[int]:
    """Steps any peer applied (its `step N: ...` log line) between two wall-clock times."""
    steps = []
    for proc in one_per_log([p for p in collab.procs if p.name.startswith("peer")]):
        for record in proc.records():
            match = _STEP.match(record.get("msg", ""))
            if not match:
                continue
            stamp = datetime.datetime.fromisoformat(record["ts"].replace("Z", "+00:00"))
            if start <= stamp.timestamp() <= end:
                steps.append(int(match.group(1)))
    return sorted(set(steps))


def test_backbone_sigkilled_and_restarted_at_the_same_address(tmp_path):
    rng = random.Random(SEED)
    collab = ChaosCollaboration(
        tmp_path, {**GPT_ENV, "PEERTRAIN_TRAINING_MAX_STEPS": str(MAX_STEPS)}
    )
    port = free_port()
    outages: list[dict] = []
    figures: dict = {}
    failures = ["the run ended before its checks"]
    later: list[int] = []
    try:
        backbone = collab.start_backbone_on(port)
        address = collab.backbone_addr
        assert f"/tcp/{port}/p2p/" in address, address
        peers = {i: collab.start_peer(i) for i in range(4)}
        collab.watch_global_step()
        assert collab.wait_for_step(1, timeout=180), "training never reached step 1"
        collab.note("step 1 reached")

        for _ in range(ROUNDS):
            time.sleep(rng.uniform(8.0, 14.0))
            if collab.global_step() >= MAX_STEPS - MARGIN_STEPS:
                break
            before = collab.global_step()
            down_at = time.time()
            graceful = len(outages) == ROUNDS - 1  # the last restart is an upgrade: SIGINT
            if graceful:
                collab.stop(backbone)
            else:
                collab.kill(backbone)
            time.sleep(rng.uniform(1.0, 8.0))
            backbone = collab.start_backbone_on(port)
            up_at = time.time()  # once it printed its address (start-up takes seconds too)
            assert collab.backbone_addr == address, (collab.backbone_addr, address)
            outages.append(
                {
                    "stop": "SIGINT" if graceful else "SIGKILL",
                    "global_step_at_kill": before,
                    "down_s": round(up_at - down_at, 1),
                    "steps_applied_while_down": steps_logged_between(collab, down_at, up_at),
                }
            )
            collab.note(f"backbone restarted at {address}")

        restarted_at = collab.now()
        step_then = collab.global_step()
        figures, failures = check_all(collab, peers, backbone, max_steps=MAX_STEPS, window=WINDOW)
        later = [s for t, s in collab.step_samples if t > restarted_at]
        if len(outages) < ROUNDS - 1:
            failures.append(f"only {len(outages)} backbone restarts before the end")
        if not (later and max(later) > step_then):
            failures.append(
                f"no status read through the restarted backbone showed a step above {step_then}"
            )
    finally:
        collab.close()
        collab.report(
            "b: backbone restarts",
            seed=SEED,
            backbone_kills=len(outages),
            outages=outages,
            reads_after_last_restart=len(later),
            failures=failures,
            regressions=regressions(collab),
            **figures,
        )
    assert not failures, failures
