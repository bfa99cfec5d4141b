"""A TCP relay that delays every byte by a fixed time each way: latency without `netem`.

    python -m tests.delay_relay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT DELAY_MS

Used by the shaped-link test on kernels without the netem qdisc. Bytes are forwarded in the
order and chunks they arrive, each `DELAY_MS` after it arrived; the relay adds no rate limit
(tc shapes the link itself). Prints "relaying" once it listens.
"""

from __future__ import annotations

import functools
import math
import sys

import trio


async def delayed_pipe(src: trio.SocketStream, dst: trio.SocketStream, delay: float) -> None:
    send, receive = trio.open_memory_channel[tuple[float, bytes]](math.inf)

    async def read() -> None:
        async with send:
            async for data in src:
                send.send_nowait((trio.current_time() + delay, data))

    async def write() -> None:
        async for due, data in receive:
            await trio.sleep_until(due)
            await dst.send_all(data)
        await dst.send_eof()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        nursery.start_soon(write)


async def relay(client: trio.SocketStream, target: tuple[str, int], delay: float) -> None:
    try:
        async with (
            client,
            await trio.open_tcp_stream(*target) as server,
            trio.open_nursery() as nursery,
        ):
            nursery.start_soon(delayed_pipe, client, server, delay)
            nursery.start_soon(delayed_pipe, server, client, delay)
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError):
        pass  # either side went away: so does the relayed connection


async def main(host: str, port: int, target_host: str, target_port: int, delay_ms: float) -> None:
    handler = functools.partial(relay, target=(target_host, target_port), delay=delay_ms / 1000)
    async with trio.open_nursery() as nursery:
        await nursery.start(functools.partial(trio.serve_tcp, handler, port, host=host))
        print("relaying", flush=True)


if __name__ == "__main__":
    h, p, th, tp, d = sys.argv[1:6]
    trio.run(main, h, int(p), th, int(tp), float(d))
