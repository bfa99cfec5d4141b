"""The global batch each step applies against `task.target_batch`: real `peer join` processes and
a backbone on loopback, on the demo's settings (the default task, target 256, micro-batch 32,
DeDLOC, groups of 4). Every peer logs the samples behind each step it applies (the averaging's
total weight); the spread shows how close the collaboration stops to the target. Two criteria
(issue 45): the mean within 5 % of the target, and no step above the target plus one
micro-batch per peer (each peer's quota is its share of the target rounded up at most).

    .venv/bin/python -m benchmarks.global_batch [--peers 3 8 16] [--steps 30]

On 2 cores a 16-peer run takes several minutes: one size at a time (`--peers 16 --steps 20`).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

from tests.collab_processes import ROOT, Collaboration, wait_all

TARGET = 256
MICRO_BATCH = 32
#: The mean global batch may differ from the target by at most this fraction.
MEAN_TOLERANCE = 0.05


def run(peers: int, steps: int) -> tuple[list[float], dict[str, int], Path]:
    workdir = Path(tempfile.mkdtemp(prefix=f"peertrain-batch-{peers}-"))
    collab = Collaboration(
        workdir,
        {
            "PEERTRAIN_CONFIG": str(ROOT / "configs" / "demo.toml"),
            "PEERTRAIN_LOG_FORMAT": "json",
            "PEERTRAIN_LOG_LEVEL": "info",
            "PEERTRAIN_TASK_TARGET_BATCH": str(TARGET),
            "PEERTRAIN_TASK_MICRO_BATCH": str(MICRO_BATCH),
            "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "0",
            "PEERTRAIN_TRAINING_TARGET_VALIDATION_LOSS": "0",
            "PEERTRAIN_TRAINING_MAX_STEPS": str(steps),
        },
    )
    events: Counter[str] = Counter()
    try:
        collab.start_backbone()
        procs = [collab.start_peer(i) for i in range(peers)]
        try:  # a run that outlasts its bound (a loaded machine) still reports its steps
            wait_all(procs, timeout=120 + (10 + 2 * peers) * steps)
        except subprocess.TimeoutExpired:
            events["timed out"] += 1
        by_step: dict[int, float] = {}
        for proc in procs:
            for record in proc.records():
                applied = record.get("applied")
                if applied:  # every peer that applies a step logs the same total
                    by_step.setdefault(applied["step"], applied["global_batch"])
                message = record.get("msg", "")
                for event in ("did not complete", "downloaded the state", "missed the gathering"):
                    events[event] += event in message
        return [by_step[s] for s in sorted(by_step)], dict(events), workdir
    finally:
        collab.close()


def report(peers: int, batches: list[float], events: dict[str, int], workdir: Path) -> str:
    if not batches:
        return f"{peers} peers: no step applied; {events}; logs in {workdir}"
    mean = statistics.fmean(batches)
    bound = TARGET + peers * MICRO_BATCH
    over = sum(b > bound for b in batches)
    mean_ok = abs(mean - TARGET) <= MEAN_TOLERANCE * TARGET
    return (
        f"{peers} peers, target {TARGET}, micro-batch {MICRO_BATCH}: {len(batches)} steps; "
        f"global batch min {min(batches):.0f}, median {statistics.median(batches):.0f}, "
        f"mean {mean:.1f}, max {max(batches):.0f}; first step {batches[0]:.0f}; above the "
        f"target: {sum(b > TARGET for b in batches)}; histogram "
        f"{sorted(Counter(int(b) for b in batches).items())}; {events}\n"
        f"  mean within {MEAN_TOLERANCE:.0%} of {TARGET}: {'yes' if mean_ok else 'NO'} "
        f"({mean - TARGET:+.1f}); steps above {TARGET} + {peers} x {MICRO_BATCH} = {bound}: "
        f"{over} ({'met' if over == 0 else 'NOT met'}); logs in {workdir}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[3, 8, 16])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    for peers in args.peers:
        print(report(peers, *run(peers, args.steps)), flush=True)


if __name__ == "__main__":
    main()
