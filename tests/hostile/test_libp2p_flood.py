"""An outsider floods the libp2p ports of a training collaboration of real processes with
idle TCP connections (issue 16, class 5): a newcomer still joins, the global step keeps
advancing and no honest process exits.

Before the inbound gate (peer.net.inbound), py-libp2p gave each accepted connection one of 250
inbound slots before any handshake and held it up to 10 s: 300 idle connections per port,
reopened as they were closed, kept every newcomer (and every `peer status` client) out."""

from __future__ import annotations

import selectors
import socket
import time

import pytest

from tests.collab_processes import Collaboration, Proc
from tests.hostile.common import ENV, FloodThread, free_port, wait_until

# Outsiders: 8 networks (/24s) other than the collaboration's own 127.0.0.0/24, as limits
# count per prefix. (From the members' own /24, a flood spends the accept budget they share:
# what that costs them is in docs/SECURITY.md, "A shared public address".)
SOURCES = [f"127.0.{i}.1" for i in range(2, 10)]

PER_TARGET = 300
REFUSED_BACKOFF = 1.0
"""Seconds before a connection the target closed within `HELD` seconds is tried again."""
HELD = 0.5


class IdleFlood(FloodThread):
    """`PER_TARGET` TCP connections to each target, spread over `SOURCES`, that never send a
    byte. One the target held and then closed (its handshake deadline) is opened again at once,
    to take the slot it freed; one it refused at accept, after `REFUSED_BACKOFF`. A thread of
    its own, owned by the `with` block: it stops and every socket is closed on exit."""

    NAME = "idle-flood"

    def __init__(self, targets: list[tuple[str, int]]) -> None:
        self.targets = targets
        self.opened = 0
        super().__init__()

    def _run(self) -> None:
        due = [
            (0.0, target, SOURCES[i % len(SOURCES)])
            for target in self.targets
            for i in range(PER_TARGET)
        ]
        while not self._stop.is_set():
            now = time.monotonic()
            later = []
            for at, target, source in due:
                if at > now:
                    later.append((at, target, source))
                elif not self._open(target, source, now):
                    later.append((now + REFUSED_BACKOFF, target, source))
            due = later
            for key, _ in self._selector.select(timeout=0.01):
                sock: socket.socket = key.fileobj  # type: ignore[assignment]
                try:
                    if sock.recv(4096):
                        continue  # the target's multistream header: still open
                except BlockingIOError:
                    continue
                except OSError:
                    pass  # reset or refused: closed all the same
                self._selector.unregister(sock)
                sock.close()
                target, source, opened_at = key.data
                now = time.monotonic()
                backoff = 0.0 if now - opened_at > HELD else REFUSED_BACKOFF
                due.append((now + backoff, target, source))

    def _open(self, target: tuple[str, int], source: str, now: float) -> bool:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            sock.connect_ex(target)
        except OSError:
            sock.close()
            return False
        self._selector.register(sock, selectors.EVENT_READ, (target, source, now))
        self.opened += 1
        return True


def averaged_with_others(proc: Proc) -> bool:
    return any(r.get("applied", {}).get("peers", 0) >= 2 for r in proc.records())


# About a minute of real processes under a flood: with -m slow (CI's 15 min budget).
@pytest.mark.slow
def test_an_idle_connection_flood_on_the_libp2p_ports_keeps_no_newcomer_out(tmp_path):
    collab = Collaboration(tmp_path, ENV)
    peer_port = free_port()
    try:
        collab.start_backbone()
        collab.start(
            "peer0",
            [
                "cli.peer_cli",
                "join",
                "--backbone",
                collab.backbone_addr,
                "--listen",
                f"/ip4/127.0.0.1/tcp/{peer_port}",
                "--identity",
                str(tmp_path / "peer0.key"),
            ],
            {"PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(tmp_path / "checkpoints0")},
        )
        collab.start_peer(1)
        collab.watch_global_step()
        steps = collab.global_steps
        wait_until(
            lambda: bool(steps) and steps[-1] >= 2, timeout=120, what="step 2", collab=collab
        )

        backbone_port = int(collab.backbone_addr.split("/tcp/")[1].split("/")[0])
        with IdleFlood([("127.0.0.1", backbone_port), ("127.0.0.1", peer_port)]) as flood:
            wait_until(
                lambda: flood.opened >= 2 * PER_TARGET,
                timeout=30,
                what="the flood's connections",
                collab=collab,
            )
            flooded_at = steps[-1]
            newcomer = collab.start_peer(2)
            wait_until(
                lambda: averaged_with_others(newcomer),
                timeout=120,
                what="the newcomer to average with the others",
                collab=collab,
            )
            wait_until(
                lambda: steps[-1] >= flooded_at + 3,
                timeout=120,
                what="3 more global steps under the flood",
                collab=collab,
            )
            assert flood.opened > 2 * PER_TARGET  # the ports kept closing them
        assert all(p.popen.poll() is None for p in collab.procs)
    finally:
        collab.close()
