"""What a flood of raw TCP connections at one peer's libp2p port costs the collaboration's step
rate: a backbone and `--peers` real `peer join` processes train the default task on loopback
(the chaos suite's small-batch settings); the global steps the flooded peer applies are counted
over `--seconds` without a flood, then over `--seconds` while one process opens and at once
closes connections to that peer's port at `--rate` a second from one other /24 (127.0.7.2-9),
as `benchmarks/accept_flood.py` does. Printed: steps a second in each window, their ratio, and
the flooded peer's share of a core in each (/proc/<pid>/stat).

    .venv/bin/python -m benchmarks.flood_step_rate [--peers 2] [--seconds 40] [--rate 3000]

Issue 45 reported a 3,000/s flood from one address costing a 2-core peer 55-80 % of its step
rate before the per-prefix accept budget.
"""

from __future__ import annotations

import argparse
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.accept_flood import cpu_seconds, flood
from tests.chaos.harness import GPT_ENV
from tests.collab_processes import Collaboration
from tests.hostile.common import free_port

FLOOD_SOURCES = [f"127.0.7.{n}" for n in range(2, 10)]


def applied(proc) -> int:
    """Steps the process applied so far (its log's `applied` lines)."""
    return sum("applied" in record for record in proc.records())


def window(proc, seconds: float) -> tuple[float, float]:
    """(steps a second the process applied, its share of a core) over the next `seconds`."""
    steps, cpu = applied(proc), cpu_seconds(proc.popen.pid)
    time.sleep(seconds)
    return (
        (applied(proc) - steps) / seconds,
        (cpu_seconds(proc.popen.pid) - cpu) / seconds,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--rate", type=float, default=3000.0)
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="peertrain-flood-"))
    collab = Collaboration(workdir, {**GPT_ENV, "PEERTRAIN_LOG_LEVEL": "info"})
    try:
        collab.start_backbone()
        port = free_port()
        target = collab.start(
            "peer0",
            ["cli.peer_cli", "join", "--backbone", collab.backbone_addr, "--listen",
             f"/ip4/127.0.0.1/tcp/{port}", "--identity", str(workdir / "peer0.key")],
            {"PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(workdir / "checkpoints0")},
        )  # fmt: skip
        others = [collab.start_peer(i) for i in range(1, args.peers)]
        deadline = time.monotonic() + 300
        while applied(target) < 3:
            if time.monotonic() > deadline or any(p.popen.poll() is not None for p in collab.procs):
                raise SystemExit(f"no steps: see {workdir}")
            time.sleep(1)
        quiet = window(target, args.seconds)
        tried: list[int] = []
        flooder = threading.Thread(
            target=lambda: tried.append(
                flood(port, seconds=args.seconds + 2, rate=args.rate, sources=FLOOD_SOURCES)
            )
        )
        flooder.start()
        time.sleep(1)
        flooded = window(target, args.seconds)
        flooder.join()
        alive = all(p.popen.poll() is None for p in [target, *others])
        print(
            f"{args.peers} peers, {args.seconds:.0f} s windows, flood {args.rate:.0f}/s at one "
            f"peer ({tried[0]} connections tried): {quiet[0]:.3f} -> {flooded[0]:.3f} steps/s "
            f"({flooded[0] / quiet[0]:.0%} of the rate without it); the flooded peer's CPU "
            f"{quiet[1]:.0%} -> {flooded[1]:.0%} of a core; all alive: {alive}; logs in {workdir}",
            flush=True,
        )
    finally:
        collab.close()


if __name__ == "__main__":
    main()
