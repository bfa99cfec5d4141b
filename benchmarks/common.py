"""What every benchmark shares: percentiles, the raw-TCP baselines, quiet logging.

Absolute times drift from run to run on a shared machine, so every script measures its raw
loopback TCP baseline in the same run and prints its figures as ratios against it.
"""

from __future__ import annotations

import functools
import logging
import statistics
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
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index]


def summary_ms(samples: Sequence[float]) -> str:
    ms = [s * 1000 for s in samples]
    return (
        f"p50 {percentile(ms, 50):7.2f} ms  p99 {percentile(ms, 99):7.2f} ms  "
        f"mean {statistics.fmean(ms):7.2f} ms  (n={len(ms)})"
    )


async def _echo_server(stream: trio.SocketStream) -> None:
    async with stream:
        async for data in stream:
            await stream.send_all(data)


async def _start_echo_server(nursery: trio.Nursery) -> int:
    listeners = await nursery.start(
        functools.partial(trio.serve_tcp, _echo_server, 0, host="127.0.0.1")
    )
    return listeners[0].socket.getsockname()[1]


async def raw_tcp_round_trips(count: int) -> list[float]:
    """Round trips of a 100-byte ping on one open loopback TCP connection (trio, one process)."""
    samples = []
    async with trio.open_nursery() as nursery:
        port = await _start_echo_server(nursery)
        async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
            for _ in range(count):
                start = time.perf_counter()
                await stream.send_all(b"x" * PING_BYTES)
                received = 0
                while received < PING_BYTES:
                    received += len(await stream.receive_some(PING_BYTES))
                samples.append(time.perf_counter() - start)
        nursery.cancel_scope.cancel()
    return samples


async def raw_tcp_connect_round_trips(count: int) -> list[float]:
    """A new loopback TCP connection plus one 100-byte ping, each time."""
    samples = []
    async with trio.open_nursery() as nursery:
        port = await _start_echo_server(nursery)
        for _ in range(count):
            start = time.perf_counter()
            async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
                await stream.send_all(b"x" * PING_BYTES)
                received = 0
                while received < PING_BYTES:
                    received += len(await stream.receive_some(PING_BYTES))
            samples.append(time.perf_counter() - start)
        nursery.cancel_scope.cancel()
    return samples
