"""A local collaboration of real `backbone start` / `peer join` processes on loopback, for tests
and benchmarks: start, kill by PID, read each peer's JSON log lines, watch the global step."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from peer.config import load_config
from peer.errors import RemoteError
from peer.status import collect_status

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
BASE_ENV = {
    "PEERTRAIN_CONFIG": str(ROOT / "configs" / "debug.toml"),
    "PEERTRAIN_LOG_FORMAT": "json",
    "PEERTRAIN_LOG_LEVEL": "info",
    "OMP_NUM_THREADS": "1",
}


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path
    offset: int = 0
    """Where this process's lines begin in the log (a restart appends to the same file)."""

    def records(self) -> list[dict]:
        """The JSON log lines this process wrote so far."""
        out = []
        text = self.log.read_bytes()[self.offset :].decode(errors="replace")
        for line in text.splitlines():
            with contextlib.suppress(ValueError):  # a line cut by a kill
                out.append(json.loads(line))
        return out

    def finished(self) -> dict | None:
        """The trainer's final figures, if it logged them."""
        for record in self.records():
            if "training" in record:
                return record["training"]
        return None

    def loop_record(self) -> dict | None:
        """The record with the event loop's figures in its `loop` field (`peer.loopwatch`),
        logged once when the daemon stopped."""
        for record in self.records():
            if "loop" in record:
                return record
        return None


@dataclass
class Collaboration:
    workdir: Path
    env: dict[str, str]
    procs: list[Proc] = field(default_factory=list)
    backbone_addr: str = ""
    global_steps: list[int] = field(default_factory=list)
    status_reads: list[str] = field(default_factory=list)
    """Per global step recorded: the records behind it, for a failure's message."""
    _stop_watch: threading.Event = field(default_factory=threading.Event)

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        popen = subprocess.Popen(
            [sys.executable, "-m", *args],
            # Only the backbone's address is read; an unread pipe would block a chatty peer.
            stdout=subprocess.PIPE if name == "backbone" else subprocess.DEVNULL,
            stderr=log.open("ab"),
            env={**os.environ, **BASE_ENV, **self.env, **(env or {})},
            cwd=ROOT,
        )
        proc = Proc(name, popen, log, offset)
        self.procs.append(proc)
        return proc

    def start_backbone(self, *extra: str) -> Proc:
        proc = self.start(
            "backbone",
            [
                "cli.backbone_cli",
                "start",
                "--identity",
                str(self.workdir / "backbone.key"),
                "--listen",
                LOOPBACK,
                *extra,
            ],
            # Its state (the genesis notary's registry) in the test's folder, not ~/.peertrain.
            {"PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(self.workdir / "backbone-state")},
        )
        deadline = time.monotonic() + 30
        assert proc.popen.stdout is not None
        while time.monotonic() < deadline:
            line = proc.popen.stdout.readline().decode()
            if "peer join --backbone /ip4/127.0.0.1/" in line:
                self.backbone_addr = line.split("--backbone ", 1)[1].strip()
                return proc
            if not line and proc.popen.poll() is not None:
                break
        raise AssertionError(f"backbone did not start: {proc.log.read_text()[-2000:]}")

    def start_peer(self, index: int, env: dict[str, str] | None = None) -> Proc:
        return self.start(
            f"peer{index}",
            [
                "cli.peer_cli",
                "join",
                "--backbone",
                self.backbone_addr,
                "--listen",
                LOOPBACK,
                "--identity",
                str(self.workdir / f"peer{index}.key"),
            ],
            {
                "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(self.workdir / f"checkpoints{index}"),
                **(env or {}),
            },
        )

    def watch_global_step(self) -> threading.Thread:
        """Record the collaboration's global step every half second (a status client)."""
        config = load_config(
            env={**BASE_ENV, **self.env},
            overrides={"collaboration.backbones": [self.backbone_addr], "log.level": "error"},
        ).config

        async def poll() -> None:
            while not self._stop_watch.is_set():
                try:
                    with trio.fail_after(10):
                        report = await collect_status(config)
                    if report.progress:
                        self.global_steps.append(report.training.global_step)
                        self.status_reads.append(describe_read(report.progress))
                except* (RemoteError, trio.TooSlowError):
                    pass  # no backbone answered this time (collect_status raises a group)
                await trio.sleep(0.5)

        thread = threading.Thread(target=trio.run, args=(poll,), daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._stop_watch.set()
        for proc in self.procs:
            if proc.popen.poll() is None:
                proc.popen.kill()
        for proc in self.procs:
            proc.popen.wait(timeout=10)
            if proc.popen.stdout is not None:
                proc.popen.stdout.close()


def describe_read(records: list) -> str:
    """One read of the progress records in a line: each peer's role, step, digest, signers."""
    return f"{time.monotonic():.2f}: " + ", ".join(
        f"{r.peer_id[-4:]} {r.role[0]} {r.step}/{r.digest[:6]}/{len(r.signatures)}"
        + ("/dl" if r.downloading else "")
        for r in records
    )


def steps_went_back(collab: Collaboration) -> str:
    """'' if the recorded global steps never decrease, else the reads around the first fall."""
    steps = collab.global_steps
    for i in range(1, len(steps)):
        if steps[i] < steps[i - 1]:
            return f"steps {steps}; reads:\n" + "\n".join(
                collab.status_reads[max(0, i - 2) : i + 2]
            )
    return ""


def wait_all(procs: list[Proc], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))


def kill(proc: Proc) -> None:
    os.kill(proc.popen.pid, signal.SIGKILL)
    proc.popen.wait(timeout=10)


def run_example_shards(
    workdir: Path, script: str, steps: int, *, shards: int = 2, timeout: float = 400
) -> list[str]:
    """`examples/<script>` run once per shard beside a backbone (loopback), each with
    `--shard i --shards N --steps STEPS` and its own identity and checkpoints; their outputs,
    once all have exited 0 (every process killed by PID whatever happens)."""
    collab = Collaboration(workdir, {"PEERTRAIN_LOG_LEVEL": "warning"})
    runs: list[subprocess.Popen[str]] = []
    try:
        collab.start_backbone()
        env = {**os.environ, **BASE_ENV, "PEERTRAIN_LOG_LEVEL": "warning"}
        env.pop("PEERTRAIN_CONFIG")  # the example's own settings, with debug.toml's loopback
        env["PEERTRAIN_NET_LISTEN"] = LOOPBACK
        env["PEERTRAIN_TRAINING_GATHER_WINDOW"] = "1.0"
        env["PEERTRAIN_TRAINING_PROGRESS_INTERVAL"] = "0.5"
        for shard in range(shards):
            runs.append(
                subprocess.Popen(
                    [sys.executable, f"examples/{script}", "--backbone", collab.backbone_addr,
                     "--shard", str(shard), "--shards", str(shards), "--steps", str(steps),
                     "--identity", str(workdir / f"example{shard}.key"),
                     "--checkpoints", str(workdir / f"example-checkpoints{shard}")],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
            )  # fmt: skip
        outputs = [run.communicate(timeout=timeout)[0] for run in runs]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait(10)
        collab.close()
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output[-3000:]
    return outputs
