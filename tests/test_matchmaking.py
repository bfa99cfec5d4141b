"""Moshpit matchmaking and averaging over the real DHT, RPC and data plane, in process."""

from __future__ import annotations

import dataclasses
import time
from contextlib import asynccontextmanager

import numpy as np
import pytest
import trio

from peer.averaging.allreduce import DataServer
from peer.averaging.averager import Averager, AveragingResult, fingerprint
from peer.averaging.moshpit import group_of, rounds_for
from peer.config import AveragingConfig, DhtConfig
from tests.helpers import swarm

DHT_CONFIG = dataclasses.replace(DhtConfig(), replicas=5, alpha=3, purge_interval=3600.0)
SIZE = 4099
MODEL = fingerprint([("w", (SIZE,), "float32")])


def test_groups_partition_the_peers_along_a_new_axis_every_round():
    peers = [f"peer-{i}" for i in range(27)]
    assert rounds_for(27, 3) == 3 and rounds_for(28, 3) == 4 and rounds_for(1, 2) == 1
    seen_pairs = set()
    for round_index in range(3):
        groups = {tuple(group_of(peers, p, group_size=3, round_index=round_index)) for p in peers}
        assert sorted(p for g in groups for p in g) == sorted(peers)  # a partition
        assert {len(g) for g in groups} == {3}
        pairs = {(a, b) for g in groups for a in g for b in g if a < b}
        assert not pairs & seen_pairs  # nobody meets the same peer twice
        seen_pairs |= pairs
    with pytest.raises(ValueError, match="not among"):
        group_of(peers, "stranger", group_size=3, round_index=0)


@asynccontextmanager
async def averaging_swarm(count: int, config: AveragingConfig):
    """`count` DHT nodes, each with a data server and an averager."""
    async with swarm(count, DHT_CONFIG) as s:
        averagers = []
        for dht in s.dhts:
            server = DataServer()
            port = await s.nursery.start(server.serve, "127.0.0.1", 0)
            averagers.append(
                Averager(
                    dht,
                    config,
                    collaboration="test",
                    data_server=server,
                    data_host="127.0.0.1",
                    data_port=port,
                )
            )
        yield s, averagers


async def average_all(
    averagers, vectors, *, weights=None, fingerprints=None, on_round=None, skip=(), gather=1.5
) -> list[AveragingResult | None]:
    gather_until = time.time() + gather
    results: list[AveragingResult | None] = [None] * len(averagers)

    async def one(i: int) -> None:
        results[i] = await averagers[i].average(
            vectors[i],
            weight=1.0 if weights is None else weights[i],
            epoch=1,
            fingerprint=MODEL if fingerprints is None else fingerprints[i],
            gather_until=gather_until,
            on_round=(lambda r, report: on_round(i, r)) if on_round else (lambda r, report: None),
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(len(averagers)):
                if i not in skip:
                    nursery.start_soon(one, i)
    return results


async def test_eight_peers_in_pairs_reach_the_exact_average_in_three_rounds():
    config = AveragingConfig(group_size=2, join_timeout=3.0, timeout_floor=5.0)
    async with averaging_swarm(8, config) as (_, averagers):
        rng = np.random.default_rng(0)
        vectors = [rng.standard_normal(SIZE).astype(np.float32) * (i + 1) for i in range(8)]
        mean = np.mean([v.astype(np.float64) for v in vectors], axis=0)
        spread: dict[int, list[float]] = {}

        def record(i: int, round_index: int) -> None:
            spread.setdefault(round_index, []).append(float(np.abs(vectors[i] - mean).max()))

        initial = max(float(np.abs(v - mean).max()) for v in vectors)
        results = await average_all(averagers, vectors, on_round=record)
        assert all(len(r.rounds) == 3 and not r.skipped for r in results)
        assert all(len(group) == 2 for r in results for group in r.groups)
        widths = [initial] + [max(spread[r]) for r in range(3)]
        assert widths[0] > widths[1] > widths[2] > widths[3]  # the spread shrinks every round
        for v in vectors:
            np.testing.assert_allclose(v, mean, atol=1e-5)  # exact after log2(8) = 3 rounds


async def test_a_lone_peer_is_told_there_are_too_few_peers():
    async with averaging_swarm(1, AveragingConfig(join_timeout=0.5)) as (_, averagers):
        vector = np.ones(SIZE, np.float32)
        (result,) = await average_all(averagers, [vector])
        assert result.rounds == [] and len(result.skipped) == 1
        assert "too few peers to average" in result.skipped[0]
        assert (vector == 1).all()


async def test_incompatible_models_never_share_a_group():
    config = AveragingConfig(group_size=4, join_timeout=2.0)
    async with averaging_swarm(4, config) as (_, averagers):
        vectors = [np.full(SIZE, float(i), np.float32) for i in range(4)]
        other = fingerprint([("w", (SIZE,), "float16")])
        prints = [MODEL, other, MODEL, other]
        results = await average_all(averagers, vectors, fingerprints=prints)
        for i, r in enumerate(results):
            assert r.peers_seen == 2
            same = [j for j in range(4) if prints[j] == prints[i]]
            assert sorted(r.groups[0]) == sorted(averagers[j].me for j in same)
            np.testing.assert_allclose(vectors[i], np.mean([float(j) for j in same]), atol=1e-6)


async def test_a_dead_leader_is_passed_over():
    config = AveragingConfig(group_size=4, join_timeout=2.0)
    async with averaging_swarm(4, config) as (s, averagers):
        # The peer with the lowest id declares, then dies before the gathering closes.
        order = sorted(range(4), key=lambda i: averagers[i].me)
        dead = order[0]
        vectors = [np.full(SIZE, float(i), np.float32) for i in range(4)]

        async def declare_then_die() -> None:
            await averagers[dead].matchmaker.declare(
                f"test/avg/{MODEL}/1", _ticket(averagers[dead]), expiration=time.time() + 600
            )
            s.kill(s.dhts.index(averagers[dead].dht))

        await declare_then_die()
        # Stores that ask the dead node wait out its RPC timeout (5 s): gather long enough for
        # every live ticket to be in place before anyone reads.
        results = await average_all(averagers, vectors, skip={dead}, gather=7.0)
        alive = [i for i in range(4) if i != dead]
        expected = np.mean([float(i) for i in alive])
        for i in alive:
            assert results[i].peers_seen == 4  # its ticket was there
            assert averagers[dead].me not in [p for g in results[i].groups for p in g]
            np.testing.assert_allclose(vectors[i], expected, atol=1e-6)


def _ticket(averager: Averager):
    from peer.averaging.group import Ticket

    return Ticket(
        peer_id=averager.me,
        rpc_addrs=averager.dht.node.public_addrs(),
        data_host=averager.data_host,
        data_port=averager.data_port,
        computes=True,
        weight=1.0,
    )


async def test_joins_for_other_epochs_and_abandoned_joins_leave_no_trace():
    from peer.averaging.crypto import RoundKey
    from peer.averaging.group import Joined
    from peer.averaging.matchmaking import SERVICE, Join, JoinReply, Redirect
    from peer.errors import DeadlineExceeded

    async with averaging_swarm(2, AveragingConfig(join_timeout=2.0)) as (_, (leader, joiner)):
        namespace = f"test/avg/{MODEL}/9"
        key = RoundKey(b"k", joiner.me, joiner.dht.node.identity.key_pair.private_key)
        me = Joined(_ticket(joiner), key.announcement)

        async def join(ns: str, timeout: float):
            return await joiner.dht.node.rpc.call(
                leader.dht.node.peer_id, SERVICE, "join", Join(ns, 0, me), JoinReply,
                timeout=timeout,
            )  # fmt: skip

        # Not an epoch the leader gathers for: turned away, nothing is kept.
        assert isinstance(await join("junk/namespace", 5), Redirect)
        assert leader.matchmaker._gatherings == {}
        # An epoch it gathers for, but the joiner hangs up before any decision: forgotten.
        await leader.matchmaker.declare(namespace, _ticket(leader), expiration=time.time() + 60)
        with pytest.raises(DeadlineExceeded):
            await join(namespace, 0.3)
        with trio.fail_after(5):
            while leader.matchmaker._gatherings[(namespace, 0)].joined:
                await trio.sleep(0.05)
