"""Memory of a peer catching up: the download beside its own state, or into its own tensors.

    .venv/bin/python -m benchmarks.catchup_memory [--size 100] [--mode dedloc] [--runs 1]

A donor process holds the scale task's state (`benchmarks.scale_task`, `--size` M parameters)
after two steps and serves it (`StateDonor`, over loopback). Then, per run and per way, a
fresh child process builds the same worker, takes one step (a trained peer: AdamW's moments
are allocated) or none (a fresh joiner), and catches up on the donor's state:
- beside: `StateDownload.run`, `TorchWorker.parse`, `restore` (the trainer's way before, the
  keeper's way still);
- in place: `StateDownload.run_into` an `InPlaceCatchUp`, then `finish` (the trainer's way).
Each child reports its RSS holding its own state just before the catch-up (the baseline), its
peak RSS during it (VmHWM, reset just before through /proc/self/clear_refs), the seconds it
took, and whether its digest is the donor's. Ratios are to the bytes the donor serves (DiLoCo:
without the inner optimizer, each peer's own).
"""

from __future__ import annotations

import argparse
import multiprocessing
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import trio

from benchmarks.common import quiet_logs
from benchmarks.scale_task import SIZES, ScaleGPTTask
from peer.config import load_config
from peer.errors import RemoteError
from peer.heap import releaser
from peer.net.host import open_node, split_peer_addr
from peer.training.catchup import InPlaceCatchUp
from peer.training.statesync import StateDonor, StateDownload
from peer.training.worker import TorchWorker
from tests.helpers import LOOPBACK, new_identity

MAX_MESSAGE = 4 << 20
MB = 1e6


def build(size: int, mode: str) -> TorchWorker:
    config = load_config(
        env={}, overrides={"training.mode": mode, "task.micro_batch": 4, "training.seed": 0}
    ).config
    return TorchWorker(
        ScaleGPTTask(SIZES[size]), config, device=torch.device("cpu"), peer_id="catch-up"
    )


async def steps(worker: TorchWorker, count: int) -> None:
    for _ in range(count):  # one micro-batch each (DiLoCo: one inner step)
        await worker.compute()
        vector, _ = await worker.take()
        await worker.apply(vector)


def status(field: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise LookupError(field)


# ---------------------------------------------------------------------------- the donor


async def _donor(pipe: Connection, size: int, mode: str) -> None:
    quiet_logs()
    worker = build(size, mode)
    await steps(worker, 2)
    digest = await worker.hold(2)
    held = worker.held
    assert held is not None
    state_bytes = sum(t.numel() * t.element_size() for t in held.state.tensors.values())
    async with (
        open_node(
            new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
        ) as node,
        trio.open_nursery() as nursery,
    ):
        donor = StateDonor(node, worker.serialize, max_downloads=8, caller_states=1e6)
        await nursery.start(donor.serve, "127.0.0.1", 0)
        pipe.send((node.public_addrs()[0], digest, state_bytes))
        await trio.sleep_forever()


def donor_process(pipe: Connection, size: int, mode: str) -> None:
    trio.run(_donor, pipe, size, mode)


# ---------------------------------------------------------------------------- a catch-up


async def _catch_up(way: str, trained: bool, size: int, mode: str, donor: tuple[str, str]):
    quiet_logs()
    worker = build(size, mode)
    await steps(worker, 1 if trained else 0)
    await worker.hold(1 if trained else 0)
    await worker.before_download()  # as the trainer does
    addr_text, digest = donor
    peer, addr = split_peer_addr(addr_text, what="donor")
    async with open_node(
        new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=MAX_MESSAGE
    ) as node:
        await node.connect(peer, [addr], timeout=5)
        job = StateDownload(node, [peer], min_step=2, parallel=1)
        deadline = trio.current_time() + 300
        before = status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
        started = time.perf_counter()
        if way == "beside":
            snapshot = await job.run(deadline=deadline)
            state, got = await worker.parse(snapshot)
            blob = snapshot.blob
            assert isinstance(blob, bytes)
            release = releaser(blob)
            del snapshot, blob
            await worker.restore(state, from_donor=True, release=release)
            del state
        else:

            def certify(step: int, seen: str) -> None:
                if seen != digest:
                    raise RemoteError(f"digest {seen}, the donor's is {digest}")

            sink = InPlaceCatchUp(worker, certify)
            await job.run_into(sink, deadline=deadline)
            _, got = await sink.finish()
        seconds = time.perf_counter() - started
        held = await worker.hold(2, digest=got)
        peak = status("VmHWM")
    return before, peak, seconds, got == digest and held == digest


def catch_up_process(pipe: Connection, *args: object) -> None:
    pipe.send(trio.run(_catch_up, *args))


def child(target, *args: object):
    ours, theirs = multiprocessing.Pipe()
    process = multiprocessing.get_context("spawn").Process(
        target=target, args=(theirs, *args), daemon=True
    )
    process.start()
    return process, ours


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=100, choices=sorted(SIZES))
    parser.add_argument("--mode", default="dedloc", choices=["dedloc", "diloco"])
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    donor, pipe = child(donor_process, args.size, args.mode)
    try:
        addr, digest, state_bytes = pipe.recv()
        print(
            f"catch-up memory: {args.size} M parameters, {args.mode}; the donor serves a state "
            f"of {state_bytes / MB:.0f} MB"
        )
        print(f"{'peer':<12} {'way':<9} {'before':>18} {'peak':>18} {'peak-before':>13} "
              f"{'seconds':>8}  digest")  # fmt: skip
        for _ in range(args.runs):
            for trained in (True, False):
                for way in ("beside", "in place"):
                    process, result = child(
                        catch_up_process, way, trained, args.size, args.mode, (addr, digest)
                    )
                    before, peak, seconds, same = result.recv()
                    process.join(60)
                    print(
                        f"{'trained' if trained else 'fresh':<12} {way:<9} "
                        f"{before / MB:7.0f} MB {before / state_bytes:5.2f}x "
                        f"{peak / MB:7.0f} MB {peak / state_bytes:5.2f}x "
                        f"{(peak - before) / state_bytes:12.2f}x {seconds:8.2f}  "
                        f"{'= donor' if same else 'DIFFERS'}",
                        flush=True,
                    )
    finally:
        donor.kill()


if __name__ == "__main__":
    main()
