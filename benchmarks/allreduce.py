"""All-reduce round time against the raw-TCP floor of the same traffic, one process per peer.

    .venv/bin/python -m benchmarks.allreduce [--peers 2 4 8] [--mb 10 100] [--rounds 5]
                                             [--codec none fp16 int8]

For every (N, M): N worker processes on loopback, each with a data server. The floor first:
every peer exchanges exactly 2(N-1)/N x M bytes over plain sockets with no arithmetic (it sends
M/N bytes to each other peer, which sends M/N bytes back). Then `--rounds` all-reduce rounds of
an M-byte float32 vector per codec, equal shares, every peer computing, the codecs taking turns
round by round (so a drift of the shared machine hits them alike), after one warm-up round
each. All peers start each round at the same instant; a round's time is its slowest peer's.
Reported per codec: median round time, its ratio to the floor's median and to the first
codec's (`none` by default); CPU seconds per peer per round (process time: every thread),
its ratio to the first codec's, and the part of it on the event loop's thread; the longest event-loop stall any peer saw during a round (a
task that sleeps 5 ms over and over notes how late it wakes: a loop doing synchronous work
wakes it late by that work's length), and ("ours") the same less the time the loop's thread
waited for a CPU (`watch_lag`: on a shared machine a process the kernel leaves waiting is late
too); data-plane bytes each peer sent over 2(N-1)/N x M; and the share of rounds in which every peer averaged every chunk.
"""

from __future__ import annotations

import argparse
import functools
import gc
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
LAG_PERIOD = 0.005  # the stall watcher's sleep


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


def _run_queue_wait() -> float:
    """Seconds the calling thread has waited for a CPU while runnable (Linux schedstat; 0.0
    where it is missing)."""
    try:
        with open("/proc/thread-self/schedstat") as stat:
            return int(stat.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


async def watch_lag(longest: list[float], *, task_status=trio.TASK_STATUS_IGNORED) -> None:
    """Sleep LAG_PERIOD over and over. `longest[0]`: the latest a wake-up came after it was
    due, i.e. the longest the loop went without yielding (a lower bound). `longest[1]`: the
    same less the time the loop's thread waited for a CPU meanwhile: on a shared 2-core
    machine the kernel leaves a runnable process waiting, and that is late too; what is left
    is the loop's own work and its waits for the GIL (our worker threads)."""
    task_status.started()
    while True:
        due = trio.current_time() + LAG_PERIOD
        waited = _run_queue_wait()
        await trio.sleep_until(due)
        late = trio.current_time() - due
        longest[0] = max(longest[0], late)
        longest[1] = max(longest[1], late - (_run_queue_wait() - waited))


async def timed_round(spec: RoundSpec, vector: np.ndarray, server: DataServer, start_at: float):
    """(seconds from the common start, CPU seconds, longest loop stalls (`watch_lag`), report)
    of one round."""
    await _sleep_until(start_at)
    cpu, loop_cpu = time.process_time(), time.thread_time()
    longest = [0.0, 0.0]
    async with trio.open_nursery() as nursery:
        await nursery.start(watch_lag, longest)
        report = await allreduce(
            spec, vector, server, deadline=trio.current_time() + 120, stall_timeout=30
        )
        nursery.cancel_scope.cancel()
    cpus = (time.process_time() - cpu, time.thread_time() - loop_cpu)
    return time.time() - start_at, cpus, tuple(longest), report


async def _worker(pipe: Connection) -> None:
    quiet_logs()
    import torch  # noqa: F401  (the fp16 codec's casts; a training peer has it loaded already)

    # As a trainer does once its model is built: a full collection would otherwise walk
    # torch's many objects (~0.1 s, on the loop) and show up as a stall of the round's.
    gc.freeze()

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
                vector = np.random.default_rng().standard_normal(message[2], dtype=np.float32)
                pipe.send(("announce", server.identity.certificate))
            elif message[0] == "floor":
                _, peers, part_bytes, start_at = message
                floor_part[0] = part_bytes
                await _sleep_until(start_at)
                cpu = time.process_time()
                await _floor_exchange(peers, part_bytes)
                pipe.send(
                    (
                        "done",
                        time.time() - start_at,
                        (time.process_time() - cpu, 0),
                        (0, 0),
                        0,
                        True,
                    )
                )
            elif message[0] == "round":
                spec = msgspec.msgpack.decode(message[1], type=RoundSpec)
                assert vector is not None
                elapsed, cpu, stall, report = await timed_round(spec, vector, server, message[2])
                complete = report.complete and all(
                    c.senders == len(spec.members) for c in report.chunks
                )
                pipe.send(("done", elapsed, cpu, stall, report.bytes_sent, complete))
            else:
                nursery.cancel_scope.cancel()
                return


def worker(pipe: Connection) -> None:
    trio.run(_worker, pipe)


# ---------------------------------------------------------------------------- driver


def collect(pipes: list[Connection]) -> list[tuple]:
    return [pipe.recv() for pipe in pipes]


def one_round(
    pipes: list[Connection], hellos: list[tuple], round_id: bytes, size: int, codec: str
) -> list[tuple]:
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
        round_id=round_id, members=tuple(members), size=size, codec=codec,
        chunk_elements=CHUNK_ELEMENTS,
    )  # fmt: skip
    start_at = time.time() + START_DELAY
    for pipe in pipes:
        pipe.send(("round", msgspec.msgpack.encode(spec), start_at))
    return collect(pipes)


def run_case(n: int, megabytes: int, rounds: int, codecs: list[str]) -> tuple[float, dict]:
    """(floor seconds, {codec: figures})."""
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
        figures = {
            c: {"times": [], "cpus": [], "loop": [], "stalls": [], "ours": [], "sent": [], "ok": 0}
            for c in codecs
        }
        for codec in codecs:  # warm-up: first-use costs (threads, page faults) stay out
            one_round(pipes, hellos, f"warm-{n}-{megabytes}-{codec}".encode(), size, codec)
        for round_number in range(rounds):
            for codec in codecs:
                round_id = f"bench-{n}-{megabytes}-{codec}-{round_number}".encode()
                results = one_round(pipes, hellos, round_id, size, codec)
                f = figures[codec]
                f["times"].append(max(r[1] for r in results))
                f["cpus"].extend(r[2][0] for r in results)
                f["loop"].extend(r[2][1] for r in results)
                f["stalls"].append(max(r[3][0] for r in results))
                f["ours"].append(max(r[3][1] for r in results))
                f["sent"].extend(r[4] / ideal for r in results)
                f["ok"] += all(r[5] for r in results)
        return statistics.median(floor_times), {
            codec: {
                "round": statistics.median(f["times"]),
                "cpu": statistics.median(f["cpus"]),
                "loop": statistics.median(f["loop"]),
                "stall": max(f["stalls"]),
                "ours": max(f["ours"]),
                "wire": max(f["sent"]),
                "success": f["ok"] / rounds,
            }
            for codec, f in figures.items()
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
    parser.add_argument(
        "--codec", nargs="+", default=["none", "fp16", "int8"], choices=["none", "fp16", "int8"]
    )
    args = parser.parse_args()
    base = args.codec[0]
    print(
        f"{'peers':>5} {'MB':>5} {'codec':>5} {'floor s':>8} {'round s':>8} {'/ floor':>8} "
        f"{'/ ' + base:>8} {'CPU s/peer':>10} {'/ ' + base:>8} {'on loop':>8} {'stall ms':>8} {'ours ms':>8} "
        f"{'wire / ideal':>12} {'success':>8}"
    )
    for n in args.peers:
        for megabytes in args.mb:
            floor, figures = run_case(n, megabytes, args.rounds, args.codec)
            for codec, r in figures.items():
                print(
                    f"{n:>5} {megabytes:>5} {codec:>5} {floor:>8.3f} {r['round']:>8.3f} "
                    f"{r['round'] / floor:>7.1f}x {r['round'] / figures[base]['round']:>7.2f}x "
                    f"{r['cpu']:>10.3f} {r['cpu'] / figures[base]['cpu']:>7.2f}x {r['loop']:>8.3f} "
                    f"{1000 * r['stall']:>8.1f} {1000 * r['ours']:>8.1f} {r['wire']:>12.4f} "
                    f"{r['success']:>8.0%}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
