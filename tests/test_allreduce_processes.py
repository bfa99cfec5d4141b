"""An all-reduce member killed with SIGKILL mid-round: every member is a separate process.

Four processes average 40 MB vectors; one is killed 50 ms into the round. The survivors must
return within the round's deadline, report the dead member (as a dropped sender of their parts
and a failed reducer of its part), hold identical values for every chunk they all averaged,
and those values must be the right averages (with or without the dead member's contribution,
as each chunk's sender count says).
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import numpy as np
import trio

from peer.averaging.allreduce import DataServer, Member, RoundSpec, allreduce
from peer.averaging.partition import chunk_ranges
from peer.net.identity import ephemeral_identity
from peer.net.tls import DataIdentity

SIZE = 10_000_000  # 40 MB of float32
CHUNK = 1 << 18
ROUND = b"sigkill-round"


def values_of(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SIZE).astype(np.float32)


async def _member(pipe: Connection, seed: int) -> None:
    identity = ephemeral_identity()
    peer_id = identity.peer_id.to_base58()
    server = DataServer(DataIdentity(identity.key_pair.private_key, peer_id))
    vector = values_of(seed)
    async with trio.open_nursery() as nursery:
        port = await nursery.start(server.serve, "127.0.0.1", 0)
        pipe.send((peer_id, port, server.identity.certificate, os.getpid()))
        spec_bytes, start_at = await trio.to_thread.run_sync(pipe.recv)
        spec = msgspec.msgpack.decode(spec_bytes, type=RoundSpec)
        await trio.sleep(max(0.0, start_at - time.time()))
        report = await allreduce(
            spec, vector, server, deadline=trio.current_time() + 20, stall_timeout=2.0
        )
        chunks = [
            (
                c.start,
                c.end,
                c.senders,
                hashlib.blake2b(vector[c.start : c.end]).hexdigest(),
                vector[c.start : c.start + 8].tolist(),  # a sample to check the arithmetic
            )
            for c in report.chunks
        ]
        pipe.send((chunks, report.dropped_senders, report.failed_reducers, time.time() - start_at))
        nursery.cancel_scope.cancel()


def member(pipe: Connection, seed: int) -> None:
    trio.run(_member, pipe, seed)


def test_survivors_of_a_sigkilled_member_finish_agree_and_average_correctly():
    ctx = multiprocessing.get_context("spawn")
    pipes, processes = [], []
    for seed in range(4):
        parent, child = ctx.Pipe()
        process = ctx.Process(target=member, args=(child, seed), daemon=True)
        process.start()
        pipes.append(parent)
        processes.append(process)
    try:
        hellos = [pipe.recv() for pipe in pipes]
        members = tuple(
            sorted(
                (
                    Member(peer_id=h[0], host="127.0.0.1", port=h[1], computes=True, share=1.0,
                           weight=1.0, cert=h[2])
                    for h in hellos
                ),
                key=lambda m: m.peer_id,
            )
        )  # fmt: skip
        spec = RoundSpec(
            round_id=ROUND, members=members, size=SIZE, codec="none", chunk_elements=CHUNK
        )
        start_at = time.time() + 0.5
        for pipe in pipes:
            pipe.send((msgspec.msgpack.encode(spec), start_at))
        victim = 1
        time.sleep(max(0.0, start_at + 0.05 - time.time()))
        os.kill(hellos[victim][3], signal.SIGKILL)
        survivors = [i for i in range(4) if i != victim]
        results = {}
        for i in survivors:
            assert pipes[i].poll(60), f"member {i} did not finish"
            results[i] = pipes[i].recv()
    finally:
        for process in processes:
            process.kill()
            process.join(10)

    dead_id = hellos[victim][0]
    for chunks, dropped, failed, elapsed in results.values():
        assert elapsed < 20  # within the round's deadline
        assert dead_id in dropped or dead_id in failed  # the report names it
        assert {c[2] for c in chunks} <= {0, 3, 4}
    # Every chunk that all survivors averaged holds identical bytes everywhere...
    by_chunk = {}
    for chunks, *_ in results.values():
        for start, end, senders, digest, sample in chunks:
            by_chunk.setdefault((start, end), []).append((senders, digest, sample))
    vectors = {seed: values_of(seed) for seed in range(4)}
    checked = 0
    for (start, _end), seen in by_chunk.items():
        counts = {s for s, _, _ in seen}
        if 0 in counts:
            continue  # kept local by someone: the dead member's part
        assert len(counts) == 1 and len({d for _, d, _ in seen}) == 1
        # ...and is the average of the contributions its count says.
        among = list(range(4)) if counts == {4} else survivors
        expected = np.mean([vectors[i][start : start + 8] for i in among], axis=0)
        np.testing.assert_allclose(seen[0][2], expected, atol=1e-5)
        checked += 1
    assert checked >= len(chunk_ranges(0, SIZE, CHUNK)) // 2  # most of the vector averaged
