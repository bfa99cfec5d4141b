"""Chaos (network): a backbone and 4 peers train the default task (the byte-level GPT) across
emulated hosts, one network namespace each, built by deploy/testbed.sh (the user-space switch,
deploy/impair.py, where the kernel has no sch_netem), under four kinds of network:

1. 200 ms RTT: every peer's link 50 Mbit/s with 100 ms one-way delay (each way: its upload and
   its download), with the testbed's gathering window (3 s) and with 1 s (the trainer widens
   it by the measured DHT store time).
2. 2 % loss on every peer's link (each way), 50 Mbit/s, 5 ms.
3. Bandwidth caps: 5 Mbit/s on every peer's link (a state download, 10 MB with the optimizer
   state, takes 20-23 s at that rate; an averaging moves ~5 MB per peer each way).
4. A partition, healed: two peers cut off for PARTITION_S seconds during training, one by
   taking its eth0 down (it sees `network unreachable` at once), the other silently (a
   blackhole qdisc replaces the shaping on both ends of its veth: everything it sends or is sent
   vanishes); then both links are restored as they were. They must rejoin and end with the
   others' parameters; the figures say how the two sides were reconciled (who stepped alone
   during the cut, who downloaded whose state after the heal).

Checked in every scenario (tests/chaos/invariants.py): the global step read by a status client
in the backbone's namespace (`testbed.sh status --json --watch`) never goes backwards, nor does
any peer's own step in its log; every peer exits 0 after `training finished` at max_steps; the
peers' final checkpoints hold bit-identical parameters (and those that evaluated the last step
logged the same validation loss, at most invariants.TARGET_VALIDATION); every checkpoint folder passes the independent check; the
global step advances within every WINDOW seconds; the backbone's SIGINT stop ends within 10 s;
no log line carries an error or a traceback.

How the processes are ours: testbed.sh starts them in the background and exits, so the test
process makes itself a child subreaper (prctl PR_SET_CHILD_SUBREAPER) while a testbed runs: the
orphaned backbone and peers become its children, and their exit status is read with waitpid, by
the PIDs the script recorded. Every test bounds its time; `down`, then a kill by PID of whatever
it missed and a deletion of the namespaces, clean up whatever happens.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

from peer.files import state_folder
from tests.chaos.harness import COLLABORATION, ChaosCollaboration
from tests.chaos.invariants import (
    check_all,
    check_peer_steps_monotonic,
    last_training_figures,
    log_time,
    peer_step_events,
    regressions,
)
from tests.collab_processes import Proc

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "testbed.sh"
PEERS = 4
#: Inside the namespaces only (nothing is routed from the root namespace): any /24 will do.
SUBNET = "10.79.0"

CAN_RUN = (
    sys.platform == "linux"
    and os.geteuid() == 0
    and shutil.which("ip") is not None
    and shutil.which("tc") is not None
)
pytestmark = [
    pytest.mark.chaos,
    pytest.mark.skipif(
        not CAN_RUN,
        reason="needs Linux, root, and iproute2 (ip, tc): network namespaces and traffic shaping",
    ),
]

#: The default task with the testbed's own small-batch defaults (testbed.sh's peer_env: micro
#: batch 16, target batch 256, gathering window 3 s, progress every 0.5 s, validation every 5
#: steps) and its default averaging deadlines (floor 5 s, join 5 s): a 256-sample batch is a few
#: seconds of 4 peers' compute on 2 shared cores, so a step is not all communication.
NETNS_ENV = {
    "PEERTRAIN_TASK_NAME": "gpt",
    "PEERTRAIN_MEASURE_COMPUTE_SECONDS": "0.5",
    "PEERTRAIN_TRAINING_VALIDATION_BATCHES": "2",
}
#: A multiple of the validation interval (5), so the peers that apply the last step evaluate it.
MAX_STEPS = 15
#: The global step must rise at least once in every WINDOW seconds: a step is a batch (a few
#: seconds), a gathering (3 s, widened behind slow DHT stores), an averaging (5 s floor plus the
#: predicted transfer, ~5 MB per peer: 8 s at 5 Mbit/s) and maybe a failed attempt or two and a
#: state download first; times 4 for 2 cores shared with other runs.
WINDOW = 180.0
#: Longest waits: every peer joined; the first step; every peer finished.
START_TIMEOUT = 300.0
FIRST_STEP_TIMEOUT = 300.0
TRAIN_TIMEOUT = 900.0
#: The partition: from the first read of global step PARTITION_AT, for PARTITION_S seconds.
PARTITION_AT = 4
PARTITION_S = 35.0
PARTITION_STEPS = 25

#: Whatever the child's status: the process was not ours to wait for (it ended while testbed.sh
#: was still its parent, which reaped it).
NOT_OURS = "unknown (reaped by testbed.sh, not by the test)"

PR_SET_CHILD_SUBREAPER = 36
#: The status client's command: a JSON report every second, from the backbone's namespace.
WATCH = ["status", "--json", "--watch", "--interval", "1"]


@contextlib.contextmanager
def child_subreaper() -> Iterator[None]:
    """While inside, orphans of our descendants (testbed.sh's background processes) are
    re-parented to this process rather than to init, so we can wait for them."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        pytest.skip(f"prctl(PR_SET_CHILD_SUBREAPER): {os.strerror(ctypes.get_errno())}")
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


class Reaped:
    """The `subprocess.Popen` face (pid, poll, wait, kill, returncode) of a process testbed.sh
    started in the background: our child once the script has exited (`child_subreaper`).
    Before that, or if it never became ours, it counts as running while a process with that PID
    runs a command containing `mark` (a PID reused since runs someone else's)."""

    stdout = None

    def __init__(self, pid: int, mark: str) -> None:
        self.pid = pid
        self.mark = mark
        self.returncode: int | str | None = None

    def _reap(self) -> bool:
        """Whether it is our child (reaped now if it has exited)."""
        try:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)
        return True

    def poll(self) -> int | str | None:
        if self.returncode is None and not self._reap() and not self._runs_ours():
            self.returncode = NOT_OURS
        return self.returncode

    def _runs_ours(self) -> bool:
        try:
            proc = psutil.Process(self.pid)
            return proc.status() != psutil.STATUS_ZOMBIE and self.mark in " ".join(proc.cmdline())
        except psutil.Error:
            return False

    def wait(self, timeout: float | None = None) -> int | str:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.1)
        return code

    def kill(self) -> None:
        """SIGKILL, only while it is our running child (never a PID we cannot vouch for)."""
        if self.returncode is None and self._reap() and self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


@dataclass
class NetnsBed:
    """One testbed under a unique prefix (deploy/testbed.sh), and what it started."""

    run_dir: Path
    env: dict[str, str]
    prefix: str = field(default_factory=lambda: f"ptc{uuid.uuid4().hex[:6]}-")
    pids: dict[str, int] = field(default_factory=dict)
    switch: int | None = None

    def __call__(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["bash", str(SCRIPT), *self.where(), *args],
            env=self.environment(),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def where(self) -> list[str]:
        return [
            *("--prefix", self.prefix, "--run-dir", str(self.run_dir)),
            *("--subnet", f"{SUBNET}.0/24"),
        ]

    def environment(self) -> dict[str, str]:
        clean = {
            k: v for k, v in os.environ.items() if not k.startswith(("PEERTRAIN_", "TESTBED_"))
        }
        return {**clean, "PYTHON": sys.executable, **self.env}

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def namespaces(self) -> set[str]:
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
        ).stdout
        pattern = re.compile(re.escape(self.prefix) + r"(sw|bb|p\d+)")
        return {line.split()[0] for line in out.splitlines() if pattern.fullmatch(line.split()[0])}

    def read_pids(self) -> dict[str, int]:
        path = self.run_dir / "pids"
        if path.exists():
            for line in path.read_text().splitlines():
                host, pid = line.split()
                self.pids[host] = int(pid)
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.switch = int((self.run_dir / "switch.pid").read_text())
        return dict(self.pids)

    def reaped(self, host: str) -> Reaped:
        """The process started for `host` (bb, pI); its command names our run dir."""
        return Reaped(self.pids[host], str(self.run_dir))

    def ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)

    def tc(self, *args: str) -> str:
        return subprocess.run(
            ["tc", *args], check=True, capture_output=True, text=True, timeout=10
        ).stdout

    def teardown(self) -> str:
        """`down`; then, by PID, whatever it missed; then the namespaces; then reap whatever of
        ours became a zombie. Returns what `down` said."""
        self.read_pids()
        said = ""
        with contextlib.suppress(subprocess.TimeoutExpired):
            said = self("down", timeout=120).stderr
        mine = [self.reaped(host) for host in self.pids]
        if self.switch:
            mine.append(Reaped(self.switch, "deploy/impair.py"))
        for proc in mine:
            proc.kill()  # only if still our running child
        for name in self.namespaces():
            out = subprocess.run(
                ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10
            ).stdout
            for pid in map(int, out.split()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
        for proc in mine:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        return said


@dataclass
class NetnsCollaboration(ChaosCollaboration):
    """The chaos harness's bookkeeping for a testbed: the global-step samples come from a status
    watcher in the backbone's namespace; checkpoints are in the run dir's pI.checkpoints."""

    def checkpoint_dir(self, index: int, task: str = "gpt") -> Path:
        return state_folder(str(self.workdir / f"p{index}.checkpoints"), COLLABORATION, task)

    def record(self, report: dict) -> None:
        progress = report.get("progress") or []
        if not progress:
            return
        training = (report.get("collaboration") or {}).get("training") or {}
        step = training.get("global_step", max(r["step"] for r in progress))
        now = self.now()
        self.global_steps.append(step)
        self.step_samples.append((now, step))
        self.record_samples.append(
            {"t": round(now, 2), "steps": {r["peer_id"][-6:]: r["step"] for r in progress}}
        )


@dataclass
class StatusWatcher:
    """`testbed.sh status --json --watch` in its own session: one JSON report after another,
    each recorded by a reader thread."""

    popen: subprocess.Popen[bytes]
    thread: threading.Thread
    errors: Path
    ended_early: str | None = None

    @classmethod
    def start(cls, bed: NetnsBed, collab: NetnsCollaboration) -> StatusWatcher:
        errors = bed.run_dir / "status.err"
        with errors.open("ab") as sink:
            popen = subprocess.Popen(
                ["bash", str(SCRIPT), *bed.where(), *WATCH],
                env=bed.environment(),
                stdout=subprocess.PIPE,
                stderr=sink,
                start_new_session=True,
            )

        def read() -> None:
            assert popen.stdout is not None
            decoder, buffer = json.JSONDecoder(), ""
            while chunk := popen.stdout.read1(1 << 16):
                buffer += chunk.decode(errors="replace")
                while buffer := buffer.lstrip():
                    try:
                        report, end = decoder.raw_decode(buffer)
                    except ValueError:
                        break
                    buffer = buffer[end:]
                    if isinstance(report, dict):
                        collab.record(report)

        thread = threading.Thread(target=read, daemon=True)
        thread.start()
        return cls(popen, thread, errors)

    def stop(self) -> int:
        """SIGINT to its session (bash and the status client), SIGKILL after 10 s; the number of
        reads that failed (a line each on stderr). A client that had exited by itself is noted
        in `ended_early` (its exit status and last error lines)."""
        if (code := self.popen.poll()) is not None:
            tail = self.errors.read_text(errors="replace")[-500:] if self.errors.exists() else ""
            self.ended_early = f"exited {code} before it was stopped: {tail}"
        try:
            children = [p.pid for p in psutil.Process(self.popen.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            children = []
        for sig in (signal.SIGINT, signal.SIGKILL):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
            try:
                self.popen.wait(timeout=10)
                break
            except subprocess.TimeoutExpired:
                continue
        for pid in children:  # re-parented to us if bash went first: reap them
            with contextlib.suppress(subprocess.TimeoutExpired):
                Reaped(pid, "cli.peer_cli").wait(timeout=5)
        self.thread.join(timeout=10)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        text = self.errors.read_text(errors="replace") if self.errors.exists() else ""
        return sum(1 for line in text.splitlines() if line.startswith("status:"))


# ------------------------------------------------------------------------------ figures


def messages(proc: Proc) -> list[tuple[float | None, str]]:
    return [(log_time(r), str(r.get("msg", ""))) for r in proc.records()]


def spread(values: list[float]) -> dict | None:
    if not values:
        return None
    return {
        "n": len(values),
        "min": round(min(values), 2),
        "median": round(statistics.median(values), 2),
        "max": round(max(values), 2),
    }


def network_figures(peers: dict[int, Proc]) -> dict:
    """What the network did to the peers, read off their logs: the gathering windows they
    called (after widening), their state downloads (seconds, bytes), tickets stored after the
    gathering closed, averagings that failed, failed downloads, their measured links, and what
    each had averaged and computed at the end."""
    windows, downloads, sizes, late, links, per_peer = [], [], [], 0, {}, {}
    for i, proc in peers.items():
        failed_averaging = failed_downloads = 0
        for _, msg in messages(proc):
            if m := re.match(r"calling step \d+: averaging at \+([\d.]+)s", msg):
                windows.append(float(m[1]))
            elif m := re.match(
                r"downloaded the state of step \d+ \((\d+) bytes\) in ([\d.]+) s", msg
            ):
                sizes.append(int(m[1]))
                downloads.append(float(m[2]))
            elif "after the gathering closed" in msg:
                late += 1
            elif msg.startswith("averaging for step"):
                failed_averaging += 1
            elif msg.startswith("state download failed"):
                failed_downloads += 1
            elif msg.startswith("link: "):
                links[f"peer{i}"] = msg[len("link: ") :]
        final = last_training_figures(proc) or {}
        per_peer[f"peer{i}"] = {
            "failed_averagings": failed_averaging,
            "failed_downloads": failed_downloads,
            **{k: final.get(k) for k in ("averaged_bytes", "utilisation", "wall_s")},
        }
    return {
        "called_windows_s": spread(windows),
        "downloads_s": spread(downloads),
        "state_bytes": max(sizes, default=None),
        "tickets_stored_late": late,
        "links_measured": links,
        "per_peer": per_peer,
    }


def first_in_logs(peers: dict[int, Proc], step: int, since: float) -> float | None:
    """Seconds from `since` (wall clock) until a peer's log first says it holds `step`."""
    times = [t for p in peers.values() for t, s, _ in peer_step_events(p) if t and s >= step]
    return round(min(times) - since, 1) if times else None


def first_step_at(collab: NetnsCollaboration, step: int) -> float | None:
    return next((round(t, 1) for t, s in collab.step_samples if s >= step), None)


# ------------------------------------------------------------------------------ the run


Disturbance = Callable[[NetnsBed, NetnsCollaboration, dict], None]
Afterwards = Callable[[dict[int, Proc], NetnsCollaboration, dict], dict]


def run_scenario(
    tmp_path: Path,
    title: str,
    *,
    shapes: str,
    max_steps: int = MAX_STEPS,
    env: dict[str, str] | None = None,
    disturb: Disturbance | None = None,
    afterwards: Afterwards | None = None,
) -> None:
    """Up a testbed of a backbone and PEERS peers with `shapes` on every peer's link, train to
    `max_steps` (with `disturb` run once the global step is 1), check every invariant, and
    tear everything down; the figures (with those `afterwards` adds from the peers' logs) go to
    stdout and <run dir>/report.json."""
    settings = {**NETNS_ENV, **(env or {})}
    bed = NetnsBed(tmp_path / "run", settings)
    bed.run_dir.mkdir(parents=True)
    collab = NetnsCollaboration(bed.run_dir, settings)
    figures: dict = {"shapes": shapes, "env": settings, "run_dir": str(bed.run_dir)}
    failures = ["the run ended before its checks"]
    watcher: StatusWatcher | None = None
    peers: dict[int, Proc] = {}
    with child_subreaper():
        try:
            up = bed("--shapes", shapes, "up", str(PEERS))
            assert up.returncode == 0, up.stderr[-3000:]
            state = (bed.run_dir / "state").read_text()
            figures["shaper"] = re.search(r"^shaper=(\w+)", state, re.M)[1]  # type: ignore[index]
            collab.note(f"up: {PEERS} peers, shaper {figures['shaper']}")

            start = bed("--max-steps", str(max_steps), "start", timeout=START_TIMEOUT)
            pids = bed.read_pids()
            backbone = Proc("backbone", bed.reaped("bb"), bed.run_dir / "bb.log")  # type: ignore[arg-type]
            for i in range(1, PEERS + 1):
                if f"p{i}" in pids:
                    popen = bed.reaped(f"p{i}")
                    peers[i] = Proc(f"peer{i}", popen, bed.run_dir / f"p{i}.log")  # type: ignore[arg-type]
            collab.procs = [backbone, *peers.values()]
            assert start.returncode == 0, start.stderr[-3000:]
            collab.note("every peer joined")
            started, joined_at = collab.now(), time.time()

            watcher = StatusWatcher.start(bed, collab)
            assert collab.wait_for_step(1, timeout=FIRST_STEP_TIMEOUT), (
                f"no step 1 within {FIRST_STEP_TIMEOUT}s of every peer joining"
            )
            collab.note("global step 1 read")
            figures["first_step_after_join_s"] = round(first_step_at(collab, 1) - started, 1)  # type: ignore[operator]
            if disturb is not None:
                disturb(bed, collab, figures)

            deadline = time.monotonic() + TRAIN_TIMEOUT
            while time.monotonic() < deadline and any(
                p.popen.poll() is None for p in peers.values()
            ):
                time.sleep(1.0)
            for proc in peers.values():  # past the deadline: stopped, then failed below
                if proc.popen.poll() is None:
                    collab.stop(proc)
                    collab.note(f"{proc.name} still training after {TRAIN_TIMEOUT}s")
            collab.note(f"global step {collab.global_step()} when the last peer exited")
            collab.failed_reads = watcher.stop()
            if watcher.ended_early:
                collab.note(f"the status client {watcher.ended_early}")
            watcher = None

            checked, failures = check_all(
                collab, peers, backbone, max_steps=max_steps, window=WINDOW, finish_timeout=15
            )
            figures.update(checked)
            try:
                figures["peer_step_changes"] = check_peer_steps_monotonic(list(peers.values()))
            except AssertionError as error:
                failures.append(f"peer_steps_monotonic: {str(error)[:3000]}")
            figures["max_steps_after_join_s"] = first_in_logs(peers, max_steps, joined_at)
            figures["network"] = network_figures(peers)
        finally:
            if afterwards is not None and peers:
                try:
                    figures.update(afterwards(peers, collab, figures))
                except Exception as error:  # figures only: never hide the outcome
                    figures["afterwards_error"] = repr(error)
            if watcher is not None:
                collab.failed_reads = watcher.stop()
            said = bed.teardown()
            figures["switch"] = next(
                (line for line in said.splitlines() if "user switch" in line), None
            )
            if bed.namespaces():
                failures.append(f"namespaces left: {sorted(bed.namespaces())}")
            collab.report(title, failures=failures, regressions=regressions(collab), **figures)
    assert not failures, failures


# ------------------------------------------------------------------------------ scenarios


@pytest.mark.parametrize("gather_window", ["3.0", "1.0"])
def test_200ms_rtt_on_every_link(tmp_path, gather_window):
    run_scenario(
        tmp_path,
        f"netns: 200 ms RTT, gather window {gather_window}",
        shapes="50mbit,100ms,0%",
        env={"PEERTRAIN_TRAINING_GATHER_WINDOW": gather_window},
    )


def test_2_percent_loss_on_every_link(tmp_path):
    run_scenario(tmp_path, "netns: 2% loss each way", shapes="50mbit,5ms,2%")


def test_5mbit_cap_on_every_link(tmp_path):
    run_scenario(tmp_path, "netns: 5 Mbit/s links", shapes="5mbit,5ms,0%")


def restorable(bed: NetnsBed, namespace: str, device: str) -> list[str]:
    """`tc qdisc replace` arguments that put back the root qdisc of `device` as it is now
    (the testbed's tbf, or netem where the kernel has it)."""
    line = bed.tc("-n", namespace, "qdisc", "show", "dev", device).splitlines()[0]
    words = line.split()
    assert words[0] == "qdisc" and "root" in words, line
    kind, rest = words[1], words[words.index("root") + 1 :]
    if rest[:1] == ["refcnt"]:
        rest = rest[2:]
    return ["root", kind, *["latency" if w == "lat" else w for w in rest]]


def partition(bed: NetnsBed, collab: NetnsCollaboration, figures: dict) -> None:
    """Cut p3 (eth0 down) and p4 (blackholed, silently) off for PARTITION_S seconds from global
    step PARTITION_AT, then put both links back as they were."""
    assert collab.wait_for_step(PARTITION_AT, timeout=2 * WINDOW), f"no step {PARTITION_AT}"
    shaping = {
        (bed.ns("p4"), "eth0"): restorable(bed, bed.ns("p4"), "eth0"),
        (bed.ns("sw"), "p4"): restorable(bed, bed.ns("sw"), "p4"),
    }
    part: dict = {"seconds": PARTITION_S, "cut_at_global_step": collab.global_step()}
    figures["partition"] = part
    try:
        part["cut_wall"], part["cut_t"] = time.time(), collab.now()
        bed.ip("-n", bed.ns("p3"), "link", "set", "dev", "eth0", "down")
        for namespace, device in shaping:
            bed.tc("-n", namespace, "qdisc", "replace", "dev", device, "root", "blackhole")
        collab.note(f"p3 eth0 down, p4 blackholed, at global step {part['cut_at_global_step']}")
        time.sleep(PARTITION_S)
    finally:
        bed.ip("-n", bed.ns("p3"), "link", "set", "dev", "eth0", "up")
        for (namespace, device), args in shaping.items():
            bed.tc("-n", namespace, "qdisc", "replace", "dev", device, *args)
        part["heal_wall"], part["heal_t"] = time.time(), collab.now()
    part["healed_at_global_step"] = collab.global_step()
    collab.note(f"healed at global step {part['healed_at_global_step']}")
    part["restored_qdiscs"] = {
        f"{ns}:{dev}": bed.tc("-n", ns, "qdisc", "show", "dev", dev).splitlines()[0]
        for ns, dev in shaping
    }


def reconciliation(peers: dict[int, Proc], collab: NetnsCollaboration, figures: dict) -> dict:
    """How the two sides of the partition came back together, from the peers' logs and the
    status reads: each peer's step at the cut and at the heal, the steps it applied during the
    cut and after the heal (and how many of them alone), its state downloads after the heal;
    and the seconds from the heal until a status read first saw all PEERS peers' records at one
    step."""
    part = figures.get("partition") or {}
    if "heal_wall" not in part:
        return {}
    cut, heal = part["cut_wall"], part["heal_wall"]
    out: dict = {}
    for i, proc in peers.items():
        events = [(t, step, line) for t, step, line in peer_step_events(proc) if t is not None]
        during = [line for t, _, line in events if cut <= t < heal and line.startswith("step ")]
        after = [line for t, _, line in events if t >= heal and line.startswith("step ")]
        out[f"peer{i}"] = {
            "step_at_cut": max((s for t, s, _ in events if t < cut), default=0),
            "step_at_heal": max((s for t, s, _ in events if t < heal), default=0),
            "steps_during_cut": len(during),
            "alone": sum(1 for line in during if re.match(r"step \d+: 1 peers", line)),
            "downloads_after_heal": [
                s for t, s, line in events if t >= heal and line.startswith("downloaded")
            ],
            "steps_after_heal": len(after),
            "alone_after_heal": sum(1 for line in after if re.match(r"step \d+: 1 peers", line)),
        }
    together = next(
        (
            round(r["t"] - part["heal_t"], 1)
            for r in collab.record_samples
            if r["t"] >= part["heal_t"]
            and len(r["steps"]) == len(peers)
            and len(set(r["steps"].values())) == 1
        ),
        None,
    )
    return {"reconciliation": {"all_at_one_step_after_heal_s": together, **out}}


def test_partition_of_two_peers_heals(tmp_path):
    """The partitioned peers must rejoin and catch up: they finish at max_steps with the others'
    parameters (checked with every other invariant by `run_scenario`)."""

    run_scenario(
        tmp_path,
        f"netns: p3 and p4 partitioned for {PARTITION_S:g}s",
        shapes="50mbit,5ms,0%",
        max_steps=PARTITION_STEPS,
        disturb=partition,
        afterwards=reconciliation,
    )
