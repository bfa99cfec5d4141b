"""An outsider floods the data ports of a training collaboration of real processes (every TCP
port its processes listen on but libp2p's: each peer's all-reduce port and state donor port)
with idle and junk connections from 8 networks, reopened as they are closed (issue 16,
class 5): the global step keeps advancing at half the calm rate or more, a late joiner (whose
ports are flooded as soon as they open) downloads the state and averages with the others, and
no honest process exits. (The libp2p ports are tests/hostile/test_libp2p_flood.py's.)

Before admission (peer.net.admission), the state donor closed every connection past
2 * max_downloads + 16 = 24 unauthenticated ones and gave each 10 s to show its ticket: a few
dozen idle connections, reopened as they were closed, kept every joiner's download out."""

from __future__ import annotations

import contextlib
import errno
import heapq
import itertools
import os
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

import psutil
import pytest

from tests.collab_processes import Collaboration, Proc
from tests.hostile.common import ENV, FloodThread, check_alive, free_port, wait_until

# Outsiders: 8 networks (/24s) other than the collaboration's own 127.0.0.0/24, as limits
# count per prefix. (From the members' own /24, a flood spends the accept budget they share:
# what that costs them is in docs/SECURITY.md, "A shared public address".)
SOURCES = [f"127.0.{i}.1" for i in range(2, 10)]

PER_SOURCE = 40  # connections per port and source (a /24): over the per-prefix cap (32)
JUNK_PER_SOURCE = 4  # of those, ones that send junk bytes once connected
JUNK_BYTES = 512
REFUSED_BACKOFF = 1.0
"""Seconds before a connection the target closed within `HELD` seconds is tried again."""
HELD = 0.5
SCAN_INTERVAL = 2.0  # seconds between looks for new listening ports (the late joiner's)
WINDOW = 20.0  # seconds of each measurement of the step rate, at least
FLOOR = 0.5  # the step rate under the flood, as a share of the calm one, at least

Target = tuple[str, int]
IP_BIND_ADDRESS_NO_PORT = getattr(socket, "IP_BIND_ADDRESS_NO_PORT", 24)  # Linux


def listening_ports(pids: list[int]) -> set[Target]:
    """The IPv4 TCP ports these processes (and their children) listen on."""
    out: set[Target] = set()
    for pid in pids:
        try:
            root = psutil.Process(pid)
            for proc in [root, *root.children(recursive=True)]:
                lister = getattr(proc, "net_connections", None) or proc.connections
                for conn in lister(kind="tcp4"):
                    if conn.status == psutil.CONN_LISTEN:
                        host = conn.laddr.ip
                        out.add(("127.0.0.1" if host == "0.0.0.0" else host, conn.laddr.port))
        except psutil.Error:
            continue  # it exited meanwhile: the test notices
    return out


@dataclass
class _Conn:
    target: Target
    source: str
    junk: bool
    opened_at: float
    connected: bool = False


class PortFlood(FloodThread):
    """`PER_SOURCE` TCP connections to each port in `ports()` from each of `SOURCES`;
    `JUNK_PER_SOURCE` of them send junk once connected, the others never send a byte. Ports
    are looked for every `SCAN_INTERVAL` s, so a newcomer's are flooded too. A connection the
    target held and then closed (its deadline, or an eviction) is opened again at once, to take
    the slot it freed; one it refused at accept, after `REFUSED_BACKOFF`. A thread of its own,
    owned by the `with` block: it stops and every socket is closed on exit."""

    NAME = "port-flood"

    def __init__(self, ports: Callable[[], set[Target]]) -> None:
        self.ports = ports
        self.targets: set[Target] = set()
        self.opened = 0
        self.held = 0  # connected and not closed yet
        self.most_held = 0
        self.closed_by_targets = 0
        super().__init__()

    @property
    def running(self) -> bool:
        """Its thread is still flooding (it did not die of an error)."""
        return self._thread.is_alive()

    def _run(self) -> None:
        due: list[tuple[float, int, Target, str, bool]] = []  # a heap: (when, seq, ...)
        seq = itertools.count()
        next_scan = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now >= next_scan:
                next_scan = now + SCAN_INTERVAL
                for target in self.ports() - self.targets:
                    self.targets.add(target)
                    for i in range(PER_SOURCE):
                        for source in SOURCES:
                            heapq.heappush(
                                due, (now, next(seq), target, source, i < JUNK_PER_SOURCE)
                            )
            while due and due[0][0] <= now:
                _, _, target, source, junk = heapq.heappop(due)
                if not self._open(_Conn(target, source, junk, now)):
                    heapq.heappush(due, (now + REFUSED_BACKOFF, next(seq), target, source, junk))
            for key, events in self._selector.select(timeout=0.01):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                conn: _Conn = key.data
                if (events & selectors.EVENT_WRITE and not self._connected(sock, conn)) or (
                    events & selectors.EVENT_READ and not self._still_open(sock)
                ):
                    at = self._close(sock, conn)
                    heapq.heappush(due, (at, next(seq), conn.target, conn.source, conn.junk))

    def _open(self, conn: _Conn) -> bool:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.setsockopt(socket.IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, 1)
            sock.bind((conn.source, 0))
            error = sock.connect_ex(conn.target)
        except OSError:
            error = -1
        if error not in (0, errno.EINPROGRESS):
            sock.close()
            return False
        self._selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
        self.opened += 1
        return True

    def _connected(self, sock: socket.socket, conn: _Conn) -> bool:
        """The connect finished: False if it failed."""
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
            return False
        conn.connected = True
        self.held += 1
        self.most_held = max(self.most_held, self.held)
        if conn.junk:
            with contextlib.suppress(OSError):
                sock.send(os.urandom(JUNK_BYTES))
        self._selector.modify(sock, selectors.EVENT_READ, conn)
        return True

    def _still_open(self, sock: socket.socket) -> bool:
        try:
            return bool(sock.recv(4096))  # a nonce, a TLS alert, a multistream header
        except BlockingIOError:
            return True
        except OSError:
            return False  # reset or refused: closed all the same

    def _close(self, sock: socket.socket, conn: _Conn) -> float:
        """Forget a connection the target closed; when to open it again."""
        self._selector.unregister(sock)
        sock.close()
        now = time.monotonic()
        if conn.connected:
            self.held -= 1
            self.closed_by_targets += 1
        return now + (0.0 if conn.connected and now - conn.opened_at > HELD else REFUSED_BACKOFF)


def steps_in_window(collab: Collaboration, what: str) -> tuple[int, float]:
    """Global steps taken in the next `WINDOW` seconds, and the seconds measured."""
    steps = collab.global_steps
    first, start = steps[-1], time.monotonic()
    wait_until(
        lambda: time.monotonic() - start >= WINDOW, timeout=2 * WINDOW, what=what, collab=collab
    )
    return steps[-1] - first, time.monotonic() - start


def messages(proc: Proc, prefix: str) -> list[dict]:
    return [r for r in proc.records() if str(r.get("msg", "")).startswith(prefix)]


def failures(proc: Proc) -> list[str]:
    """The last few state download failures it logged."""
    return [str(r["msg"])[:160] for r in messages(proc, "state download failed")][-3:]


def averaged_after_download(proc: Proc) -> bool:
    """It applied a step averaged with others after it downloaded the state."""
    seen = False
    for record in proc.records():
        seen = seen or str(record.get("msg", "")).startswith("downloaded the state")
        if seen and record.get("applied", {}).get("peers", 0) >= 2:
            return True
    return False


def start_peer(collab: Collaboration, index: int) -> tuple[Proc, int]:
    """`collab.start_peer`, on a libp2p port we know (the flood leaves it alone)."""
    port = free_port()
    proc = collab.start(
        f"peer{index}",
        [
            "cli.peer_cli",
            "join",
            "--backbone",
            collab.backbone_addr,
            "--listen",
            f"/ip4/127.0.0.1/tcp/{port}",
            "--identity",
            str(collab.workdir / f"peer{index}.key"),
        ],
        {"PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(collab.workdir / f"checkpoints{index}")},
    )
    return proc, port


@pytest.mark.slow  # ~90 s of real processes: CI keeps to 15 minutes (run with -m slow)
def test_a_connection_flood_on_the_data_ports_stalls_neither_steps_nor_a_late_joiner(tmp_path):
    collab = Collaboration(tmp_path, ENV)
    try:
        collab.start_backbone()
        libp2p = {int(collab.backbone_addr.split("/tcp/")[1].split("/")[0])}
        for index in (0, 1):
            libp2p.add(start_peer(collab, index)[1])
        collab.watch_global_step()
        steps = collab.global_steps
        wait_until(
            lambda: bool(steps) and steps[-1] >= 2, timeout=120, what="step 2", collab=collab
        )
        calm_steps, calm_seconds = steps_in_window(collab, "the calm window")

        def data_ports() -> set[Target]:
            alive = [p.popen.pid for p in list(collab.procs) if p.popen.poll() is None]
            return {t for t in listening_ports(alive) if t[1] not in libp2p}

        with PortFlood(data_ports) as flood:
            ports = len(data_ports())
            wait_until(
                lambda: flood.opened >= ports * len(SOURCES) * PER_SOURCE,
                timeout=30,
                what="the flood's connections",
                collab=collab,
            )
            flood_steps, flood_seconds = steps_in_window(collab, "the flood's window")
            calm_rate, flood_rate = calm_steps / calm_seconds, flood_steps / flood_seconds
            figures = (
                f"calm: {calm_steps} steps in {calm_seconds:.0f} s; flood: {flood_steps} steps "
                f"in {flood_seconds:.0f} s, {len(flood.targets)} ports, {flood.held} "
                f"connections held (most {flood.most_held}), {flood.opened} opened, "
                f"{flood.closed_by_targets} closed by the targets"
            )
            print(figures)
            assert ports >= 4, figures  # two peers' all-reduce and donor ports
            assert calm_steps >= 3, figures
            assert flood_rate >= FLOOR * calm_rate, figures
            assert flood.closed_by_targets > 0, figures  # held, then closed: they were served
            assert flood.running, figures

            late, port = start_peer(collab, 2)
            libp2p.add(port)
            wait_until(
                lambda: averaged_after_download(late),
                timeout=120,
                what=lambda: (
                    "the late joiner to download the state and average with the others "
                    f"(download failures: {failures(late)}; {flood.held} connections held "
                    f"on {len(flood.targets)} ports)"
                ),
                collab=collab,
            )
            joined_at = steps[-1]
            wait_until(
                lambda: steps[-1] >= joined_at + 3,
                timeout=60,
                what="3 more global steps with the late joiner",
                collab=collab,
            )
            assert len(flood.targets) >= ports + 2  # the late joiner's ports were flooded too
            assert flood.running
            print(
                f"late joiner: {[r['msg'] for r in messages(late, 'downloaded the state')]}; "
                f"flood: {flood.held} connections held (most {flood.most_held}) on "
                f"{len(flood.targets)} ports, {flood.opened} opened"
            )
        check_alive(collab, "the end")
    finally:
        collab.close()
