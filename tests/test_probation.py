"""Probation (`peer.averaging.probation`): a member that sent nothing sits out the next
gatherings, by one rule every view applies to the same tickets."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import numpy as np
import trio

from peer.averaging.averager import AveragingResult
from peer.averaging.group import Ticket
from peer.averaging.probation import MAX_NAMED, MEMORY_SECONDS, Probation, seated
from peer.config import AveragingConfig
from tests.helpers import CuttingRelay
from tests.test_matchmaking import MODEL, SIZE, averaging_swarm


def ticket(peer_id: str, *named: str) -> Ticket:
    return Ticket(
        peer_id=peer_id,
        rpc_addrs=[],
        data_host="127.0.0.1",
        data_port=1,
        computes=True,
        weight=1.0,
        probation=list(named),
    )


def test_strikes_double_and_are_forgotten_an_hour_after_the_last_probation():
    probation = Probation(base=60.0, cap=200.0)
    assert probation.strike("x", now=0.0) == 60.0
    assert probation.named(now=59.0) == ["x"]
    assert probation.named(now=60.0) == []  # expired: seated again
    assert probation.strike("x", now=100.0) == 220.0  # second strike: twice as long
    assert probation.strike("x", now=300.0) == 500.0  # capped at 200 s
    # Sending in between earns nothing; an hour after the last probation, a first strike.
    assert probation.strike("x", now=500.0 + MEMORY_SECONDS - 1) == 500.0 + MEMORY_SECONDS + 199
    assert probation.strike("x", now=600.0 + 3 * MEMORY_SECONDS) == 660.0 + 3 * MEMORY_SECONDS


def test_a_ticket_names_at_most_a_few_members_latest_expiry_first():
    probation = Probation(base=10.0)
    for n in range(MAX_NAMED + 3):
        probation.strike(f"p{n:02d}", now=float(n))
    named = probation.named(now=0.0)
    assert len(named) == MAX_NAMED and named[0] == f"p{MAX_NAMED + 2:02d}"


def test_a_member_sits_out_only_when_two_other_tickets_name_it():
    honest = [ticket("a", "x"), ticket("b", "x"), ticket("c"), ticket("x")]
    kept, out = seated(honest)
    assert out == {"x"} and [t.peer_id for t in kept] == ["a", "b", "c"]
    # One accuser decides nothing; naming oneself or a peer twice counts once.
    assert seated([ticket("a", "x", "x"), ticket("x", "x"), ticket("c")])[1] == set()
    # A name of a peer not in the view is ignored; each view is judged on its own tickets.
    assert seated([ticket("a", "z"), ticket("b", "z"), ticket("c")])[1] == set()
    # Every reader of the same tickets, in whatever order, seats the same members.
    assert seated(list(reversed(honest)))[1] == {"x"}
    # The silent member names its accusers back: named by three, its names do not count.
    back = [ticket("a", "x"), ticket("b", "x"), ticket("c", "x"), ticket("x", "a", "b")]
    assert seated(back)[1] == {"x"}


def test_liars_keep_out_at_most_as_many_honest_peers_as_they_are():
    """Review find: two tickets naming eight honest peers each kept all eight out. Each ticket
    gives at most MAX_NAMED (2) names now, and an exclusion takes two: two liars, two out."""
    honest = [ticket(f"h{i}") for i in range(12)]
    names = [f"h{i}" for i in range(8)]
    liars = [ticket("l1", *names), ticket("l2", *names)]
    _, out = seated([*honest, *liars])
    assert out == {"h0", "h1"}


async def average_epoch(averagers, vectors, epoch: int) -> dict[int, AveragingResult]:
    gather_until = time.time() + 1.5
    results: dict[int, AveragingResult] = {}

    async def one(i: int) -> None:
        results[i] = await averagers[i].average(
            vectors[i], weight=1.0, epoch=epoch, fingerprint=MODEL, gather_until=gather_until
        )

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(len(averagers)):
                nursery.start_soon(one, i)
    return results


@asynccontextmanager
async def four_with_a_cut_reducer(cut: int, *, limit: int, floor: float):
    """Four averagers in one group; every connection to member `cut`'s data port is cut once
    `limit` bytes came back from it (0: before any). Yields (averagers, vectors)."""
    config = AveragingConfig(
        partial_from=2, group_size=4, join_timeout=2.0, timeout_floor=floor, chunk_elements=256
    )
    async with averaging_swarm(4, config) as (s, averagers):
        relay = CuttingRelay(averagers[cut].data_port, limit=limit)
        averagers[cut].data_port = await s.nursery.start(relay.serve)
        yield averagers, [np.full(SIZE, float(i), np.float32) for i in range(4)]


async def test_a_member_that_returns_nothing_sits_out_the_next_gathering():
    """One member of four never returns the part it reduces (every connection to its data
    port is cut before a byte comes back): the first averaging waits for it and retries
    without it; in the next, the three others' tickets name it, every view leaves it out, and
    the three average at once, without a retry (before: the same wait and retry every time,
    which halved the step rate)."""
    silent = 3
    async with four_with_a_cut_reducer(silent, limit=0, floor=1.0) as (averagers, vectors):
        others = [i for i in range(4) if i != silent]
        first = await average_epoch(averagers, vectors, 1)
        assert all(averagers[silent].me in first[i].dropped for i in others)
        assert all(len(first[i].rounds) == 2 for i in others)  # waited, then retried
        second = await average_epoch(averagers, vectors, 2)
    exact = np.mean([float(i) for i in others])
    for i in others:
        assert second[i].members == 3 and not second[i].dropped
        assert len(second[i].rounds) == 1  # no wait for it, no retry
        np.testing.assert_allclose(second[i].average, exact, rtol=1e-6)
    assert second[silent].average is None
    assert any("probation" in why for why in second[silent].skipped)


async def test_a_reducer_that_returned_part_of_its_share_is_slowed_not_silent():
    """Review find: every reducer that missed the deadline was struck, and honest members
    slowed by one (held back in lock-step) named each other: a whole group sat out. A reducer
    that returned some of its part is no evidence (nor is a retry's silence: members that saw
    other failures are in another round)."""
    slowed = 3
    async with four_with_a_cut_reducer(slowed, limit=8000, floor=2.0) as (averagers, vectors):
        results = await average_epoch(averagers, vectors, 1)
    victim = averagers[slowed].me
    got_some = []
    for i in (i for i in range(4) if i != slowed):
        first = results[i].rounds[0]
        if victim in first.failed_reducers and any(
            victim in chunk.included for chunk in first.chunks
        ):
            got_some.append(i)
            assert victim not in first.silent, i
        assert all(not r.silent for r in results[i].rounds[1:]), i  # retries: no evidence
    assert got_some, "nobody got part of its share: the scenario did not happen"
