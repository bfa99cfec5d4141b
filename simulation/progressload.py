"""The progress exchange alone, at N peers: where the bytes of its replies land.

    .venv/bin/python -m simulation.progressload --peers 100 300 [--seconds 60] [--one-key]
        [--verbose] [--shard-records 16] [--placed [--reachable 0.5] [--seed 0]]

(300 peers took 27 minutes of wall time on 2 cores; 1,000, hours.)

Every peer runs the real DHT and `ProgressPublisher` over the simulated network
(`simulation.network`: DeDLOC's volunteer links, every reply on its sender's uplink, CPU for
the signatures checked), publishing a record of a trainer's size every second and reading
everyone's as the publisher does. Nothing else runs, so the figures are the progress
exchange's alone: the reply bytes each node sent, the busiest node against the mean, and the
share of the collaboration each read saw. `--one-key` keeps every record on the one key (the
layout before `peer.training.shards`), for comparison.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import random
import statistics
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import CARRIED_READ_REPLICAS, DHT, SPREAD_HOLDERS
from peer.dht.routing import Contact, first_readers, hot_holders, key_id, node_id, spread_bits
from peer.training import shards
from peer.training.progress import CollaborationView, ProgressRecord
from peer.training.publisher import ProgressPublisher
from peer.training.timing import Timing
from simulation import cpu
from simulation.clock import VirtualClock
from simulation.collaboration import EPOCH
from simulation.determinism import deterministic_trio
from simulation.network import MBIT, Link, LinkDistribution, SimNetwork

SEEDS = 2
"""Nodes every other joins through (fast, as a backbone's)."""


@dataclass(frozen=True)
class Load:
    peers: int
    seconds: float
    served: list[float]
    """Bytes/s of replies each node sent, over the measured seconds."""
    coverage: float
    """Mean share of the peers a read saw."""
    calls: dict[str, float]
    """DHT calls a second per node, by method."""
    reply_bytes: dict[str, float]
    """Reply bytes a second per node, by method."""
    wall_seconds: float

    @property
    def mean(self) -> float:
        return statistics.fmean(self.served)

    @property
    def busiest(self) -> float:
        return max(self.served)


def record(peer_id: str, now: float) -> ProgressRecord:
    """A trainer's record of the size real ones have (~0.7 KB with its entry)."""
    return ProgressRecord(
        peer_id=peer_id, role="trainer", addrs=["/ip4/203.0.113.9/tcp/4001"] * 2, step=12,
        digest="d" * 64, samples=300, samples_per_second=40.0, updated_at=now,
        fingerprint="f" * 64, task="t" * 120, recent_losses=[3.0] * 8, min_votes=2,
        electorate="e" * 64, electorate_size=12,
    )  # fmt: skip


@contextlib.contextmanager
def one_key() -> Iterator[None]:
    """Every record on the one key, whatever the size (`shards.MAX_LEVEL` 0)."""
    level = shards.MAX_LEVEL
    shards.MAX_LEVEL = 0
    try:
        yield
    finally:
        shards.MAX_LEVEL = level


async def _run(
    peers: int, seconds: float, warmup: float, seed: int
) -> tuple[list[float], float, dict[str, float], dict[str, float]]:
    rng = random.Random(seed)
    network = SimNetwork(rng)
    config = PeerConfig()
    timing = Timing.of(config)
    clock = lambda: EPOCH + trio.current_time()  # noqa: E731
    coverage: list[float] = []
    served_at_start: dict[object, int] = {}

    async def node(
        link: Link,
        seeds: list[DHT],
        *,
        task_status: trio.TaskStatus[DHT] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        sim = network.node(link)
        cpu.CURRENT.set(network.cpus[sim.peer_id])
        dht = DHT(
            sim,  # type: ignore[arg-type]
            config.dht,
            server=True,
            rpc_timeout=config.net.rpc_timeout,
            clock=clock,
        )
        dht.rng = random.Random(rng.getrandbits(64))
        if seeds:
            await dht.bootstrap([(s.node.peer_id, s.node.announce[0]) for s in seeds])
        me = sim.peer_id.to_base58()

        def seen(view: CollaborationView) -> None:
            if trio.current_time() >= warmup:
                coverage.append(len(view.records) / peers)

        publisher = ProgressPublisher(
            dht,
            config,
            record=lambda: record(me, clock()),
            on_read=seen,
            interval=config.training.progress_interval,
            longest_read_interval=timing.longest_read_interval,
            ttl=timing.progress_ttl,
            clock=clock,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(dht.run)
            task_status.started(dht)
            await trio.sleep(rng.uniform(0, 1))  # publishers out of step, as real ones are
            await nursery.start(publisher.run)

    async with trio.open_nursery() as nursery:
        fast = Link(upload=1000 * MBIT, download=1000 * MBIT, rtt=0.02)
        seeds = [await nursery.start(node, fast, []) for _ in range(SEEDS)]
        for _ in range(peers - SEEDS):  # all at once: the warm-up is theirs to fill tables
            nursery.start_soon(node, LinkDistribution().draw(rng), seeds)
        await trio.sleep_until(warmup)
        served_at_start.update(network.traffic.served)
        calls, replies = Counter(network.traffic.calls), Counter(network.traffic.bytes)
        await trio.sleep_until(warmup + seconds)
        served = [
            (network.traffic.served[p] - served_at_start.get(p, 0)) / seconds for p in network.links
        ]
        per_node = seconds * peers
        call_rates = {
            m: (n - calls[s, m]) / per_node for (s, m), n in network.traffic.calls.items()
        }
        reply_rates = {
            m: (n - replies[s, m]) / per_node for (s, m), n in network.traffic.bytes.items()
        }
        nursery.cancel_scope.cancel()
    return served, statistics.fmean(coverage) if coverage else 0.0, call_rates, reply_rates


def run_load(peers: int, *, seconds: float = 60.0, warmup: float = 20.0, seed: int = 0) -> Load:
    random.seed(seed)
    started = time.perf_counter()
    with deterministic_trio(seed), cpu.charged():
        served, coverage, calls, replies = trio.run(
            _run, peers, seconds, warmup, seed, clock=VirtualClock()
        )
    return Load(peers, seconds, served, coverage, calls, replies, time.perf_counter() - started)


class Placed(NamedTuple):
    mean: float
    """Records served a node, the mean over every node (in records read once)."""
    busiest: float
    mean_server: float
    """The same mean over the DHT servers alone (the `reachable` share: a peer behind NAT
    holds nothing)."""


def placed_load(peers: int, *, seed: int = 0, reachable: float = 1.0) -> Placed:
    """The mean and the busiest node's share of the progress reads' reply bytes, from where the
    shards and their holders fall alone: records of one size, every peer a trainer, every
    table complete, every reader reading every shard from `CARRIED_READ_REPLICAS` of its holders
    at random, those of its prefix first where they are enough (`hot_read_order`). What
    `run_load` measures without running a DHT, so 1,000 and 10,000 peers cost seconds; in
    units of one record read once. Only the `reachable` share of the peers is a DHT server
    (the others are behind NAT) and holds anything; `mean` is over all peers, so the busiest
    serves at least 1 / `reachable` times it, `mean_server` over the servers."""
    rng = random.Random(seed)
    replicas = PeerConfig().dht.replicas
    ids = [ID(rng.randbytes(34)) for _ in range(peers)]
    servers = ids[: max(replicas, round(reachable * peers))]
    at = shards.level(peers)
    records = Counter(shards.shard_index(i.to_base58(), at) for i in ids)
    load = dict.fromkeys(ids, 0.0)
    for index in range(2**at):
        key = shards.shard_key("load", at, index)
        target, bits = key_id(key), spread_bits(key)
        # What a lookup finds (`DHT._hot_replicas`).
        closest = heapq.nsmallest(
            SPREAD_HOLDERS * replicas, servers, key=lambda i: node_id(i) ^ target
        )
        contacts = [Contact(i, ()) for i in closest]
        holders = contacts[: hot_holders(target, bits, contacts, replicas)]
        read = first_readers(target, bits, holders)  # `hot_read_order`
        for holder in read:
            load[holder.peer_id] += peers * CARRIED_READ_REPLICAS / len(read) * records[index]
    served = [load[i] for i in servers]
    return Placed(statistics.fmean(load.values()), max(served), statistics.fmean(served))


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m simulation.progressload", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[100])
    parser.add_argument("--seconds", type=float, default=60.0, help="virtual seconds measured")
    parser.add_argument("--warmup", type=float, default=20.0, help="virtual seconds first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--one-key", action="store_true", help="every record on one key")
    parser.add_argument(
        "--placed", action="store_true", help="the shards' placement alone, no DHT (fast)"
    )
    parser.add_argument(
        "--reachable", type=float, default=1.0, help="with --placed: the share not behind NAT"
    )
    parser.add_argument("--verbose", action="store_true", help="calls by method, the busiest")
    parser.add_argument(
        "--shard-records", type=int, default=shards.SHARD_RECORDS, help="records a shard holds"
    )
    args = parser.parse_args()
    layout = one_key() if args.one_key else contextlib.nullcontext()
    shards.SHARD_RECORDS = args.shard_records
    if args.placed:
        print(
            "| peers | busiest node's replies (placement alone): / the mean node's"
            " | / the mean DHT server's |"
        )
        print("| --- | --- | --- |")
        for peers in args.peers:
            placed = placed_load(peers, seed=args.seed, reachable=args.reachable)
            print(
                f"| {peers} | {placed.busiest / placed.mean:.2f}x"
                f" | {placed.busiest / placed.mean_server:.2f}x |",
                flush=True,
            )
        return
    print(
        "| peers | mean node's replies | busiest node's | busiest / mean | read coverage | wall |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    with layout:
        for peers in args.peers:
            load = run_load(peers, seconds=args.seconds, warmup=args.warmup, seed=args.seed)
            print(
                f"| {peers} | {load.mean * 8 / 1e6:.2f} Mbit/s | {load.busiest * 8 / 1e6:.2f} Mbit/s"
                f" | {load.busiest / load.mean:.1f}x | {load.coverage:.1%} | {load.wall_seconds:.0f} s |",
                flush=True,
            )
            if args.verbose:
                for method, count in sorted(load.calls.items()):
                    print(
                        f"  {method}: {count:.1f} calls/s, "
                        f"{load.reply_bytes.get(method, 0) * 8 / 1e6:.3f} Mbit/s per node"
                    )
                top = sorted(load.served, reverse=True)[:5]
                print("  busiest:", ", ".join(f"{b * 8 / 1e6:.2f}" for b in top), "Mbit/s")


if __name__ == "__main__":
    main()
