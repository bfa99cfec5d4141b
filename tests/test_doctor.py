"""`peer doctor`: the pure verdicts, the observations on real files and libp2p hosts, then the
real CLI against real backbone processes on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import pytest
import trio

from peer import doctor_run
from peer.config import (
    CollaborationConfig,
    IdentityConfig,
    NetConfig,
    PeerConfig,
    ProbeConfig,
    TaskConfig,
    TrainingConfig,
)
from peer.doctor import (
    CHECKS,
    BackboneContact,
    ClockSample,
    DiskProbe,
    KeyProbe,
    announce_verdict,
    backbone_verdict,
    bandwidth_verdict,
    clock_offset,
    disk_verdict,
    identity_verdict,
    is_loopback,
    is_peertrain_command,
    listen_verdict,
    memory_verdict,
    reachability_finding,
    skew_verdict,
)
from peer.doctor_run import (
    contact_backbone,
    dial_failure,
    inspect_disk,
    inspect_key,
    run_doctor,
)
from peer.measure import probe
from peer.measure.probe import LinkMeasurement, ProbeServer
from peer.measure.reachability import BUSY, DialBackResult
from peer.net.identity import load_or_create_identity
from peer.net.rpc import FramedStream
from tests import test_cli_e2e as e2e
from tests.helpers import nodes

NOBODY = e2e.NOBODY
procs = e2e.procs  # the fixture: CLI processes killed by PID at the end

# ---------------------------------------------------------------------------- pure: addresses


@pytest.mark.parametrize(
    ("addr", "local_ips", "expected"),
    [
        ("/ip4/127.0.0.1/tcp/1", (), True),
        ("/ip4/127.3.4.5/tcp/1", (), True),
        ("/ip6/::1/tcp/1", (), True),
        ("/dns4/localhost/tcp/1", (), True),
        ("/ip4/192.168.1.5/tcp/1", (), False),
        ("/dns4/example.org/tcp/1", (), False),
        ("/ip4/0.0.0.0/tcp/1", ("127.0.0.1", "::1"), True),  # a container without a network
        ("/ip4/0.0.0.0/tcp/1", ("127.0.0.1", "10.1.2.3"), False),
        ("/ip6/::/tcp/1", ("127.0.0.1", "10.1.2.3", "::1"), True),  # no routable IPv6
    ],
)
def test_loopback_addresses(addr, local_ips, expected):
    assert is_loopback(addr, local_ips=local_ips) is expected


REMOTE = f"/ip4/10.255.255.1/tcp/1/p2p/{NOBODY}"
LOCAL = f"/ip4/127.0.0.1/tcp/4001/p2p/{NOBODY}"


def test_loopback_only_addresses_with_a_remote_backbone_fail_with_the_announce_advice():
    finding = announce_verdict(
        listen=["/ip4/127.0.0.1/tcp/31337"], announce=[], backbones=[LOCAL, REMOTE], local_ips=()
    )
    assert finding.level == "fail" and REMOTE in finding.message
    assert finding.advice is not None
    assert "--announce /ip4/<public-ip>/tcp/31337" in finding.advice
    assert "--listen /ip4/0.0.0.0/tcp/31337" in finding.advice
    # A wildcard that expands to loopback only is the same mistake.
    wildcard = announce_verdict(
        listen=["/ip4/0.0.0.0/tcp/0"], announce=[], backbones=[REMOTE], local_ips=["127.0.0.1"]
    )
    assert wildcard.level == "fail" and "<port>" in (wildcard.advice or "")


@pytest.mark.parametrize(
    ("listen", "announce", "backbones", "local_ips"),
    [
        (["/ip4/127.0.0.1/tcp/0"], [], [LOCAL], ()),  # everything on this machine
        (["/ip4/127.0.0.1/tcp/0"], ["/ip4/203.0.113.5/tcp/31337"], [REMOTE], ()),  # announced
        (["/ip4/0.0.0.0/tcp/0"], [], [REMOTE], ["127.0.0.1", "10.0.0.2"]),  # a LAN interface
        (["/ip4/127.0.0.1/tcp/0"], [], [], ()),  # no backbone: the backbone check says so
    ],
)
def test_addresses_others_can_dial_are_fine(listen, announce, backbones, local_ips):
    finding = announce_verdict(
        listen=listen, announce=announce, backbones=backbones, local_ips=local_ips
    )
    assert finding.level == "ok", finding


# ---------------------------------------------------------------------------- pure: clock


def test_clock_offset_takes_the_fastest_ping_and_its_midpoint():
    samples = [
        ClockSample(sent=100.0, received=100.4, server_time=110.0),  # slow: +- 0.2 s
        ClockSample(sent=200.0, received=200.02, server_time=205.01),  # fast: +- 0.01 s
        ClockSample(sent=300.0, received=300.0, server_time=None),  # an older backbone
    ]
    offset, uncertainty = clock_offset(samples)
    assert offset == pytest.approx(5.0) and uncertainty == pytest.approx(0.01)
    assert clock_offset([ClockSample(1.0, 1.1, None)]) is None


@pytest.mark.parametrize(
    ("estimate", "level"),
    [
        ((0.3, 0.001), "ok"),
        ((-0.45, 0.0), "ok"),
        ((1.0, 0.001), "warn"),  # our clock is 1 s behind: corrected, but worth knowing
        ((-1.0, 0.001), "warn"),  # ... or ahead
        ((1.0, 0.6), "ok"),  # within what a slow round trip can explain
        ((45.0, 0.01), "warn"),  # a peer corrects up to 60 s
        ((75.0, 0.01), "fail"),  # beyond what it corrects
        (None, "warn"),  # an older backbone: not checked
    ],
)
def test_skew_verdict(estimate, level):
    finding = skew_verdict(estimate, backbone="127.0.0.1:4001", fail_above=60.0)
    assert finding.level == level, finding
    if level != "ok":
        assert "timedatectl set-ntp true" in (finding.advice or "")
    if level == "warn" and estimate is not None:
        assert "gather_until" in finding.message  # says why it matters
        assert ("behind" if estimate[0] > 0 else "ahead of") in finding.message


# ---------------------------------------------------------------------------- pure: the rest


def test_backbone_verdicts():
    ok = backbone_verdict(BackboneContact(LOCAL, NOBODY, 0.0012))
    assert ok.level == "ok" and "1.2 ms" in ok.message
    dead = backbone_verdict(BackboneContact(REMOTE, NOBODY, None, error="Connection refused"))
    assert dead.level == "fail" and "Connection refused" in dead.message
    assert "`backbone start` runs at 10.255.255.1:1" in (dead.advice or "")


def test_reachability_findings():
    reached = DialBackResult(["/ip4/127.0.0.1/tcp/5"], {})
    assert reachability_finding(reached, backbone="b", port=None).level == "ok"
    busy = DialBackResult([], {"/ip4/127.0.0.1/tcp/5": BUSY + ": too many"})
    assert reachability_finding(busy, backbone="b", port=None).level == "warn"
    nat = DialBackResult([], {"/ip4/192.168.1.5/tcp/31337": "not the address your ..."})
    finding = reachability_finding(nat, backbone="b", port="31337")
    assert finding.level == "warn" and finding.message.startswith("client-only")
    assert "forward TCP port 31337" in (finding.advice or "")
    assert "--announce /ip4/<public-ip>/tcp/31337" in (finding.advice or "")
    # A port chosen at random each start cannot be forwarded: pick a fixed one first.
    assert "--port" in (reachability_finding(nat, backbone="b", port=None).advice or "")


def test_a_listen_port_held_by_a_running_peer_is_a_warning_and_by_anything_else_a_failure():
    assert is_peertrain_command(["/usr/bin/python3", "-m", "cli.peer_cli", "join"])
    assert is_peertrain_command(["/home/u/.venv/bin/python", "/home/u/.venv/bin/peer", "join"])
    assert not is_peertrain_command(["nginx", "-g", "daemon off;"])
    ours = listen_verdict("/ip4/0.0.0.0/tcp/5", "Address in use", holder="pid 7", peertrain=True)
    assert ours.level == "warn" and "running peertrain node (pid 7)" in ours.message
    theirs = listen_verdict("/ip4/0.0.0.0/tcp/5", "Address in use", holder="pid 8", peertrain=False)
    assert theirs.level == "fail" and "--port" in (theirs.advice or "")


def test_memory_bandwidth_and_disk_thresholds():
    gib = 1 << 30
    assert memory_verdict(device="cpu", free_bytes=8 * gib, model_bytes=1 << 20).level == "ok"
    assert memory_verdict(device="cpu", free_bytes=gib // 2, model_bytes=1 << 20).level == "warn"
    # A 1 GiB model wants ~8 GiB free (weights, gradients, Adam, averaging, state download).
    assert memory_verdict(device="cuda:0", free_bytes=4 * gib, model_bytes=gib).level == "warn"

    assert bandwidth_verdict(LinkMeasurement(5e6, 20e6, 0.03), backbone="b").level == "ok"
    slow = bandwidth_verdict(LinkMeasurement(50e3, 20e6, 0.03), backbone="b")
    assert slow.level == "warn" and "up 0.05 MB/s" in slow.message

    folder = Path("/data/ckpt")
    assert disk_verdict(DiskProbe(folder, folder, 50 * gib, None), model_bytes=0).level == "ok"
    low = disk_verdict(DiskProbe(folder, folder, gib // 2, None), model_bytes=0)
    assert low.level == "warn"
    # Nine copies of the parameters: 3 checkpoints (one being written) of weights + Adam.
    assert disk_verdict(DiskProbe(folder, folder, 5 * gib, None), model_bytes=gib).level == "warn"
    denied = disk_verdict(
        DiskProbe(folder, Path("/data"), 50 * gib, "Permission denied"), model_bytes=0
    )
    assert denied.level == "fail" and "training.checkpoint_dir" in (denied.advice or "")


KEY = Path("/home/u/.peertrain/peer.key")


@pytest.mark.parametrize(
    ("probe", "level", "advice"),
    [
        (KeyProbe(KEY, exists=False), "ok", None),
        (KeyProbe(KEY, exists=False, folder_error="Permission denied"), "fail", "--identity"),
        (KeyProbe(KEY, exists=True), "fail", "move it away"),  # a folder where the key should be
        (
            KeyProbe(KEY, exists=True, is_file=True, mode=0o600, read_error="Permission denied"),
            "fail",
            f"chmod 600 {KEY}",
        ),
        (KeyProbe(KEY, exists=True, is_file=True, mode=0o600, size=31), "fail", "backup"),
        (
            KeyProbe(KEY, exists=True, is_file=True, mode=0o640, size=32, peer_id=NOBODY),
            "fail",  # `peer join` refuses such a key: peer/net/identity.py
            f"chmod 600 {KEY}",
        ),
        (
            KeyProbe(
                KEY, exists=True, is_file=True, mode=0o600, size=32, peer_id=NOBODY, holder_pid=42
            ),
            "warn",
            "stop pid 42",
        ),
        (KeyProbe(KEY, exists=True, is_file=True, mode=0o600, size=32, peer_id=NOBODY), "ok", None),
    ],
)
def test_identity_verdict(probe, level, advice):
    finding = identity_verdict(probe)
    assert finding.level == level, finding
    if advice:
        assert advice in (finding.advice or "")
    if level == "ok" and probe.exists:
        assert NOBODY in finding.message


def test_dial_failure_finds_the_operating_systems_reason_deep_in_the_chain():
    def chained() -> Exception:
        try:
            try:
                raise ExceptionGroup("all attempts failed", [ConnectionRefusedError(111, "x")])
            except ExceptionGroup as group:
                raise RuntimeError("fail to open connection") from group
        except RuntimeError as error:
            return error

    assert dial_failure(chained()) == os.strerror(111)
    assert dial_failure(RuntimeError("no answer within 5s")) == "no answer within 5s"


# ---------------------------------------------------------------------------- files


def test_inspect_key_on_real_files(tmp_path):
    assert identity_verdict(inspect_key(tmp_path / "new" / "peer.key")).level == "ok"
    (tmp_path / "file").write_text("x")
    blocked = identity_verdict(inspect_key(tmp_path / "file" / "peer.key"))
    assert blocked.level == "fail" and "cannot be created" in blocked.message

    key = tmp_path / "peer.key"
    identity = load_or_create_identity(key)
    good = identity_verdict(inspect_key(key))
    assert good.level == "ok" and identity.peer_id.to_base58() in good.message
    key.chmod(0o640)
    shared = identity_verdict(inspect_key(key))
    assert shared.level == "fail" and shared.advice == f"chmod 600 {key}"
    key.chmod(0o600)
    key.write_bytes(b"\x00" * 33)
    assert "not an Ed25519 key" in identity_verdict(inspect_key(key)).message

    (tmp_path / "dir.key").mkdir()
    assert "not a regular file" in identity_verdict(inspect_key(tmp_path / "dir.key")).message


def test_a_key_in_use_by_a_live_process_is_reported(tmp_path):
    key = tmp_path / "peer.key"
    load_or_create_identity(key)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "peer.key.lock").write_text(f"{sleeper.pid}\n")
        finding = identity_verdict(inspect_key(key))
        assert finding.level == "warn" and f"pid {sleeper.pid}" in finding.message
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)


# Run as an unprivileged user: root reads any file whatever its mode, so chmod alone cannot
# make a key unreadable in a test running as root. Everything is imported before setuid (the
# interpreter's own files may not be readable by nobody).
UNREADABLE = """
import json, os, sys
from pathlib import Path
from peer.doctor import identity_verdict
from peer.doctor_run import inspect_key
if os.geteuid() == 0:
    os.setgid(65534)
    os.setuid(65534)
finding = identity_verdict(inspect_key(Path(sys.argv[1])))
print(json.dumps([finding.level, finding.message, finding.advice]))
"""


def test_an_unreadable_key_fails_with_the_chown_and_chmod_advice():
    # Not tmp_path: pytest makes its folders 0700, and the unprivileged user must get as far as
    # opening the file itself.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        os.chmod(folder, 0o755)
        key = Path(folder) / "peer.key"
        load_or_create_identity(key)
        if os.geteuid() != 0:
            key.chmod(0)
        result = subprocess.run(
            [sys.executable, "-c", UNREADABLE, str(key)],
            cwd=e2e.ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 0, result.stderr
        level, message, advice = json.loads(result.stdout)
    assert level == "fail" and "Permission denied" in message
    assert f"chmod 600 {key}" in advice and "chown" in advice


def test_inspect_disk_on_real_folders(tmp_path):
    ok = disk_verdict(inspect_disk(tmp_path / "not" / "yet"), model_bytes=0)
    assert ok.level in ("ok", "warn") and "free" in ok.message  # warn: a nearly full disk
    (tmp_path / "file").write_text("x")
    blocked = disk_verdict(inspect_disk(tmp_path / "file" / "ckpt"), model_bytes=0)
    assert blocked.level == "fail" and "not a folder" in blocked.message
    assert not list(tmp_path.glob(".peertrain-doctor-*"))  # the write test cleaned up


# ---------------------------------------------------------------------------- libp2p in-process


@pytest.mark.parametrize(("skew", "level"), [(0.0, "ok"), (5.0, "warn"), (-100.0, "fail")])
async def test_the_backbone_clock_travels_in_pong(skew, level):
    async with nodes(2) as (backbone, peer):
        ProbeServer(backbone.host, ProbeConfig(), wall_clock=lambda: time.time() + skew)
        addr = backbone.announce[0]
        with trio.fail_after(30):
            contact = await contact_backbone(peer, backbone.peer_id, addr, text=str(addr))
        assert contact.error is None and len(contact.samples) == doctor_run.PINGS
        offset, _ = clock_offset(contact.samples)
        assert offset == pytest.approx(skew, abs=0.5)
        assert (
            skew_verdict(clock_offset(contact.samples), backbone="b", fail_above=30).level == level
        )


async def test_an_older_backbone_without_server_time_still_answers_pings():
    async def old_pong(stream):
        framed = FramedStream(stream, 1024)
        while await framed.read_frame() is not None:
            await framed.write_frame(msgspec.msgpack.encode({"type": "Pong"}))

    async with nodes(2) as (backbone, peer):
        backbone.host.set_stream_handler(probe.PROTOCOL, old_pong)
        with trio.fail_after(30):
            contact = await contact_backbone(
                peer, backbone.peer_id, backbone.announce[0], text="old"
            )
        assert contact.rtt_s is not None and clock_offset(contact.samples) is None
        assert "older peertrain" in skew_verdict(None, backbone="b", fail_above=30).message


async def test_a_backbone_that_never_answers_costs_one_deadline(monkeypatch):
    monkeypatch.setattr(doctor_run, "BACKBONE_SECONDS", 0.5)

    async def silent(stream):
        await trio.sleep_forever()

    async with nodes(2) as (backbone, peer):
        backbone.host.set_stream_handler(probe.PROTOCOL, silent)
        with trio.fail_after(30):
            contact = await contact_backbone(
                peer, backbone.peer_id, backbone.announce[0], text="silent"
            )
    assert contact.rtt_s is None and contact.error == "no answer within 0.5 s"


async def test_whatever_hangs_the_whole_run_ends_at_its_deadline(tmp_path, monkeypatch):
    monkeypatch.setattr(doctor_run, "BACKBONE_SECONDS", 60.0)  # only the overall deadline

    async def silent(stream):
        await trio.sleep_forever()

    async with nodes(1) as (backbone,):
        backbone.host.set_stream_handler(probe.PROTOCOL, silent)
        config = PeerConfig(
            identity=IdentityConfig(path=str(tmp_path / "peer.key")),
            net=NetConfig(listen=["/ip4/127.0.0.1/tcp/0"]),
            collaboration=CollaborationConfig(
                backbones=[f"{backbone.announce[0]}/p2p/{backbone.peer_id}"]
            ),
            task=TaskConfig(name="tiny"),
            training=TrainingConfig(checkpoint_dir=str(tmp_path / "ckpt")),
        )
        with trio.fail_after(30):
            findings = await run_doctor(config, deadline=1.0)
    assert [f.name for f in findings if f.name in CHECKS] == sorted(
        (f.name for f in findings), key=CHECKS.index
    )
    assert {f.name for f in findings} == set(CHECKS)
    backbone_finding = next(f for f in findings if f.name == "backbone")
    assert (
        backbone_finding.level == "fail" and "did not finish within 1 s" in backbone_finding.message
    )


# ---------------------------------------------------------------------------- the CLI


def run_cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`peer doctor` with its key and checkpoints in the test's folder (never ~/.peertrain);
    bounded by its own timeout, which kills it."""
    return subprocess.run(
        [sys.executable, "-m", "cli.peer_cli", "doctor", *args],
        cwd=e2e.ROOT,
        env={**e2e.ENV, "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(tmp_path / "ckpt")},
        capture_output=True,
        text=True,
        timeout=90,
    )


def finding_lines(stdout: str, level: str, name: str) -> tuple[str, str]:
    """The `LEVEL name ...` line and the `fix:` line after it."""
    lines = stdout.splitlines()
    for i, line in enumerate(lines):
        if line.split()[:2] == [level, name]:
            return line, lines[i + 1] if i + 1 < len(lines) else ""
    raise AssertionError(f"no {level} {name} line in:\n{stdout}")


def test_a_healthy_setup_passes_every_check(procs, tmp_path):
    _, addr = e2e.start_backbone(procs, tmp_path, "bb")
    result = run_cli(tmp_path, "--json", "--backbone", addr, "--identity", str(tmp_path / "k"))
    assert result.returncode == 0, result.stdout + result.stderr
    findings = {f["name"]: f for f in json.loads(result.stdout)}
    assert set(findings) == set(CHECKS)
    for name in ("backbone", "reachability", "announce", "clock", "bandwidth", "identity"):
        assert findings[name]["level"] == "ok", findings[name]
    # On a small machine memory or disk may be short; they must not fail.
    assert findings["device"]["level"] != "fail" and findings["device"]["message"].startswith("cpu")
    assert findings["disk"]["level"] != "fail"
    assert addr in findings["backbone"]["message"]
    assert findings["reachability"]["message"].startswith(f"backbone {addr.split('/')[2]}:")
    assert not (tmp_path / "k").exists()  # the doctor creates no key


def test_an_unreachable_backbone_fails_with_advice_and_exit_1(tmp_path):
    port = e2e.free_port()
    dead = f"/ip4/127.0.0.1/tcp/{port}/p2p/{NOBODY}"
    result = run_cli(tmp_path, "--backbone", dead, "--identity", str(tmp_path / "k"))
    assert result.returncode == 1, result.stdout + result.stderr
    line, fix = finding_lines(result.stdout, "FAIL", "backbone")
    assert dead in line and "Connection refused" in line
    assert fix.startswith(f"     fix: check that `backbone start` runs at 127.0.0.1:{port}")
    assert "Traceback" not in result.stderr
    # What needs a backbone says it was not checked, instead of failing again.
    line, _ = finding_lines(result.stdout, "WARN", "clock")
    assert "no backbone answered" in line


def test_a_backbone_that_accepts_but_never_speaks_is_a_bounded_failure(tmp_path):
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        addr = f"/ip4/127.0.0.1/tcp/{silent.getsockname()[1]}/p2p/{NOBODY}"
        result = run_cli(tmp_path, "--backbone", addr, "--identity", str(tmp_path / "k"))
    assert result.returncode == 1, result.stdout + result.stderr
    line, _ = finding_lines(result.stdout, "FAIL", "backbone")
    assert "no answer" in line


def test_loopback_addresses_with_a_remote_backbone_get_the_announce_advice(tmp_path):
    # configs/debug.toml listens on 127.0.0.1 only; this backbone is (nominally) elsewhere.
    result = run_cli(tmp_path, "--backbone", REMOTE, "--identity", str(tmp_path / "k"))
    assert result.returncode == 1, result.stdout + result.stderr
    line, fix = finding_lines(result.stdout, "FAIL", "announce")
    assert "only loopback addresses" in line and REMOTE in line
    assert fix == (
        "     fix: pass --announce /ip4/<public-ip>/tcp/<port>, or listen on all interfaces "
        "(--listen /ip4/0.0.0.0/tcp/<port>)"
    )


def test_a_group_readable_key_fails_with_the_chmod_advice(tmp_path):
    key = tmp_path / "peer.key"
    load_or_create_identity(key)
    key.chmod(0o640)
    result = run_cli(tmp_path, "--identity", str(key))  # no backbone: that fails too
    line, fix = finding_lines(result.stdout, "FAIL", "identity")
    assert "accessible by group or others (mode 0640)" in line
    assert fix == f"     fix: chmod 600 {key}"
    assert result.returncode == 1


def test_a_folder_where_the_key_should_be_fails(tmp_path):
    (tmp_path / "peer.key").mkdir()
    result = run_cli(tmp_path, "--json", "--identity", str(tmp_path / "peer.key"))
    identity = next(f for f in json.loads(result.stdout) if f["name"] == "identity")
    assert identity["level"] == "fail" and "not a regular file" in identity["message"]


# Slow (CI's 15 min budget): a running daemon beside the doctor; the healthy-setup check runs
# in the default suite.
@pytest.mark.slow
def test_the_port_of_a_running_peer_is_named_not_failed(procs, tmp_path):
    _, addr = e2e.start_backbone(procs, tmp_path, "bb")
    port = e2e.free_port()
    key = str(tmp_path / "p.key")
    peer = procs("cli.peer_cli", "join", "--identity", key, "--backbone", addr, "--port", str(port))
    peer.wait_line(" joined collaboration", timeout=30)
    result = run_cli(tmp_path, "--backbone", addr, "--port", str(port), "--identity", key)
    assert result.returncode == 0, result.stdout + result.stderr
    line, _ = finding_lines(result.stdout, "WARN", "reachability")
    assert f"in use by a running peertrain node (pid {peer.popen.pid}" in line
    line, _ = finding_lines(result.stdout, "WARN", "identity")
    assert f"in use by a running daemon (pid {peer.popen.pid})" in line
    finding_lines(result.stdout, "OK", "bandwidth")  # the rest ran without listening


def test_a_malformed_backbone_address_is_a_one_line_error_with_exit_2(tmp_path):
    result = run_cli(tmp_path, "--backbone", "/ip4/127.0.0.1/tcp/1")
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no /p2p/<peer id> part" in lines[0], result.stderr
