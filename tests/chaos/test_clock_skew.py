"""Chaos (d): clock skew. Two of 4 peers run with their wall clock shifted, one ahead by SKEW
seconds and one behind by SKEW seconds (2 x SKEW apart), while a backbone and 4 peers train the
default task. Production code is untouched: a test-only `sitecustomize.py` first on the child's
PYTHONPATH shifts time.time and time.time_ns (`harness.clock_shift_dir`); monotonic clocks stay
true, as on a machine whose wall clock is off.

Checked first that the shift takes effect: each skewed peer's JSON log timestamps run SKEW ahead
of (behind) the test's clock, within the read delay, and an unshifted peer's do not. Then the
invariants every scenario checks (tests/chaos/invariants.py): the global step never goes
backwards, every peer exits 0 at max_steps, identical final parameters and validation, sound
checkpoint folders, a new step within every WINDOW seconds, SIGINT stops within 10 s, no error
or traceback in any log. Reported: steps each peer applied alone, missed gatherings and failed
averagings per peer (where skew costs).
"""

from __future__ import annotations

import os

import pytest

from tests.chaos.harness import (
    GPT_ENV,
    ChaosCollaboration,
    clock_shift_dir,
    free_port,
    observed_clock_offset,
)
from tests.chaos.invariants import check_all, regressions

pytestmark = pytest.mark.chaos

MAX_STEPS = 40
SKEW = 3.0
SHIFTS = {2: +SKEW, 3: -SKEW}
#: As in test_peer_churn: ~10 s per step at worst, times 6 for a shared 2-core machine.
WINDOW = 60.0
#: A log line is read within this long of being written (50 ms polling on a loaded machine).
READ_DELAY = 1.0


def test_two_peers_with_skewed_clocks(tmp_path):
    collab = ChaosCollaboration(
        tmp_path, {**GPT_ENV, "PEERTRAIN_TRAINING_MAX_STEPS": str(MAX_STEPS)}
    )
    figures: dict = {}
    failures = ["the run ended before its checks"]
    offsets: dict[str, float | None] = {}
    try:
        backbone = collab.start_backbone_on(free_port())
        peers = {}
        for i in range(4):
            env = {}
            if i in SHIFTS:
                shifted = clock_shift_dir(tmp_path, SHIFTS[i])
                env["PYTHONPATH"] = os.pathsep.join(
                    p for p in (str(shifted), os.environ.get("PYTHONPATH", "")) if p
                )
            peers[i] = collab.start_peer(i, env)
        collab.watch_global_step()
        assert collab.wait_for_step(1, timeout=180), "training never reached step 1"
        collab.note("step 1 reached")
        for i in (0, *SHIFTS):
            offsets[f"peer{i}"] = observed_clock_offset(peers[i])
        collab.note(f"observed clock offsets {offsets}")
        for i in (0, *SHIFTS):
            shift = SHIFTS.get(i, 0.0)
            seen = offsets[f"peer{i}"]
            assert seen is not None, f"peer{i} logged nothing to read its clock from"
            assert shift - READ_DELAY <= seen <= shift + 0.05, (
                f"peer{i}'s clock runs {seen:+.2f}s from ours; the shift is {shift:+g}s"
            )

        figures, failures = check_all(collab, peers, backbone, max_steps=MAX_STEPS, window=WINDOW)
    finally:
        collab.close()
        collab.report(
            "d: clock skew",
            shifts={f"peer{i}": s for i, s in SHIFTS.items()},
            observed_offsets=offsets,
            failures=failures,
            regressions=regressions(collab),
            **figures,
        )
    assert not failures, failures
