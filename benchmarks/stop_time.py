"""How long a training peer takes to stop on Ctrl+C, optionally with CPU burners beside it.

A backbone and 3 `peer join` processes train the default task (configs/demo.toml) on loopback;
once a peer has printed step 4, it gets SIGINT and we time its exit (it saves a final
checkpoint and withdraws its records first). Each peer in turn. The baseline, measured in the
same run: a plain Python process holding the same model and AdamW state after 3 steps, ended
by SIGINT through the interpreter's default path (KeyboardInterrupt, then teardown).

    .venv/bin/python -m benchmarks.stop_time [--burners 2]
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = """
import signal, sys, time, torch
from peer.training.task import load_task
task = load_task("gpt")
model = task.build_model()
optimizer = task.make_optimizer(model.parameters())
generator = torch.Generator().manual_seed(0)
for _ in range(3):
    optimizer.zero_grad()
    task.loss(model, task.sample_batch(32, generator)).backward()
    optimizer.step()
print("ready", flush=True)
time.sleep(3600)
"""


class Child:
    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.popen = subprocess.Popen(
            [sys.executable, *args],
            cwd=ROOT,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            self.lines.put(line)

    def wait_line(self, needle: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.2)
            except queue.Empty:
                continue
            if needle in line:
                return line
        raise SystemExit(f"no line with {needle!r} within {timeout} s")

    def stop_seconds(self) -> float:
        started = time.monotonic()
        self.popen.send_signal(signal.SIGINT)
        self.popen.wait(timeout=60)
        return time.monotonic() - started

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--burners", type=int, default=0, help="CPU-bound processes beside")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="peertrain-stop-"))
    env = {**os.environ, "PEERTRAIN_CONFIG": str(ROOT / "configs" / "demo.toml")}
    env["PYTHONUNBUFFERED"] = "1"
    children: list[Child] = []
    burners = []
    try:
        baseline = Child(["-c", BASELINE], env)
        children.append(baseline)
        baseline.wait_line("ready", timeout=120)
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.burners)
        ]
        floor = baseline.stop_seconds()
        backbone = Child(
            ["-m", "cli.backbone_cli", "start", "--identity", str(workdir / "bb.key")], env
        )
        children.append(backbone)
        addr = backbone.wait_line("--backbone", timeout=60).split("--backbone ", 1)[1].strip()
        peers = []
        for i in range(3):
            peer_env = {**env, "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(workdir / f"ck{i}")}
            join = ["-m", "cli.peer_cli", "join", "--backbone", addr]
            peers.append(Child([*join, "--identity", str(workdir / f"p{i}.key")], peer_env))
        children += peers
        times = []
        for peer in peers:
            peer.wait_line("step 4 |", timeout=600)
            times.append(peer.stop_seconds())
            assert peer.popen.returncode == 0, peer.popen.returncode
            saved = list((workdir / f"ck{peers.index(peer)}").rglob("step-*.json"))
            assert saved, "no final checkpoint"
        print(f"burners beside: {args.burners} (machine has {os.cpu_count()} cores)")
        print(f"baseline (plain process, same model, SIGINT -> default exit): {floor:.2f} s")
        for i, seconds in enumerate(times):
            print(f"peer {i} stop (final checkpoint, records withdrawn): {seconds:.2f} s "
                  f"= {seconds / floor:.2f}x baseline")  # fmt: skip
    finally:
        for burner in burners:
            burner.kill()
        for child in children:
            child.kill()


if __name__ == "__main__":
    main()
