"""What TLS 1.3 costs a bulk transfer here, and what the usual remedies buy: one-way transfers
of `--mb` MB between two processes on loopback, against raw TCP in the same run.

    .venv/bin/python -m benchmarks.tls_transport [--mb 100] [--runs 5]

Variants (`xK`: the bytes split over K connections at once):
- raw: plain trio sockets, 1 MiB per call (the floor);
- fd: `peer.net.tls.TlsStream` as both data planes use it (OpenSSL on a non-blocking socket,
  driven by trio), with 16 KiB, 256 KiB (ours) or 4 MiB handed to OpenSSL per Python call;
- thread: a blocking `ssl.SSLSocket` per connection, `sendall`/`recv_into` in its own worker
  thread (OpenSSL releases the GIL, so K connections may use K cores).
TLS records are at most 16 KiB whatever the write size (RFC 8446 5.1), so "larger records"
means more records per call. Reported per variant: median wall seconds, its ratio to raw,
and the CPU seconds the sender and the receiver spent per transfer.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import socket
import ssl
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import trio

from benchmarks.common import quiet_logs
from peer.net import tls
from peer.net.identity import ephemeral_identity
from peer.net.tls import DataIdentity, TlsStream, pinned_client_context

PIECE = 1 << 20  # raw sockets: bytes per call


@dataclass(frozen=True)
class Variant:
    kind: str  # raw, fd or thread
    connections: int = 1
    write_bytes: int = 1 << 18  # fd: bytes handed to OpenSSL per call

    @property
    def name(self) -> str:
        name = self.kind
        if self.kind == "fd":
            name += f" {self.write_bytes >> 10} KiB"
        return name + (f" x{self.connections}" if self.connections > 1 else "")


VARIANTS = [
    Variant("raw"),
    Variant("fd", write_bytes=1 << 14),
    Variant("fd"),
    Variant("fd", write_bytes=1 << 22),
    Variant("fd", connections=2),
    Variant("fd", connections=4),
    Variant("thread"),
    Variant("thread", connections=2),
    Variant("thread", connections=4),
]


def _slices(size: int, connections: int) -> list[tuple[int, int]]:
    step = -(-size // connections)
    return [(start, min(size, start + step)) for start in range(0, size, step)]


def _in_threads(work: Callable[[int], None], count: int) -> None:
    threads = [threading.Thread(target=work, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


# ---------------------------------------------------------------------------- sender process


async def _send_trio(
    sockets: list[socket.socket], view: memoryview, variant: Variant, context: ssl.SSLContext
) -> None:
    async def one(sock: socket.socket, start: int, end: int) -> None:
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(sock))
        if variant.kind == "raw":
            async with stream:
                for offset in range(start, end, PIECE):
                    await stream.send_all(view[offset : min(end, offset + PIECE)])
            return
        connection = TlsStream(stream, context, server_side=True)
        try:
            await connection.handshake()
            await connection.send_all(view[start:end])
            await connection.receive_some(1)  # the receiver's "done": then close
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for sock, (start, end) in zip(
            sockets, _slices(len(view), variant.connections), strict=True
        ):
            nursery.start_soon(one, sock, start, end)


def _send_threads(sockets: list[socket.socket], view: memoryview, context: ssl.SSLContext) -> None:
    slices = _slices(len(view), len(sockets))

    def one(i: int) -> None:
        sock = sockets[i]
        sock.setblocking(True)
        with context.wrap_socket(sock, server_side=True) as connection:
            start, end = slices[i]
            connection.sendall(view[start:end])
            connection.recv(1)

    _in_threads(one, len(sockets))


def sender(pipe: Connection, size: int) -> None:
    quiet_logs()
    view = memoryview(os.urandom(size))
    identity = ephemeral_identity()
    data_identity = DataIdentity(identity.key_pair.private_key, str(identity.peer_id))
    listener = socket.create_server(("127.0.0.1", 0))
    pipe.send((listener.getsockname()[1], data_identity.certificate))
    while (message := pipe.recv()) is not None:
        variant: Variant = message
        tls.WRITE_BYTES = variant.write_bytes
        sockets = [listener.accept()[0] for _ in range(variant.connections)]
        cpu = time.process_time()
        if variant.kind == "thread":
            _send_threads(sockets, view, data_identity.open_server)
        else:
            trio.run(_send_trio, sockets, view, variant, data_identity.open_server)
        pipe.send(time.process_time() - cpu)


# ---------------------------------------------------------------------------- receiver (here)


async def _receive_trio(
    port: int, buffer: memoryview, variant: Variant, context: ssl.SSLContext
) -> None:
    async def one(start: int, end: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        if variant.kind == "raw":
            async with stream:
                offset = start
                while offset < end:
                    offset += await stream.socket.recv_into(buffer[offset:end])
            return
        connection = TlsStream(stream, context, server_side=False)
        try:
            await connection.handshake()
            offset = start
            while offset < end:
                count = await connection.receive_into(buffer[offset:end])
                if not count:
                    raise RuntimeError("sender closed early")
                offset += count
            await connection.send_all(b"k")
        finally:
            await connection.aclose()

    async with trio.open_nursery() as nursery:
        for start, end in _slices(len(buffer), variant.connections):
            nursery.start_soon(one, start, end)


def _receive_threads(
    port: int, buffer: memoryview, connections: int, context: ssl.SSLContext
) -> None:
    slices = _slices(len(buffer), connections)

    def one(i: int) -> None:
        raw = socket.create_connection(("127.0.0.1", port))
        with context.wrap_socket(raw) as connection:
            offset, end = slices[i]
            while offset < end:
                count = connection.recv_into(buffer[offset:end])
                if not count:
                    raise RuntimeError("sender closed early")
                offset += count
            connection.sendall(b"k")

    _in_threads(one, connections)


def measure(
    pipe: Connection, port: int, context: ssl.SSLContext, size: int, variant: Variant
) -> tuple[float, float, float]:
    """(wall seconds, sender CPU seconds, receiver CPU seconds) of one transfer."""
    buffer = memoryview(bytearray(size))
    pipe.send(variant)
    started, cpu = time.perf_counter(), time.process_time()
    if variant.kind == "thread":
        _receive_threads(port, buffer, variant.connections, context)
    else:
        trio.run(_receive_trio, port, buffer, variant, context)
    wall, receiver_cpu = time.perf_counter() - started, time.process_time() - cpu
    return wall, pipe.recv(), receiver_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    size = args.mb * 1_000_000
    parent, child = multiprocessing.get_context("spawn").Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=sender, args=(child, size), daemon=True
    )
    process.start()
    try:
        port, certificate = parent.recv()
        context = pinned_client_context([certificate])
        results: dict[str, list[tuple[float, float, float]]] = {v.name: [] for v in VARIANTS}
        for _ in range(args.runs):  # interleaved, so drift hits every variant alike
            for variant in VARIANTS:
                results[variant.name].append(measure(parent, port, context, size, variant))
        raw = statistics.median(r[0] for r in results["raw"])
        print(f"{args.mb} MB one way, {args.runs} runs, {os.cpu_count()} cores, "
              f"{ssl.OPENSSL_VERSION}")  # fmt: skip
        print(f"{'variant':<16}{'wall s':>8}{'/ raw':>8}{'send CPU s':>12}{'recv CPU s':>12}")
        for name, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            send_cpu = statistics.median(r[1] for r in runs)
            receive_cpu = statistics.median(r[2] for r in runs)
            print(f"{name:<16}{wall:8.3f}{wall / raw:8.2f}{send_cpu:12.3f}{receive_cpu:12.3f}")
    finally:
        parent.send(None)
        process.join(10)
        if process.is_alive():
            process.kill()


if __name__ == "__main__":
    main()
