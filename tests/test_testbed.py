"""deploy/testbed.sh and deploy/impair.py: a collaboration of emulated hosts, one network namespace
each, on one machine; the user-space switch that adds delay and loss where netem is missing.

The slow tests (root, `ip` and `tc`; skipped otherwise) build a testbed under a unique namespace
prefix, check the shaping `tc` reports inside the namespaces and the RTTs pings see, train a
3-peer collaboration across them (with netem where the kernel has it, and with the user switch),
check the user switch's delay, loss and a 20 MB TCP transfer through it, and that `down` leaves no
namespace and no process behind. Every subprocess has a timeout, and a fixture tears everything
down by PID whatever happens. Timing checks are lower bounds only (a busy machine adds delay).

The fast tests need neither root nor namespaces: syntax, help, argument errors, `down` on nothing,
and the switch's pure core (MAC learning, where a frame goes, release times, order, loss, limits).
"""

from __future__ import annotations

import contextlib
import importlib.util
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
IMPAIR = ROOT / "deploy" / "impair.py"
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
    for word in ("--subnet", "--shapes", "--shaper", "--seed", "--max-steps", "--timeout"):
        assert word in result.stdout, word
    assert "user" in result.stdout and "deploy/impair.py" in result.stdout


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
        (["--shaper", "slow", "up", "1"], "--shaper slow: expected auto, netem, user or tbf"),
        (["--seed", "-1", "up", "1"], "--seed -1: expected a whole number"),
    ],
)
def test_bad_arguments_are_one_line_with_exit_1(args, expected, tmp_path):
    result = script("--run-dir", str(tmp_path / "run"), *args, timeout=10)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert not (tmp_path / "run").exists()


def test_bad_switch_arguments_exit_2():
    for args, expected in [
        (["p1=40ms,0.5%"], "expected two or more distinct ports"),
        (["p1", "p1"], "expected two or more distinct ports"),
        (["bb", "p1=40,0.5%"], "p1=40,0.5%"),
        (["--seed", "x", "bb", "p1"], "--seed 'x': expected a whole number"),
    ]:
        result = subprocess.run(
            [sys.executable, str(IMPAIR), *args], capture_output=True, text=True, timeout=10
        )
        assert result.returncode == 2 and expected in result.stderr, (args, result.stderr)


# --- fast: the user switch's pure core ------------------------------------------------------


def load_impair():
    spec = importlib.util.spec_from_file_location("impair", IMPAIR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules["impair"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


impair = load_impair()
BB, P1, P2 = (bytes([2, 0, 0, 0, 0, i]) for i in (1, 2, 3))
BROADCAST = b"\xff" * 6


def frame(src: bytes, dst: bytes, payload: bytes = b"") -> bytes:
    return dst + src + b"\x08\x00" + payload.ljust(46, b"\0")


def switch(*specs: str, seed: int = 0, **options):
    ports = [impair.parse_port(spec) for spec in specs]
    return impair.Switch(ports=ports, rng=impair.random.Random(seed), **options)


def test_port_specifications_parse_delay_and_loss():
    assert impair.parse_port("p2=40ms,0.5%") == impair.Port(name="p2", delay=0.04, loss=0.005)
    assert impair.parse_port("p1=1.5s,100%") == impair.Port(name="p1", delay=1.5, loss=1.0)
    assert impair.parse_port("p3=250us,0%").delay == pytest.approx(250e-6)
    assert impair.parse_port("bb") == impair.Port(name="bb", delay=0.0, loss=0.0)
    for bad in ("p1=40ms", "p1=40,1%", "p1=40ms,101%", "p1=-1ms,0%", "a/b=1ms,0%", "=1ms,0%"):
        with pytest.raises(impair.SpecError, match=re.escape(repr(bad))):
            impair.parse_port(bad)


def test_macs_are_learned_per_port_and_age_out():
    table = impair.MacTable(age=10.0)
    table.learn(P1, 1, now=0.0)
    table.learn(BROADCAST, 2, now=0.0)  # a group address is never a source
    assert (table.lookup(P1, 5.0), table.lookup(BROADCAST, 5.0), len(table)) == (1, None, 1)
    table.learn(P1, 2, now=6.0)  # moved
    assert table.lookup(P1, 16.0) == 2
    assert table.lookup(P1, 16.5) is None and len(table) == 0


def test_unicast_goes_to_its_port_the_rest_floods():
    table = impair.MacTable()
    table.learn(P1, 1, now=0.0)
    assert impair.egress_ports(table, 0, P1, 3, 1.0) == [1]
    assert impair.egress_ports(table, 1, P1, 3, 1.0) == []  # no hairpin
    assert impair.egress_ports(table, 0, P2, 3, 1.0) == [1, 2]  # unknown
    assert impair.egress_ports(table, 2, BROADCAST, 3, 1.0) == [0, 1]
    assert impair.egress_ports(table, 0, b"\x01\x00\x5e\x00\x00\x01", 3, 1.0) == [1, 2]


def test_a_frame_is_released_after_the_delays_of_its_ingress_and_egress_ports():
    sw = switch("bb", "p1=5ms,0%", "p2=40ms,0%")
    sw.receive(0, frame(BB, BROADCAST), now=0.0)  # bb floods: p1 after 5 ms, p2 after 40 ms
    sw.receive(1, frame(P1, BB), now=0.0)  # bb learned: 5 ms to it
    assert sw.due(0.0049) == []
    assert [port for port, _ in sw.due(0.005)] == [1, 0]
    assert sw.next_release() == pytest.approx(0.04)
    assert [port for port, _ in sw.due(1.0)] == [2]
    # p2 to p1: 40 + 5 ms; p1's RTT to the backbone: 5 ms each way.
    sw.receive(2, frame(P2, P1), now=1.0)
    assert sw.next_release() == pytest.approx(1.045)
    assert sw.stats.flooded == 1 and sw.stats.forwarded == 3


def test_frames_of_a_pair_leave_in_arrival_order():
    sw = switch("bb", "p1=40ms,0%", "p2=5ms,0%")
    sw.receive(1, frame(P1, BROADCAST), now=0.0)
    sw.receive(2, frame(P2, BROADCAST), now=0.0)
    sw.due(1.0)
    # Same arrival times (a coarse clock) and interleaved pairs: each pair's FIFO holds.
    for i in range(50):
        sw.receive(1, frame(P1, P2, b"a%d" % i), now=1.0 + i // 10 * 0.001)
        sw.receive(2, frame(P2, P1, b"b%d" % i), now=1.0 + i // 10 * 0.001)
    out = sw.due(2.0)
    to_p2 = [f[14:].rstrip(b"\0") for port, f in out if port == 2]
    to_p1 = [f[14:].rstrip(b"\0") for port, f in out if port == 1]
    assert to_p2 == [b"a%d" % i for i in range(50)]
    assert to_p1 == [b"b%d" % i for i in range(50)]


def test_loss_is_drawn_on_the_way_in_and_out_from_a_seeded_rng():
    def delivered(seed: int) -> list[int]:
        sw = switch("bb", "p1=0ms,20%", seed=seed)
        sw.table.learn(BB, 0, now=0.0)
        for i in range(5000):
            sw.receive(1, frame(P1, BB, b"%d" % i), now=0.0)  # p1's loss once
        for i in range(5000):
            sw.receive(0, frame(BB, P1, b"%d" % i), now=0.0)  # p1 learned; its loss once
        out = sw.due(1.0)
        assert sw.stats.lost + len(out) == 10000
        return [int(f[14:].rstrip(b"\0")) for _, f in out]

    first = delivered(seed=1)
    assert 0.17 < 1 - len(first) / 10000 < 0.23
    assert delivered(seed=1) == first and delivered(seed=2) != first
    # A round trip crosses the lossy port twice: 1 - 0.8 ** 2 = 36 % of pings lost.
    sw = switch("bb", "p1=0ms,20%", seed=3)
    sw.table.learn(BB, 0, now=0.0)
    sw.table.learn(P1, 1, now=0.0)
    answered = 0
    for _ in range(5000):
        sw.receive(1, frame(P1, BB), now=0.0)
        if sw.due(0.0):
            sw.receive(0, frame(BB, P1), now=0.0)
            answered += len(sw.due(0.0))
    assert 0.33 < 1 - answered / 5000 < 0.39


def test_a_full_queue_and_oversize_frames_drop_and_count():
    sw = switch("bb", "p1=10ms,0%", queue_limit=3, max_frame=1514)
    for _ in range(5):
        sw.receive(0, frame(BB, BROADCAST), now=0.0)
    sw.receive(0, frame(BB, BROADCAST, b"x" * 1501), now=0.0)  # 1515 bytes: a GSO super-frame
    sw.receive(0, b"short", now=0.0)
    assert (sw.queued(), sw.stats.queue_full, sw.stats.oversize, sw.stats.received) == (3, 2, 1, 7)
    assert len(sw.due(0.01)) == 3 and sw.queued() == 0
    assert "queue full 2, oversize 1" in sw.statistics_line()


# --- slow: namespaces, shaping, a real collaboration ----------------------------------------


@dataclass
class Bed:
    """One testbed under a unique prefix; `teardown` removes it whatever state it is in."""

    run_dir: Path
    prefix: str = field(default_factory=lambda: f"ptt{uuid.uuid4().hex[:6]}-")
    subnet: str = SUBNET
    started: dict[str, int] = field(default_factory=dict)
    switch: int | None = None
    """The user switch's PID (switch.pid), once seen."""

    def __call__(self, *args: str, timeout: float = 60, env: dict[str, str] | None = None):
        where = ["--prefix", self.prefix, "--run-dir", str(self.run_dir)]
        return script(*where, "--subnet", f"{self.subnet}.0/24", *args, env=env, timeout=timeout)

    def ns(self, host: str) -> str:
        return f"{self.prefix}{host}"

    def namespaces(self) -> set[str]:
        """Namespaces of exactly this testbed's form (NAT routers included) that exist now."""
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10
        ).stdout
        names = {line.split()[0] for line in out.splitlines() if line.strip()}
        pattern = re.compile(re.escape(self.prefix) + r"(sw|bb|[pr]\d+)")
        return {name for name in names if pattern.fullmatch(name)}

    def read_pids(self) -> dict[str, int]:
        path = self.run_dir / "pids"
        if path.exists():
            for line in path.read_text().splitlines():
                host, pid = line.split()
                self.started[host] = int(pid)
        with contextlib.suppress(FileNotFoundError, ValueError):
            self.switch = int((self.run_dir / "switch.pid").read_text())
        return dict(self.started)

    def ours_alive(self) -> list[int]:
        """PIDs the script started that still run (a reused PID runs someone else's command)."""
        alive = []
        mine = [(pid, str(self.run_dir)) for pid in self.started.values()]
        if self.switch is not None:
            mine.append((self.switch, str(IMPAIR.relative_to(ROOT))))
        for pid, mark in mine:
            try:
                proc = psutil.Process(pid)
                if proc.status() != psutil.STATUS_ZOMBIE and mark in " ".join(proc.cmdline()):
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


# An ICMP echo client (no `ping` binary needed): prints {"sent": N, "rtts": [seconds, ...]}.
PINGER = r"""
import json, os, select, socket, struct, sys, time
target, count, interval = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
def checksum(data):
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    return ~(total + (total >> 16)) & 0xFFFF
ident, payload = os.getpid() & 0xFFFF, b"peertrain-testbed-ping-0123456789"[:32]
sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
sent, rtts, seq, next_send, end = {}, {}, 0, time.monotonic(), None
while len(rtts) < count:
    now = time.monotonic()
    if seq < count and now >= next_send:
        header = struct.pack("!BBHHH", 8, 0, 0, ident, seq)
        icmp = struct.pack("!BBHHH", 8, 0, checksum(header + payload), ident, seq) + payload
        sock.sendto(icmp, (target, 0))
        sent[seq], seq, next_send = now, seq + 1, now + interval
        end = now + 2.0 if seq == count else None
    if end is not None and now >= end:
        break
    readable, _, _ = select.select([sock], [], [], max(0.0, (end or next_send) - now))
    if readable:
        data, now = sock.recv(2048), time.monotonic()
        ihl = (data[0] & 15) * 4
        kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
        if kind == 0 and rid == ident and rseq in sent and rseq not in rtts:
            rtts[rseq] = now - sent[rseq]
print(json.dumps({"sent": count, "rtts": sorted(rtts.values())}))
"""

# `server IP PORT`: prints "listening", counts the bytes of one connection, answers with the count.
# `client IP PORT N`: sends N bytes, prints the count the server answered and the seconds taken.
TRANSFER = r"""
import socket, sys, time
mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode == "server":
    listener = socket.create_server((ip, port))
    print("listening", flush=True)
    conn, _ = listener.accept()
    got = 0
    while chunk := conn.recv(1 << 16):
        got += len(chunk)
    conn.sendall(str(got).encode())
    conn.close()
else:
    n, chunk, started = int(sys.argv[4]), b"x" * (1 << 16), time.monotonic()
    conn = socket.create_connection((ip, port), timeout=30)
    for offset in range(0, n, len(chunk)):
        conn.sendall(chunk[: n - offset])
    conn.shutdown(socket.SHUT_WR)
    answer = conn.recv(64).decode()
    print(answer, time.monotonic() - started, flush=True)
"""


def ping(namespace: str, target: str, *, count: int, interval: float) -> list[float]:
    """RTTs of the echo requests answered, from `namespace` to `target`."""
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", PINGER, target, str(count),
         str(interval)],
        capture_output=True, text=True, timeout=count * interval + 30,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["rtts"]


def transfer(bed: Bed, sender: str, receiver: str, nbytes: int) -> tuple[int, float]:
    """Bytes the receiver counted of `nbytes` sent over TCP between two hosts, and seconds."""
    receiver_ip = f"{SUBNET}.1" if receiver == "bb" else f"{SUBNET}.{int(receiver[1:]) + 1}"
    where = [receiver_ip, "5201"]
    server = subprocess.Popen(
        ["ip", "netns", "exec", bed.ns(receiver), sys.executable, "-c", TRANSFER, "server", *where],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline() == "listening\n"
        client = subprocess.run(
            ["ip", "netns", "exec", bed.ns(sender), sys.executable, "-c", TRANSFER, "client",
             *where, str(nbytes)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert client.returncode == 0, client.stderr
        got, seconds = client.stdout.split()
        return int(got), float(seconds)
    finally:
        server.kill()
        server.wait(timeout=10)


def bridge_ports(namespace: str) -> list[str]:
    out = subprocess.run(
        ["ip", "-n", namespace, "-o", "link", "show", "type", "bridge_slave"],
        capture_output=True, text=True, timeout=10, check=True,
    ).stdout  # fmt: skip
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]


@pytest.mark.slow
@needs_root
@pytest.mark.parametrize("shaper", ["netem", "user"])
def test_three_shaped_peers_train_across_namespaces_and_down_leaves_nothing(bed, shaper):
    shapes = " ".join(",".join(SHAPES[h]) for h in ("p1", "p2", "p3"))
    up = bed("--shaper", shaper, "--shapes", shapes, "up", "3")
    if shaper == "netem" and "this kernel has no sch_netem" in up.stderr:
        pytest.skip("this kernel has no sch_netem")
    assert up.returncode == 0, up.stderr
    assert bed.namespaces() == {bed.ns(h) for h in ("sw", "bb", "p1", "p2", "p3")}

    # The shaping tc reports in the namespaces: each peer's upload (its eth0) and download (its
    # port on the switch) as requested; the backbone's link left alone. The user switch shapes
    # the rate with tbf and runs in place of the bridge.
    for host, shape in SHAPES.items():
        rate, delay, loss = requested(*shape)
        for namespace, device in ((bed.ns(host), "eth0"), (bed.ns("sw"), host)):
            qdisc = root_qdisc(namespace, device)
            if shaper == "netem":
                assert qdisc["kind"] == "netem", qdisc
                assert qdisc["rate"] == rate and qdisc["delay"] == pytest.approx(delay), qdisc
                assert qdisc.get("loss", 0.0) == pytest.approx(loss), qdisc
            else:
                assert qdisc["kind"] == "tbf" and qdisc["rate"] == rate, qdisc
    assert root_qdisc(bed.ns("bb"), "eth0")["kind"] == "noqueue"
    assert root_qdisc(bed.ns("sw"), "bb")["kind"] == "noqueue"
    if shaper == "user":
        bed.read_pids()
        assert bed.ours_alive() == [bed.switch]
        assert bridge_ports(bed.ns("sw")) == []
    else:
        assert sorted(bridge_ports(bed.ns("sw"))) == ["bb", "p1", "p2", "p3"]

    # Each peer's RTT to the backbone: twice its one-way delay, at least.
    rtts = {}
    for host, (_, delay, _) in SHAPES.items():
        answered = ping(bed.ns(host), f"{SUBNET}.1", count=10, interval=0.05)
        rtts[host] = min(answered)
        assert len(answered) >= 5 and rtts[host] >= 1.8 * requested("1bit", delay, "0%")[1]
    print(
        f"\nshaper {shaper}; min RTTs "
        + ", ".join(f"{h} {1e3 * t:.1f} ms" for h, t in rtts.items())
    )

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
    print(f"trained {STEPS} steps in {elapsed:.1f} s")

    # down: every process stopped (the switch too), every namespace gone.
    started_pids = bed.read_pids()
    assert set(started_pids) == {"bb", "p1", "p2", "p3"}
    down = bed("down")
    assert down.returncode == 0, down.stderr
    if shaper == "user":
        assert "down: user switch received" in down.stderr
        print(down.stderr.splitlines()[0])
    assert bed.namespaces() == set()
    assert bed.ours_alive() == []
    again = bed("down")
    assert (again.returncode, again.stderr) == (0, "")


@pytest.mark.slow
@needs_root
def test_the_user_switch_delays_drops_and_carries_a_large_tcp_transfer(bed):
    delay = 0.030
    shapes = "1000mbit,30ms,0% 1000mbit,1ms,20%"
    up = bed("--shaper", "user", "--shapes", shapes, "up", "2")
    assert up.returncode == 0, up.stderr
    assert "shaper=user" in (bed.run_dir / "state").read_text()
    bed.read_pids()
    assert bed.switch is not None and bed.ours_alive() == [bed.switch]

    # p1: 30 ms each way, no loss; the first ping waits for ARP, so the least RTT is the one.
    rtts = ping(bed.ns("p1"), f"{SUBNET}.1", count=20, interval=0.05)
    assert len(rtts) == 20 and min(rtts) >= 1.8 * delay, rtts
    # p2: 20 % on the way in and again on the way out: 1 - 0.8 ** 2 = 36 % of pings lost (over
    # 400 pings, 2.4 % standard deviation: 20 %, as from one way only, is well outside).
    answered = ping(bed.ns("p2"), f"{SUBNET}.1", count=400, interval=0.005)
    lost = 1 - len(answered) / 400
    assert 0.27 < lost < 0.45, lost
    # A 20 MB TCP transfer from p1 to the backbone arrives whole: the hosts' offloads are off,
    # or the switch would read 64 KB segments and partial checksums it cannot pass on.
    got, seconds = transfer(bed, "p1", "bb", 20_000_000)
    assert got == 20_000_000
    print(f"\np1 min RTT {1e3 * min(rtts):.1f} ms, p2 ping loss {lost:.0%}, "
          f"20 MB p1 -> bb in {seconds:.2f} s ({20 / seconds:.1f} MB/s)")  # fmt: skip

    down = bed("down")
    assert down.returncode == 0, down.stderr
    assert re.search(r"down: user switch received \d+, forwarded \d+", down.stderr), down.stderr
    assert bed.namespaces() == set() and bed.ours_alive() == []


@pytest.mark.slow
@needs_root
def test_run_tears_down_after_a_failed_start(bed):
    # The backbone cannot start (its interpreter is `false`): run fails, and its trap cleans up.
    # (tbf: the user switch, which runs with $PYTHON too, would fail first.)
    result = bed("--shaper", "tbf", "run", "2", env={"PYTHON": "/bin/false"}, timeout=120)
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
