"""End to end through the real CLI, every node a separate process on loopback."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from tests.helpers import load_factor, needs_ipv6
from tests.hostile.test_participants import write_key

ROOT = Path(__file__).resolve().parent.parent
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
NOBODY = "12D3KooWRq4tRRfDE1ZbAnpYPiwCxsQhV2U8uFDtM3qjUfASSFMV"  # a peer id no one runs
# configs/debug.toml: presence ttl 4 s, refresh 1 s, loopback only.
ENV = {
    **os.environ,
    "PEERTRAIN_CONFIG": str(ROOT / "configs" / "debug.toml"),
    "PYTHONUNBUFFERED": "1",
}


class Proc:
    """A CLI process whose stdout lines are read on a thread, so waits can have deadlines."""

    def __init__(self, args: list[str]) -> None:
        self.popen = subprocess.Popen(
            self.command(args),
            cwd=ROOT,
            env=self.environment(),
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def command(self, args: list[str]) -> list[str]:
        return [sys.executable, "-m", *args]

    def environment(self) -> dict[str, str]:
        return ENV

    def _pump(self) -> None:
        for line in self.popen.stdout:  # type: ignore[union-attr]
            self.lines.put(line)

    def wait_line(self, needle: str, *, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.1)
            except queue.Empty:
                if self.popen.poll() is not None:
                    break
                continue
            self.seen.append(line)
            if needle in line:
                return line
        raise AssertionError(
            f"no line with {needle!r} within {timeout}s; got {self.seen}; "
            f"stderr: {self.stderr_if_done()}"
        )

    def stderr_if_done(self) -> str:
        return self.popen.stderr.read() if self.popen.poll() is not None else "(still running)"  # type: ignore[union-attr]


class IsolatedProc(Proc):
    """A CLI process whose checkpoints stay in the test's own folder (never ~/.peertrain)."""

    def __init__(self, args: list[str], checkpoints: Path) -> None:
        self.checkpoints = checkpoints
        super().__init__(args)

    def environment(self) -> dict[str, str]:
        return {**ENV, "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(self.checkpoints)}


@pytest.fixture
def procs(tmp_path):
    """Starts CLI processes and kills every one of them (by PID) at the end."""
    started: list[Proc] = []

    def start(*args: str) -> Proc:
        proc = IsolatedProc(list(args), tmp_path / f"checkpoints{len(started)}")
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.popen.poll() is None:
            proc.popen.kill()
        proc.popen.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_backbone(
    start,
    tmp: Path,
    name: str,
    *bootstrap: str,
    port: int | None = None,
    options: tuple = (),
    listen: str = LOOPBACK,
) -> tuple[Proc, str]:
    args = [
        "cli.backbone_cli",
        "start",
        "--identity",
        str(tmp / f"{name}.key"),
        "--listen",
        listen,
        *options,
    ]
    if port is not None:
        args += ["--port", str(port)]
    for addr in bootstrap:
        args += ["--bootstrap", addr]
    proc = start(*args)
    line = proc.wait_line("peer join --backbone /ip", timeout=30)
    return proc, line.split("--backbone ", 1)[1].strip()


def start_peer(
    start, tmp: Path, name: str, backbones: list[str], *, listen: str = LOOPBACK
) -> tuple[Proc, str]:
    args = ["cli.peer_cli", "join", "--identity", str(tmp / f"{name}.key"), "--listen", listen]
    for addr in backbones:
        args += ["--backbone", addr]
    proc = start(*args)
    line = proc.wait_line(" joined collaboration", timeout=30)
    return proc, line.split()[1]


def status(backbones: list[str]) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "cli.peer_cli", "status", "--json"]
    for addr in backbones:
        args += ["--backbone", addr]
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=60)


def status_report(backbones: list[str]) -> dict:
    result = status(backbones)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"collaboration", "peers", "progress"}
    return report


def listed_peers(backbones: list[str]) -> set[str]:
    return {p["peer_id"] for p in status_report(backbones)["peers"] if p["role"] == "peer"}


def measured_and_assigned(backbones: list[str], ids: set[str]) -> bool:
    """Every peer in `ids` shows measured compute, both directions, RTT, reachability and work."""
    report = status_report(backbones)
    rows = {p["peer_id"]: p for p in report["peers"]}
    return (
        report["collaboration"]["assignment"] is not None
        and all(
            rows[i]["samples_per_s"]
            and rows[i]["upload_bps"]
            and rows[i]["download_bps"]
            and rows[i]["rtt_s"]
            and rows[i]["reachable"] is True
            and rows[i]["work"]
            for i in ids
            if i in rows
        )
        and ids <= set(rows)
    )


def wait_for(
    predicate, *, timeout: float, what: str, last: Callable[[], object] | None = None
) -> None:
    """Poll until `predicate` holds; `timeout` is for an idle machine, stretched by its load
    (`load_factor`: under two CPU burners 3 peers were listed after more than 10 s). On failure
    the message ends with `last()`, what the predicate saw last."""
    timeout *= load_factor()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    seen = f"; last seen: {last()}" if last is not None else ""
    raise AssertionError(f"{what} did not happen within {timeout:.0f}s{seen}")


# The second case takes as long as the first (1-3 min): it runs with -m slow, CI's 15 min
# budget runs the first.
@pytest.mark.parametrize(
    "dead_backbone",
    [0, pytest.param(1, marks=pytest.mark.slow)],
    ids=["first-dies", "second-dies"],
)
def test_collaboration_lifecycle(procs, tmp_path, dead_backbone):
    port = free_port()
    bb1, addr1 = start_backbone(procs, tmp_path, "bb1", port=port)
    assert f"/tcp/{port}/p2p/" in addr1
    bb2, addr2 = start_backbone(procs, tmp_path, "bb2", addr1)
    backbones = [addr1, addr2]
    peers = [start_peer(procs, tmp_path, f"p{i}", backbones) for i in range(3)]
    ids = {peer_id for _, peer_id in peers}

    # All three are listed within 10 s of joining.
    wait_for(lambda: listed_peers(backbones) >= ids, timeout=10, what="3 peers listed")
    # Each measures itself against the backbones (reachable on loopback) and shows the work it
    # does; the role solver's prediction is there too.
    # A bound, not a speed: measuring, then averaging (for the work shown) took 60 s and more
    # on a loaded 2-core machine (failed twice in full CI runs, passed alone in 46-51 s).
    wait_for(lambda: measured_and_assigned(backbones, ids), timeout=120, what="peers measured")

    # kill -9: no goodbye, so the peer disappears once its presence record expires (ttl 4 s).
    victim, victim_id = peers[0]
    victim.popen.send_signal(signal.SIGKILL)
    wait_for(
        lambda: victim_id not in listed_peers(backbones),
        timeout=30,
        what="killed peer leaves the list",
    )
    assert listed_peers(backbones) >= ids - {victim_id}

    # With either backbone dead, a new peer still joins through the other.
    dead, survivor = [(bb1, addr2), (bb2, addr1)][dead_backbone]
    dead.popen.send_signal(signal.SIGKILL)
    dead.popen.wait(timeout=10)
    _, newcomer = start_peer(procs, tmp_path, "late", backbones)
    wait_for(
        lambda: newcomer in listed_peers([survivor]),
        timeout=20,
        what="newcomer listed via the surviving backbone",
    )

    # SIGINT and SIGTERM: a clean exit within 3 s, no child processes left behind.
    for (proc, peer_id), sig in zip(peers[1:], (signal.SIGINT, signal.SIGTERM), strict=True):
        children = psutil.Process(proc.popen.pid).children(recursive=True)
        proc.popen.send_signal(sig)
        assert proc.popen.wait(timeout=3) == 0  # the promise: stopped within 3 s
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        # It withdrew its presence: gone at once, without waiting for expiry.
        assert peer_id not in listed_peers([survivor])


@pytest.mark.slow  # 31 s on CI's 2 cores: a whole collaboration again, over ::1
@needs_ipv6
def test_a_collaboration_on_ipv6_alone_measures_reachability_and_trains(procs, tmp_path):
    """Backbone and peers listen on ::1 only: the peers join over IPv6, the backbone's
    dial-back reaches them there (they are reachable, not client-only), and their averaged
    steps cross the IPv6 data plane."""
    _, addr = start_backbone(procs, tmp_path, "bb", listen="/ip6/::1/tcp/0")
    assert addr.startswith("/ip6/::1/tcp/"), addr
    peers = [start_peer(procs, tmp_path, f"p{i}", [addr], listen="/ip6/::1/tcp/0") for i in (0, 1)]
    ids = {peer_id for _, peer_id in peers}
    last: list[object] = [None]

    def trained_and_reachable() -> bool:
        report = status_report([addr])
        training = report["collaboration"]["training"]
        rows = [p for p in report["peers"] if p["peer_id"] in ids]
        last[0] = (training, [(p["addrs"], p["reachable"], p["client_only"]) for p in rows])
        return (
            bool(training) and training["global_step"] >= 2 and training["bytes_per_step"] > 0
            and len(rows) == 2 and all(p["reachable"] is True for p in rows)
            and all(a.startswith("/ip6/::1/") for p in rows for a in p["addrs"])
        )  # fmt: skip

    wait_for(trained_and_reachable, timeout=120, what="IPv6 peers measured and trained",
             last=lambda: last[0])  # fmt: skip


def test_unreachable_backbone_is_a_one_line_error_with_exit_2(procs, tmp_path):
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{NOBODY}"
    joiner = procs(
        "cli.peer_cli", "join", "--identity", str(tmp_path / "p.key"), "--backbone", nobody
    )
    assert joiner.popen.wait(timeout=60) == 2
    err = joiner.popen.stderr.read().strip().splitlines()
    assert len(err) == 1 and "no backbone answered" in err[0] and nobody in err[0], err
    result = status([nobody])
    assert result.returncode == 2
    assert "no backbone answered" in result.stderr and "Traceback" not in result.stderr


def test_a_peer_given_its_own_address_as_backbone_is_a_one_line_error(procs, tmp_path):
    """It would join a DHT of its own and average alone for ever."""
    me = write_key(tmp_path / "p.key")
    own = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/{me}"
    joiner = procs("cli.peer_cli", "join", "--identity", str(tmp_path / "p.key"), "--backbone", own)
    assert joiner.popen.wait(timeout=60) == 2
    err = joiner.popen.stderr.read().strip().splitlines()
    assert len(err) == 1 and "is this peer's own address" in err[0] and own in err[0], err


@pytest.mark.slow  # two measurements 30 s apart: ~1 min
def test_peers_with_no_backbone_among_them_stop_with_a_one_line_error(procs, tmp_path):
    """Two peers, each given the other's address as --backbone, no backbone anywhere (issue
    45's stall: nobody is dialed back, so nobody becomes a DHT server or leads a group, and
    every peer averaged alone for ever). The first to measure twice stops with one line that
    says what to do (the other then finds its "backbone" gone, as after a backbone's crash,
    and waits for it)."""
    ids = [write_key(tmp_path / f"p{i}.key") for i in range(2)]
    ports = [free_port(), free_port()]
    joiners = []
    for i in range(2):
        other = f"/ip4/127.0.0.1/tcp/{ports[1 - i]}/p2p/{ids[1 - i]}"
        listen = f"/ip4/127.0.0.1/tcp/{ports[i]}"
        key = str(tmp_path / f"p{i}.key")
        joiners.append(
            procs(
                "cli.peer_cli", "join", "--identity", key, "--listen", listen, "--backbone", other
            )
        )
    deadline = time.monotonic() + 180
    while all(j.popen.poll() is None for j in joiners):
        assert time.monotonic() < deadline, "neither peer stopped"
        time.sleep(0.5)
    i = next(i for i, j in enumerate(joiners) if j.popen.poll() is not None)
    assert joiners[i].popen.returncode == 2
    last = joiners[i].popen.stderr.read().strip().splitlines()[-1]  # after its log
    assert last.startswith("error: no backbone in this collaboration"), last
    assert ids[1 - i] in last and "backbone start" in last, last


def test_second_daemon_with_the_same_key_is_refused(procs, tmp_path):
    _, addr = start_backbone(procs, tmp_path, "bb")
    start_peer(procs, tmp_path, "same", [addr])
    twin = procs(
        "cli.peer_cli", "join", "--identity", str(tmp_path / "same.key"), "--backbone", addr
    )
    assert twin.popen.wait(timeout=60) == 2
    err = twin.popen.stderr.read()
    assert "already used by a running daemon" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (["--log-level", "loud"], {}, "log.level = 'loud' (from flag)"),
        (
            [],
            {"PEERTRAIN_DHT_REPLICAS": "abc"},
            "dht.replicas = 'abc' (from env PEERTRAIN_DHT_REPLICAS)",
        ),
        (["--backbone", "/ip4/127.0.0.1/tcp/1"], {}, "has no /p2p/<peer id> part"),
        (
            ["--task", "huge", "--backbone", f"/ip4/127.0.0.1/tcp/9/p2p/{NOBODY}"],
            {},
            "task.name = 'huge': expected one of gpt, tiny or package.module:factory",
        ),
    ],
)
def test_config_errors_are_one_line_with_exit_2(args, env, expected, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "cli.peer_cli", "join", "--identity", str(tmp_path / "k"), *args],
        cwd=ROOT,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr


# Slow (CI's 15 min budget; a clean-clone run took 16m04s): the status e2e test covers the
# report, and the stop tests cover SIGINT.
@pytest.mark.slow
def test_status_watch_refreshes_until_sigint(procs, tmp_path):
    _, addr = start_backbone(procs, tmp_path, "bb")
    watcher = procs("cli.peer_cli", "status", "--watch", "--interval", "0.3", "--backbone", addr)
    watcher.wait_line("collaboration 'default'", timeout=30)
    watcher.wait_line("collaboration 'default'", timeout=10)  # a second report, same process
    _, peer_id = start_peer(procs, tmp_path, "p", [addr])
    watcher.wait_line(peer_id[-8:], timeout=20)  # a later refresh shows the newcomer
    watcher.popen.send_signal(signal.SIGINT)
    assert watcher.popen.wait(timeout=3) == 0


# SIGTERM takes the same path as SIGINT: with -m slow, like the training peer's.
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_backbone_stops_cleanly_within_3_s(procs, tmp_path, sig):
    backbone, addr = start_backbone(procs, tmp_path, "bb")
    start_peer(procs, tmp_path, "p", [addr])  # so it has connections to close
    children = psutil.Process(backbone.popen.pid).children(recursive=True)
    backbone.popen.send_signal(sig)
    assert backbone.popen.wait(timeout=3) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_status_shows_the_training_the_peers_report(procs, tmp_path, monkeypatch):
    """...and the roles they play: the backbone (started with --aggregate) reduces a share.
    Three peers: with two, each sends its whole vector whatever its share (DeDLOC's cost
    model), so the solver rightly gives an aggregator-only member nothing."""
    # The tiny task's 10 k parameters in 11 chunks (one by default): shares cut it finely
    # enough that the backbone's share is not rounded away.
    monkeypatch.setitem(ENV, "PEERTRAIN_AVERAGING_CHUNK_ELEMENTS", "1024")
    _, addr = start_backbone(procs, tmp_path, "bb", options=("--aggregate",))
    peers = [start_peer(procs, tmp_path, f"p{i}", [addr]) for i in range(3)]
    ids = {peer_id for _, peer_id in peers}

    # Two facts, each waited for on its own: the backbone's share is that of its last averaging,
    # and a gathering of only two trainers gives it none (each sends its whole vector). Under two
    # CPU burners in the full suite, no single report held both within 170 s (once).
    last: list[object] = [None]
    shared: list[dict] = []  # a backbone row that reduced a share
    seen: list[dict] = []  # the first report of an averaged step with every peer trained

    def ready() -> bool:
        report = status_report([addr])
        training = report["collaboration"]["training"]
        rows = [p for p in report["peers"] if p["peer_id"] in ids]
        backbone = [p for p in report["peers"] if p["role"] == "backbone"]
        last[0] = {
            "backbone": [(p["work"], p["share"]) for p in backbone],
            "peers": [(p["step"], p["loss"] is not None, p["client_only"]) for p in rows],
            "training": training and {k: training[k] for k in ("global_step", "bytes_per_step")},
        }
        shared.extend(p for p in backbone if p["work"] == "aggregate" and p["share"] > 0)
        # (and measured: a loaded machine may step before a peer's dial-back check is done)
        trained = len(rows) == 3 and all(
            p["step"] and p["loss"] and p["client_only"] is not None for p in rows
        )
        # The first peer may step alone (0 bytes) before the second arrives: wait for a step
        # the peers averaged.
        averaged = training and training["global_step"] >= 2 and training["bytes_per_step"] > 0
        seen.extend([report] if averaged and trained and not seen else [])
        return bool(shared and seen)

    wait_for(
        ready,
        timeout=90,
        what="an averaged step in status, and the backbone's share",
        last=lambda: last[0],
    )
    report = seen[0]
    training = report["collaboration"]["training"]
    records = {r["peer_id"]: r for r in report["progress"]}
    rows = {p["peer_id"]: p for p in report["peers"] if p["peer_id"] in ids}
    for peer_id, row in rows.items():  # each row is what that peer's own record says
        record = records[peer_id]
        assert row["progress_role"] == "trainer"
        assert (row["step"], row["contribution"]) == (record["step"], record["samples"])
        assert row["loss"] == record["loss"] and row["client_only"] is False
        assert row["version"] and row["work"] and row["share"] is not None
    assert training["global_step"] == max(r["step"] for r in records.values())
    at_step = [r for r in records.values() if r["step"] == training["global_step"]]
    assert training["trainers"] == len(at_step)
    assert training["samples"] == sum(r["samples"] for r in at_step)
    assert training["target_batch"] == 4096  # configs/default.toml: the task's target batch
    assert training["bytes_per_step"] > 0  # the peers averaged: bytes crossed the wire
    assert training["loss_trend"]
    # Each peer printed the step status shows for it (a line per step on a pipe).
    for proc, peer_id in peers:
        proc.wait_line(f"step {rows[peer_id]['step']} |", timeout=30)

    # The table, as a terminal-less run prints it: every section, 80 columns.
    result = subprocess.run(
        [sys.executable, "-m", "cli.peer_cli", "status", "--backbone", addr],
        cwd=ROOT,
        env={**ENV, "COLUMNS": "80"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    for heading in ("peers", "next step", "loss", "averaging", "measured capabilities", "training"):
        assert heading in text
    training_rows = [line for line in text.splitlines() if " trainer " in line]
    assert {line.split()[0] for line in training_rows} == {f"…{i[-8:]}" for i in ids}
    assert max(len(line) for line in text.splitlines()) <= 80


def scrape(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
    return reply.decode()


def metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    return None


def test_metrics_endpoints_of_a_backbone_and_a_training_peer(procs, tmp_path):
    bb_port, peer_port = free_port(), free_port()
    backbone = procs(
        "cli.backbone_cli", "start", "--identity", str(tmp_path / "bb.key"),
        "--listen", LOOPBACK, "--metrics-port", str(bb_port),
    )  # fmt: skip
    line = backbone.wait_line("peer join --backbone /ip4/127.0.0.1/", timeout=30)
    addr = line.split("--backbone ", 1)[1].strip()
    for i in range(2):
        args = ["--identity", str(tmp_path / f"p{i}.key"), "--listen", LOOPBACK]
        args += ["--backbone", addr] + (["--metrics-port", str(peer_port)] if i == 0 else [])
        procs("cli.peer_cli", "join", *args).wait_line(" joined collaboration", timeout=30)

    # The first peer may step alone before the second has measured: wait for an averaged
    # step (bytes alone are not one: a round that failed under load sent some, 0 steps).
    def averaged_a_step(text: str) -> bool:
        bytes_sent = metric(text, "peertrain_allreduce_bytes_total") or 0
        return bytes_sent > 0 and (metric(text, "peertrain_steps_total") or 0) >= 1

    wait_for(lambda: averaged_a_step(scrape(peer_port)), timeout=90, what="an averaged step")
    text = scrape(peer_port)
    assert 'role="peer"' in text
    assert averaged_a_step(text)
    assert (metric(text, "peertrain_allreduce_seconds_count") or 0) >= 1
    assert metric(text, "peertrain_samples_total")
    assert metric(text, "peertrain_measured_samples_per_second")
    assert 'peertrain_dht_operations_total{method="get",outcome="ok"}' in text
    backbone_text = scrape(bb_port)
    assert 'role="backbone"' in backbone_text and "peertrain_steps_total" not in backbone_text
    # Peers join the backbone's table once its dial-back reached them (a DHT client before).
    wait_for(
        lambda: (metric(scrape(bb_port), "peertrain_peers_seen") or 0) >= 2,
        timeout=90,
        what="both peers in the backbone's DHT table",
    )


def step_of(proc: Proc) -> int:
    """The newest step a peer printed (a line per step on a pipe: "step N | ...")."""
    steps = [int(line.split()[1]) for line in proc.seen if line.startswith("step ")]
    return max(steps, default=0)


# SIGTERM takes the same path as SIGINT (another half minute): with -m slow.
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_training_peer_stops_within_3_s_with_a_final_checkpoint(procs, tmp_path, sig):
    from peer.training.checkpoint import load_latest

    _, addr = start_backbone(procs, tmp_path, "bb")
    peers = [start_peer(procs, tmp_path, f"p{i}", [addr]) for i in range(2)]
    proc, _ = peers[0]
    proc.wait_line("step 3 |", timeout=90)
    folder = proc.checkpoints / "default-tiny"  # type: ignore[attr-defined]
    assert not list(folder.glob("step-*.json"))  # checkpoint_interval is 300 s: none yet
    children = psutil.Process(proc.popen.pid).children(recursive=True)
    proc.popen.send_signal(sig)
    assert proc.popen.wait(timeout=3) == 0
    assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    while not proc.lines.empty():  # every line it printed before it exited
        proc.seen.append(proc.lines.get())
    state = load_latest(folder)
    assert state is not None and state.step == step_of(proc) >= 3


def test_a_peer_stopped_while_it_measures_exits_cleanly(procs, tmp_path):
    # Right after joining, its compute benchmark runs in a thread: leaving that thread inside
    # torch at exit aborted the process (SIGABRT, "terminate called without an active exception").
    _, addr = start_backbone(procs, tmp_path, "bb")
    proc, _ = start_peer(procs, tmp_path, "p", [addr])
    proc.popen.send_signal(signal.SIGINT)
    assert proc.popen.wait(timeout=3) == 0


# Slow (CI's 15 min budget): the first Ctrl+C's clean stop runs in the default suite.
@pytest.mark.slow
def test_a_second_ctrl_c_forces_exit_at_once(procs, tmp_path):
    _, addr = start_backbone(procs, tmp_path, "bb")
    # Two peers: a step needs averaging.min_group_size (2) of them.
    (proc, _), _ = [start_peer(procs, tmp_path, f"p{i}", [addr]) for i in range(2)]
    proc.wait_line("step 1 |", timeout=90)
    # Its first Ctrl+C lets it withdraw and save for up to 2.5 s; the second ends that at once.
    proc.popen.send_signal(signal.SIGINT)
    proc.wait_line("stopping", timeout=3)
    proc.popen.send_signal(signal.SIGINT)
    assert proc.popen.wait(timeout=3) == 130  # forced: not the clean exit's 0
