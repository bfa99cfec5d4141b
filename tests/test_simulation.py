"""The in-process simulation (`simulation/`): its network and data plane keep the protocol's
rules, and small collaborations on it train as real ones do. The 300-peer runs are slow."""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace
from typing import Any

import msgspec
import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.averaging.allreduce import Member, RoundSpec
from peer.averaging.partition import part_ranges
from peer.config import AveragingConfig
from peer.dht import records, routing
from peer.dht.records import Limits, make_entry
from peer.errors import DeadlineExceeded, RpcError, Unreachable
from peer.net.rpc import RpcServer
from peer.training import progress, shards
from peer.training.certificate import sign_step
from peer.training.publisher import ProgressPublisher
from simulation import collaboration, cpu, memo
from simulation.collaboration import (
    EPOCH,
    VECTOR,
    Attempt,
    RoundTime,
    Scenario,
    peer_config,
    run_collaboration,
    scale_factor,
)
from simulation.cpu import VERIFY_SECONDS, SimCpu, charged
from simulation.dataplane import SimDataPlane, SimDataServer, SimIdentity
from simulation.links import SharedLink, _Waiter, carry, carry_groups
from simulation.nat import Nat, NatTally
from simulation.network import MBIT, Link, SimNetwork, Traffic
from simulation.progressload import placed_load, run_load
from simulation.report import gatherings, round_lines, rounds_of, rows, step_phases, summarize
from simulation.safety import SafetyCheck
from simulation.worker import QUIET, ComputeNoise, Variation

SLOW_LINK = Link(upload=10 * MBIT, download=10 * MBIT, rtt=0.2)
FAST_LINK = Link(upload=100 * MBIT, download=100 * MBIT, rtt=0.02)


class Echo(msgspec.Struct):
    text: str


def serve_echo(network: SimNetwork, link: Link, handler=None):
    node = network.node(link)
    server = RpcServer(node.host, "echo", max_message_bytes=1 << 20)  # type: ignore[arg-type]

    async def echo(caller, request: Echo) -> Echo:
        return Echo(request.text * 2)

    server.add_unary("echo", Echo, handler or echo)
    return node


async def test_a_call_takes_the_latency_and_the_bytes_both_ways(autojump_clock):
    network = SimNetwork(random.Random(0))
    caller = network.node(SLOW_LINK)
    callee = serve_echo(network, FAST_LINK)
    text = "x" * 125_000  # ~0.1 s at 10 Mbit/s, twice as much back
    started = trio.current_time()
    reply = await caller.rpc.call(callee.peer_id, "echo", "echo", Echo(text), Echo, timeout=10)
    assert reply.text == text * 2
    elapsed = trio.current_time() - started
    one_way = (SLOW_LINK.rtt + FAST_LINK.rtt) / 4
    expected = 2 * one_way + (125_000 + 250_000) / (10 * MBIT)
    assert elapsed == pytest.approx(expected, rel=0.01)
    assert network.traffic.calls[("echo", "echo")] == 1


async def test_a_link_is_shared_equally_by_what_it_carries_at_once(autojump_clock):
    up, down = SharedLink(100.0), SharedLink(1000.0)
    ends: dict[str, float] = {}

    async def transfer(name: str, size: float, start: float, *links: SharedLink) -> None:
        await trio.sleep(start)
        await carry(size, *links)
        ends[name] = trio.current_time()

    async def stopped_after_one_second() -> None:  # its caller's deadline
        with trio.move_on_after(1.0):
            await carry(1e9, up)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(transfer, "a", 100, 0, up)
        nursery.start_soon(transfer, "b", 100, 0, up, down)  # the faster link waits for up
        nursery.start_soon(transfer, "c", 10, 0.5, up)
        nursery.start_soon(stopped_after_one_second)
    # Three share 100 B/s (16.7 B each by 0.5 s); c makes four at 25 B/s and its 10 B take
    # 0.4 s; a and b have 30 B by 1 s, when the third stops; their last 70 B at 50 B/s.
    assert ends["c"] == pytest.approx(0.9)
    assert ends["a"] == ends["b"] == pytest.approx(1.0 + 70 / 50)
    assert up.carried == pytest.approx(210 + 1e9)


async def test_a_message_s_bytes_share_the_link_only_from_the_end_of_its_latency(autojump_clock):
    up = SharedLink(100.0)
    ends: dict[str, float] = {}

    async def transfer(name: str, size: float, after: float, timeout: float = 100) -> None:
        with trio.move_on_after(timeout):
            await carry(size, up, after=after)
            ends[name] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(transfer, "bulk", 100, 0)
        nursery.start_soon(transfer, "message", 10, 0.5)
        nursery.start_soon(transfer, "cut before it starts", 1e6, 2.0, 1.0)
    # The bulk has 50 B by 0.5 s; the message's 10 B then take 0.2 s at 50 B/s, and the
    # bulk's last 40 B 0.4 s alone; the cut one never shares.
    assert ends == {"message": pytest.approx(0.7), "bulk": pytest.approx(1.1)}


async def test_a_busy_link_ends_each_of_hundreds_of_transfers_at_its_exact_time(autojump_clock):
    """Past `links.EXACT_PROJECTION` transfers ahead, a transfer sleeps on a cheaper bound: it
    may wake early, never late."""
    link, sizes = SharedLink(1000.0), [float(size) for size in range(1, 201)]
    ends: dict[float, float] = {}

    async def transfer(size: float) -> None:
        await carry(size, link)
        ends[size] = trio.current_time()

    async with trio.open_nursery() as nursery:
        for size in sizes:
            nursery.start_soon(transfer, size)
    expected, at, done = {}, 0.0, 0.0
    for index, size in enumerate(sizes):  # processor sharing: the smallest first
        at += (size - done) * (len(sizes) - index) / link.capacity
        expected[size], done = at, size
    assert ends == pytest.approx(expected, rel=1e-9)


@given(
    st.lists(  # (which link, bytes, starts after): one link's side of many messages
        st.tuples(st.integers(0, 1), st.integers(1, 500), st.sampled_from([0.0, 0.0, 0.5, 3.0])),
        min_size=1,
        max_size=80,
    ),
    st.lists(st.booleans(), min_size=80, max_size=80),  # which of them are the waiter's
    st.floats(0.0, 20.0),
)
def test_a_waiter_s_deadline_is_the_latest_end_of_its_transfers(messages, ours, now):
    """`_Waiter.deadline` works out each link's latest end once (`SharedLink._latest_end`); it
    is the latest of its transfers' own projected ends (`_end_of`), to the bit, past `EXACT_PROJECTION`
    transfers on a link too, and with transfers of others and transfers yet to start."""
    links, waiter, other = [SharedLink(100.0), SharedLink(37.0)], _Waiter(), _Waiter()
    for (which, size, after), mine in zip(messages, ours, strict=False):
        owner = waiter if mine else other
        link = links[which]
        owner.transfers.append((link, link._start(float(size), owner, after, 0.0)))
    latest = waiter.deadline(now)
    for link in links:
        link._advance(now)  # as `deadline` left them: each transfer's end on its own
    alone = [link._end_of(t) for link, t in waiter.transfers if not t.done]
    assert latest == max(alone, default=-math.inf)


async def test_a_fan_out_cut_at_its_deadline_speeds_up_what_else_its_link_carries(autojump_clock):
    """Three messages of a fan-out share a link with a fourth transfer, and the fan-out's
    deadline cuts them all at once: the fourth has its link alone from then on, and ends when
    its bytes say (its task sleeps again once, from the link as all three cuts left it)."""
    link = SharedLink(100.0)
    ends: dict[str, float] = {}

    async def alone() -> None:
        await carry(100, link)
        ends["alone"] = trio.current_time()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(alone)
        landed = await carry_groups([(0.0, [(link, 1e9)]) for _ in range(3)], deadline=1.0)
    assert landed == [False, False, False]
    assert ends["alone"] == pytest.approx(1.0 + (100 - 100 / 4) / 100)  # 25 B by 1 s, then 100 B/s


async def test_a_carry_that_ends_at_once_is_still_a_checkpoint(autojump_clock):
    link = SharedLink(1.0)
    await trio.sleep(5000)  # a sliver ends within the clock's slack at once
    with trio.CancelScope() as scope:
        scope.cancel()
        await carry(1e-13, link)
        pytest.fail("a cancelled carry went on")


async def test_a_reply_waits_its_share_behind_a_bulk_transfer_on_the_same_uplink(autojump_clock):
    network = SimNetwork(random.Random(0))
    caller = network.node(FAST_LINK)
    callee = serve_echo(network, SLOW_LINK)
    text = "x" * 62_500  # 125 KB back: 0.1 s alone at 10 Mbit/s, 0.2 s beside one transfer
    alone = await timed_call(caller, callee, text)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(carry, 100 * MBIT, network.uplinks[callee.peer_id])  # 80 s alone
        await trio.sleep(1)
        shared = await timed_call(caller, callee, text)
        nursery.cancel_scope.cancel()
    assert shared - alone == pytest.approx(125_000 / (10 * MBIT), rel=0.01)


async def timed_call(caller, callee, text: str) -> float:
    started = trio.current_time()
    await caller.rpc.call(callee.peer_id, "echo", "echo", Echo(text), Echo, timeout=100)
    return trio.current_time() - started


async def test_a_request_is_decoded_as_its_type_and_a_handler_error_reaches_the_caller(
    autojump_clock,
):
    network = SimNetwork(random.Random(0))
    caller = network.node(FAST_LINK)

    async def refuse(caller_id, request: Echo) -> Echo:
        raise RpcError("forbidden", "not you")

    callee = serve_echo(network, FAST_LINK, refuse)
    with pytest.raises(RpcError, match="forbidden"):
        await caller.rpc.call(callee.peer_id, "echo", "echo", Echo("a"), Echo, timeout=10)
    other = serve_echo(network, FAST_LINK)
    with pytest.raises(RpcError, match="bad_request"):  # as the real server's decode refuses it
        await caller.rpc.call(other.peer_id, "echo", "echo", {"text": 5}, Echo, timeout=10)


async def test_a_peer_that_left_fails_fast_or_at_the_deadline(autojump_clock):
    network = SimNetwork(random.Random(0), silent_departures=0.0)
    caller = network.node(FAST_LINK)
    closed = serve_echo(network, FAST_LINK)
    network.leave(closed.peer_id)
    started = trio.current_time()
    with pytest.raises(Unreachable):
        await caller.rpc.call(closed.peer_id, "echo", "echo", Echo("a"), Echo, timeout=10)
    assert trio.current_time() - started < 1
    network.silent_departures = 1.0
    vanished = serve_echo(network, FAST_LINK)
    network.leave(vanished.peer_id)
    started = trio.current_time()
    with pytest.raises(DeadlineExceeded):
        await caller.rpc.call(vanished.peer_id, "echo", "echo", Echo("a"), Echo, timeout=10)
    assert trio.current_time() - started == pytest.approx(10)


def round_spec(plane: SimDataPlane, network: SimNetwork, links: list[Link], weights: list[float]):
    nodes = [network.node(link) for link in links]
    for node in nodes:
        plane.register(node.peer_id)
    members = tuple(
        sorted(
            (
                Member(
                    peer_id=node.peer_id.to_base58(),
                    host=node.data_host,
                    port=4002,
                    computes=True,
                    share=1 / len(nodes),
                    weight=weight,
                    cert=b"",
                )
                for node, weight in zip(nodes, weights, strict=True)
            ),
            key=lambda m: m.peer_id,
        )
    )
    spec = RoundSpec(round_id=b"r", members=members, size=24, codec="none", chunk_elements=8)
    return nodes, spec


def server_of(member: Member) -> SimDataServer:
    return SimDataServer(SimIdentity(member.peer_id, b""))


async def test_a_round_gives_every_member_the_same_weighted_mean_after_the_transfer(
    autojump_clock,
):
    network = SimNetwork(random.Random(0))
    plane = SimDataPlane(network, model_bytes=10e6)
    _, spec = round_spec(plane, network, [SLOW_LINK, FAST_LINK, FAST_LINK], [1.0, 2.0, 3.0])
    values = {m.peer_id: np.full(24, i + 1, dtype=np.float32) for i, m in enumerate(spec.members)}
    weights = {m.peer_id: m.weight for m in spec.members}
    expected = sum(weights[p] * values[p].astype(np.float64) for p in values) / 6
    reports = {}
    started = trio.current_time()

    async def take_part(member: Member) -> None:
        reports[member.peer_id] = await plane.allreduce(
            spec, values[member.peer_id], server_of(member), deadline=1e9, stall_timeout=1e9
        )

    async with trio.open_nursery() as nursery:
        for member in spec.members:
            nursery.start_soon(take_part, member)
    # The slow member sends and receives 4/3 of 10 MB at 10 Mbit/s (`bytes_per_round`, a
    # third each), plus the slowest round trip.
    assert trio.current_time() - started == pytest.approx(10e6 * (4 / 3) / (10 * MBIT) + 0.2)
    for peer_id, report in reports.items():
        assert report.complete and report.exact_over == frozenset(weights)
        np.testing.assert_array_equal(values[peer_id], expected.astype(np.float32))
    assert len({v.tobytes() for v in values.values()}) == 1


async def test_a_member_that_never_comes_fails_the_round_for_the_others(autojump_clock):
    network = SimNetwork(random.Random(0))
    plane = SimDataPlane(network, model_bytes=10e6)
    _, spec = round_spec(plane, network, [FAST_LINK] * 3, [1.0, 1.0, 1.0])
    absent = spec.members[2].peer_id
    reports = {}

    async def take_part(member: Member) -> None:
        vector = np.ones(24, dtype=np.float32)
        reports[member.peer_id] = await plane.allreduce(
            spec, vector, server_of(member), deadline=trio.current_time() + 30, stall_timeout=5
        )

    async with trio.open_nursery() as nursery:
        for member in spec.members[:2]:
            nursery.start_soon(take_part, member)
    assert trio.current_time() == pytest.approx(30)  # waited for it until the deadline
    for report in reports.values():
        assert not report.complete
        assert absent in report.dropped_senders and absent in report.excluded()


def call(peer: str, step: int, close: float, started: float, average: bytes = b"a") -> Attempt:
    """One averaging call for `step` in the gathering closing at `close` (virtual seconds)."""
    epoch = int((EPOCH + close) * 1000)
    return Attempt(peer, epoch, step, started, peers_seen=3, members=3, average=average, why="")


def test_a_round_is_a_steps_try_and_calls_split_at_once_are_one_round():
    first, split = call("a", 1, close=10, started=8), call("b", 1, close=10.6, started=9)
    failed = call("c", 1, close=10, started=8.5, average=b"c")  # 2 of 3 on one: step taken
    missed = call("d", 1, close=14, started=11)  # called after the step was taken
    missed_too = call("e", 1, close=14.5, started=11.5)  # another of those, at once
    nxt = call("a", 2, close=50, started=47, average=b"")  # no average: not taken
    retry = call("a", 2, close=70, started=67)  # step 2 was not taken: the next try
    late = Attempt("f", first.epoch, 1, 11, peers_seen=0, members=0, average=b"", why="late")
    taken_at = {1: 10.5}  # a peer first took step 1 after its gathering; nobody took step 2
    rounds = rounds_of([retry, nxt, late, missed_too, missed, failed, split, first], taken_at)
    by_peer = [(r.step, sorted(r.calls, key=lambda a: a.peer), r.late_gatherings) for r in rounds]
    assert by_peer == [
        (1, [first, split, failed, missed, missed_too], 2),
        (2, [nxt], 0),
        (2, [retry], 0),
    ]
    assert rounds[0].on_the_step == 0.8
    assert [r.yielded for r in rounds] == [True, False, False]
    # A step the rule certified from a split (every average another: a partial average's
    # voters joined the leader) is still the round's step; taken after the retry opened, it
    # is the retry's.
    apart = [call(p, 2, close=50, started=47, average=p.encode()) for p in "abc"]
    again = call("a", 2, close=70, started=67)
    (taken,) = rounds_of([*apart, again], {2: 51.0})  # the retry missed it: a late gathering
    assert taken.yielded and taken.late_gatherings == 1
    assert [r.yielded for r in rounds_of([*apart, again], {2: 71.0})] == [False, True]


def test_a_gathering_shows_the_averages_its_calls_split_into_and_why_calls_failed():
    """`python -m simulation --gatherings`: per gathering, its calls, those over their whole
    view, the distinct averages and the most calls on one, when they ended, and the most
    common failures (peer ids left out, so that one kind of failure counts once)."""
    whole = [call(p, 1, close=10, started=8) for p in "ab"]
    whole[1].ended = 30.0
    part = Attempt("c", whole[0].epoch, 1, 8, peers_seen=3, members=2, average=b"c", why="")
    failed = [
        Attempt(p, whole[0].epoch, 1, 8, 3, 0, b"", f"round 4: too few peers (12D3KooW{p})")
        for p in "de"
    ]
    late = Attempt("f", whole[0].epoch, 1, 9, peers_seen=0, members=0, average=b"", why="late")
    retry = call("a", 2, close=70, started=67)
    whole[0].rounds = (RoundTime(0, 8.0, 9.0, 12.0, True), RoundTime(1, 12.0, 20.0, 20.0, False))
    whole[1].rounds = (RoundTime(0, 8.5, 11.0, 14.5, True),)
    first, second = gatherings([retry, late, *failed, part, *whole])
    assert first.splitlines() == [
        "step 1, gathering closed at 10.0 s: 5 calls, 2 over their whole view; 2 averages, the "
        "largest on 2; ended 0.0 s (median), 30.0 s (last)",
        "    2 x round 4: too few peers (<peer>)",
        "    round 0: 2 met a group, 2 averaged; started 8.5 / 8.5 s, formed in 2.5 / 2.5 s, "
        "all-reduce 3.5 / 3.5 s",
        "    round 1: 1 met a group, 0 averaged; started 12.0 / 12.0 s, formed in 8.0 / 8.0 s, "
        "all-reduce - s",
    ]
    assert second.startswith("step 2, gathering closed at 70.0 s: 1 calls, 1 over")


def test_a_round_left_alone_counts_whether_a_planned_member_was_in_it_meanwhile():
    """Of the calls left alone in a round (too few came), those with a planned member of
    their group forming its own group of that round at the same time: at 300 simulated peers
    54 of a first step's 101 groups of one, before session 48's fix (each led, waiting for the
    other). A member that came after we gave up, or a round of another index, does not count."""
    calls = [call(p, 1, close=10, started=8) for p in "abcd"]
    calls[0].rounds = (RoundTime(1, 12.0, 40.0, 40.0, False, ("a", "b"), alone=True),)
    calls[1].rounds = (RoundTime(1, 30.0, 60.0, 60.0, False, ("a", "b"), alone=True),)
    calls[2].rounds = (RoundTime(1, 12.0, 20.0, 20.0, False, ("c", "d"), alone=True),)
    calls[3].rounds = (
        RoundTime(0, 12.0, 18.0, 19.0, True, ("c", "d")),  # another round
        RoundTime(1, 21.0, 25.0, 28.0, True, ("d", "e")),  # after c gave up
    )
    (line,) = [line for line in round_lines(calls) if line.startswith("round 1:")]
    assert line.endswith("; alone in 3 (2 with a planned member in the round meanwhile)")
    (first,) = [line for line in round_lines(calls) if line.startswith("round 0:")]
    assert "alone" not in first


def test_the_round_that_yields_a_step_is_its_first_holders():
    """A gathering opened while a round's election ran (peers that missed its gathering) is no
    try of its own: the round whose call gave the step's first holder the step yielded it, and
    the gathering after it missed it. Without the holder's call, the last try before the step."""
    elected = [call(p, 4, close=40, started=37) for p in "abc"]
    straggler = call("d", 4, close=45, started=43)  # its window opens once the round's closed
    taken_at = {4: 60.0}  # the round's election ended at 60
    (round_,) = rounds_of([*elected, straggler], taken_at, {4: "b"})
    assert (round_.yielded, round_.late_gatherings, len(round_.calls)) == (True, 1, 4)
    # The straggler's gathering gave the step (its holder called there): the round before failed.
    tries = rounds_of([*elected, straggler], taken_at, {4: "d"})
    assert [(r.yielded, len(r.calls)) for r in tries] == [(False, 3), (True, 1)]
    # A holder's call after it took the step (its next gathering) is not where it took it.
    after = call("b", 4, close=70, started=65)
    (round_,) = rounds_of([*elected, straggler, after], taken_at, {4: "b"})
    assert round_.yielded and round_.late_gatherings == 2
    tries = rounds_of([*elected, straggler], taken_at)  # no holder known: the last try
    assert [r.yielded for r in tries] == [False, True]


def test_a_steps_time_splits_into_the_wait_for_its_call_its_averaging_and_its_election():
    """From the step before to the yielding round's first call, that round's median call,
    and from its median end to the step: the medians over the steps taken after another."""
    step_1 = [call(p, 1, close=10, started=8) for p in "ab"]
    step_2 = [
        dataclasses.replace(call(p, 2, close=30, started=started), ended=ended)
        for p, started, ended in (("a", 28.0, 40.0), ("b", 29.0, 43.0), ("c", 30.0, 44.0))
    ]
    never = [call("a", 3, close=80, started=78)]  # step 3 was not taken: no figures
    rounds = rounds_of([*step_1, *step_2, *never], {1: 20.0, 2: 50.0})
    # Step 2: first call at 28 (8 s after step 1), calls of 12, 14 and 14 s, median end 43.
    assert step_phases(rounds, {1: 20.0, 2: 50.0}) == (8.0, 14.0, 7.0)
    assert all(math.isnan(x) for x in step_phases(rounds_of(step_1, {1: 20.0}), {1: 20.0}))


def a_report(**fields: Any) -> SimpleNamespace:
    """The `Report` fields `summarize` reads: 3 peers for a minute, nothing happened."""
    return SimpleNamespace(**{
        "scenario": small(peers=3, minutes=1), "attempts": [], "cut": frozenset(),
        "dht_seconds": {"store": [], "get": []}, "views": [], "traffic": Traffic(),
        "wall_seconds": 1.0, "steps": 1, "ideal_step_seconds": 1.0, "departures": 0,
        "arrivals": 0, "downloads": 0, "digests_agree": True, "violations": [],
        "backbone_failures": 0, "elections": Counter(), "election_seconds": 0.0,
        "volunteers": [], "nat": NatTally(), "taken_at": {}, "taken_by": {},
        "busiest_window": None, **fields,
    })  # fmt: skip


def test_rounds_cut_by_the_end_count_neither_way():
    agreed = [call(p, 1, close=10, started=8) for p in "abc"]
    split = [call(p, 2, close=40, started=38, average=p.encode()) for p in "abc"]

    def report(cut: frozenset[int]) -> SimpleNamespace:
        return a_report(attempts=[*agreed, *split], cut=cut, taken_at={1: 10.5})

    summary = summarize(report(frozenset()))  # type: ignore[arg-type]
    assert (summary.rounds, summary.agreed_rounds, summary.cut_rounds) == (2, 0.5, 0)
    summary = summarize(report(frozenset({split[0].epoch})))  # type: ignore[arg-type]
    assert (summary.rounds, summary.agreed_rounds, summary.cut_rounds) == (1, 1.0, 1)


def test_the_busiest_node_is_measured_against_the_dht_servers_too():
    """NATed peers are DHT clients and serve no records: against the mean over every node the
    busiest is ~2x where every server serves alike (half the peers behind NAT). The mean over
    the servers (backbones and public peers) shows the imbalance the shards leave."""
    traffic = Traffic()
    traffic.served.update({"backbone": 600, "public-a": 600, "public-b": 1200})  # in 60 s
    kinds = [Nat.PUBLIC, Nat.PUBLIC, Nat.CONE, Nat.SYMMETRIC]
    volunteers = [SimpleNamespace(nat=kind) for kind in kinds]
    summary = summarize(a_report(scenario=small(peers=4, minutes=1), traffic=traffic,
                                 volunteers=volunteers))  # type: ignore[arg-type]  # fmt: skip
    assert summary.hottest_node_bytes == 20
    assert summary.mean_node_reply_bytes == pytest.approx(40 / 6)  # 4 peers, 2 backbones
    assert summary.mean_server_reply_bytes == pytest.approx(40 / 4)  # 2 backbones, 2 public
    busiest = next(value for name, value in rows(summary) if name.startswith("busiest node"))
    assert busiest.endswith("(3.0x / 2.0x)")


def small(**fields) -> Scenario:
    """A 4 MB model and 512-sample steps: several steps in a few simulated minutes."""
    return Scenario(model_bytes=4e6, target_batch=512, warmup_minutes=1, **fields)


def test_a_small_collaboration_trains_with_every_average_exact():
    report = run_collaboration(small(peers=6, minutes=4, churn_per_hour=0, seed=1))
    summary = summarize(report)
    assert summary.steps >= 4
    assert summary.complete_share == 1.0 and summary.complete_rounds == 1.0
    assert report.digests_agree and not report.violations
    assert summary.view_coverage > 0.95
    # Each call's rounds, timed as they ran: 6 peers in groups of 4 take two rounds.
    for attempt in report.attempts:
        assert [t.index for t in attempt.rounds] == [0, 1], attempt
        ends = [attempt.started]
        for timing in attempt.rounds:
            assert ends[-1] <= timing.started <= timing.formed <= timing.ended <= attempt.ended
            ends.append(timing.ended)
            assert attempt.peer in timing.planned and len(timing.planned) >= 2
        assert all(t.averaged and not t.alone for t in attempt.rounds)
    # Every reply is counted by what it answered, and the busiest window is a whole one.
    by_node: Counter = Counter()
    for (node, _), size in report.traffic.served_as.items():
        by_node[node] += size
    assert by_node == report.traffic.served
    window = report.busiest_window
    assert window is not None and window.end - window.start >= 30
    assert window.busiest >= window.mean_server > 0
    assert window.what[0][0] in ("get progress", "get avg", "find_node")


def fingerprint(report) -> tuple:
    """What two runs of one seed must share: every averaging call (who, when to the
    nanosecond, over whom, which bits) and every byte on the network, per peer."""
    calls = tuple((a.peer, round(a.started, 9), a.members, a.average) for a in report.attempts)
    traffic = report.traffic
    return calls, sorted(traffic.bytes.items()), sorted(traffic.served.values()), report.downloads


def test_a_scenario_sets_the_averaging_parameter_it_explores():
    """`--partial-from` (issue 46: at 100 peers, plans of 16-59 failed below 64)."""
    assert peer_config(small(peers=5), 1.0).averaging.partial_from == 32  # the daemon's default
    assert peer_config(small(peers=5, partial_from=2), 1.0).averaging.partial_from == 2


def test_a_simulated_chunk_stands_for_a_real_chunks_bytes():
    """The short vector's chunk is scaled like the bandwidths: a group of four splits it in four
    parts (unscaled, one member reduced all of it) and a chunk's time on a scaled link is a
    real chunk's on the real link (the stall timeout)."""
    for model_bytes in (4e6, 70.8e6):
        factor = scale_factor(model_bytes)
        chunk = peer_config(small(peers=5), factor).averaging.chunk_elements
        parts = part_ranges(VECTOR, [1.0] * 4, unit=chunk)
        assert all(end > start for start, end in parts)
        real = AveragingConfig().chunk_elements * 4  # bytes of a real chunk
        assert abs(chunk * 4 * factor - real) <= 4 * factor / 2 + 1  # within rounding


def test_the_same_seed_gives_the_same_run_to_the_byte_and_another_seed_another():
    # With churn: departures, joins and downloads are the most order-sensitive part.
    runs = [
        run_collaboration(small(peers=5, minutes=1.5, churn_per_hour=12.0, seed=seed))
        for seed in (7, 7, 8)
    ]
    assert runs[0].departures >= 1 and runs[0].attempts
    first, again, other = (fingerprint(r) for r in runs)
    assert first == again
    assert first != other


def test_memos_widened_for_many_nodes_give_the_same_run_and_are_put_back(monkeypatch):
    """`simulation.memo`: a run whose caches hold room for many nodes is the run of the caches'
    own sizes, to the byte; every module that imported a memo by name sees the wider one
    while the run lasts, and the originals afterwards."""
    scenario = small(peers=5, minutes=1.5, churn_per_hour=12.0, seed=7)
    own = fingerprint(run_collaboration(scenario))
    before = shards.node_id, progress._decoded, records.VERIFIED_CACHE
    with memo.widened(64):
        assert shards.node_id is routing.node_id
        assert routing.node_id.cache_info().maxsize > before[0].cache_info().maxsize
        assert progress._decoded.cache_info().maxsize > before[1].cache_info().maxsize
        assert before[2] < records.VERIFIED_CACHE
    assert (shards.node_id, progress._decoded, records.VERIFIED_CACHE) == before
    monkeypatch.setattr(memo, "NODES_PER_CACHE", 1)  # the run below widens them 5 times
    assert fingerprint(run_collaboration(scenario)) == own


def test_the_virtual_clock_gives_the_run_trio_s_mock_clock_gives(monkeypatch):
    """`simulation.clock.VirtualClock` reads the time and jumps without the real clock: the
    same run, to the nanosecond and the byte, as trio's `MockClock` at rate 0."""
    scenario = small(peers=5, minutes=1.5, churn_per_hour=12.0, seed=7)
    fast = run_collaboration(scenario)
    monkeypatch.setattr(
        collaboration,
        "VirtualClock",
        lambda on_jump=None: trio.testing.MockClock(autojump_threshold=0),
    )
    assert fingerprint(run_collaboration(scenario)) == fingerprint(fast)


def test_a_run_that_prints_its_progress_is_the_run_that_does_not():
    """`run_collaboration(progress=...)`: a line every `PROGRESS_SECONDS` of virtual time, from
    the clock's jumps, which schedule nothing: the run is the same to the byte."""
    scenario = small(peers=5, minutes=1.5, churn_per_hour=12.0, seed=7)
    quiet = fingerprint(run_collaboration(scenario))
    out = io.StringIO()
    assert fingerprint(run_collaboration(scenario, progress=out)) == quiet
    lines = out.getvalue().splitlines()
    at = [float(line.split(": ")[1].split(" of ")[0]) for line in lines]
    # 150 virtual seconds: a line at (or just past) each 30 s, ending before the run's end.
    assert len(lines) == 5 and all(30 * (i + 1) <= t < 30 * (i + 2) for i, t in enumerate(at))
    assert lines[0].startswith("5 peers, 4 MB, seed 7: 30 of 150 virtual s in ")


def test_a_step_taken_as_another_state_by_anyone_at_any_time_is_a_violation():
    check = SafetyCheck()
    check.held(1, "a", "d1", at=1.0)
    check.held(1, "b", "d1", at=2.0)
    check.held(2, "a", "d2", at=3.0)
    assert not check.violations
    check.held(1, "c", "other", at=4.0)  # later, long after step 1
    check.held(2, "b", "d2", at=5.0)
    assert [(v.step, v.peer, v.first_peer) for v in check.violations] == [(1, "c", "a")]


@pytest.mark.slow  # 60 s on CI's 2 cores; joiners: tests/test_training_collab.py
def test_volunteers_that_join_late_download_the_state_and_train():
    # Churn of 2 per peer-hour over 5 minutes: a few leave and as many join and catch up.
    scenario = small(peers=6, minutes=5, churn_per_hour=2.0, seed=4)
    report = run_collaboration(scenario)
    assert report.departures >= 1 and report.arrivals == report.departures
    end = report.ended_at
    settled = [
        v for v in report.volunteers if v.late and v.left_at is None and v.joined_at < end - 60
    ]
    assert settled, "no volunteer joined early enough to be checked: change the seed"
    for volunteer in settled:
        assert volunteer.trainer.tally.downloads >= 1
        assert volunteer.step_at_end >= report.newest_step - 1
    assert report.digests_agree and not report.violations


@pytest.mark.slow
def test_thirty_simulated_volunteers_with_churn_stay_exact():
    """30 volunteers on DeDLOC's links, a tenth of them leaving each 10 minutes (and as many
    joining): every trainer at the newest step holds the same bits, and the progress reads see
    everyone. (The figures at 100 and 300 are docs/scale.md's.)"""
    scenario = small(peers=30, minutes=6, churn_per_hour=0.6, seed=5)
    report = run_collaboration(scenario)
    summary = summarize(report)
    assert report.departures >= 1 and report.digests_agree and not report.violations
    assert summary.steps >= 2
    assert summary.view_coverage > 0.95


THREE_HUNDRED = """
import json
from simulation.scale import Column, _run, scenario
summary, violations = _run(scenario(Column(300, 0.5, 4.0), minutes=8, warmup=0, seed=0))
print(json.dumps({"steps": summary.steps, "rounds": summary.rounds,
                  "agreed": summary.agreed_rounds, "coverage": summary.view_coverage,
                  "violations": summary.safety_violations, "left": summary.departures}))
"""


@pytest.mark.slow
def test_three_hundred_simulated_volunteers_with_half_leaving_an_hour_agree_on_their_steps():
    """Issue 46's 300-peer column: 50 %/hour churn, half the peers behind NAT (a third of
    those symmetric), DeDLOC's links, a 4 MB model. The scale report's own run (seed 0, 8
    virtual minutes, `simulation.scale`; about 35 minutes of wall time on 2 cores), in a
    process of its own with PYTHONHASHSEED=0 so that it is that run, figure for figure: at
    03f4fd8 2 steps, 1 of 2 rounds yielding its step (1 cut by the end); at 51def23 2 steps,
    2 of 3 (1 cut by the end); at 7c9cd54 and 509a4c4 1 step, 1 of 8 (2 cut by the end); at
    3790c05 (reverted) none; no step taken as two states. Before the first step counted in
    rounds (3e45494) no step was taken at this size: its votes split 48 ways and the count
    waited for ever. The issue's goal (>= 95 % of the rounds yield a step) is not met: this
    keeps what is from regressing."""
    done = subprocess.run(
        [sys.executable, "-c", THREE_HUNDRED],
        env={**os.environ, "PYTHONHASHSEED": "0"},
        capture_output=True,
        text=True,
        timeout=5400,  # killed past it (subprocess.run kills its child)
        check=True,
    )
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["left"] >= 1 and figures["violations"] == 0, figures
    assert figures["steps"] >= 1, figures
    assert figures["agreed"] > 0, figures
    assert figures["coverage"] > 0.95, figures


def test_a_volunteer_s_speed_jitters_slows_in_spells_and_pauses_as_the_scenario_says():
    def micro_batches(noise: ComputeNoise, hours: float) -> list[float]:
        variation, now, times = Variation(noise, np.random.default_rng(3)), 0.0, []
        while now < hours * 3600:
            times.append(variation.seconds(1.0, now))
            now += times[-1]
        return times

    assert set(micro_batches(QUIET, 0.1)) == {1.0}  # no noise: the mean
    noise = ComputeNoise()
    times = micro_batches(noise, 50)
    assert sum(times) / len(times) == pytest.approx(noise.mean_slowdown(), rel=0.02)
    assert max(times) > 10  # paused
    assert sum(3 < t < 10 for t in times) > 0.01 * len(times)  # slow spells (4x)
    assert times == micro_batches(noise, 50)  # the peer's seed decides


async def test_transfers_end_however_the_clock_rounds_late_in_a_run(autojump_clock):
    """Late in a run (a large virtual time) a sliver of bytes can need fewer seconds than the
    clock can add: the transfer must end when its timer fires, not be woken again and again
    (a 30-peer simulation froze at 142 s: 1e-7 of 80 bytes left on a 56 MB/s link)."""
    rng = random.Random(5)
    links = [SharedLink(rng.uniform(1e7, 1e8)) for _ in range(4)]
    await trio.sleep(142.26124398886725)

    ended = 0

    async def transfers(index: int) -> None:
        nonlocal ended
        for _ in range(50):
            await trio.sleep(rng.random() * 1e-3)
            await carry(rng.uniform(10, 200), links[index % 4], links[(index + 1) % 4])
            ended += 1

    async with trio.open_nursery() as nursery:  # a livelock raises (`links.MAX_WAKEUPS`)
        for index in range(8):
            nursery.start_soon(transfers, index)
    assert ended == 8 * 50


async def test_a_node_pays_for_the_signatures_it_checks_first_before_its_reply_leaves(
    autojump_clock,
):
    network = SimNetwork(random.Random(0))
    caller = network.node(FAST_LINK)
    writers = [create_new_key_pair(bytes([i]) * 32) for i in range(1, 101)]
    entries = {
        ID.from_pubkey(k.public_key).to_base58(): make_entry(
            "k", ID.from_pubkey(k.public_key).to_base58(), b"v", 1e9, signer=k.private_key
        )
        for k in writers
    }
    limits = Limits(max_value_bytes=1024, max_subkeys=1000, max_keys=10, max_ttl=1e9,
                    max_clock_skew=1)  # fmt: skip

    async def check_all(caller_id, request: Echo) -> Echo:  # a replica validating a store
        for subkey, entry in entries.items():
            records.validate_entry("k", subkey, entry, now=0.0, limits=limits)
        return request

    callee = serve_echo(network, FAST_LINK, check_all)
    with charged():
        first = await timed_call(caller, callee, "x")
        again = await timed_call(caller, callee, "x")  # remembered: checked once
    assert first - again == pytest.approx(100 * VERIFY_SECONDS)
    assert network.cpus[callee.peer_id].spent == pytest.approx(100 * VERIFY_SECONDS)
    assert network.cpus[caller.peer_id].spent == 0


def test_each_node_pays_for_the_step_signatures_of_a_progress_read_it_meets_first():
    """The checked records are remembered once for the whole process (`progress._checked`),
    so a node whose read hits that memo checked nothing itself: each simulated node still
    pays for every step signature it meets first, as a real reader would, and nothing for
    those it met before."""
    keys = [create_new_key_pair(bytes([i]) * 32) for i in range(1, 4)]
    peers = [ID.from_pubkey(k.public_key).to_base58() for k in keys]

    def record(i: int, *signers: int) -> progress.ProgressRecord:
        signatures = [sign_step(keys[j].private_key, peers[j], "c", 3, "d") for j in signers]
        return progress.ProgressRecord(
            peers[i], "trainer", [], 3, "d", 0, 0.0, 1.0, signatures=signatures
        )

    # 5 signatures, 3 distinct: Ed25519's are the same bytes for the same statement and key.
    read = sorted([record(0, 0, 1), record(1, 1, 0), record(2, 2)], key=lambda r: r.peer_id)
    entries = {r.peer_id: records.Entry(progress.encode_progress(r), 2e9) for r in read}
    assert progress.decode_progress(entries, collaboration="c") == read  # now remembered
    first, second = SimCpu(), SimCpu()
    with charged():
        for node in (first, first, second):
            token = cpu.CURRENT.set(node)
            assert progress.decode_progress(entries, collaboration="c") == read
            cpu.CURRENT.reset(token)
    assert first.spent == second.spent == pytest.approx(3 * VERIFY_SECONDS)


@pytest.mark.slow  # 47 s on CI's 2 cores
def test_backbones_that_fail_and_restart_leave_the_collaboration_training():
    scenario = small(
        peers=6, minutes=4, churn_per_hour=0, seed=2,
        backbone_failures_per_hour=40, backbone_downtime=(20, 40),
    )  # fmt: skip
    report = run_collaboration(scenario)
    assert report.backbone_failures >= 2 and report.backbone_restarts >= 2
    assert summarize(report).steps >= 3
    assert report.digests_agree and not report.violations


@pytest.mark.slow  # 26 s on CI's 2 cores
def test_progress_reads_go_on_after_a_replica_of_the_progress_key_leaves_silently(monkeypatch):
    """Seed 5's departure at 77.8 s takes a replica of the progress key with it, silently.
    With the exchange's deadline at the RPC timeout, the store's call to it and the exchange
    ran out at the same instant: the replica was never dropped, and no peer read the records
    again (every exchange cut at 5 s; calls made on records 5 s stale split every step)."""
    reads: list[float] = []
    read = ProgressPublisher.read

    async def counted(self) -> None:
        await read(self)
        reads.append(trio.current_time())

    monkeypatch.setattr(ProgressPublisher, "read", counted)
    report = run_collaboration(small(peers=8, minutes=2, churn_per_hour=3.0, seed=5))
    assert report.departures >= 1
    after = [t for t in reads if 80 <= t < 100]  # the first silent departure was at 77.8 s
    assert len(after) >= 8 * 5, len(after)  # each of the 7-8 peers reads several times


def test_progress_replies_spread_over_the_shards_holders():
    """40 simulated peers publishing and reading progress records (`simulation.progressload`):
    on one key its 8 replicas sent 5.4x the mean node's replies (at 100 peers 13x, 15 Mbit/s
    each); in shards on hashed keys the busiest sent 2.6x; held by the prefix of the peer ids
    whose records they hold, 1.1x (1.25x at b41d111); read from the first three of the prefix
    in each read's own order, 1.44x (session 43). Every read sees everyone."""
    load = run_load(40, seconds=20, warmup=15, seed=0)
    assert load.coverage >= 0.99
    assert load.busiest <= 1.5 * load.mean, (load.busiest, load.mean)


def test_by_placement_the_servers_mean_leaves_out_the_peers_behind_nat():
    """Half the peers behind NAT hold no shard: the mean DHT server serves twice the mean node
    (the goal's ratio has that floor against the mean node: session 30)."""
    placed = placed_load(300, seed=0, reachable=0.5)
    assert placed.mean_server == pytest.approx(2 * placed.mean)
    assert placed.busiest >= placed.mean_server


@pytest.mark.parametrize("peers", [100, 1000, 10_000])
def test_by_placement_no_node_serves_twice_the_mean_at_any_size(peers: int):
    """Where the shards, their records and their holders fall (`placed_load`, no DHT): the
    busiest node's share of the reads within 2x the mean node's up to 10,000 peers. With
    records placed by a hash of their own it was 3.0x at 300 peers; with 64 shards at most,
    7.6x at 10,000."""
    for seed in range(2):
        placed = placed_load(peers, seed=seed)
        mean, busiest = placed.mean, placed.busiest
        assert busiest <= 1.5 * mean, (peers, seed, busiest / mean)
