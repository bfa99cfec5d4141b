"""What the chaos scenarios share: a collaboration of real processes on loopback (a backbone and
peers, from `tests/collab_processes.py`) with a timed global-step watcher, a backbone on a fixed
port, kills and graceful stops by PID with their durations, a clock-shifting `sitecustomize`,
and an event log that each scenario prints at its end (its figures for the report).

Nothing here asserts; the checks are in `invariants.py`."""

from __future__ import annotations

import datetime
import json
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio

from peer.config import load_config
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.files import state_folder
from peer.status import collect_status
from tests.collab_processes import BASE_ENV, Collaboration, Proc

#: The default collaboration.name: a peer's checkpoints live in <checkpoint_dir>/default-<task>.
COLLABORATION = "default"

#: The training settings every scenario starts from: the default task (a 0.83 M-parameter
#: byte-level GPT) with small batches, so that 4 peers on 2 shared cores take a step every few
#: seconds; short deadlines so that a dead peer costs a retry of seconds, not minutes.
GPT_ENV = {
    "PEERTRAIN_TASK_NAME": "gpt",
    "PEERTRAIN_TASK_MICRO_BATCH": "8",
    "PEERTRAIN_TASK_TARGET_BATCH": "64",
    "PEERTRAIN_MEASURE_COMPUTE_SECONDS": "0.5",
    "PEERTRAIN_TRAINING_GATHER_WINDOW": "1.0",
    "PEERTRAIN_TRAINING_PROGRESS_INTERVAL": "0.3",
    "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "5",
    "PEERTRAIN_TRAINING_VALIDATION_BATCHES": "2",
    "PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": "2.0",
    "PEERTRAIN_AVERAGING_TIMEOUT_FLOOR": "2.0",
    "PEERTRAIN_AVERAGING_JOIN_TIMEOUT": "2.0",
}


#: The DHT calls of the status read in progress that failed (the watcher's thread is the only
#: DHT user in the test process).
_failed_calls: list[str] = []


def _observe_dht_calls() -> None:
    """Record, in the test process only, which DHT calls of a status read fail (observation:
    the call and its outcome are unchanged)."""
    original = DHT._call
    if getattr(original, "chaos_observed", False):
        return

    async def _call(self, peer_id, method, request, reply_type):
        try:
            return await original(self, peer_id, method, request, reply_type)
        except RemoteError as error:
            _failed_calls.append(f"{method} to {peer_id.to_base58()[-6:]}: {error}"[:200])
            raise

    _call.chaos_observed = True  # type: ignore[attr-defined]
    DHT._call = _call  # type: ignore[method-assign]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now (the backbone's fixed port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@dataclass
class ChaosCollaboration(Collaboration):
    """A `Collaboration` that also remembers when it saw each global step, and what was done
    to it (kills, restarts, stops) and when."""

    started: float = field(default_factory=time.monotonic)
    #: (seconds since `started`, global step) of every successful status read
    step_samples: list[tuple[float, int]] = field(default_factory=list)
    #: the same reads in detail: {"t": seconds since `started`, "read_s": how long the read
    #: took, "steps": {peer id's last 6 characters: step}, "failed_calls": the DHT calls of the
    #: read that failed}
    record_samples: list[dict] = field(default_factory=list)
    #: (seconds since `started`, what happened)
    events: list[tuple[float, str]] = field(default_factory=list)
    #: seconds each SIGINT stop took, by process name
    stop_seconds: list[tuple[str, float]] = field(default_factory=list)
    #: status reads that failed or timed out (a backbone down, a loaded machine)
    failed_reads: int = 0

    #: where each incarnation's lines begin in its log (restarts append), by PID
    log_offsets: dict[int, int] = field(default_factory=dict)

    def now(self) -> float:
        return time.monotonic() - self.started

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> Proc:
        log = self.workdir / f"{name}.log"
        offset = log.stat().st_size if log.exists() else 0
        proc = super().start(name, args, env)
        self.log_offsets[proc.popen.pid] = offset
        return proc

    def own_records(self, proc: Proc) -> list[dict]:
        """The JSON log lines of this incarnation only (whole lines)."""
        with proc.log.open("rb") as log:
            log.seek(self.log_offsets.get(proc.popen.pid, 0))
            lines = log.read().decode(errors="replace").split("\n")[:-1]
        out = []
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
        return out

    def wait_until_training(self, proc: Proc, timeout: float) -> bool:
        """Wait until this incarnation's trainer has logged a line (True), it exited or
        `timeout` passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.popen.poll() is None:
            if any(r.get("logger") == "peertrain.trainer" for r in self.own_records(proc)):
                return True
            time.sleep(0.25)
        return False

    def note(self, what: str) -> None:
        self.events.append((round(self.now(), 1), what))

    def watch_global_step(self) -> threading.Thread:
        """Like `Collaboration.watch_global_step` (a status client reading the progress
        records every half second, samples in `global_steps`), also timing each sample."""
        config = load_config(
            env={**BASE_ENV, **self.env},
            overrides={"collaboration.backbones": [self.backbone_addr], "log.level": "error"},
        ).config

        async def poll() -> None:
            while not self._stop_watch.is_set():
                _failed_calls.clear()
                began = self.now()
                try:
                    with trio.fail_after(10):
                        report = await collect_status(config)
                    if report.progress:
                        step = report.training.global_step
                        self.global_steps.append(step)
                        self.step_samples.append((self.now(), step))
                        self.record_samples.append(
                            {
                                "t": round(self.now(), 2),
                                "read_s": round(self.now() - began, 2),
                                "steps": {r.peer_id[-6:]: r.step for r in report.progress},
                                "failed_calls": list(_failed_calls),
                            }
                        )
                except* (RemoteError, trio.TooSlowError):
                    # bare, or in a group: open_node's nursery wraps e.g. Unreachable
                    self.failed_reads += 1
                await trio.sleep(0.5)

        _observe_dht_calls()

        thread = threading.Thread(target=trio.run, args=(poll,), daemon=True)
        thread.start()
        return thread

    def global_step(self) -> int:
        return self.global_steps[-1] if self.global_steps else 0

    def wait_for_step(self, step: int, timeout: float) -> bool:
        """Wait until the watcher has seen `step` (True) or `timeout` seconds passed (False)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.global_step() >= step:
                return True
            time.sleep(0.25)
        return False

    def start_backbone_on(self, port: int) -> Proc:
        """A backbone on 127.0.0.1:`port` with the key in the work folder, so a restart keeps
        its address (same port, same peer id)."""
        proc = self.start_backbone("--port", str(port))
        self.note(f"backbone started (pid {proc.popen.pid})")
        return proc

    def checkpoint_dir(self, index: int, task: str = "gpt") -> Path:
        return state_folder(str(self.workdir / f"checkpoints{index}"), COLLABORATION, task)

    def kill(self, proc: Proc) -> None:
        """SIGKILL by PID and reap."""
        os.kill(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(timeout=10)
        self.note(f"SIGKILL {proc.name} (pid {proc.popen.pid})")

    def stop(self, proc: Proc, *, timeout: float = 30.0) -> float:
        """SIGINT by PID; the seconds until it exited (inf, and a SIGKILL, past `timeout`)."""
        started = time.monotonic()
        os.kill(proc.popen.pid, signal.SIGINT)
        try:
            proc.popen.wait(timeout=timeout)
            seconds = time.monotonic() - started
        except subprocess.TimeoutExpired:
            os.kill(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)
            seconds = float("inf")
        self.stop_seconds.append((proc.name, seconds))
        self.note(f"SIGINT {proc.name}: exited {proc.popen.returncode} after {seconds:.2f}s")
        return seconds

    def report(self, title: str, **figures: object) -> str:
        """The scenario's figures as one JSON line (printed; pytest -s or -rA shows it)."""
        line = json.dumps(
            {
                "scenario": title,
                "wall_s": round(self.now(), 1),
                "final_global_step": self.global_step(),
                "status_reads": len(self.step_samples),
                "failed_status_reads": self.failed_reads,
                "stops": [(name, round(s, 2)) for name, s in self.stop_seconds],
                **figures,
                "events": self.events,
            },
            default=str,
        )
        print(line)
        (self.workdir / "report.json").write_text(line + "\n")
        return line


def clock_shift_dir(root: Path, seconds: float) -> Path:
    """A folder holding a `sitecustomize.py` that moves this process's wall clock by `seconds`
    (time.time and time.time_ns; monotonic clocks are left alone, as a real skewed clock
    would). Put it first on a child's PYTHONPATH: `site` imports it before anything else, so
    every later `time.time` lookup, default arguments bound at import included, sees the
    shifted clock. The shift shows in the JSON log's `ts` (logging stamps records with
    time.time())."""
    folder = root / f"clock{seconds:+g}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "# Test only: shift the wall clock of this process (tests/chaos/harness.py).\n"
        "import time as _time\n"
        f"_SHIFT = {float(seconds)!r}\n"
        "_time_ns, _time_time = _time.time_ns, _time.time\n"
        "_time.time = lambda: _time_time() + _SHIFT\n"
        "_time.time_ns = lambda: _time_ns() + int(_SHIFT * 1e9)\n"
    )
    return folder


def observed_clock_offset(proc: Proc, *, seconds: float = 20.0) -> float | None:
    """How far ahead of ours `proc`'s wall clock runs, read off its JSON log: the file is
    polled every 50 ms for `seconds` (or until 20 new lines), and each new line's `ts` minus
    our clock at the read is at most the true offset (the line was written before the read)
    and at least the offset minus the read delay; the largest such difference is returned
    (None: no new line). Lines already in the file at the call are left out."""
    seen = len(proc.log.read_text(errors="replace").split("\n")[:-1])
    best: float | None = None
    lines = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and lines < 20:
        now = time.time()
        text = proc.log.read_text(errors="replace").split("\n")[:-1]  # whole lines only
        for line in text[seen:]:
            try:
                stamp = datetime.datetime.fromisoformat(
                    json.loads(line)["ts"].replace("Z", "+00:00")
                )
            except (ValueError, KeyError, TypeError):
                continue
            lines += 1
            offset = stamp.timestamp() - now
            best = offset if best is None else max(best, offset)
        seen = len(text)
        time.sleep(0.05)
    return best
