"""What a flood of raw TCP connections costs a listener: one process opens and at once
closes connections to a listener in another process for `--seconds`, from one /24, and we
read the listener's CPU time (/proc/<pid>/stat) per 1,000 connections it accepted.

    .venv/bin/python -m benchmarks.accept_flood [--seconds 10] [--rate 3000] [--modes ...]

Listeners (`--modes`, each in a fresh process):
- bare: a trio accept-and-close loop (the floor every ratio is against);
- task: trio.serve_listeners with a handler that closes at once (what a check made in the
  connection's own task, instead of at accept, would cost at least);
- libp2p: a peertrain node (`peer.net.host.open_node`, default inbound limits);
- data: a data port (`peer.net.admission`, as the all-reduce serves it, no network key);
- dashboard, metrics: the HTTP endpoints.
The flooder connects from 8 addresses of one /24 (127.0.0.2-9: each has its own ephemeral
ports for the TIME_WAIT its closes leave) and closes at once; `--rate` paces it (0: as fast
as it can). A connection reset before the listener accepts it never reaches its code, so the
flood closes with a FIN, as one that wants to cost us something does. The listener's CPU over
an idle period as long as the flood is measured first and taken off. Printed per listener:
connections tried and accepted, listener CPU per 1,000 accepted, its ratio to bare, and the
share of a core the listener spent during the flood. (Measured for issue 45 on 2 busy cores,
3,000/s: libp2p 986 ms per 1,000 before the accept budget, 15.7 x bare, 90 % of a core and
two thirds never accepted; 84 ms after, 1.3 x bare.)
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

MODES = ("bare", "task", "libp2p", "data", "dashboard", "metrics")
SOURCES = [f"127.0.0.{n}" for n in range(2, 10)]  # one /24
TICKS = os.sysconf("SC_CLK_TCK")


# ------------------------------------------------------------------------- the listener


def serve(mode: str) -> None:
    """Run listener `mode` on 127.0.0.1 in this process; print its port, serve until killed."""
    import trio

    from benchmarks.common import quiet_logs

    quiet_logs()
    accepted = count_accepts()

    def ready(port: int) -> None:
        print(port, flush=True)

    async def bare() -> None:
        listener = trio.socket.socket()
        await listener.bind(("127.0.0.1", 0))
        listener.listen(4096)
        ready(listener.getsockname()[1])
        while True:
            sock, _ = await listener.accept()
            sock.close()

    async def task() -> None:
        async def close(stream: trio.SocketStream) -> None:
            await stream.aclose()

        listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
        ready(listeners[0].socket.getsockname()[1])
        await trio.serve_listeners(close, listeners)

    async def libp2p() -> None:
        from peer.net.host import open_node
        from peer.net.identity import ephemeral_identity

        node_cm = open_node(
            ephemeral_identity(), listen=["/ip4/127.0.0.1/tcp/0"], announce=[],
            max_message_bytes=1 << 20,
        )  # fmt: skip
        async with node_cm as node:
            ready(int(str(node.announce[0]).split("/tcp/")[1]))
            await trio.sleep_forever()

    async def data() -> None:
        import contextlib
        import functools

        from peer.net.admission import Admission
        from peer.net.identity import ephemeral_identity
        from peer.net.tls import DataIdentity

        identity = ephemeral_identity()
        context = DataIdentity(identity.key_pair.private_key, identity.peer_id.to_base58()).server
        admission = Admission(None)

        async def greet(tls: object) -> None:
            return None

        async def handle(stream: trio.SocketStream) -> None:
            with contextlib.suppress(OSError, trio.BrokenResourceError, trio.ClosedResourceError):
                await admission.accept(stream, context, greet)

        # What the all-reduce and the donor serve with: `Admission.serve` where it exists
        # (the budget at accept), else trio's serve_tcp.
        serve_with = getattr(admission, "serve", None) or trio.serve_tcp
        async with trio.open_nursery() as nursery:
            listeners = await nursery.start(
                functools.partial(serve_with, host="127.0.0.1"), handle, 0
            )
            ready(listeners[0].socket.getsockname()[1])

    async def dashboard() -> None:
        from peer.dashboard.server import serve_dashboard

        async with trio.open_nursery() as nursery:
            ready(await nursery.start(serve_dashboard, "127.0.0.1", 0, lambda: b"{}"))

    async def metrics() -> None:
        from prometheus_client.registry import CollectorRegistry

        from peer.metrics import serve_metrics

        async with trio.open_nursery() as nursery:
            ready(await nursery.start(serve_metrics, CollectorRegistry(), "127.0.0.1", 0))

    runners = {"bare": bare, "task": task, "libp2p": libp2p, "data": data}
    runners |= {"dashboard": dashboard, "metrics": metrics}

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(runners[mode])
            while await trio.to_thread.run_sync(sys.stdin.readline):
                print(accepted[0], flush=True)  # the flooder asks how many were accepted
            nursery.cancel_scope.cancel()

    trio.run(main)


def count_accepts() -> list[int]:
    """Count every accept(2) of trio sockets in this process from now on, whichever loop
    calls it (a listener's own, trio's serve_listeners): [count], read by the caller."""
    import trio

    counter = [0]
    socket_type = trio._socket._SocketType  # the class of every trio socket (private)
    original = socket_type.accept

    async def accept(self: object) -> object:
        accepted = await original(self)
        counter[0] += 1
        return accepted

    socket_type.accept = accept  # type: ignore[method-assign]
    return counter


# -------------------------------------------------------------------------- the flooder


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime (fields 14, 15)


def flood(port: int, *, seconds: float, rate: float, sources: list[str] | None = None) -> int:
    """Open and close connections to 127.0.0.1:`port` for `seconds` from `sources` (default
    127.0.0.2-9); how many were tried.
    Non-blocking: a connection the listener's full accept queue drops costs no wait (a
    blocking connect waited out the 1 s SYN retransmission and flooded at a trickle)."""
    sources = sources or SOURCES
    tried = 0
    start = time.monotonic()
    end = start + seconds
    while (now := time.monotonic()) < end:
        if rate and tried >= (now - start) * rate:
            time.sleep(min(0.001, end - now))
            continue
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((sources[tried % len(sources)], 0))
            sock.connect_ex(("127.0.0.1", port))  # on loopback done within the call
        except OSError:
            pass
        finally:
            sock.close()
        tried += 1
    return tried


@dataclass
class Result:
    mode: str
    tried: int
    connections: int
    """Accepted by the listener."""
    cpu: float
    """Listener CPU seconds during the flood and its drain, idle CPU taken off."""
    wall: float

    @property
    def per_thousand_ms(self) -> float:
        return 1000 * self.cpu / max(1, self.connections) * 1000


def measure(mode: str, *, seconds: float, rate: float) -> Result:
    child = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.accept_flood", "--serve", mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )

    def accepted() -> int:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write("?\n")
        child.stdin.flush()
        return int(child.stdout.readline())

    try:
        assert child.stdout is not None
        port = int(child.stdout.readline())
        time.sleep(1.0)  # startup work done
        before = cpu_seconds(child.pid)
        time.sleep(seconds)
        idle = cpu_seconds(child.pid) - before
        before, first = cpu_seconds(child.pid), accepted()
        start = time.monotonic()
        tried = flood(port, seconds=seconds, rate=rate)
        time.sleep(1.0)  # the listener drains its accept queue
        wall = time.monotonic() - start
        cpu = cpu_seconds(child.pid) - before - idle * wall / seconds
        return Result(mode, tried, accepted() - first, max(0.0, cpu), wall)
    finally:
        child.kill()
        child.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rate", type=float, default=3000.0, help="connections/s; 0: max")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    args = parser.parse_args()
    if args.serve:
        serve(args.serve)
        return
    modes = ["bare", *(m for m in args.modes if m != "bare")]
    pace = f"{args.rate:g}/s" if args.rate else "as fast as possible"
    print(f"flood from 127.0.0.2-9, {args.seconds:g} s per listener, {pace}")
    results = [measure(mode, seconds=args.seconds, rate=args.rate) for mode in modes]
    floor = results[0].per_thousand_ms
    print(
        f"{'listener':10} {'tried':>8} {'accepted':>8} {'acc/s':>7} {'CPU ms/1000':>12} "
        f"{'x bare':>7} {'core':>6}"
    )
    for r in results:
        print(
            f"{r.mode:10} {r.tried:8d} {r.connections:8d} {r.connections / args.seconds:7.0f} "
            f"{r.per_thousand_ms:12.1f} {r.per_thousand_ms / floor:7.1f} "
            f"{100 * r.cpu / r.wall:5.0f}%"
        )


if __name__ == "__main__":
    main()
