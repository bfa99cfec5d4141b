"""deploy/testbed.sh: a collaboration of emulated hosts, one network namespace each, on one machine.

The slow tests (root, `ip` and `tc`; skipped otherwise) build a testbed under a unique namespace
prefix, check the shaping `tc` reports inside the namespaces, train a 3-peer collaboration across
them, and check that `down` leaves no namespace and no process behind. A kernel without
sch_netem gets tbf (rate only): the shaping check follows what the kernel offers. Every
subprocess has a timeout, and a fixture tears everything down by PID whatever happens.

The fast tests need neither root nor namespaces: syntax, help, argument errors, `down` on nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "testbed.sh"
SUBNET = "10.66.0"
STEPS = 12
# Per peer: rate, one-way delay, loss (the example links).
SHAPES = {
    "p1": ("100mbit", "5ms", "0%"),
    "p2": ("20mbit", "40ms", "0.5%"),
    "p3": ("10mbit", "80ms", "1%"),
}
ROOTLESS = os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc")
needs_root = pytest.mark.skipif(
    ROOTLESS, reason="needs root with ip and tc (network namespaces and traffic shaping)"
)


def script(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PEERTRAIN_", "TESTBED_"))}
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env={**clean, "PYTHON": sys.executable, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# --- fast: no root needed -------------------------------------------------------------------


def test_the_script_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr


def test_help_names_every_command_and_option():
    result = script("--help", timeout=10)
    assert result.returncode == 0, result.stderr
    for word in ("up N", "start", "wait", "status", "down", "run N", "--prefix", "--run-dir"):
        assert word in result.stdout, word
    for word in ("--subnet", "--shapes", "--shaper", "--max-steps", "--timeout"):
        assert word in result.stdout, word


def test_down_with_nothing_up_is_a_no_op(tmp_path):
    prefix = f"ptt{uuid.uuid4().hex[:6]}-"
    result = script("--prefix", prefix, "--run-dir", str(tmp_path / "run"), "down", timeout=30)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--shapes", "fast", "up", "3"], "--shapes entry fast: expected RATE,DELAY,LOSS"),
        (["--subnet", "10.0.0.0/16", "down"], "--subnet 10.0.0.0/16: expected an IPv4 /24"),
        (["--prefix", "a/b", "down"], "--prefix a/b: expected up to 32 letters"),
        (["up", "0"], "up N: N must be 1..200 peers"),
        (["launch"], "unknown command launch"),
        (["--bogus", "up", "1"], "unknown option --bogus"),
    ],
)
def test_bad_arguments_are_one_line_with_exit_1(args, expected, tmp_path):
    result = script("--run-dir", str(tmp_path / "run"), *args, timeout=10)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


# --- slow: namespaces, shaping, a real collaboration ----------------------------------------


@dataclass
class Bed:
    """One testbed under a unique prefix; `teardown` removes it whatever state it is in."""

    run_dir: Path
    prefix: str = field(default_factory=lambda: f"ptt{uuid.uuid4().hex[:6]}-")
    started: dict[str, int] = field(default_factory=dict)

    def __call__(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None):
        where = ["--prefix", self.prefix, "--run-dir", str(self.run_dir)]
        return script(*where, "--subnet", f"{SUBNET}.0/24", *args, env=env, timeout=timeout)

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def namespaces(self) -> set[str]:
        """Namespaces of exactly this testbed's form that exist now."""
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
        ).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        pattern = re.compile(re.escape(self.prefix) + r"(sw|bb|p\d+)")
        return {name for name in names if pattern.fullmatch(name)}

    def read_pids(self) -> dict[str, int]:
        path = self.run_dir / "pids"
        if path.exists():
            for line in path.read_text().splitlines():
                host, pid = line.split()
                self.started[host] = int(pid)
        return dict(self.started)

    def ours_alive(self) -> list[int]:
        """PIDs the script started that still run (a reused PID runs someone else's command)."""
        alive = []
        for pid in self.started.values():
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and str(self.run_dir) in " ".join(
                    proc.cmdline()
                ):
                    alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        return alive

    def teardown(self) -> None:
        self.read_pids()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self("down", timeout=60)
        for pid in self.ours_alive():  # whatever `down` missed, by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for name in self.namespaces():
            for pid in pids_in(name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)


def pids_in(namespace: str) -> list[int]:
    out = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, timeout=10
    ).stdout
    return [int(pid) for pid in out.split()]


@pytest.fixture
def bed(tmp_path):
    testbed = Bed(tmp_path / "run")
    try:
        yield testbed
    finally:
        testbed.teardown()


def netem_in_kernel(namespace: str) -> bool:
    tc = ["tc", "-n", namespace, "qdisc"]
    netem = [*tc, "add", "dev", "lo", "root", "netem", "delay", "1ms"]
    added = subprocess.run(netem, capture_output=True, timeout=10)
    if added.returncode == 0:
        subprocess.run([*tc, "del", "dev", "lo", "root"], capture_output=True, timeout=10)
    return added.returncode == 0


UNITS = {"": 1, "K": 1e3, "M": 1e6, "G": 1e9, "k": 1e3, "m": 1e6, "g": 1e9}
TIMES = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def root_qdisc(namespace: str, device: str) -> dict[str, object]:
    """The root qdisc of `device` as `tc qdisc show` prints it: kind, and rate in bit/s, delay in
    seconds and loss in percent where it shows them."""
    out = subprocess.run(
        ["tc", "-n", namespace, "qdisc", "show", "dev", device],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    ).stdout
    line = next(line for line in out.splitlines() if " root " in line)
    qdisc: dict[str, object] = {"kind": line.split()[1], "line": line}
    if m := re.search(r" rate (\d+(?:\.\d+)?)([KMG]?)bit", line):
        qdisc["rate"] = float(m[1]) * UNITS[m[2]]
    if m := re.search(r" delay (\d+(?:\.\d+)?)(ns|us|ms|s)\b", line):
        qdisc["delay"] = float(m[1]) * TIMES[m[2]]
    if m := re.search(r" loss (\d+(?:\.\d+)?)%", line):
        qdisc["loss"] = float(m[1])
    return qdisc


def requested(rate: str, delay: str, loss: str) -> tuple[float, float, float]:
    r = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate)
    d = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s)", delay)
    assert r and d
    return float(r[1]) * UNITS[r[2]], float(d[1]) * TIMES[d[2]], float(loss.rstrip("%"))


def status_rows(bed: Bed) -> list[dict]:
    result = bed("status", "--json", timeout=60)
    assert result.returncode == 0, result.stderr
    return [p for p in json.loads(result.stdout)["peers"] if p["role"] == "peer"]


def finished_figures(bed: Bed, host: str) -> dict | None:
    for line in (bed.run_dir / f"{host}.log").read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if "training" in record:
            return record["training"]
    return None


@pytest.mark.slow
@needs_root
def test_three_shaped_peers_train_across_namespaces_and_down_leaves_nothing(bed):
    shapes = " ".join(",".join(SHAPES[h]) for h in ("p1", "p2", "p3"))
    up = bed("--shapes", shapes, "up", "3")
    assert up.returncode == 0, up.stderr
    assert bed.namespaces() == {bed.ns(h) for h in ("sw", "bb", "p1", "p2", "p3")}

    # The shaping tc reports in the namespaces: each peer's upload (its eth0) and download (its
    # port on the bridge) as requested; the backbone's link left alone.
    netem = netem_in_kernel(bed.ns("bb"))
    if not netem:
        assert "no sch_netem: shaping rate only (tbf); delay and loss not applied" in up.stderr
    for host, shape in SHAPES.items():
        rate, delay, loss = requested(*shape)
        for namespace, device in ((bed.ns(host), "eth0"), (bed.ns("sw"), host)):
            qdisc = root_qdisc(namespace, device)
            if netem:
                assert qdisc["kind"] == "netem", qdisc
                assert qdisc["rate"] == rate and qdisc["delay"] == pytest.approx(delay), qdisc
                assert qdisc.get("loss", 0.0) == pytest.approx(loss), qdisc
            else:
                assert qdisc["kind"] == "tbf" and qdisc["rate"] == rate, qdisc
    assert root_qdisc(bed.ns("bb"), "eth0")["kind"] == "noqueue"
    assert root_qdisc(bed.ns("sw"), "bb")["kind"] == "noqueue"

    started = time.monotonic()
    start = bed("--max-steps", str(STEPS), "start", timeout=300)
    bed.read_pids()
    assert start.returncode == 0, start.stderr
    joined = dict(re.findall(r"(p\d) joined at [\d.]+ as (\w+)", start.stderr))
    assert set(joined) == set(SHAPES), start.stderr

    # Seen from the backbone's namespace: three peers, each announcing its own namespace's IP.
    rows, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = status_rows(bed)
        if len(rows) == 3:
            break
        time.sleep(1)
    addrs = {row["peer_id"]: row["addrs"] for row in rows}
    for host, peer_id in joined.items():
        ip = f"{SUBNET}.{int(host[1:]) + 1}"
        assert addrs.get(peer_id) == [f"/ip4/{ip}/tcp/4001/p2p/{peer_id}"], (host, rows)

    # Every peer reaches the last step, having averaged with the others across the bridge.
    waited = bed("--timeout", "300", "wait", timeout=360)
    elapsed = time.monotonic() - started
    assert waited.returncode == 0, (waited.stdout, waited.stderr)
    assert waited.stdout.split("\n")[:3] == [f"p{i} finished at step {STEPS}" for i in (1, 2, 3)]
    for host in SHAPES:
        figures = finished_figures(bed, host)
        assert figures is not None and figures["step"] == STEPS, (host, figures)
        assert figures["averaged_bytes"] > 0, (host, figures)
    print(f"\nshaper {'netem' if netem else 'tbf'}; trained {STEPS} steps in {elapsed:.1f} s")

    # down: every process stopped, every namespace gone.
    started_pids = bed.read_pids()
    assert set(started_pids) == {"bb", "p1", "p2", "p3"}
    down = bed("down")
    assert down.returncode == 0, down.stderr
    assert bed.namespaces() == set()
    assert bed.ours_alive() == []
    again = bed("down")
    assert (again.returncode, again.stderr) == (0, "")


@pytest.mark.slow
@needs_root
def test_run_tears_down_after_a_failed_start(bed):
    # The backbone cannot start (its interpreter is `false`): run fails, and its trap cleans up.
    result = bed("run", "2", env={"PYTHON": "/bin/false"}, timeout=120)
    assert result.returncode == 1
    assert "backbone did not start" in result.stderr
    assert "namespaces deleted" in result.stderr
    assert bed.namespaces() == set()
    assert set(bed.read_pids()) == {"bb"} and bed.ours_alive() == []


@pytest.mark.slow
@needs_root
def test_down_after_a_partial_up_kills_what_runs_inside_and_deletes_it(bed):
    # Left-overs of an interrupted `up`: two namespaces, a process in one of them.
    for host in ("sw", "p2"):
        subprocess.run(["ip", "netns", "add", bed.ns(host)], check=True, timeout=10)
    sleeper = subprocess.Popen(["ip", "netns", "exec", bed.ns("p2"), "sleep", "300"])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not pids_in(bed.ns("p2")):
            time.sleep(0.1)
        refused = bed("up", "2")
        assert refused.returncode == 1 and "run down first" in refused.stderr
        down = bed("down")
        assert down.returncode == 0, down.stderr
        assert sleeper.wait(timeout=10) == -signal.SIGKILL
        assert bed.namespaces() == set()
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait(timeout=10)


@pytest.mark.slow
@needs_root
def test_run_trains_and_tears_down(bed):
    result = bed("--shapes", "-", "--max-steps", "3", "run", "2", timeout=400)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["p1 finished at step 3", "p2 finished at step 3"]
    assert "namespaces deleted" in result.stderr
    assert bed.namespaces() == set()
    assert set(bed.read_pids()) == {"bb", "p1", "p2"} and bed.ours_alive() == []
