"""Measured bandwidth and RTT against a shaped link, in network namespaces this test creates.

A backbone and a peer run as real processes in two namespaces joined by a veth pair. `tc`
shapes the peer's upload (egress of its veth end) to 20 Mbit/s and its download (egress of the
backbone's end) to 100 Mbit/s with token bucket filters, and adds 20 ms of delay each way
(40 ms RTT): with `netem` where the kernel has it, else with a user-space relay on the peer's
side of the link (`tests/delay_relay.py`). The peer's own measurements, read with
`peer status --json`, must be within 15 % of the shaping (goodput: TCP/IP headers take ~4 %).

Needs root, `ip` and `tc`; skipped otherwise. Slow (about 30 s): run it with
`sudo .venv/bin/python -m pytest -m slow tests/test_shaped_link.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from tests.test_cli_e2e import ENV, ROOT, Proc

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
        reason="needs root with ip and tc (network namespaces and traffic shaping)",
    ),
]

UP_MBIT, DOWN_MBIT, DELAY_MS = 20, 100, 20
TOLERANCE = 0.15
# Goodput of TCP over Ethernet: 1448 payload bytes per 1514-byte frame shaped by tbf.
GOODPUT = 1448 / 1514


def sh(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=30)


def netem_available(device: str) -> bool:
    ok = sh("tc", "qdisc", "add", "dev", device, "root", "netem", "delay", "1ms").returncode == 0
    if ok:
        sh("tc", "qdisc", "del", "dev", device, "root")
    return ok


def shape(ns: str, device: str, mbit: int, *, delay_ms: int | None) -> None:
    """Rate-limit `device`'s egress in `ns`; with `delay_ms`, netem first, tbf under it."""
    tc = ["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", device]
    burst = f"{max(32, mbit // 2)}kb"
    if delay_ms:
        run(*tc, "root", "handle", "1:", "netem", "delay", f"{delay_ms}ms", "limit", "10000")
        run(
            *tc,
            "parent",
            "1:1",
            "handle",
            "10:",
            "tbf",
            "rate",
            f"{mbit}mbit",
            "burst",
            burst,
            "latency",
            "100ms",
        )
    else:
        run(*tc, "root", "tbf", "rate", f"{mbit}mbit", "burst", burst, "latency", "100ms")


def run(*args: str) -> None:
    result = sh(*args)
    assert result.returncode == 0, f"{' '.join(args)}: {result.stderr}"


@contextmanager
def namespaces() -> Iterator[tuple[str, str, str, str]]:
    """Two namespaces joined by veth: backbone 10.77.0.1, peer 10.77.0.2. Removed afterwards."""
    tag = str(os.getpid())[-5:]
    bb, pe = f"ptbb{tag}", f"ptpe{tag}"
    try:
        run("ip", "netns", "add", bb)
        run("ip", "netns", "add", pe)
        run("ip", "link", "add", f"vbb{tag}", "type", "veth", "peer", "name", f"vpe{tag}")
        for ns, dev, ip in ((bb, f"vbb{tag}", "10.77.0.1"), (pe, f"vpe{tag}", "10.77.0.2")):
            run("ip", "link", "set", dev, "netns", ns)
            run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/24", "dev", dev)
            run("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
            run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield bb, pe, f"vbb{tag}", f"vpe{tag}"
    finally:
        for ns in (bb, pe):
            sh("ip", "netns", "del", ns)  # takes the veth pair with it


class NsProc(Proc):
    """A CLI process inside a namespace (`ip netns exec` execs it: its PID is ours to kill)."""

    def __init__(self, ns: str, args: list[str], env: dict) -> None:
        self.ns, self.extra_env = ns, env
        super().__init__(args)

    def command(self, args: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, sys.executable, "-m", *args]

    def environment(self) -> dict:
        return {**ENV, **self.extra_env}


def measured_peer(ns: str, backbone: str, env: dict) -> dict | None:
    result = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            sys.executable,
            "-m",
            "cli.peer_cli",
            "status",
            "--json",
            "--backbone",
            backbone,
        ],
        cwd=ROOT,
        env={**ENV, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    rows = [p for p in json.loads(result.stdout)["peers"] if p["role"] == "peer"]
    return rows[0] if rows and rows[0]["upload_bps"] else None


@pytest.fixture(scope="module")
def shaped(tmp_path_factory) -> tuple[dict, bool]:
    """The peer's status row after it measured itself across the shaped link, and whether the
    delay could be shaped too. Runs once for the tests below."""
    tmp_path = tmp_path_factory.mktemp("shaped")
    with namespaces() as (bb_ns, pe_ns, bb_dev, pe_dev):
        netem = netem_available("lo")  # the same kernel serves every namespace
        shape(pe_ns, pe_dev, UP_MBIT, delay_ms=DELAY_MS if netem else None)  # peer's upload
        shape(bb_ns, bb_dev, DOWN_MBIT, delay_ms=DELAY_MS if netem else None)  # its download
        env = {"PEERTRAIN_NET_LISTEN": "/ip4/0.0.0.0/tcp/0", "PEERTRAIN_MEASURE_PROBE_SECONDS": "3"}
        procs: list[NsProc] = []
        try:
            backbone = NsProc(
                bb_ns,
                [
                    "cli.backbone_cli",
                    "start",
                    "--identity",
                    str(tmp_path / "bb.key"),
                    "--announce",
                    "/ip4/10.77.0.1/tcp/31337",
                    "--port",
                    "31337",
                ],
                env,
            )
            procs.append(backbone)
            line = backbone.wait_line("peer join --backbone /ip4/10.77.0.1/", timeout=60)
            address = line.split("--backbone ", 1)[1].strip()
            if not netem:
                # Delay in user space instead: the peer reaches the backbone through a relay on
                # its own side, so the backbone still sees the peer's address (dial-back works).
                relay_args = ["127.0.0.1", "31338", "10.77.0.1", "31337", str(DELAY_MS)]
                relay = NsProc(pe_ns, ["tests.delay_relay", *relay_args], env)
                procs.append(relay)
                relay.wait_line("relaying", timeout=30)
                address = address.replace("/ip4/10.77.0.1/tcp/31337/", "/ip4/127.0.0.1/tcp/31338/")
            peer = NsProc(
                pe_ns,
                [
                    "cli.peer_cli",
                    "join",
                    "--identity",
                    str(tmp_path / "pe.key"),
                    "--backbone",
                    address,
                    "--announce",
                    "/ip4/10.77.0.2/tcp/4001",
                    "--port",
                    "4001",
                ],
                env,
            )
            procs.append(peer)
            peer.wait_line(" joined collaboration", timeout=60)
            deadline, row = time.monotonic() + 120, None
            while row is None and time.monotonic() < deadline:
                time.sleep(2)
                row = measured_peer(pe_ns, address, env)
            assert row is not None, "the peer published no link measurement within 120 s"
        finally:
            for proc in procs:
                proc.popen.kill()
                proc.popen.wait(timeout=10)
    up, down, rtt = row["upload_bps"] * 8e-6, row["download_bps"] * 8e-6, row["rtt_s"] * 1e3
    print(f"\nmeasured up {up:.2f} Mbit/s, down {down:.2f} Mbit/s, rtt {rtt:.1f} ms")
    return row, netem


def test_upload_and_download_are_within_15_percent_of_the_shaping(shaped):
    row, _ = shaped
    assert row["upload_bps"] * 8e-6 == pytest.approx(UP_MBIT * GOODPUT, rel=TOLERANCE)
    assert row["download_bps"] * 8e-6 == pytest.approx(DOWN_MBIT * GOODPUT, rel=TOLERANCE)


def test_the_backbone_dials_the_peer_back_across_the_link(shaped):
    row, _ = shaped
    assert row["reachable"] is True


def test_rtt_is_within_15_percent_of_the_shaping(shaped):
    row, _ = shaped
    assert row["rtt_s"] * 1e3 == pytest.approx(2 * DELAY_MS, rel=TOLERANCE)
