"""What every benchmark shares: percentiles, the raw-TCP baselines, quiet logging.

Absolute times drift from run to run on a shared machine, so every script measures its raw
loopback TCP baseline in the same run and prints its figures as ratios against it.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence

import trio

PING_BYTES = 100


def quiet_logs() -> None:
    """Keep py-libp2p's routine ERROR lines out of benchmark output."""
    import libp2p  # noqa: F401  (its import resets the "libp2p" logger; silence it afterwards)

    for name in ("libp2p", "multiaddr", "peertrain"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `samples`, nearest-rank."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summary_ms(samples: Sequence[float]) -> str:
    ms = [s * 1000 for s in samples]
    return (
        f"p50 {percentile(ms, 50):7.2f} ms  p99 {percentile(ms, 99):7.2f} ms  "
        f"mean {statistics.fmean(ms):7.2f} ms  (n={len(ms)})"
    )


async def tcp_echo(stream: trio.SocketStream) -> None:
    """A raw TCP echo handler for `trio.serve_tcp`."""
    async with stream:
        async for data in stream:
            await stream.send_all(data)


async def tcp_round_trips(port: int, count: int, *, reconnect: bool) -> list[float]:
    """Round trips of a 100-byte ping to an echo server; `reconnect`: a new connection each."""
    samples = []
    stream = None if reconnect else await trio.open_tcp_stream("127.0.0.1", port)
    for _ in range(count):
        start = time.perf_counter()
        s = stream or await trio.open_tcp_stream("127.0.0.1", port)
        await s.send_all(b"x" * PING_BYTES)
        received = 0
        while received < PING_BYTES:
            received += len(await s.receive_some(PING_BYTES))
        if reconnect:
            await s.aclose()
        samples.append(time.perf_counter() - start)
    if stream is not None:
        await stream.aclose()
    return samples


async def raw_tcp_round_trips(count: int) -> list[float]:
    """Round trips on one open loopback TCP connection to an echo server in this process."""
    async with trio.open_nursery() as nursery:
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, tcp_echo, 0, host="127.0.0.1")
        )
        samples = await tcp_round_trips(
            listeners[0].socket.getsockname()[1], count, reconnect=False
        )
        nursery.cancel_scope.cancel()
    return samples


#: Set in a benchmark re-run by `rerun_on_shaped_loopback`: the rate its loopback is shaped to.
SHAPED_ENV = "BENCH_LINK_MBIT"  # not PEERTRAIN_*: the daemons refuse unknown ones


def rerun_on_shaped_loopback(mbit: int, argv: Sequence[str]) -> int:
    """Run `python argv` in a network namespace of its own whose loopback is shaped to `mbit`
    Mbit/s (tbf, all traffic together, as through one link), then delete the namespace; the
    child's exit code. Everything the benchmark starts, its raw-TCP baselines included, runs
    there. Root with `ip` and `tc` (iproute2), Linux only."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        sys.exit("a shaped link needs root with ip and tc (iproute2): run it with sudo")
    namespace = f"peertrain-bench-{os.getpid()}"
    rate_bytes = mbit * 1_000_000 // 8
    burst = max(1 << 20, rate_bytes // 100)  # >= rate / HZ, and above lo's 64 KiB packets

    def ip(*args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    ip("netns", "add", namespace)
    try:
        ip("-n", namespace, "link", "set", "lo", "up")
        inside = ["ip", "netns", "exec", namespace]
        subprocess.run(
            [*inside, "tc", "qdisc", "add", "dev", "lo", "root", "tbf", "rate", f"{mbit}mbit",
             "burst", str(burst), "latency", "100ms"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        env = {**os.environ, SHAPED_ENV: str(mbit)}
        return subprocess.run([*inside, sys.executable, *argv], env=env).returncode
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, timeout=30)
