"""What an attacker sharing a member's public address costs the member: a node listens in a
process of its own, an attacker works from the member's own address (127.0.0.1; a NAT'd
site's members and a stranger behind the same carrier-grade NAT look alike), and the member
joins (`Node.connect`, a fresh identity each time) `--joins` times per scenario.

    .venv/bin/python -m benchmarks.shared_address [--joins 20] [--rate 3000]

Scenarios (the first is the baseline the others are read against):
- calm: no attacker;
- idle: `max_pending_per_source` (16) connections that never send a byte, opened once;
- idle, reopened: the same, each opened again as soon as the node closes it;
- flood: connections opened and closed at once, `--rate` a second, from the member's /24
  (127.0.0.2-9: their own ephemeral ports for the TIME_WAITs);
- flood elsewhere: the same flood from another /24 (127.0.5.2-9).
Printed: joins that succeeded, and the median time of those.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import trio

from benchmarks.common import quiet_logs

IDLE = 16
MEMBER = "127.0.0.1"


def serve() -> None:
    """A node on 127.0.0.1 with the default inbound limits; prints its address."""
    from peer.net.host import open_node
    from peer.net.identity import ephemeral_identity

    quiet_logs()

    async def main() -> None:
        node_cm = open_node(
            ephemeral_identity(), listen=["/ip4/127.0.0.1/tcp/0"], announce=[],
            max_message_bytes=1 << 20,
        )  # fmt: skip
        async with node_cm as node:
            print(f"{node.announce[0]}/p2p/{node.peer_id}", flush=True)
            await trio.sleep_forever()

    trio.run(main)


class Attacker:
    """A thread of raw sockets against `port`, owned by the `with` block."""

    def __init__(self, port: int, run: Callable[[threading.Event], None] | None) -> None:
        self.port = port
        self._stop = threading.Event()
        self._thread = (
            threading.Thread(target=run, args=(self._stop,), daemon=True) if run else None
        )

    def __enter__(self) -> Attacker:
        if self._thread:
            self._thread.start()
            time.sleep(0.5)  # under way before the member comes
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(10)


def idle(port: int, *, reopen: bool) -> Callable[[threading.Event], None]:
    def run(stop: threading.Event) -> None:
        selector = selectors.DefaultSelector()

        def open_one() -> None:
            sock = socket.create_connection(("127.0.0.1", port), source_address=(MEMBER, 0))
            sock.setblocking(False)
            selector.register(sock, selectors.EVENT_READ)

        for _ in range(IDLE):
            open_one()
        while not stop.is_set():
            for key, _ in selector.select(timeout=0.05):
                sock = key.fileobj
                try:
                    if sock.recv(4096):  # type: ignore[union-attr]
                        continue
                except BlockingIOError:
                    continue
                except OSError:
                    pass
                selector.unregister(sock)
                sock.close()  # type: ignore[union-attr]
                if reopen:
                    open_one()
        for key in list(selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]

    return run


def flood(port: int, *, network: str, rate: float) -> Callable[[threading.Event], None]:
    """Connections from addresses 2-9 of `network` (a /24: "127.0.0"), closed at once (a
    FIN: one reset before the node accepts it never reaches its code), `rate` a second."""

    def run(stop: threading.Event) -> None:
        start, tried = time.monotonic(), 0
        while not stop.is_set():
            if tried >= (time.monotonic() - start) * rate:
                time.sleep(0.001)
                continue
            sock = socket.socket()
            sock.setblocking(False)
            try:
                sock.bind((f"{network}.{2 + tried % 8}", 0))
                sock.connect_ex(("127.0.0.1", port))
            except OSError:
                pass
            finally:
                sock.close()
            tried += 1

    return run


async def joins(address: str, count: int) -> list[float | None]:
    """`count` joins of fresh members: each one's seconds, None if it failed."""
    from libp2p.peer.id import ID
    from multiaddr import Multiaddr

    from peer.errors import Unreachable
    from peer.net.host import open_node
    from peer.net.identity import ephemeral_identity

    transport, peer = address.split("/p2p/")
    out: list[float | None] = []
    for _ in range(count):
        node_cm = open_node(
            ephemeral_identity(), listen=["/ip4/127.0.0.1/tcp/0"], announce=[],
            max_message_bytes=1 << 20,
        )  # fmt: skip
        async with node_cm as member:
            start = trio.current_time()
            try:
                await member.connect(ID.from_base58(peer), [Multiaddr(transport)], timeout=5)
                out.append(trio.current_time() - start)
            except Unreachable:
                out.append(None)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--joins", type=int, default=20)
    parser.add_argument("--rate", type=float, default=3000.0)
    args = parser.parse_args()
    if args.serve:
        serve()
        return
    quiet_logs()
    node = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.shared_address", "--serve"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert node.stdout is not None
        address = node.stdout.readline().strip()
        port = int(address.split("/tcp/")[1].split("/")[0])
        scenarios = {
            "calm": None,
            "idle": idle(port, reopen=False),
            "idle, reopened": idle(port, reopen=True),
            f"flood {args.rate:g}/s": flood(port, network="127.0.0", rate=args.rate),
            f"flood elsewhere {args.rate:g}/s": flood(port, network="127.0.5", rate=args.rate),
        }
        print(f"member joins from {MEMBER}, {args.joins} per scenario")
        for name, attack in scenarios.items():
            with Attacker(port, attack):
                times = trio.run(joins, address, args.joins)
            good = [t for t in times if t is not None]
            median = f"{statistics.median(good) * 1000:7.0f} ms" if good else "      -"
            print(f"{name:26} {len(good):3d} of {len(times):3d} joined   median {median}")
            time.sleep(2.0)  # the node's handshake deadlines pass, its buckets refill
    finally:
        node.kill()
        node.wait()


if __name__ == "__main__":
    main()
