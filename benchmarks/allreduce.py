"""All-reduce round time against the raw-TCP floor of the same traffic, one process per peer.

    .venv/bin/python -m benchmarks.allreduce [--peers 2 4 8] [--mb 10 100] [--rounds 5]
                                             [--codec none]

For every (N, M): N worker processes on loopback, each with a data server. The floor first:
every peer exchanges exactly 2(N-1)/N x M bytes over plain sockets with no arithmetic (it sends
M/N bytes to each other peer, which sends M/N bytes back). Then `--rounds` all-reduce rounds of
an M-byte float32 vector, equal shares, every peer computing. All peers start each round at
the same instant; a round's time is its slowest peer's. Reported: median round time, its
ratio to the floor's median, data-plane bytes each peer sent over 2(N-1)/N x M, CPU seconds
per peer per round, and the share of rounds in which every peer averaged every chunk.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import statistics
import time
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import trio

from benchmarks.common import quiet_logs
from peer.averaging.allreduce import DataServer, Member, RoundSpec, allreduce
from peer.net.identity import ephemeral_identity
from peer.net.tls import DataIdentity

CHUNK_ELEMENTS = 1 << 18  # 1 MiB of float32 per frame
START_DELAY = 0.3  # seconds between "go" and the common start


# ---------------------------------------------------------------------------- worker process


async def _floor_server(part_bytes: list[int], stream: trio.SocketStream) -> None:
    async with stream:
        got, want = 0, part_bytes[0]
        while got < want:
            data = await stream.receive_some(1 << 20)
            if not data:
                return
            got += len(data)
        await stream.send_all(bytes(want))


async def _floor_exchange(peers: list[tuple[str, int]], part_bytes: int) -> None:
    async def one(host: str, port: int) -> None:
        async with await trio.open_tcp_stream(host, port) as stream:
            await stream.send_all(bytes(part_bytes))
            got = 0
            while got < part_bytes:
                got += len(await stream.receive_some(1 << 20))

    async with trio.open_nursery() as nursery:
        for host, port in peers:
            nursery.start_soon(one, host, port)


async def _sleep_until(wall_time: float) -> None:
    await trio.sleep(max(0.0, wall_time - time.time()))


async def _worker(pipe: Connection) -> None:
    quiet_logs()
    identity = ephemeral_identity()
    peer_id = identity.peer_id.to_base58()
    server = DataServer(DataIdentity(identity.key_pair.private_key, peer_id))
    floor_part = [0]  # bytes each floor connection carries, set per run
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        listeners = await nursery.start(
            functools.partial(trio.serve_tcp, host="127.0.0.1"),
            functools.partial(_floor_server, floor_part),
            0,
        )
        pipe.send(("hello", peer_id, port, listeners[0].socket.getsockname()[1]))
        vector = None
        while True:
            message = await trio.to_thread.run_sync(pipe.recv)
            if message[0] == "key":  # also make the vector now: it takes longer than START_DELAY
                vector = np.random.default_rng().standard_normal(message[2]).astype(np.float32)
                pipe.send(("announce", server.identity.certificate))
            elif message[0] == "floor":
                _, peers, part_bytes, start_at = message
                floor_part[0] = part_bytes
                await _sleep_until(start_at)
                cpu = time.process_time()
                await _floor_exchange(peers, part_bytes)
                pipe.send(("done", time.time() - start_at, time.process_time() - cpu, 0, True))
            elif message[0] == "round":
                spec = msgspec.msgpack.decode(message[1], type=RoundSpec)
                await _sleep_until(message[2])
                cpu = time.process_time()
                report = await allreduce(
                    spec,
                    vector,
                    server,
                    deadline=trio.current_time() + 120,
                    stall_timeout=30,
                )
                elapsed = time.time() - message[2]
                complete = report.complete and all(
                    c.senders == len(spec.members) for c in report.chunks
                )
                pipe.send(("done", elapsed, time.process_time() - cpu, report.bytes_sent, complete))
            else:
                nursery.cancel_scope.cancel()
                return


def worker(pipe: Connection) -> None:
    trio.run(_worker, pipe)


# ---------------------------------------------------------------------------- driver


def collect(pipes: list[Connection]) -> list[tuple]:
    return [pipe.recv() for pipe in pipes]


def run_case(n: int, megabytes: int, rounds: int, codec: str) -> dict:
    ctx = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for _ in range(n):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=worker, args=(child,), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        hellos = collect(pipes)
        size = megabytes * 1_000_000 // 4
        ideal = 2 * (n - 1) / n * megabytes * 1_000_000
        floor_times = []
        for _ in range(rounds):
            start_at = time.time() + START_DELAY
            for i, pipe in enumerate(pipes):
                peers = [("127.0.0.1", h[3]) for j, h in enumerate(hellos) if j != i]
                pipe.send(("floor", peers, megabytes * 1_000_000 // n, start_at))
            floor_times.append(max(r[1] for r in collect(pipes)))
        times, cpus, sent, complete = [], [], [], 0
        for round_number in range(rounds):
            round_id = f"bench-{n}-{megabytes}-{round_number}".encode()
            for pipe in pipes:
                pipe.send(("key", round_id, size))
            certificates = [r[1] for r in collect(pipes)]
            members = sorted(
                (
                    Member(peer_id=h[1], host="127.0.0.1", port=h[2], computes=True, share=1.0,
                           weight=1.0, cert=c)
                    for h, c in zip(hellos, certificates, strict=True)
                ),
                key=lambda m: m.peer_id,
            )  # fmt: skip
            spec = RoundSpec(
                round_id=round_id,
                members=tuple(members),
                size=size,
                codec=codec,
                chunk_elements=CHUNK_ELEMENTS,
            )
            wire = msgspec.msgpack.encode(spec)
            start_at = time.time() + START_DELAY
            for pipe in pipes:
                pipe.send(("round", wire, start_at))
            results = collect(pipes)
            times.append(max(r[1] for r in results))
            cpus.extend(r[2] for r in results)
            sent.extend(r[3] / ideal for r in results)
            complete += all(r[4] for r in results)
        return {
            "floor": statistics.median(floor_times),
            "round": statistics.median(times),
            "cpu": statistics.median(cpus),
            "wire": max(sent),
            "success": complete / rounds,
        }
    finally:
        for pipe in pipes:
            pipe.send(("stop",))
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--mb", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codec", default="none", choices=["none", "fp16", "int8"])
    args = parser.parse_args()
    print(
        f"{'peers':>5} {'MB':>5} {'floor s':>8} {'round s':>8} {'/ floor':>8} "
        f"{'wire / ideal':>12} {'CPU s/peer':>10} {'success':>8}   (codec {args.codec})"
    )
    for n in args.peers:
        for megabytes in args.mb:
            r = run_case(n, megabytes, args.rounds, args.codec)
            print(
                f"{n:>5} {megabytes:>5} {r['floor']:>8.3f} {r['round']:>8.3f} "
                f"{r['round'] / r['floor']:>7.1f}x {r['wire']:>12.4f} {r['cpu']:>10.3f} "
                f"{r['success']:>8.0%}",
                flush=True,
            )


if __name__ == "__main__":
    main()
