"""All-reduce rounds on shaped links (network namespaces, root): LP shares against equal
shares, or the wire codecs against each other.

    sudo .venv/bin/python -m benchmarks.allreduce_shaped [--mb 10] [--rounds 3]
    sudo .venv/bin/python -m benchmarks.allreduce_shaped --codecs [--mbit 50 100 200] [--mb 20]

Four members, each in its own network namespace, joined by a bridge in a fifth; tbf shapes
every member's upload and download.

Shares (the default). Member 0 is a well-connected aggregator that computes nothing (a
backbone); members 1-3 compute, on 100, 20 and 20 Mbit/s links. The same rounds run with the
role solver's shares (`peer.roles.shares`, from the shaped rates) and with equal shares; the
table shows measured median round time next to the cost model's prediction.

Codecs (`--codecs`). All four members compute, with equal shares, every link shaped to the
same rate, one rate after another (`--mbit`); the codecs take turns round by round (after a
warm-up round each). Per codec and rate: the median round time (the slowest member's) and its
ratio to `none`'s, where fp16 halves the bytes and int8 quarters them; the median CPU seconds
per member and round (process time, every thread) and its ratio to `none`'s. A codec should
never make a round slower where the link is the bottleneck, nor cost much more CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import multiprocessing
import os
import shutil
import statistics
import subprocess
import sys
import time
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import trio

from benchmarks.common import quiet_logs
from peer.averaging.allreduce import DataServer, Member, RoundSpec, allreduce
from peer.net.identity import ephemeral_identity
from peer.net.tls import DataIdentity
from peer.roles import PeerCapacity, optimal_shares

MBIT = {0: 400, 1: 100, 2: 20, 3: 20}  # each member's up and down link
COMPUTES = {0: False, 1: True, 2: True, 3: True}
CODECS = ("none", "fp16", "int8")
CLONE_NEWNET = 0x40000000
TAG = str(os.getpid())[-4:]


def sh(*args: str) -> None:
    result = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip()}")


def build_network() -> None:
    switch = f"ptsw{TAG}"
    sh("ip", "netns", "add", switch)
    sh("ip", "netns", "exec", switch, "ip", "link", "add", "br0", "type", "bridge")
    sh("ip", "netns", "exec", switch, "ip", "link", "set", "br0", "up")
    for i in MBIT:
        ns, inner, outer = f"ptm{i}{TAG}", f"vm{i}{TAG}", f"vs{i}{TAG}"
        sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", inner, "type", "veth", "peer", "name", outer)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "link", "set", outer, "netns", switch)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"10.78.0.{i + 1}/24", "dev", inner)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        sh("ip", "netns", "exec", switch, "ip", "link", "set", outer, "master", "br0")
        sh("ip", "netns", "exec", switch, "ip", "link", "set", outer, "up")
    shape(MBIT)


def shape(rates: dict[int, int]) -> None:
    """Shape member i's upload and download to rates[i] Mbit/s (replacing any shaping)."""
    for i, mbit in rates.items():
        ns, inner, outer = f"ptm{i}{TAG}", f"vm{i}{TAG}", f"vs{i}{TAG}"
        burst = f"{max(32, mbit // 2)}kb"
        for where, dev in ((ns, inner), (f"ptsw{TAG}", outer)):  # its upload, its download
            sh("ip", "netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
               "rate", f"{mbit}mbit", "burst", burst, "latency", "200ms")  # fmt: skip


def tear_down() -> None:
    for name in [f"ptsw{TAG}", *(f"ptm{i}{TAG}" for i in MBIT)]:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def enter_namespace(name: str) -> None:
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        raise OSError(ctypes.get_errno(), f"setns into {name} failed")
    os.close(fd)


async def _worker(pipe: Connection, index: int) -> None:
    quiet_logs()
    import torch  # noqa: F401  (the fp16 codec's casts; a training peer has it loaded already)

    # As a trainer does once its model is built: a full collection would otherwise walk
    # torch's many objects (~0.1 s, on the loop) and show up as a stall of the round's.
    gc.freeze()

    identity = ephemeral_identity()
    peer_id = identity.peer_id.to_base58()
    server = DataServer(DataIdentity(identity.key_pair.private_key, peer_id))
    host = f"10.78.0.{index + 1}"
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, host, 0)
        pipe.send((peer_id, host, port))
        while True:
            message = await trio.to_thread.run_sync(pipe.recv)
            if message[0] == "key":
                vector = np.random.default_rng(index).standard_normal(message[2], np.float32)
                pipe.send(server.identity.certificate)
            elif message[0] == "round":
                spec = msgspec.msgpack.decode(message[1], type=RoundSpec)
                await trio.sleep(max(0.0, message[2] - time.time()))
                cpu = time.process_time()
                report = await allreduce(
                    spec, vector, server, deadline=trio.current_time() + 120, stall_timeout=60
                )
                pipe.send((time.time() - message[2], report.complete, time.process_time() - cpu))
            else:
                nursery.cancel_scope.cancel()
                return


def worker(pipe: Connection, index: int, namespace: str) -> None:
    enter_namespace(namespace)  # the driver's name: TAG differs in this spawned process
    trio.run(_worker, pipe, index)


def capacities(peer_ids: list[str]) -> list[PeerCapacity]:
    return [
        PeerCapacity(
            peer_id=peer_ids[i],
            samples_per_s=1.0 if COMPUTES[i] else 0.0,
            upload_bps=MBIT[i] * 1e6 / 8,
            download_bps=MBIT[i] * 1e6 / 8,
            reachable=True,
        )
        for i in MBIT
    ]


def one_round(
    pipes: list[Connection],
    hellos: list[tuple],
    round_id: bytes,
    size: int,
    *,
    computes: list[bool],
    shares: list[float],
    codec: str,
) -> list[tuple]:
    """(seconds, complete, CPU seconds) of every member for one round."""
    for pipe in pipes:
        pipe.send(("key", round_id, size))
    certs = [p.recv() for p in pipes]
    members = sorted(
        (
            Member(
                peer_id=h[0],
                host=h[1],
                port=h[2],
                computes=computes[i],
                share=shares[i],
                weight=1.0 if computes[i] else 0.0,
                cert=certs[i],
            )
            for i, h in enumerate(hellos)
        ),
        key=lambda m: m.peer_id,
    )
    spec = RoundSpec(
        round_id=round_id, members=tuple(members), size=size, codec=codec, chunk_elements=1 << 18
    )
    start_at = time.time() + 0.5
    for pipe in pipes:
        pipe.send(("round", msgspec.msgpack.encode(spec), start_at))
    results = [pipe.recv() for pipe in pipes]
    assert all(r[1] for r in results), f"{round_id!r}: a round did not complete"
    return results  # fmt: skip


def compare_shares(pipes: list[Connection], hellos: list[tuple], args: argparse.Namespace) -> None:
    size = args.mb * 1_000_000 // 4
    peer_ids = [h[0] for h in hellos]
    computes = [COMPUTES[i] for i in MBIT]
    solver, _ = optimal_shares(capacities(peer_ids), computes)
    schemes = {"LP shares": solver, "equal shares": [1.0] * len(MBIT)}
    print(f"{args.mb} MB, links (Mbit/s): {MBIT}; member 0 computes nothing")
    for name, shares in schemes.items():
        times = []
        for r in range(args.rounds):
            results = one_round(
                pipes, hellos, f"{name}-{r}".encode(), size,
                computes=computes, shares=shares, codec="none",
            )  # fmt: skip
            times.append(max(t for t, _, _ in results))
        predicted = _predicted(capacities(peer_ids), computes, shares, size * 4)
        print(
            f"  {name:13s} shares {[round(g / sum(shares), 3) for g in shares]}: "
            f"median {statistics.median(times):.2f} s, model predicts {predicted:.2f} s"
        )


def compare_codecs(pipes: list[Connection], hellos: list[tuple], args: argparse.Namespace) -> None:
    size = args.mb * 1_000_000 // 4
    everyone, equal = [True] * len(MBIT), [1.0] * len(MBIT)
    ideal = 2 * (len(MBIT) - 1) / len(MBIT) * args.mb * 8  # Mbit each member sends
    print(
        f"{args.mb} MB, {len(MBIT)} members computing, equal shares, every link shaped alike\n"
        f"{'Mbit/s':>6} {'codec':>5} {'ideal s':>8} {'round s':>8} {'/ none':>7} "
        f"{'CPU s/member':>12} {'/ none':>7}"
    )
    for mbit in args.mbit:
        shape(dict.fromkeys(MBIT, mbit))
        for codec in CODECS:  # warm-up
            one_round(pipes, hellos, f"warm-{mbit}-{codec}".encode(), size,
                      computes=everyone, shares=equal, codec=codec)  # fmt: skip
        times: dict[str, list[float]] = {c: [] for c in CODECS}
        cpus: dict[str, list[float]] = {c: [] for c in CODECS}
        for r in range(args.rounds):
            for codec in CODECS:
                results = one_round(
                    pipes, hellos, f"{mbit}-{codec}-{r}".encode(), size,
                    computes=everyone, shares=equal, codec=codec,
                )  # fmt: skip
                times[codec].append(max(t for t, _, _ in results))
                cpus[codec].extend(c for _, _, c in results)
        base_time, base_cpu = statistics.median(times["none"]), statistics.median(cpus["none"])
        for codec in CODECS:
            t, c = statistics.median(times[codec]), statistics.median(cpus[codec])
            per_byte = CODEC_BYTES[codec]
            print(
                f"{mbit:>6} {codec:>5} {ideal * per_byte / mbit:>8.2f} {t:>8.2f} "
                f"{t / base_time:>6.2f}x {c:>12.3f} {c / base_cpu:>6.2f}x",
                flush=True,
            )


CODEC_BYTES = {"none": 1.0, "fp16": 0.5, "int8": 1.004 / 4}  # wire bytes per float32 byte


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--codecs", action="store_true", help="compare the codecs instead")
    parser.add_argument("--mbit", type=int, nargs="+", default=[50, 100, 200])
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("tc"):
        sys.exit("needs root with ip and tc: run it with sudo")
    ctx = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    try:
        build_network()
        for i in MBIT:
            parent, child = ctx.Pipe()
            process = ctx.Process(target=worker, args=(child, i, f"ptm{i}{TAG}"), daemon=True)
            process.start()
            pipes.append(parent)
            processes.append(process)
        hellos = [pipe.recv() for pipe in pipes]
        (compare_codecs if args.codecs else compare_shares)(pipes, hellos, args)
    finally:
        for pipe in pipes:
            with contextlib.suppress(OSError):
                pipe.send(("stop",))
        for process in processes:
            process.join(10)
            if process.is_alive():
                process.kill()
        tear_down()


def _predicted(peers, computes, shares, gradient_bytes) -> float:
    from peer.roles import predict

    total = sum(shares)
    return predict(peers, computes, [g / total for g in shares], gradient_bytes=gradient_bytes,
                   target_batch=1.0, delayed=False).comm_time  # fmt: skip


if __name__ == "__main__":
    main()
