"""A fan-out on the simulated network (`SimRpc.call_each`): one wait for its requests and one
for its replies, with every message still charged on its own links and every call failing as
it would alone."""

from __future__ import annotations

import random

import msgspec
import pytest
import trio

from peer.errors import DeadlineExceeded, Unreachable
from peer.net.rpc import RpcServer
from simulation.collaboration import Collaboration, Scenario
from simulation.links import SharedLink, carry, carry_groups
from simulation.network import MBIT, Link, SimNetwork, SimNode

LINK = Link(upload=10 * MBIT, download=20 * MBIT, rtt=0.06)


class Echo(msgspec.Struct):
    text: str


def echo_peer(network: SimNetwork) -> SimNode:
    node = network.node(LINK)
    server = RpcServer(node.host, "echo", max_message_bytes=1 << 20)  # type: ignore[arg-type]

    async def echo(caller, request: Echo) -> Echo:
        return Echo(request.text * 2)

    server.add_unary("echo", Echo, echo)
    return node


async def test_a_fan_out_charges_each_message_on_its_links_and_fails_each_call_as_alone(
    autojump_clock,
):
    network = SimNetwork(random.Random(0))
    caller, live, silent, closed = (echo_peer(network) for _ in range(4))
    network.leave(silent.peer_id)
    network.gone[silent.peer_id] = True  # vanished: nothing answers until the deadline
    network.leave(closed.peer_id)
    network.gone[closed.peer_id] = False  # stopped: its connections refuse
    text = "x" * 50_000
    started = trio.current_time()
    outcomes = await caller.rpc.call_each(
        [(p.peer_id, Echo(text)) for p in (live, silent, closed)], "echo", "echo", Echo, timeout=5
    )
    assert outcomes[0] == Echo(text * 2)
    assert isinstance(outcomes[1], DeadlineExceeded)
    assert isinstance(outcomes[2], Unreachable)
    assert trio.current_time() - started == 5  # the silent callee's deadline, as alone
    request, reply = (
        len(msgspec.msgpack.encode(Echo(text))),
        len(msgspec.msgpack.encode(outcomes[0])),
    )
    assert network.uplinks[caller.peer_id].carried == 3 * request
    for callee in (live, silent, closed):
        assert network.downlinks[callee.peer_id].carried == request
    assert network.uplinks[live.peer_id].carried == reply
    assert network.downlinks[caller.peer_id].carried == reply
    assert network.traffic.calls["echo", "echo"] == 3
    assert network.traffic.failed["echo", "echo"] == 2


async def test_a_fan_out_of_one_call_takes_what_the_call_takes_alone(autojump_clock):
    network = SimNetwork(random.Random(0))
    caller, callee = echo_peer(network), echo_peer(network)
    text = "y" * 200_000  # long enough that its bytes, not the latency, take most of the time
    started = trio.current_time()
    await caller.rpc.call(callee.peer_id, "echo", "echo", Echo(text), Echo, timeout=30)
    alone = trio.current_time() - started
    started = trio.current_time()
    (reply,) = await caller.rpc.call_each(
        [(callee.peer_id, Echo(text))], "echo", "echo", Echo, timeout=30
    )
    assert reply == Echo(text * 2)
    assert trio.current_time() - started == pytest.approx(alone, rel=1e-12)


async def test_the_messages_of_a_fan_out_share_the_caller_s_uplink(autojump_clock):
    """Four requests of one fan-out leave at once on one uplink: each takes four times its
    bytes' time on it, as four calls of their own would."""
    network = SimNetwork(random.Random(0))
    caller, *callees = (echo_peer(network) for _ in range(5))
    text = "z" * 100_000
    size = len(msgspec.msgpack.encode(Echo(text)))
    reply = len(msgspec.msgpack.encode(Echo(text * 2)))
    started = trio.current_time()
    await caller.rpc.call_each(
        [(c.peer_id, Echo(text)) for c in callees], "echo", "echo", Echo, timeout=60
    )
    took = trio.current_time() - started
    one_way = network.latency(caller.peer_id, callees[0].peer_id)
    requests = 4 * size / LINK.upload  # the caller's uplink, shared by the four
    replies = 4 * reply / LINK.download  # the caller's downlink (each callee's uplink: faster)
    assert reply / LINK.upload < replies
    assert abs(took - (2 * one_way + requests + replies)) < 1e-9


async def test_a_fan_out_wakes_at_its_deadline_whatever_else_its_links_carry(autojump_clock):
    """(Found in review.) A transfer cut short on a link re-arms every waiter on it: a
    fan-out's deadline was dropped then, and its calls ended late, as successes."""
    link = SharedLink(1000.0)
    started = trio.current_time()

    async def cut_short() -> None:
        with trio.move_on_after(0.1):
            await carry(1000.0, link)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cut_short)
        landed = await carry_groups([(0.0, [(link, 1000.0)])], deadline=started + 0.5)
    assert landed == [False]
    assert trio.current_time() - started == pytest.approx(0.5)


async def test_every_dht_read_of_a_simulated_peer_is_timed_once(autojump_clock):
    """(Found regenerating the figures.) Progress reads go through `DHT.get_many`, which was
    not timed: the report's DHT get row showed ticket reads alone (~5 s each at 100 peers). A
    read of many keys counts as one get; a plain get, once."""
    collaboration = Collaboration(Scenario(peers=2))
    dht = collaboration._dht(collaboration.network.node(LINK))
    await dht.get("a")
    await dht.get_many(["b", "c"], hot=True)
    await dht.store("d", "e", b"f", expiration=collaboration.clock() + 60)
    assert len(collaboration.dht_seconds["get"]) == 2
    assert len(collaboration.dht_seconds["store"]) == 1
