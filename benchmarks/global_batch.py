"""The global batch each step applies against `task.target_batch`: real `peer join` processes and
a backbone on loopback, on the demo's settings (the default task, target 256, micro-batch 32,
DeDLOC, groups of 4). Every peer logs the samples behind each step it applies (the averaging's
total weight); the spread shows how close the collaboration stops to the target, and the
bound the trainer aims for is the target plus or minus one micro-batch per peer.

    .venv/bin/python -m benchmarks.global_batch [--peers 3 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections import Counter
from pathlib import Path

from tests.collab_processes import ROOT, Collaboration, wait_all

TARGET = 256
MICRO_BATCH = 32


def run(peers: int, steps: int) -> tuple[list[float], dict[str, int]]:
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
    try:
        collab.start_backbone()
        procs = [collab.start_peer(i) for i in range(peers)]
        wait_all(procs, timeout=120 + 20 * steps)
        by_step: dict[int, float] = {}
        events: Counter[str] = Counter()
        for proc in procs:
            for record in proc.records():
                applied = record.get("applied")
                if applied:  # every peer that applies a step logs the same total
                    by_step.setdefault(applied["step"], applied["global_batch"])
                message = record.get("msg", "")
                for event in ("did not complete", "downloaded the state", "missed the gathering"):
                    events[event] += event in message
        return [by_step[s] for s in sorted(by_step)], dict(events)
    finally:
        collab.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    for peers in args.peers:
        batches, events = run(peers, args.steps)
        within = sum(abs(b - TARGET) <= peers * MICRO_BATCH for b in batches)
        print(
            f"{peers} peers, target {TARGET}, micro-batch {MICRO_BATCH}: {len(batches)} steps; "
            f"global batch min {min(batches):.0f}, median {statistics.median(batches):.0f}, "
            f"mean {statistics.fmean(batches):.1f}, max {max(batches):.0f}; within one "
            f"micro-batch per peer of the target: {within}/{len(batches)}; histogram "
            f"{sorted(Counter(int(b) for b in batches).items())}; {events}",
            flush=True,
        )


if __name__ == "__main__":
    main()
