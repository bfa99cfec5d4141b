"""DHT store and get latency on loopback, next to a raw TCP round trip measured in the same run.

    .venv/bin/python -m benchmarks.dht_latency [--nodes 8 32] [--ops 200]

Every node is a real libp2p host (Noise + yamux) running the DHT in server mode, all in this
one process (one trio loop, so one core does every node's work). "Cold store" is the
first write of each key while connections are still being dialed; the warm store and get
figures come after every node has read some keys, so the connections lookups use are open.
A store writes to the `dht.replicas` closest nodes; a get asks the closest replicas afresh and
merges their answers (no cache), exactly as the daemon does. Every get is checked for the
right value; a wrong or missing one is counted and reported.

The timed phases run with Python's cyclic garbage collector paused (`gc_paused`). All nodes
share this one heap (~510,000 objects at 32 nodes), and a full collection of it stopped every
node at once for 120-300 ms on a quiet machine, a few times per phase: that alone was the p99
of first writes at 32 nodes. Each node's own process would scan 1/N of it. The cost of one
full collection here is measured and printed. So is the CPU time per operation (the whole
process: both ends of every call), which varies less than wall time on a shared machine.
"""

from __future__ import annotations

import argparse
import gc
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from benchmarks.common import percentile, quiet_logs, raw_tcp_round_trips, summary_ms
from peer.config import DhtConfig
from tests.helpers import swarm


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


async def main(node_counts: list[int], ops: int, replicas: int) -> None:
    quiet_logs()
    rng = random.Random(0)
    config = DhtConfig(replicas=replicas)
    raw = await raw_tcp_round_trips(1000)
    raw_p50 = percentile(raw, 50)
    print(f"raw TCP 100-byte round trip: {summary_ms(raw)}")
    for count in node_counts:
        result = await measure(count, ops, config, rng)
        print(f"\n{count} nodes, replicas={replicas}, alpha={config.alpha}, one process")
        for op in ("cold store", "store", "get"):
            p50 = percentile(result[op], 50)
            cpu_ms = result["cpu"][op] / len(result[op]) * 1000
            print(
                f"  {op:10s} {summary_ms(result[op])}  p50 = {p50 / raw_p50:,.0f} x raw RTT"
                f"  CPU {cpu_ms:.1f} ms/op"
            )
        print(f"  gets with a wrong or missing value: {result['wrong']}")
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
    args = parser.parse_args()
    trio.run(main, args.nodes, args.ops, args.replicas)
