"""DHT store and get latency on loopback, next to a raw TCP round trip measured in the same run.

    .venv/bin/python -m benchmarks.dht_latency [--nodes 8 32] [--ops 200] [--each-process]

Every node is a real libp2p host (Noise + yamux) running the DHT in server mode, all in this
one process (one trio loop, so one core does every node's work), or with `--each-process` each
in a process of its own, as daemons run them (and as hivemind runs each DHT): this process then
only drives them over pipes, each node times its own operations, and the CPU column sums every
node's process. "Cold store" is the first write of each key while connections are still being
dialed; the warm store and get figures come after every node has read some keys, so the
connections lookups use are open. A store writes to the `dht.replicas` closest nodes; a get
asks the closest replicas afresh and merges their answers (no cache), exactly as the daemon
does. Every get is checked for the right value; a wrong or missing one is counted and reported.

In one process, the timed phases run with Python's cyclic garbage collector paused
(`gc_paused`). All nodes share this one heap (~510,000 objects at 32 nodes), and a full
collection of it stopped every node at once for 120-300 ms on a quiet machine, a few times per
phase: that alone was the p99 of first writes at 32 nodes. Each node's own process scans 1/N of
it: with `--each-process` the collector runs as in a daemon (its start-up heap frozen,
`gc.freeze`). The cost of one full collection here is measured and printed. So is the CPU time
per operation (the whole process: both ends of every call), which varies less than wall time on
a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from benchmarks.common import percentile, quiet_logs, raw_tcp_round_trips, summary_ms
from peer.config import DhtConfig
from peer.dht.node import DHT
from peer.dht.routing import node_id
from peer.net.host import open_node
from peer.net.identity import ephemeral_identity
from tests.helpers import LOOPBACK, swarm


@contextmanager
def gc_paused(cpu: dict[str, float], op: str) -> Iterator[None]:
    """Run a timed phase without the cyclic collector (see the module docstring); its garbage
    is collected after it. Sets `cpu[op]` to the phase's process CPU seconds."""
    gc.collect()
    gc.disable()
    start = time.process_time()
    try:
        yield
    finally:
        cpu[op] = time.process_time() - start
        gc.enable()
        gc.collect()


def full_collection_seconds() -> tuple[float, int]:
    """(seconds, objects) of one full collection of this process's heap."""
    start = time.perf_counter()
    gc.collect()
    return time.perf_counter() - start, len(gc.get_objects())


async def measure(count: int, ops: int, config: DhtConfig, rng: random.Random) -> dict:
    async with swarm(count, config) as s:
        keys = [f"bench/key-{i}" for i in range(ops)]

        async def timed_store(key: str) -> float:
            writer = rng.choice(s.dhts)
            start = time.perf_counter()
            await writer.store(key, "x", key.encode(), expiration=time.time() + 600)
            return time.perf_counter() - start

        cpu: dict[str, float] = {}
        with gc_paused(cpu, "cold store"):
            cold_stores = [await timed_store(key) for key in keys]  # dials as it goes
        # Warm-up: every node reads some keys, opening the connections lookups use.
        for dht in s.dhts:
            for key in keys[:20]:
                await dht.get(key)
        with gc_paused(cpu, "store"):
            stores = [await timed_store(rng.choice(keys)) for _ in range(ops)]
        gets, wrong = [], 0
        with gc_paused(cpu, "get"):
            for _ in range(ops):
                reader, key = rng.choice(s.dhts), rng.choice(keys)
                start = time.perf_counter()
                got = await reader.get(key)
                gets.append(time.perf_counter() - start)
                wrong += got.get("x") is None or got["x"].value != key.encode()
        full_gc = full_collection_seconds()
        return {
            "cold store": cold_stores,
            "store": stores,
            "get": gets,
            "wrong": wrong,
            "cpu": cpu,
            "full gc": full_gc,
        }


# ------------------------------------------------------------- one process per node


async def worker(replicas: int) -> None:
    """One DHT node in this process, driven by JSON lines on stdin, one JSON line out per
    command: start (optionally bootstrapping to a seed), refresh, store, get, cpu, quit."""
    quiet_logs()
    config = DhtConfig(replicas=replicas)
    commands = trio.lowlevel.FdStream(os.dup(sys.stdin.fileno()))
    buffer = b""

    async def command() -> dict:
        nonlocal buffer
        while b"\n" not in buffer:
            data = await commands.receive_some(4096)
            if not data:
                return {"cmd": "quit"}
            buffer += data
        line, buffer = buffer.split(b"\n", 1)
        return json.loads(line)

    def reply(**fields: object) -> None:
        print(json.dumps(fields), flush=True)

    async with open_node(
        ephemeral_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1 << 20
    ) as node:
        dht = DHT(node, config, server=True, rpc_timeout=5.0)
        async with trio.open_nursery() as nursery:
            await nursery.start(dht.run)
            while (request := await command())["cmd"] != "quit":
                start = time.perf_counter()
                if request["cmd"] == "start":
                    if request.get("seed"):
                        seed_id, seed_addr = request["seed"]
                        assert await dht.bootstrap(
                            [(ID.from_base58(seed_id), Multiaddr(seed_addr))]
                        )
                    gc.collect()
                    gc.freeze()  # as a daemon does after start-up (peer.training.service)
                    reply(peer_id=node.peer_id.to_base58(), addr=str(node.announce[0]))
                elif request["cmd"] == "refresh":
                    await dht.find_nodes(node_id(node.peer_id))
                    reply(ok=True)
                elif request["cmd"] == "store":
                    key = request["key"]
                    await dht.store(key, "x", key.encode(), expiration=time.time() + 600)
                    reply(seconds=time.perf_counter() - start)
                elif request["cmd"] == "get":
                    got = await dht.get(request["key"])
                    right = "x" in got and got["x"].value == request["key"].encode()
                    reply(seconds=time.perf_counter() - start, right=right)
                elif request["cmd"] == "cpu":
                    reply(seconds=time.process_time())
            nursery.cancel_scope.cancel()


class Nodes:
    """`count` worker processes, one node each, driven one command at a time."""

    def __init__(self, count: int, replicas: int) -> None:
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "benchmarks.dht_latency",
                    "--worker",
                    *("--replicas", str(replicas)),
                ],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
            for _ in range(count)
        ]

    def ask(self, index: int, **request: object) -> dict:
        process = self.processes[index]
        assert process.stdin and process.stdout
        process.stdin.write(json.dumps(request) + "\n")
        process.stdin.flush()
        line = process.stdout.readline()
        if not line:
            raise RuntimeError(f"DHT worker {index} exited (code {process.wait()})")
        return json.loads(line)

    def cpu(self) -> float:
        return sum(self.ask(i, cmd="cpu")["seconds"] for i in range(len(self.processes)))

    def close(self) -> None:
        for process in self.processes:
            try:
                process.communicate(json.dumps({"cmd": "quit"}) + "\n", timeout=10)
            except (subprocess.TimeoutExpired, OSError):
                process.kill()
                process.wait()


def measure_each_process(count: int, ops: int, replicas: int, rng: random.Random) -> dict:
    nodes = Nodes(count, replicas)
    try:
        seed = nodes.ask(0, cmd="start")
        for index in range(1, count):
            nodes.ask(index, cmd="start", seed=[seed["peer_id"], seed["addr"]])
        for index in range(count):  # early nodes learn of late ones, as in `swarm`
            nodes.ask(index, cmd="refresh")
        keys = [f"bench/key-{i}" for i in range(ops)]
        result: dict = {"cpu": {}, "wrong": 0}

        def phase(op: str, run: list[tuple[str, str]]) -> None:
            before = nodes.cpu()
            answers = [nodes.ask(rng.randrange(count), cmd=cmd, key=key) for cmd, key in run]
            result["cpu"][op] = nodes.cpu() - before
            result[op] = [answer["seconds"] for answer in answers]
            result["wrong"] += sum(not answer.get("right", True) for answer in answers)

        phase("cold store", [("store", key) for key in keys])  # dials as it goes
        for index in range(count):  # warm-up, as in `measure`
            for key in keys[:20]:
                nodes.ask(index, cmd="get", key=key)
        phase("store", [("store", rng.choice(keys)) for _ in range(ops)])
        phase("get", [("get", rng.choice(keys)) for _ in range(ops)])
        return result
    finally:
        nodes.close()


async def main(node_counts: list[int], ops: int, replicas: int, each_process: bool) -> None:
    quiet_logs()
    rng = random.Random(0)
    config = DhtConfig(replicas=replicas)
    raw = await raw_tcp_round_trips(1000)
    raw_p50 = percentile(raw, 50)
    print(f"raw TCP 100-byte round trip: {summary_ms(raw)}")
    for count in node_counts:
        if each_process:
            result = await trio.to_thread.run_sync(measure_each_process, count, ops, replicas, rng)
        else:
            result = await measure(count, ops, config, rng)
        where = "a process each" if each_process else "one process"
        print(f"\n{count} nodes, replicas={replicas}, alpha={config.alpha}, {where}")
        for op in ("cold store", "store", "get"):
            p50 = percentile(result[op], 50)
            cpu_ms = result["cpu"][op] / len(result[op]) * 1000
            print(
                f"  {op:10s} {summary_ms(result[op])}  p50 = {p50 / raw_p50:,.0f} x raw RTT"
                f"  CPU {cpu_ms:.1f} ms/op"
            )
        print(f"  gets with a wrong or missing value: {result['wrong']}")
        if each_process:
            continue
        seconds, objects = result["full gc"]
        print(
            f"  one full GC of this process's heap ({objects:,} objects): {seconds * 1000:.0f} ms"
            " (paused while timing)"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--replicas", type=int, default=DhtConfig().replicas)
    parser.add_argument(
        "--each-process", action="store_true", help="each node in a process of its own"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        trio.run(worker, args.replicas)
    else:
        trio.run(main, args.nodes, args.ops, args.replicas, args.each_process)
