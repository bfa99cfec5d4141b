"""Scale: the default GPT widened to ~10 M, ~40 M and ~100 M parameters, a backbone and 3
`peer join` processes on loopback, DeDLOC and DiLoCo, every figure next to a baseline measured
in the same run.

    .venv/bin/python -m benchmarks.scale [--sizes 10 40 100] [--modes dedloc diloco]
        [--minutes 3] [--step-seconds 20] [--link-mbit 1000]

Per size, first in this process or its plain children (one torch thread, before any peer
starts): the product's training state (`TorchWorker` after one step, `state.capture`), its size in
bytes (parameters + optimizer state, as checkpoints carry it); one
thread's samples/s; `torch.save` / `torch.load` of the same model and optimizer state dicts
next to `save_checkpoint` / `load_latest`; a raw loopback TCP transfer of the bytes a donor
serves (the state; DiLoCo's without its inner optimizer, each peer's own)
between two processes; the all-reduce raw-TCP floor for 3 peers and the vector's size
(`benchmarks.allreduce`); a plain process holding the model and AdamW ended by SIGINT.
Then per mode: a backbone and 3 peers train (`--minutes` from the moment each has applied a
step; target batch or inner steps chosen from the measured speed so a step takes about
`--step-seconds`); then a 4th peer joins late (it downloads the state, then trains); then
peer 0 gets SIGINT; then everyone does. Peak RSS is the kernel's VmHWM of each process,
read every second and every 10 ms while it stops; the rest comes from the processes' JSON
logs (what could not be measured from them says so in the table). `--link-mbit N` (root)
runs it all in a network namespace of its own whose loopback is shaped to N Mbit/s, shared by
every connection as through one link: where the network, not the CPU, sets the pace.
Goals (the scale issue, at 100 M): peak RSS <= 2.5x the state; no event-loop stall over
100 ms; >= 95 % of averaging attempts succeed; checkpoint save <= 1.5x torch.save; stop
within 3 s; a late joiner training within 2x the time raw TCP needs to move the state.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import re
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np
import torch
import trio

from benchmarks.common import SHAPED_ENV, rerun_on_shaped_loopback
from benchmarks.scale_task import SIZES, ScaleGPTTask
from peer.config import load_config
from peer.loopwatch import WORST
from peer.training.state import StateBytes, TrainingState, capture, to_bytes
from peer.training.worker import TorchWorker
from tests.collab_processes import Collaboration, Proc

ROOT = Path(__file__).resolve().parent.parent
PEERS = 3
MB = 1e6
# Goals of the scale issue.
RSS_GOAL = 2.5  # x the state
STALL_GOAL = 0.1  # s
SUCCESS_GOAL = 0.95
SAVE_GOAL = 1.5  # x torch.save
STOP_GOAL = 3.0  # s
JOIN_GOAL = 2.0  # x raw TCP

# ---------------------------------------------------------------------------- the table


@dataclass
class Row:
    what: str
    measured: str
    baseline: str = "-"
    ratio: str = "-"
    goal: str = "-"
    verdict: str = "-"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def missing(what: str, why: str, goal: str = "-") -> Row:
    return Row(what, f"NOT MEASURED: {why}", goal=goal, verdict="n/a" if goal == "-" else "FAIL")


def print_table(title: str, rows: list[Row], notes: list[str]) -> None:
    head = Row("figure", "measured", "baseline (same run)", "ratio", "goal", "verdict")
    widths = [max(len(getattr(r, f)) for r in [head, *rows]) for f in vars(head)]
    print(f"\n{title}")
    for i, row in enumerate([head, *rows]):
        print(
            "  " + " | ".join(v.ljust(w) for v, w in zip(vars(row).values(), widths, strict=True))
        )
        if i == 0:
            print("  " + "-+-".join("-" * w for w in widths))
    for note in notes:
        print(f"  * {note}")
    sys.stdout.flush()


# ---------------------------------------------------------------------------- baselines


@dataclass(frozen=True, kw_only=True)
class Baselines:
    parameters: int
    vector_bytes: int
    state_bytes: int
    """`to_bytes(capture(...))`: parameters + optimizer state, as checkpoints save it."""
    served_bytes: int
    """What a donor serves and a joiner downloads (DiLoCo: no inner optimizer)."""
    rate: float
    """Samples/s of this mode's fastest micro-batch on one thread, in this process."""
    checkpoint: dict[str, float]
    raw_tcp: float | None
    allreduce_floor: float | None
    allreduce_round: float | None
    plain_stop: float | None
    plain_rss: int | None


def product_state(
    size: int, mode: str, micro_batch: int, *, rate_seconds: float, device: torch.device
) -> tuple[TorchWorker, TrainingState, float]:
    """The worker a peer runs, after enough micro-batches to time them and one step (so the
    optimizers hold their state); its captured state; its samples/s on one thread."""
    config = load_config(
        env={},
        overrides={"training.mode": mode, "task.micro_batch": micro_batch, "training.seed": 0},
    ).config
    worker = TorchWorker(
        ScaleGPTTask(SIZES[size]), config, device=device, peer_id="scale-benchmark"
    )

    async def run() -> float:
        await worker.compute()  # warm-up: the corpus is read on first use
        rates: list[float] = []
        started = time.perf_counter()
        while time.perf_counter() - started < rate_seconds or len(rates) < 3:
            done = await worker.compute()
            rates.append(done.samples / done.seconds)
        vector, _ = await worker.take()
        await worker.apply(vector)  # one step: AdamW's moments (DiLoCo: the outer momentum)
        # The best micro-batch: others' work on a shared machine only ever slows one down.
        return max(rates)

    rate = trio.run(run)
    strategy = worker.strategy
    state = capture(  # a copy: what a checkpoint or a donor writes, in `state.py`'s layout
        1, worker.model, strategy.optimizers(), scheduler_state=strategy.schedule.state()
    )
    return worker, state, rate


def checkpoint_times(
    worker: TorchWorker, state: TrainingState, directory: Path, *, repeats: int
) -> dict[str, float]:
    """Median seconds of the product's checkpoint save and load of `state`, next to torch.save
    and torch.load of the same model and optimizer state dicts, interleaved. Both loads read
    from the disk, as a resume does: checkpoints are written around the page cache (O_DIRECT,
    `peer.files.DirectFile`), and torch.save's file is dropped from the cache after its fsync.
    (One function: the checkpoint API may move to a background writer.)"""
    from peer.training.checkpoint import load_latest, save_checkpoint

    plain = {"model": worker.model.state_dict()}
    plain |= {name: o.state_dict() for name, o in worker.strategy.optimizers().items()}
    path, folder = directory / "plain.pt", directory / "checkpoints"
    times: dict[str, list[float]] = {}

    def timed(name: str, fn: Callable[[], object]) -> object:
        started = time.perf_counter()
        result = fn()
        times.setdefault(name, []).append(time.perf_counter() - started)
        return result

    def fsync(target: Path) -> None:
        descriptor = os.open(target, os.O_RDONLY)
        try:
            os.fsync(descriptor)
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)  # clean now: dropped
        finally:
            os.close(descriptor)

    for _ in range(repeats):
        timed("torch.save", lambda: torch.save(plain, path))
        timed("fsync after torch.save", lambda: fsync(path))
        timed("torch.load", lambda: torch.load(path, weights_only=True))
        timed("save_checkpoint", lambda: save_checkpoint(folder, state))
        loaded = timed("load_latest", lambda: load_latest(folder))
        assert isinstance(loaded, TrainingState) and loaded.step == state.step, loaded
        del loaded
        gc.collect()
    path.unlink()
    return {name: statistics.median(values) for name, values in times.items()}


RAW_SENDER = """
import socket, sys
size = int(sys.argv[1])
# Real bytes in touched pages: zero pages would all map one cached 4 KiB page.
blob = memoryview((bytes(range(256)) * (size // 256 + 1))[:size])
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
while True:
    connection, _ = server.accept()
    with connection:
        connection.sendall(blob)
"""


def read_line(popen: subprocess.Popen[str], timeout: float) -> str:
    """The child's next stdout line, or "" if none came within `timeout`."""
    assert popen.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(popen.stdout, selectors.EVENT_READ)
        if not selector.select(timeout):
            return ""
    return popen.stdout.readline()


def stop_child(popen: subprocess.Popen[str]) -> None:
    if popen.poll() is None:
        popen.kill()
        popen.wait(timeout=10)
    if popen.stdout is not None:
        popen.stdout.close()


def raw_tcp_seconds(size: int, *, runs: int) -> float | None:
    """Median seconds to receive `size` bytes over one loopback TCP connection from another
    process, into fresh memory (as a download does; nothing checked or copied)."""
    sender = subprocess.Popen(
        [sys.executable, "-c", RAW_SENDER, str(size)], stdout=subprocess.PIPE, text=True
    )
    try:
        line = read_line(sender, timeout=60)
        if not line.strip():
            return None
        port = int(line)
        samples = []
        for run in range(runs + 1):  # the first warms the sender's pages and the path
            buffer = np.empty(size, dtype=np.uint8)
            view = memoryview(buffer)
            started = time.perf_counter()
            with socket.create_connection(("127.0.0.1", port), timeout=60) as connection:
                got = 0
                while got < size:
                    count = connection.recv_into(view[got:])
                    if not count:
                        return None
                    got += count
            if run:
                samples.append(time.perf_counter() - started)
            del view, buffer
        return statistics.median(samples)
    finally:
        stop_child(sender)


# benchmarks.allreduce.run_case is being changed (one codec -> a list of codecs): either shape.
ALLREDUCE_CASE = """
import inspect, json
from benchmarks.allreduce import run_case
if "codecs" in inspect.signature(run_case).parameters:
    floor, figures = run_case({peers}, {megabytes}, {rounds}, ["none"])
    out = {{"floor": floor, "round": figures["none"]["round"]}}
else:
    out = run_case({peers}, {megabytes}, {rounds}, "none")
print(json.dumps({{"floor": out["floor"], "round": out["round"]}}))
"""


def allreduce_floor(
    vector_bytes: int, *, rounds: int, timeout: float
) -> tuple[float, float] | None:
    """(floor, round): `benchmarks.allreduce` for 3 peers and this vector, in a process group of
    its own so that a hang ends with it (its pipes have no timeouts)."""
    megabytes = math.ceil(vector_bytes / MB)
    code = ALLREDUCE_CASE.format(peers=PEERS, megabytes=megabytes, rounds=rounds)
    child = subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        return None
    if child.returncode != 0 or not out.strip():
        return None
    result = json.loads(out.strip().splitlines()[-1])
    return result["floor"], result["round"]


PLAIN_PROCESS = """
import sys, time, torch
from peer.training.task import load_task
torch.set_num_threads(1)
task, device = load_task(sys.argv[1]), torch.device(sys.argv[3])
model = task.build_model().to(device)
optimizer = task.make_optimizer(model.parameters())
generator = torch.Generator().manual_seed(0)
for _ in range(2):
    optimizer.zero_grad()
    batch = tuple(t.to(device) for t in task.sample_batch(int(sys.argv[2]), generator))
    task.loss(model, batch).backward()
    optimizer.step()
print("ready", flush=True)
time.sleep(3600)
"""


def plain_process_stop(
    task_name: str, micro_batch: int, device: str
) -> tuple[float | None, int | None]:
    """A plain process holding the model and AdamW after two steps on `device`, ended by
    SIGINT through the interpreter's default path: (seconds to exit, its peak RSS in bytes)."""
    child = subprocess.Popen(
        [sys.executable, "-c", PLAIN_PROCESS, task_name, str(micro_batch), device],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        if "ready" not in read_line(child, timeout=300):
            return None, None
        rss = vm_hwm(child.pid)
        child.send_signal(signal.SIGINT)
        seconds, _ = wait_exit(child, timeout=60)
        return seconds, rss
    finally:
        stop_child(child)


def vm_hwm(pid: int) -> int | None:
    """Peak resident memory of a live process in bytes (VmHWM), else None. Not the rusage of
    its exit: a child's ru_maxrss starts from its parent's peak (vfork + exec), ours."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024  # the kernel writes kB
    return None  # a zombie: its memory is gone


def available_memory() -> int:
    """The kernel's estimate of memory available without swapping, in bytes."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_exit(
    popen: subprocess.Popen, timeout: float, on_poll: Callable[[], None] = lambda: None
) -> tuple[float | None, int | None]:
    """Seconds until `popen` exits (None: not within `timeout`) and its exit code; `on_poll`
    runs every 10 ms until then (to read its memory until its last moments)."""
    started = time.monotonic()
    while True:
        on_poll()
        code = popen.poll()
        if code is not None:
            return time.monotonic() - started, code
        if time.monotonic() - started > timeout:
            return None, None
        time.sleep(0.01)


# ---------------------------------------------------------------------------- logs


def when(record: dict) -> float:
    return datetime.fromisoformat(record["ts"]).timestamp()


def outcomes(records: list[dict], since: float, until: float) -> Counter[str]:
    """The trainer's averaging outcomes logged in (since, until]: a step applied ("applied"
    field), "did not complete" or "missed the gathering" (a failure: the peer's work did not
    count in that step), "no sample in our group" (routine, not a step)."""
    counts: Counter[str] = Counter()
    for record in records:
        if record.get("logger") != "peertrain.trainer" or not since < when(record) <= until:
            continue
        msg = record.get("msg", "")
        if "applied" in record:
            counts["applied"] += 1
        elif (msg.startswith("averaging for step") and "did not complete" in msg) or (
            msg.startswith("missed the gathering of step")
        ):
            counts["failed"] += 1
        elif msg.startswith("no sample in our group"):
            counts["no sample"] += 1
    return counts


def steps(records: list[dict]) -> list[tuple[float, int]]:
    return [(when(r), r["applied"]["step"]) for r in records if "applied" in r]


def allreduce_seconds(records: list[list[dict]], since: float, until: float) -> list[float]:
    """The all-reduce rounds' seconds of every step applied in (since, until], as each peer
    logged them (`applied.allreduce_s`; 0 for a step taken alone)."""
    return [
        r["applied"]["allreduce_s"]
        for peer_records in records
        for r in peer_records
        if "applied" in r and since < when(r) <= until and r["applied"].get("allreduce_s")
    ]


CALL = re.compile(r"calling step (\d+): averaging at \+([0-9.]+)s")


def close_to_step(records: list[list[dict]], since: float, until: float) -> list[float]:
    """Per step applied in (since, until]: seconds from the close of its gathering (the
    caller's "calling step" log time plus the window it names) to the step's log line."""
    closes: dict[int, list[float]] = {}
    for peer_records in records:
        for record in peer_records:
            if match := CALL.match(record.get("msg", "")):
                closes.setdefault(int(match[1]), []).append(when(record) + float(match[2]))
    out = []
    for peer_records in records:
        for t, step in steps(peer_records):
            before = [c for c in closes.get(step, []) if c <= t]  # the call that made it
            if since < t <= until and before:
                out.append(t - max(before))
    return out


DOWNLOAD = re.compile(r"downloaded the state of step (\d+) \((\d+) bytes\) in ([0-9.]+) s")
ADOPTED = re.compile(r"downloaded the state of step (\d+) from (\d+) donors")


@dataclass
class Joiner:
    download_s: float | None = None
    state_bytes: int | None = None
    catch_up_s: float | None = None
    """From the download's start to the state loaded and held (training resumes)."""
    to_first_step_s: float | None = None
    """From the process's start to its first step applied after that."""
    problem: str = ""


def joiner_figures(records: list[dict], started: float) -> Joiner | None:
    """The late joiner's download and first step, once both are logged (else None)."""
    download = adopted = None
    for record in records:
        msg = record.get("msg", "")
        if download is None and (match := DOWNLOAD.match(msg)):
            download = (when(record), float(match[3]), int(match[2]))
        elif download is not None and adopted is None and ADOPTED.match(msg):
            adopted = when(record)
        elif adopted is not None and "applied" in record:
            end, took, size = download
            return Joiner(
                download_s=took,
                state_bytes=size,
                catch_up_s=adopted - (end - took),
                to_first_step_s=when(record) - started,
            )
    return None


# ---------------------------------------------------------------------------- the collaboration


@dataclass(frozen=True, kw_only=True)
class Settings:
    size: int
    mode: str
    micro_batch: int
    target_batch: int
    inner_steps: int
    ideal_step_s: float
    """A step's time if the peers did nothing but compute, at one thread's measured rate
    with the machine's cores shared among them."""


def choose_settings(size: int, mode: str, rate: float, args: argparse.Namespace) -> Settings:
    """Target batch (DeDLOC) or inner steps (DiLoCo) for a step of about --step-seconds."""
    micro_batch = SIZES[size].micro_batch
    per_peer = rate * min(1.0, len(os.sched_getaffinity(0)) / PEERS)
    if mode == "diloco":
        inner = args.inner_steps or max(1, round(args.step_seconds * per_peer / micro_batch))
        return Settings(
            size=size, mode=mode, micro_batch=micro_batch, target_batch=PEERS * inner * micro_batch,
            inner_steps=inner, ideal_step_s=inner * micro_batch / per_peer,
        )  # fmt: skip
    target = args.target_batch or micro_batch * max(
        PEERS, round(args.step_seconds * per_peer * PEERS / micro_batch)
    )
    return Settings(
        size=size, mode=mode, micro_batch=micro_batch, target_batch=target, inner_steps=1,
        ideal_step_s=target / (per_peer * PEERS),
    )  # fmt: skip


@dataclass
class Collab:
    workdir: Path
    problem: str = ""
    """Why the run ended early ("" if it did not)."""
    window: tuple[float, float] | None = None
    """Wall times: every peer had applied a step, and --minutes later."""
    steps_per_minute: float | None = None
    steps_in_window: tuple[int, int] = (0, 0)
    counts: Counter[str] = field(default_factory=Counter)
    """Averaging outcomes of the 3 peers in the window."""
    counts_all: Counter[str] = field(default_factory=Counter)
    """The same from their start to the end of the window."""
    close_to_step: list[float] = field(default_factory=list)
    allreduce_s: list[float] = field(default_factory=list)
    """The all-reduce rounds' seconds of each step applied in the window (every peer's)."""
    """Per step applied in the window: seconds from its gathering's close to the step's log."""
    rss: dict[str, int] = field(default_factory=dict)
    loops: dict[str, dict | None] = field(default_factory=dict)
    """Each process's log record with its `loop` figures (None: not logged)."""
    stall_warnings: int = 0
    joiner: Joiner | None = None
    stop_s: float | None = None
    stop_code: int | None = None
    memory_guard: str = ""
    """Set if the run was ended because the machine ran low on memory."""


def wait_for(condition: Callable[[], bool], *, timeout: float, watch: list[Proc]) -> str:
    """Poll `condition` every second until it holds (""), `timeout` passes or a watched
    process exits (what happened)."""
    deadline = time.monotonic() + timeout
    while not condition():
        for proc in watch:
            if proc.popen.poll() is not None:
                tail = proc.log.read_text(errors="replace")[-1500:]
                return (
                    f"{proc.name} exited with code {proc.popen.returncode}; its log ends:\n{tail}"
                )
        if time.monotonic() > deadline:
            return f"not within {timeout:.0f} s"
        time.sleep(1.0)
    return ""


def collaboration_env(settings: Settings, args: argparse.Namespace) -> dict[str, str]:
    return {
        "PEERTRAIN_TASK_NAME": f"benchmarks.scale_task:gpt_{settings.size}m",
        "PEERTRAIN_TASK_MICRO_BATCH": str(settings.micro_batch),
        "PEERTRAIN_TASK_TARGET_BATCH": str(settings.target_batch),
        "PEERTRAIN_TRAINING_MODE": settings.mode,
        "PEERTRAIN_TRAINING_INNER_STEPS": str(settings.inner_steps),
        "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "0",
        "PEERTRAIN_TRAINING_TARGET_VALIDATION_LOSS": "0",
        # Checkpoints during the run too, so their memory and stalls are in the figures.
        "PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": str(args.checkpoint_interval),
        "PEERTRAIN_LOG_LEVEL": args.log_level,
        "PEERTRAIN_TASK_DEVICE": args.device,
    }


def run_collaboration(settings: Settings, args: argparse.Namespace) -> Collab:
    workdir = Path(tempfile.mkdtemp(prefix=f"peertrain-scale-{settings.size}m-{settings.mode}-"))
    collab = Collaboration(workdir, collaboration_env(settings, args))
    result = Collab(workdir)
    rss = result.rss
    sampling = threading.Event()

    def note(name: str, value: int | None) -> None:
        if value:
            rss[name] = max(rss.get(name, 0), value)

    def sample_all() -> None:
        for proc in list(collab.procs):
            note(proc.name, vm_hwm(proc.popen.pid))

    def sample() -> None:  # VmHWM is the peak so far: a read a second is enough while alive
        while not sampling.wait(1.0):
            sample_all()
            # The machine is shared: end the run before the kernel's OOM killer picks a victim.
            if (free := available_memory()) < args.min_free_gb * 1e9 and not result.memory_guard:
                result.memory_guard = f"MemAvailable fell to {mb(free)}: every process killed"
                for proc in list(collab.procs):
                    proc.popen.kill()

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        backbone = collab.start_backbone()
        sampler.start()
        peers = [collab.start_peer(i) for i in range(PEERS)]
        everyone = [backbone, *peers]
        # 1. Until every peer has applied a step (start-up: imports, measurements, joining).
        result.problem = wait_for(
            lambda: all(steps(p.records()) for p in peers),
            timeout=args.startup_timeout,
            watch=everyone,
        )
        if result.problem:
            result.problem = f"not every peer applied a step: {result.problem}"
            return result
        start = max(steps(p.records())[0][0] for p in peers)
        # 2. The window.
        result.problem = wait_for(
            lambda: time.time() >= start + args.minutes * 60,
            timeout=args.minutes * 60 + 10,
            watch=everyone,
        )
        end = time.time()
        result.window = (start, end)
        records = [p.records() for p in peers]
        for peer_records in records:
            result.counts += outcomes(peer_records, start, end)
            result.counts_all += outcomes(peer_records, 0, end)
        applied = sorted(s for peer_records in records for s in steps(peer_records))
        first = max(step for t, step in applied if t <= start)
        last = max(step for t, step in applied if t <= end)
        result.steps_in_window = (first, last)
        result.steps_per_minute = (last - first) / (end - start) * 60
        result.close_to_step = close_to_step(records, start, end)
        result.allreduce_s = allreduce_seconds(records, start, end)
        if result.problem:
            return result
        # 3. A late joiner: it downloads the state, then trains.
        joined_at = time.time()
        joiner = collab.start_peer(PEERS)
        problem = wait_for(
            lambda: joiner_figures(joiner.records(), joined_at) is not None,
            timeout=args.joiner_timeout,
            watch=[backbone, joiner],
        )
        result.joiner = joiner_figures(joiner.records(), joined_at) or Joiner(problem=problem)
        # 4. SIGINT to peer 0, in the middle of training.
        peers[0].popen.send_signal(signal.SIGINT)
        result.stop_s, result.stop_code = wait_exit(peers[0].popen, 60, sample_all)
        # 5. Everyone stops (their event-loop figures are logged on the way out).
        for proc in reversed(collab.procs):  # the backbone last
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 30
        for proc in collab.procs:
            waited, _ = wait_exit(proc.popen, max(0.1, deadline - time.monotonic()), sample_all)
            if waited is None:
                proc.popen.kill()
                wait_exit(proc.popen, 10)
        result.loops = {proc.name: proc.loop_record() for proc in collab.procs}
        result.stall_warnings = sum(
            "loop_stall_ms" in r for proc in collab.procs for r in proc.records()
        )
        return result
    finally:
        sampling.set()
        collab.close()
        if sampler.is_alive():  # not started if the backbone did not start
            sampler.join(timeout=5)
        for folder in workdir.glob("checkpoints*"):  # GBs at 100 M; the logs stay
            shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------- the report


def mb(value: float) -> str:
    return f"{value / MB:,.1f} MB"


def seconds(value: float) -> str:
    return f"{value:.3f} s"


def report(settings: Settings, base: Baselines, run: Collab) -> tuple[list[Row], list[str]]:
    rows: list[Row] = []
    notes: list[str] = []
    if run.memory_guard:
        notes.append(f"MEMORY GUARD: {run.memory_guard}")
    if run.problem:
        notes.append(f"the run ended early: {run.problem}")

    # Memory.
    originals = [run.rss.get(f"peer{i}", 0) for i in range(PEERS)]
    if run.window and all(originals):
        peak = max(originals)
        rows.append(Row(
            "peak RSS per peer (max of 3)", f"{mb(peak)} ({', '.join(mb(v) for v in originals)})",
            f"state {mb(base.state_bytes)}", f"{peak / base.state_bytes:.2f}x", f"<= {RSS_GOAL}x",
            verdict(peak <= RSS_GOAL * base.state_bytes),
        ))  # fmt: skip
        if base.plain_rss:
            notes.append(
                f"a plain process holding the model and AdamW after 2 steps (torch, the corpus) "
                f"peaked at {mb(base.plain_rss)} = {base.plain_rss / base.state_bytes:.2f}x the "
                f"state; the peers' peak above it = {(peak - base.plain_rss) / base.state_bytes:.2f}x"
            )
        others = {"late joiner": run.rss.get(f"peer{PEERS}"), "backbone": run.rss.get("backbone")}
        notes.append("peak RSS: " + ", ".join(f"{n} {mb(v)}" for n, v in others.items() if v))
    else:
        why = "the run ended before training" if not run.window else "never read"
        rows.append(missing("peak RSS per peer", why, f"<= {RSS_GOAL}x"))

    # Steps and averaging.
    if run.steps_per_minute is not None and run.window:
        first, last = run.steps_in_window
        ideal = 60 / settings.ideal_step_s
        rows.append(Row(
            "steps per minute", f"{run.steps_per_minute:.2f} (steps {first}->{last} in "
            f"{run.window[1] - run.window[0]:.0f} s)", f"{ideal:.2f} if only computing",
            f"{run.steps_per_minute / ideal:.2f}x",
        ))  # fmt: skip
    else:
        rows.append(missing("steps per minute", "no window of training"))
    attempts = sum(run.counts.values())
    if attempts:
        failed = run.counts["failed"]
        rows.append(Row(
            "failed averaging attempts", f"{failed} of {attempts} ({failed / attempts:.1%})",
            goal=f">= {SUCCESS_GOAL:.0%} succeed",
            verdict=verdict(1 - failed / attempts >= SUCCESS_GOAL),
        ))  # fmt: skip
        notes.append(
            "averaging outcomes of the 3 peers in the window: "
            + ", ".join(f"{k} {v}" for k, v in sorted(run.counts.items()))
            + "; from their start: "
            + ", ".join(f"{k} {v}" for k, v in sorted(run.counts_all.items()))
            + " ('no sample': routine, counted as an attempt, not a failure)"
        )
    else:
        rows.append(missing("failed averaging attempts", "no averaging logged", ">= 95 %"))

    # The event loop.
    rows.extend(stall_rows(run, notes))
    if run.stall_warnings:
        notes.append(f"{run.stall_warnings} stall warnings logged (over 1 s; one a minute at most)")

    # All-reduce.
    floor = base.allreduce_floor
    if run.allreduce_s and floor:
        median = statistics.median(run.allreduce_s)
        rows.append(Row(
            "all-reduce s in training / floor", f"{seconds(median)} (median of "
            f"{len(run.allreduce_s)}, max {seconds(max(run.allreduce_s))})",
            f"floor {seconds(floor)}", f"{median / floor:.1f}x",
        ))  # fmt: skip
    else:
        why = "no floor" if not floor else "no step logged its all-reduce"
        rows.append(missing("all-reduce s in training / floor", why))
    if run.close_to_step and floor:
        close = statistics.median(run.close_to_step)
        rows.append(Row(
            "  proxy: gathering close -> step", f"{seconds(close)} (median of "
            f"{len(run.close_to_step)}; + matchmaking, step, capture)", f"floor {seconds(floor)}",
            f"{close / floor:.1f}x",
        ))  # fmt: skip
    if base.allreduce_round and floor:
        rows.append(Row(
            "  all-reduce alone, same vector", seconds(base.allreduce_round),
            f"floor {seconds(floor)}", f"{base.allreduce_round / floor:.1f}x",
        ))  # fmt: skip
    elif not floor:
        notes.append("the all-reduce floor could not be measured (benchmarks.allreduce failed)")

    # The late joiner.
    joiner, raw = run.joiner, base.raw_tcp
    if joiner and joiner.download_s is not None and raw:
        assert joiner.catch_up_s is not None and joiner.to_first_step_s is not None
        moved = f"raw TCP {seconds(raw)} ({mb(base.served_bytes)})"
        rows.append(Row(
            "late joiner: download", f"{seconds(joiner.download_s)} ({mb(joiner.state_bytes or 0)})",
            moved, f"{joiner.download_s / raw:.1f}x",
        ))  # fmt: skip
        rows.append(Row(
            "late joiner: download start -> training", seconds(joiner.catch_up_s),
            moved, f"{joiner.catch_up_s / raw:.1f}x", f"<= {JOIN_GOAL}x",
            verdict(joiner.catch_up_s <= JOIN_GOAL * raw),
        ))  # fmt: skip
        rows.append(
            Row("late joiner: process start -> first step", seconds(joiner.to_first_step_s))
        )
    else:
        why = ((joiner.problem if joiner else "") or "not run") if raw else "no raw TCP baseline"
        rows.append(missing("late joiner", why.splitlines()[0] if why else "?", f"<= {JOIN_GOAL}x"))

    # Checkpoints.
    ck = base.checkpoint
    rows.append(Row(
        "checkpoint save", seconds(ck["save_checkpoint"]), f"torch.save {seconds(ck['torch.save'])}",
        f"{ck['save_checkpoint'] / ck['torch.save']:.2f}x", f"<= {SAVE_GOAL}x",
        verdict(ck["save_checkpoint"] <= SAVE_GOAL * ck["torch.save"]),
    ))  # fmt: skip
    rows.append(Row(
        "checkpoint load", seconds(ck["load_latest"]), f"torch.load {seconds(ck['torch.load'])}",
        f"{ck['load_latest'] / ck['torch.load']:.2f}x",
    ))  # fmt: skip
    synced = ck["torch.save"] + ck["fsync after torch.save"]
    notes.append(
        f"save_checkpoint fsyncs (payload, record, folder); torch.save + an fsync took "
        f"{seconds(synced)}, save_checkpoint = {ck['save_checkpoint'] / synced:.2f}x that"
    )

    # Stopping.
    if run.stop_s is not None:
        rows.append(Row(
            "stop after SIGINT (peer0)", f"{seconds(run.stop_s)} (exit code {run.stop_code})",
            f"plain process {seconds(base.plain_stop)}" if base.plain_stop else "-",
            f"{run.stop_s / base.plain_stop:.2f}x" if base.plain_stop else "-",
            f"<= {STOP_GOAL:.0f} s", verdict(run.stop_s <= STOP_GOAL and run.stop_code == 0),
        ))  # fmt: skip
    else:
        why = "no exit within 60 s" if run.joiner else "the run ended before it"
        rows.append(missing("stop after SIGINT", why, f"<= {STOP_GOAL:.0f} s"))
    notes.append(f"logs: {run.workdir}")
    return rows, notes


def stall_rows(run: Collab, notes: list[str]) -> list[Row]:
    """The longest stall of the peers' whole runs (start-up and stop included) and in the
    window of steady training, from each daemon's `loop` record (`peer.loopwatch`)."""
    loops = {n: (when(r) - r["loop"]["watched_s"], r["loop"]) for n, r in run.loops.items() if r}
    peers = {n: v for n, v in loops.items() if n in {f"peer{i}" for i in range(PEERS)}}
    if not peers:
        return [missing("longest event-loop stall", "no peer logged its loop figures", "<= 100 ms")]
    t0, t1 = run.window or (0.0, 0.0)
    backbone = loops.get("backbone", (0.0, None))[1]
    base = f"backbone {backbone['longest_stall_ms']:.0f} ms" if backbone else "-"
    name, (_, worst) = max(peers.items(), key=lambda item: item[1][1]["longest_stall_ms"])
    stall = worst["longest_stall_ms"]
    rows = [Row(
        "longest event-loop stall, whole run", f"{stall:.0f} ms ({name}; "
        f"{sum(f['stalls_over_threshold'] for _, f in peers.values())} over 100 ms in all)",
        base, f"{stall / max(backbone['longest_stall_ms'], 0.1):.1f}x" if backbone else "-",
        f"<= {STALL_GOAL * 1000:.0f} ms", verdict(stall <= STALL_GOAL * 1000),
    )]  # fmt: skip
    # Only the 5 longest are logged: those in the window bound its longest from below; a
    # stall not listed is no longer than its process's 5th (or 100 ms, if fewer were over).
    low, high = 0.0, 0.0
    for start, fields in peers.values():
        listed = fields.get("worst_stalls", [])
        low = max([low, *(ms for ms, at in listed if t0 < start + at <= t1)])
        high = max(high, listed[-1][0] if len(listed) == WORST else STALL_GOAL * 1000)
    high = max(low, high)
    goal = STALL_GOAL * 1000
    if low >= high:
        text = f"{low:.0f} ms"
    elif low:
        text = f"{low:.0f} to {high:.0f} ms (only the 5 longest are logged)"
    else:
        text = f"<= {high:.0f} ms (none of the 5 longest per peer)"
    rows.append(Row(
        "  the same in the training window", text, base, goal=f"<= {goal:.0f} ms",
        verdict="PASS" if high <= goal else "FAIL" if low > goal else "?",
    ))  # fmt: skip
    notes.append(
        "5 longest stalls per process (ms @ s from the window's start): "
        + "; ".join(
            f"{n} "
            + ", ".join(
                f"{ms:.0f} @ {start + at - t0:+.0f}" for ms, at in f.get("worst_stalls", [])
            )
            for n, (start, f) in loops.items()
        )
    )
    return rows


# ---------------------------------------------------------------------------- main


def measure_baselines(
    size: int, mode: str, args: argparse.Namespace, shared: dict[str, object]
) -> Baselines:
    """This mode's state and its baselines; `shared` keeps the per-size ones (the all-reduce
    floor, the plain process) between modes."""
    micro_batch = SIZES[size].micro_batch
    worker, state, rate = product_state(
        size, mode, micro_batch, rate_seconds=args.rate_seconds, device=torch.device(args.device)
    )

    state_bytes = len(to_bytes(state))
    trio.run(worker.hold, 1)  # the state it serves, as a trainer holds it after a step
    assert worker.held is not None
    served_bytes = len(StateBytes(worker.held.state))
    parameters = sum(p.numel() for p in worker.model.parameters())
    vector_bytes = worker.vector_size * 4
    with tempfile.TemporaryDirectory(prefix="peertrain-scale-ck-") as folder:
        checkpoint = checkpoint_times(worker, state, Path(folder), repeats=args.repeats)
    del worker, state
    gc.collect()  # the peers get the memory back before they start
    if "floor" not in shared:
        shared["floor"] = allreduce_floor(vector_bytes, rounds=3, timeout=900)
        shared["plain"] = plain_process_stop(
            f"benchmarks.scale_task:gpt_{size}m", micro_batch, args.device
        )
    floor = shared["floor"]
    plain_stop, plain_rss = shared["plain"]  # type: ignore[misc]
    return Baselines(
        parameters=parameters,
        vector_bytes=vector_bytes,
        state_bytes=state_bytes,
        served_bytes=served_bytes,
        rate=rate,
        checkpoint=checkpoint,
        raw_tcp=raw_tcp_seconds(served_bytes, runs=args.repeats),
        allreduce_floor=floor[0] if floor else None,  # type: ignore[index]
        allreduce_round=floor[1] if floor else None,  # type: ignore[index]
        plain_stop=plain_stop,
        plain_rss=plain_rss,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--sizes", type=int, nargs="+", choices=sorted(SIZES), default=sorted(SIZES)
    )
    parser.add_argument(
        "--modes", nargs="+", choices=["dedloc", "diloco"], default=["dedloc", "diloco"]
    )
    parser.add_argument("--minutes", type=float, default=3.0, help="training window per run")
    parser.add_argument("--step-seconds", type=float, default=20.0, help="aimed-for step time")
    parser.add_argument(
        "--target-batch", type=int, default=0, help="DeDLOC; 0: from --step-seconds"
    )
    parser.add_argument("--inner-steps", type=int, default=0, help="DiLoCo; 0: from --step-seconds")
    parser.add_argument("--checkpoint-interval", type=float, default=60.0)
    parser.add_argument("--rate-seconds", type=float, default=5.0, help="timing one thread")
    parser.add_argument("--repeats", type=int, default=3, help="checkpoint and raw TCP runs")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    parser.add_argument("--joiner-timeout", type=float, default=600.0)
    parser.add_argument(
        "--min-free-gb", type=float, default=1.5, help="kill the run below this MemAvailable"
    )
    parser.add_argument(
        "--link-mbit", type=int, default=0, help="shape the loopback to this rate (root)"
    )
    parser.add_argument("--log-level", choices=["debug", "info"], default="info", help="peers'")
    parser.add_argument(
        "--device", default="cpu", help="the peers' task.device (cuda: all on one GPU)"
    )
    args = parser.parse_args()
    if args.link_mbit and SHAPED_ENV not in os.environ:  # the same run, in the namespace
        sys.exit(
            rerun_on_shaped_loopback(args.link_mbit, ["-m", "benchmarks.scale", *sys.argv[1:]])
        )
    if SHAPED_ENV in os.environ:
        print(f"loopback shaped to {os.environ[SHAPED_ENV]} Mbit/s (tbf) in a namespace of its own")
    torch.set_num_threads(1)
    cores = len(os.sched_getaffinity(0))
    summary: list[tuple[str, list[Row]]] = []
    for size in args.sizes:
        shared: dict[str, object] = {}
        for mode in args.modes:
            base = measure_baselines(size, mode, args, shared)
            settings = choose_settings(size, mode, base.rate, args)
            print(
                f"\n== {size} M ({base.parameters:,} parameters), {mode}: state {mb(base.state_bytes)}, "
                f"micro-batch {settings.micro_batch}, "
                + (f"H = {settings.inner_steps} inner steps" if mode == "diloco"
                   else f"target batch {settings.target_batch}")
                + f"; one thread: {base.rate:.1f} samples/s, so a step takes "
                f"{settings.ideal_step_s:.1f} s if {PEERS} peers only compute on {cores} cores",
                flush=True,
            )  # fmt: skip
            # ~8x the state above a plain process per peer at 10 M (2026-11-26): a guess only.
            guess = (PEERS + 1) * ((base.plain_rss or 0) + 8 * base.state_bytes)
            if guess > available_memory():
                print(
                    f"WARNING: {PEERS + 1} peers may need ~{mb(guess)}, {mb(available_memory())} "
                    f"is available; the run ends if less than {args.min_free_gb} GB remains",
                    flush=True,
                )
            run = run_collaboration(settings, args)
            rows, notes = report(settings, base, run)
            print_table(f"{size} M, {mode}", rows, notes)
            summary.append((f"{size} M {mode}", rows))
    print("\nSummary (goals of the scale issue):")
    for name, rows in summary:
        judged = [f"{r.what.strip()}: {r.verdict}" for r in rows if r.verdict in ("PASS", "FAIL")]
        print(f"  {name}: " + "; ".join(judged))


if __name__ == "__main__":
    main()
