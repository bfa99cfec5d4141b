"""RPC round trips and one-stream throughput over libp2p, next to raw loopback TCP, same run.

    .venv/bin/python -m benchmarks.rpc_stream [--calls 1000] [--connects 100] [--mib 512]

A server process hosts everything that is measured: a peertrain node (Noise + yamux) with an
echo RPC service and a byte sink protocol, plus a raw TCP echo and a raw TCP sink. This process
is the client. Measured:
- RPC round trip of a 100-byte echo on an open connection (the pooled stream is reused),
- the same on a new connection each time (Noise handshake + yamux + stream negotiation + call),
- one stream's throughput: `--mib` MiB in 1 MiB writes, timed until the sink acknowledges
  the byte count it received,
each next to raw trio TCP doing the same between the same two processes.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import time
from multiprocessing.connection import Connection

import msgspec
import trio
from libp2p.abc import INetStream
from libp2p.peer.id import ID

from benchmarks.common import (
    PING_BYTES,
    percentile,
    quiet_logs,
    summary_ms,
    tcp_echo,
    tcp_round_trips,
)
from peer.net.host import Node, open_node, split_peer_addr
from peer.net.rpc import RpcServer
from tests.helpers import new_identity

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
SINK_PROTOCOL = "/peertrain-bench/sink/1"
CHUNK = 1 << 20
MAX_MESSAGE = 1 << 20


class Ping(msgspec.Struct):
    data: bytes


# ---------------------------------------------------------------------------- server process


async def _echo_rpc(caller: ID, request: Ping) -> Ping:
    return request


async def _libp2p_sink(stream: INetStream) -> None:
    received = 0
    while data := await _read_or_eof(stream):
        received += len(data)
    await stream.write(received.to_bytes(8, "big"))
    await stream.close()


async def _read_or_eof(stream: INetStream) -> bytes:
    try:
        return await stream.read(CHUNK)
    except EOFError:
        return b""


async def _tcp_sink(stream: trio.SocketStream) -> None:
    async with stream:
        received = 0
        async for data in stream:
            received += len(data)
        await stream.send_all(received.to_bytes(8, "big"))


async def _serve(pipe: Connection) -> None:
    quiet_logs()
    async with (
        open_node(
            new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
        ) as node,
        trio.open_nursery() as nursery,
    ):
        RpcServer(node.host, "bench", max_message_bytes=MAX_MESSAGE).add_unary(
            "echo", Ping, _echo_rpc
        )
        node.host.set_stream_handler(SINK_PROTOCOL, _libp2p_sink)
        ports = []
        for handler in (tcp_echo, _tcp_sink):
            listeners = await nursery.start(
                functools.partial(trio.serve_tcp, handler, 0, host="127.0.0.1")
            )
            ports.append(listeners[0].socket.getsockname()[1])
        pipe.send((node.public_addrs()[0], *ports))
        await trio.sleep_forever()


def serve(pipe: Connection) -> None:
    trio.run(_serve, pipe)


# ---------------------------------------------------------------------------- client


async def rpc_round_trips(node: Node, server: ID, count: int) -> list[float]:
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        await node.rpc.call(server, "bench", "echo", Ping(b"x" * PING_BYTES), Ping, timeout=5)
        samples.append(time.perf_counter() - start)
    return samples


async def rpc_connect_round_trips(node: Node, server: ID, addr, count: int) -> list[float]:
    samples = []
    network = node.host.get_network()
    for _ in range(count):
        await network.close_peer(server)
        node.rpc.forget(server)
        start = time.perf_counter()
        await node.connect(server, [addr], timeout=5)
        await node.rpc.call(server, "bench", "echo", Ping(b"x" * PING_BYTES), Ping, timeout=5)
        samples.append(time.perf_counter() - start)
    return samples


async def libp2p_throughput(node: Node, server: ID, total: int) -> float:
    payload = b"\x00" * CHUNK
    stream = await node.host.new_stream(server, [SINK_PROTOCOL])
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        await stream.write(payload)
    await stream.close()
    ack = b""
    while len(ack) < 8:
        ack += await stream.read(8 - len(ack))
    elapsed = time.perf_counter() - start
    assert int.from_bytes(ack, "big") == total, "the sink lost bytes"
    return total / elapsed


async def tcp_throughput(port: int, total: int) -> float:
    payload = b"\x00" * CHUNK
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    start = time.perf_counter()
    for _ in range(total // CHUNK):
        await stream.send_all(payload)
    await stream.send_eof()
    ack = b""
    while len(ack) < 8:
        ack += await stream.receive_some(8 - len(ack))
    elapsed = time.perf_counter() - start
    await stream.aclose()
    assert int.from_bytes(ack, "big") == total, "the sink lost bytes"
    return total / elapsed


async def client(addr_text: str, echo_port: int, sink_port: int, args: argparse.Namespace) -> None:
    quiet_logs()
    server, addr = split_peer_addr(addr_text, what="server")
    async with open_node(
        new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
    ) as node:
        await node.connect(server, [addr], timeout=5)
        await rpc_round_trips(node, server, 50)  # warm-up
        await tcp_round_trips(echo_port, 50, reconnect=False)

        def row(what: str, samples: list[float], baseline: list[float]) -> None:
            ratio = percentile(samples, 50) / percentile(baseline, 50)
            print(f"  {what:34s} {summary_ms(samples)}  p50 = {ratio:,.1f} x raw TCP")

        print("round trip of a 100-byte message, two processes on loopback")
        raw = await tcp_round_trips(echo_port, args.calls, reconnect=False)
        print(f"  {'raw TCP, open connection':34s} {summary_ms(raw)}")
        row("RPC, open connection", await rpc_round_trips(node, server, args.calls), raw)
        raw_new = await tcp_round_trips(echo_port, args.connects, reconnect=True)
        print(f"  {'raw TCP, new connection':34s} {summary_ms(raw_new)}")
        new = await rpc_connect_round_trips(node, server, addr, args.connects)
        row("RPC, new connection", new, raw_new)

        total = args.mib * CHUNK
        print(f"\none stream, {args.mib} MiB in 1 MiB writes, two processes on loopback")
        raw_rate = max([await tcp_throughput(sink_port, total) for _ in range(3)])
        print(f"  {'raw TCP':34s} {raw_rate / 1e6:8,.0f} MB/s   (best of 3)")
        rate = max([await libp2p_throughput(node, server, total) for _ in range(3)])
        print(
            f"  {'libp2p Noise + yamux':34s} {rate / 1e6:8,.0f} MB/s   (best of 3)"
            f"  = {rate / raw_rate:.2f} x raw TCP"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--connects", type=int, default=100)
    parser.add_argument("--mib", type=int, default=512)
    args = parser.parse_args()
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=serve, args=(child,), daemon=True)
    process.start()
    try:
        if not parent.poll(60):
            raise SystemExit("the benchmark server did not start within 60 s")
        addr, echo_port, sink_port = parent.recv()
        trio.run(client, addr, echo_port, sink_port, args)
    finally:
        process.kill()
        process.join(10)


if __name__ == "__main__":
    main()
