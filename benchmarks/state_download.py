"""State download against a raw-TCP transfer of the same bytes, one process per donor.

    .venv/bin/python -m benchmarks.state_download [--mb 100] [--donors 1 3] [--runs 5]
                                                  [--chunk-mib 4]

Every donor process holds the same `--mb` MB state (a seeded random blob), runs a peertrain
node with a `StateDonor` (its chunk hashes computed before timing starts; the time that takes
is printed), and a raw TCP server that sends any byte range of the blob from memory. This
process is the downloader. Per run, in alternation:
- raw TCP, one stream: the whole blob from donor 0, received with `recv_into` into a fresh
  buffer (the floor: nothing is hashed, checked or copied);
- raw TCP, k streams: a k-th of the blob from each of k donors at once;
- `download_state` from k donors (`parallel=k`): manifests over libp2p RPC, chunks over TCP,
  every chunk hash-checked (BLAKE3), the result received into the buffer of a `Snapshot`.
Reported: median seconds, GB/s, and the ratio to the one-stream raw transfer of the same run.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import multiprocessing
import statistics
import struct
import time
from multiprocessing.connection import Connection

import numpy as np
import trio

from benchmarks.common import quiet_logs
from peer.net.host import open_node, split_peer_addr
from peer.training.statesync import Snapshot, StateDonor, download_state, held
from tests.helpers import LOOPBACK, new_identity

RANGE = struct.Struct(">QQ")  # raw server request: offset, length
MAX_MESSAGE = 4 << 20
SEED = 1234


def make_blob(size: int) -> bytes:
    return np.random.default_rng(SEED).bytes(size)


# ---------------------------------------------------------------------------- donor process


async def _raw_sender(view: memoryview, stream: trio.SocketStream) -> None:
    request = b""
    while len(request) < RANGE.size:
        data = await stream.receive_some(RANGE.size - len(request))
        if not data:
            return
        request += data
    offset, length = RANGE.unpack(request)
    await stream.send_all(view[offset : offset + length])


async def _donor(pipe: Connection, size: int, chunk_bytes: int) -> None:
    quiet_logs()
    blob = make_blob(size)
    snapshot = Snapshot(1000, blob)
    async with (
        open_node(
            new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
        ) as node,
        trio.open_nursery() as nursery,
    ):
        # One downloader takes the state many times here: no per-caller budget.
        donor = StateDonor(
            node, held(snapshot), chunk_bytes=chunk_bytes, max_downloads=8, caller_states=1e6
        )
        await nursery.start(donor.serve, "127.0.0.1", 0)
        started = time.perf_counter()
        await donor.hash_snapshot()
        hashed = time.perf_counter() - started
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"),
            functools.partial(_raw_sender, memoryview(blob)),
            0,
        )
        pipe.send((node.public_addrs()[0], listeners[0].socket.getsockname()[1], hashed))
        await trio.sleep_forever()


def donor_process(pipe: Connection, size: int, chunk_bytes: int) -> None:
    trio.run(_donor, pipe, size, chunk_bytes)


# ---------------------------------------------------------------------------- downloader


async def raw_transfer(ports: list[int], size: int) -> float:
    """Seconds to receive `size` bytes split evenly over one stream per port."""
    buffer = np.empty(size, dtype=np.uint8)
    view = memoryview(buffer)
    bounds = [size * i // len(ports) for i in range(len(ports) + 1)]

    async def one(port: int, start: int, end: int) -> None:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(RANGE.pack(start, end - start))
            got = start
            while got < end:
                count = await stream.socket.recv_into(view[got:end])
                assert count, "the raw sender closed early"
                got += count

    started = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for port, start, end in zip(ports, bounds, bounds[1:], strict=False):
            nursery.start_soon(one, port, start, end)
    return time.perf_counter() - started


async def downloader(donors: list[tuple[str, int, float]], args: argparse.Namespace) -> None:
    quiet_logs()
    size = int(args.mb * 1_000_000)
    expected = hashlib.sha256(make_blob(size)).digest()
    async with open_node(
        new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
    ) as node:
        peers, ports = [], []
        for addr_text, raw_port, _ in donors:
            peer, addr = split_peer_addr(addr_text, what="donor")
            await node.connect(peer, [addr], timeout=5)
            peers.append(peer)
            ports.append(raw_port)

        async def download(k: int) -> tuple[float, Snapshot]:
            started = time.perf_counter()
            snapshot = await download_state(
                node, peers[:k], min_step=1000, parallel=k, deadline=trio.current_time() + 60
            )
            return time.perf_counter() - started, snapshot

        hashed = statistics.median(h for _, _, h in donors)
        print(
            f"state of {size / 1e6:,.0f} MB in chunks of {args.chunk_mib} MiB; "
            f"each donor hashed it in {hashed:.3f} s before timing (once per step)"
        )
        # Warm-up: connections, thread pool, page cache of the senders.
        await raw_transfer(ports[:1], size)
        _, snapshot = await download(1)
        assert hashlib.sha256(snapshot.blob).digest() == expected, "wrong bytes"
        del snapshot

        for k in args.donors:
            if k > len(peers):
                continue
            raw1, rawk, ours = [], [], []
            for _ in range(args.runs):
                raw1.append(await raw_transfer(ports[:1], size))
                if k > 1:
                    rawk.append(await raw_transfer(ports[:k], size))
                elapsed, snapshot = await download(k)
                ours.append(elapsed)
                assert hashlib.sha256(snapshot.blob).digest() == expected, "wrong bytes"
                del snapshot
            floor = statistics.median(raw1)

            def row(what: str, samples: list[float], floor: float = floor) -> None:
                t = statistics.median(samples)
                print(
                    f"  {what:40s} {t * 1000:8.1f} ms  {size / t / 1e9:5.2f} GB/s  "
                    f"= {t / floor:4.2f} x raw TCP (1 stream)"
                )

            print(f"\n{k} donor{'s' if k > 1 else ''}, median of {args.runs} runs")
            row("raw TCP, 1 stream", raw1)
            if k > 1:
                row(f"raw TCP, {k} streams from {k} donors", rawk)
            row(f"download_state, {k} donor{'s' if k > 1 else ''}", ours)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=100)
    parser.add_argument("--donors", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--chunk-mib", type=int, default=4)
    args = parser.parse_args()
    size = int(args.mb * 1_000_000)
    ctx = multiprocessing.get_context("spawn")
    processes, pipes = [], []
    for _ in range(max(args.donors)):
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=donor_process, args=(child, size, args.chunk_mib << 20), daemon=True
        )
        process.start()
        processes.append(process)
        pipes.append(parent)
    try:
        donors = []
        for pipe in pipes:
            if not pipe.poll(120):
                raise SystemExit("a donor process did not start within 120 s")
            donors.append(pipe.recv())
        trio.run(downloader, donors, args)
    finally:
        for process in processes:
            process.kill()
            process.join(10)


if __name__ == "__main__":
    main()
