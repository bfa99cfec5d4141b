"""LP shares against equal shares on heterogeneous shaped links (network namespaces, root).

    sudo .venv/bin/python -m benchmarks.allreduce_shaped [--mb 10] [--rounds 3]

Four members, each in its own network namespace, joined by a bridge in a fifth; tbf shapes
every member's upload and download. Member 0 is a well-connected aggregator that computes
nothing (a backbone); members 1-3 compute, on 100, 20 and 20 Mbit/s links. The same rounds run
with the role solver's shares (`peer.roles.shares`, from the shaped rates) and with equal
shares; the table shows measured median round time next to the cost model's prediction.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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
    for i, mbit in MBIT.items():
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
        burst = f"{max(32, mbit // 2)}kb"
        for where, dev in ((ns, inner), (switch, outer)):  # its upload, its download
            sh("ip", "netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf",
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
                vector = np.ones(message[2], np.float32)
                pipe.send(server.identity.certificate)
            elif message[0] == "round":
                spec = msgspec.msgpack.decode(message[1], type=RoundSpec)
                await trio.sleep(max(0.0, message[2] - time.time()))
                report = await allreduce(
                    spec, vector, server, deadline=trio.current_time() + 120, stall_timeout=60
                )
                pipe.send((time.time() - message[2], report.complete))
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if os.geteuid() != 0 or not shutil.which("tc"):
        sys.exit("needs root with ip and tc: run it with sudo")
    size = args.mb * 1_000_000 // 4
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
        peer_ids = [h[0] for h in hellos]
        computes = [COMPUTES[i] for i in MBIT]
        solver, _ = optimal_shares(capacities(peer_ids), computes)
        schemes = {"LP shares": solver, "equal shares": [1.0] * len(MBIT)}
        print(f"{args.mb} MB, links (Mbit/s): {MBIT}; member 0 computes nothing")
        for name, shares in schemes.items():
            times = []
            for r in range(args.rounds):
                round_id = f"{name}-{r}".encode()
                for pipe in pipes:
                    pipe.send(("key", round_id, size))
                certs = [p.recv() for p in pipes]
                members = sorted(
                    (
                        Member(peer_id=h[0], host=h[1], port=h[2], computes=computes[i],
                               share=shares[i], weight=1.0 if computes[i] else 0.0, cert=certs[i])
                        for i, h in enumerate(hellos)
                    ),
                    key=lambda m: m.peer_id,
                )  # fmt: skip
                spec = RoundSpec(round_id=round_id, members=tuple(members), size=size,
                                 codec="none", chunk_elements=1 << 18)  # fmt: skip
                start_at = time.time() + 0.5
                for pipe in pipes:
                    pipe.send(("round", msgspec.msgpack.encode(spec), start_at))
                results = [pipe.recv() for pipe in pipes]
                assert all(ok for _, ok in results), f"{name}: a round did not complete"
                times.append(max(t for t, _ in results))
            predicted = _predicted(capacities(peer_ids), computes, shares, size * 4)
            print(
                f"  {name:13s} shares {[round(g / sum(shares), 3) for g in shares]}: "
                f"median {statistics.median(times):.2f} s, model predicts {predicted:.2f} s"
            )
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
