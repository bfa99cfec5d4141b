"""Peers behind NAT in the simulator (`simulation.nat`): the paths the real code's connections
take (direct, hole-punched, relayed, none), what relays carry and what they cost, the data
planes' rule that relays carry no tensors, and a collaboration whose NATed peers advertise
what the real daemon would."""

from __future__ import annotations

import random

import msgspec
import numpy as np
import pytest
import trio

from peer.averaging.allreduce import Member, RoundSpec
from peer.errors import DeadlineExceeded, RemoteError
from peer.net.relay import RelayLimits
from peer.net.rpc import RpcServer
from peer.net.streamio import DIRECT_TIMEOUT, PUNCH_SECONDS
from simulation.collaboration import Scenario, run_collaboration
from simulation.dataplane import SimDataPlane, SimDataServer, SimIdentity
from simulation.nat import CIRCUIT_ROUND_TRIPS, Nat, NatDraw, Path, path_between
from simulation.network import MBIT, Link, SimNetwork, SimNode
from simulation.report import summarize

PEER_LINK = Link(upload=100 * MBIT, download=100 * MBIT, rtt=0.04)
BACKBONE_LINK = Link(upload=1000 * MBIT, download=1000 * MBIT, rtt=0.02)
PUBLIC, CONE, SYMMETRIC = Nat.PUBLIC, Nat.CONE, Nat.SYMMETRIC


class Echo(msgspec.Struct):
    text: str


def with_relay() -> tuple[SimNetwork, SimNode]:
    """A network with one backbone relaying for the NATed peers added after it."""
    network = SimNetwork(random.Random(0))
    relay = network.node(BACKBONE_LINK)
    network.nat.set_relays([relay.peer_id])
    return network, relay


def echo_peer(network: SimNetwork, nat: Nat) -> SimNode:
    node = network.node(PEER_LINK, nat=nat)
    server = RpcServer(node.host, "echo", max_message_bytes=1 << 20)  # type: ignore[arg-type]

    async def echo(caller, request: Echo) -> Echo:
        return Echo(request.text * 2)

    server.add_unary("echo", Echo, echo)
    return node


async def call(caller: SimNode, callee: SimNode, text: str, *, timeout: float = 30) -> float:
    """Seconds an echo call takes."""
    started = trio.current_time()
    reply = await caller.rpc.call(callee.peer_id, "echo", "echo", Echo(text), Echo, timeout=timeout)
    assert reply.text == text * 2
    return trio.current_time() - started


def test_a_connection_takes_the_path_the_real_code_s_dial_and_punch_take():
    # To a reachable listener: direct, whatever the dialer's NAT (its own dial goes out).
    for dialer in Nat:
        assert path_between(dialer, PUBLIC, relay=False) is Path.DIRECT
    # To a NATed one: a relay, then a punch that works when the dialer is reachable (the
    # listener's dial goes straight in: a reversal) or both NATs are endpoint-independent.
    assert path_between(PUBLIC, SYMMETRIC, relay=True) is Path.PUNCHED
    assert path_between(PUBLIC, CONE, relay=True) is Path.PUNCHED
    assert path_between(CONE, CONE, relay=True) is Path.PUNCHED
    assert path_between(CONE, SYMMETRIC, relay=True) is Path.RELAYED
    assert path_between(SYMMETRIC, CONE, relay=True) is Path.RELAYED
    assert path_between(SYMMETRIC, SYMMETRIC, relay=True) is Path.RELAYED
    # No relay holds a slot for it: no way in.
    assert path_between(PUBLIC, CONE, relay=False) is Path.FAILED


def test_the_peers_behind_nat_come_in_the_scenario_s_shares():
    draw = NatDraw(0.5, 1 / 3, seed=0)
    kinds = [draw.next() for _ in range(30)]
    assert abs(sum(k is not PUBLIC for k in kinds) - 15) <= 1
    assert abs(sum(k is SYMMETRIC for k in kinds) - 5) <= 1
    assert {NatDraw(0.0, 1.0, seed=3).next() for _ in range(10)} == {PUBLIC}
    with pytest.raises(ValueError, match=r"nat_share=1\.5"):
        NatDraw(1.5, 0.0, seed=0)


async def test_a_call_between_symmetric_peers_goes_through_the_relay_and_its_links(
    autojump_clock,
):
    network, relay = with_relay()
    caller, callee = echo_peer(network, SYMMETRIC), echo_peer(network, SYMMETRIC)
    text = "x" * 125_000
    elapsed = await call(caller, callee, text)
    request = len(msgspec.msgpack.encode(Echo(text)))
    reply = len(msgspec.msgpack.encode(Echo(text * 2)))
    # The circuit's setup, then each message to the relay and on (the relay's links are
    # faster: the peers' 100 Mbit/s set the pace).
    relayed_rtt = 2 * network.round_trip(caller.peer_id, relay.peer_id)
    one_way = relayed_rtt / 2
    expected = CIRCUIT_ROUND_TRIPS * relayed_rtt + 2 * one_way + (request + reply) / (100 * MBIT)
    assert elapsed == pytest.approx(expected, rel=0.01)
    assert network.uplinks[relay.peer_id].carried == request + reply
    assert network.downlinks[relay.peer_id].carried == request + reply
    assert network.nat.tally.relayed_bytes == request + reply
    assert network.nat.tally.connections == {Path.RELAYED: 1}
    # The next call reuses the circuit: no setup.
    again = await call(caller, callee, text)
    assert again == pytest.approx(expected - CIRCUIT_ROUND_TRIPS * relayed_rtt, rel=0.01)


async def test_a_punched_connection_is_relayed_until_the_punch_then_direct(autojump_clock):
    network, relay = with_relay()
    caller, callee = echo_peer(network, PUBLIC), echo_peer(network, CONE)
    await call(caller, callee, "hello")
    relayed = network.uplinks[relay.peer_id].carried
    assert relayed > 0 and network.nat.tally.connections == {Path.PUNCHED: 1}
    await trio.sleep(10)  # the punch is long done
    elapsed = await call(caller, callee, "hello")
    assert network.uplinks[relay.peer_id].carried == relayed  # nothing more through the relay
    assert elapsed == pytest.approx(network.round_trip(caller.peer_id, callee.peer_id), rel=0.01)


async def test_a_nated_peer_that_dialed_out_is_called_back_on_that_connection(autojump_clock):
    network, relay = with_relay()
    nated, public = echo_peer(network, SYMMETRIC), echo_peer(network, PUBLIC)
    await call(nated, public, "hello")
    await call(public, nated, "hello")
    assert network.nat.tally.connections == {Path.DIRECT: 1}
    assert network.uplinks[relay.peer_id].carried == 0


async def test_a_dial_to_a_nated_peer_no_relay_holds_a_slot_for_fails_at_the_deadline(
    autojump_clock,
):
    network, relay = with_relay()
    caller, callee = echo_peer(network, PUBLIC), echo_peer(network, CONE)
    network.leave(relay.peer_id)  # its reservations end with it
    started = trio.current_time()
    with pytest.raises(DeadlineExceeded):
        await call(caller, callee, "hello", timeout=5)
    assert trio.current_time() - started == pytest.approx(5)  # the router dropped the SYN
    assert network.nat.tally.connections == {Path.FAILED: 1}
    network.rejoin(relay.peer_id)  # back: the NATed peers reserve again
    await call(caller, callee, "hello")
    assert network.nat.tally.connections == {Path.FAILED: 1, Path.PUNCHED: 1}
    network.leave(callee.peer_id)  # its slot ends with it: a departure, not a NAT's doing
    with pytest.raises(DeadlineExceeded):
        await call(caller, callee, "hello", timeout=5)
    assert network.nat.tally.connections == {Path.FAILED: 1, Path.PUNCHED: 1}


async def test_a_circuit_that_spent_its_bytes_is_replaced_by_a_new_one(autojump_clock):
    network, _ = with_relay()
    network.nat.limits = RelayLimits(circuit_bytes=1000)
    caller, callee = echo_peer(network, SYMMETRIC), echo_peer(network, SYMMETRIC)
    await call(caller, callee, "x" * 200)  # ~600 bytes both ways
    assert network.nat.tally.connections == {Path.RELAYED: 1}
    await call(caller, callee, "x" * 200)
    await call(caller, callee, "x" * 200)  # over the budget: a new circuit
    assert network.nat.tally.connections == {Path.RELAYED: 2}


async def test_a_relayed_connection_whose_punch_failed_gives_its_circuit_back(autojump_clock):
    """As the real code (`HolePunchConfig.failed_relay_seconds`): a relayed connection whose
    punch failed closes that long after, and its circuit is free for another."""
    network, _ = with_relay()
    network.nat.limits = RelayLimits(max_circuits=1)
    caller, callee, third = (echo_peer(network, SYMMETRIC) for _ in range(3))
    await call(caller, callee, "x")
    assert network.nat.tally.connections == {Path.RELAYED: 1}
    with pytest.raises((DeadlineExceeded, RemoteError, OSError)):
        await call(third, callee, "x", timeout=5)  # the relay's one circuit is taken
    await trio.sleep(network.nat.punch.dial_seconds + network.nat.punch.failed_relay_seconds)
    await call(third, callee, "x")  # given back: a circuit for the third peer
    assert network.nat.tally.connections[Path.RELAYED] == 2


def nat_round(
    plane: SimDataPlane, network: SimNetwork, nats: list[Nat], shares: list[float]
) -> tuple[dict[str, Nat], RoundSpec]:
    """A round of computing members behind `nats` (returned by peer id), with data addresses
    as `build_spec` gives them (none for a punchable peer that is not reachable)."""
    nodes = [network.node(PEER_LINK, nat=nat) for nat in nats]
    for node in nodes:
        plane.register(node.peer_id)
    members = sorted(
        (
            Member(
                peer_id=node.peer_id.to_base58(),
                host=node.data_host,
                port=0 if nat is CONE else 4002,
                computes=True,
                share=share,
                weight=1.0,
                cert=b"",
            )
            for node, nat, share in zip(nodes, nats, shares, strict=True)
        ),
        key=lambda m: m.peer_id,
    )
    spec = RoundSpec(round_id=b"r", members=tuple(members), size=24, codec="none", chunk_elements=8)
    return {n.peer_id.to_base58(): nat for n, nat in zip(nodes, nats, strict=True)}, spec


async def run_round(plane: SimDataPlane, spec: RoundSpec, *, stall_timeout: float) -> dict:
    reports = {}

    async def take_part(member: Member) -> None:
        server = SimDataServer(SimIdentity(member.peer_id, b""))
        vector = np.ones(24, dtype=np.float32)
        reports[member.peer_id] = await plane.allreduce(
            spec, vector, server, deadline=trio.current_time() + 300, stall_timeout=stall_timeout
        )

    async with trio.open_nursery() as nursery:
        for member in spec.members:
            nursery.start_soon(take_part, member)
    return reports


async def test_senders_reach_a_punchable_reducer_after_the_punch(autojump_clock):
    network, _ = with_relay()
    plane = SimDataPlane(network, model_bytes=1e6)
    _, spec = nat_round(plane, network, [PUBLIC, PUBLIC, CONE], [0.5, 0.0, 0.5])
    reports = await run_round(plane, spec, stall_timeout=30)
    assert all(report.complete for report in reports.values())
    # Both reachable senders punched through to the NATed reducer before their bytes went.
    assert network.nat.tally.reducer_paths == {Path.PUNCHED: 2}
    transfer = plane.moved(spec, spec.members[0].peer_id) / (100 * MBIT)
    assert trio.current_time() > transfer + PEER_LINK.rtt + 3 * PEER_LINK.rtt
    assert network.uplinks[network.nat.relays[0]].carried == 0  # no tensor through the relay


async def test_a_round_whose_reducers_only_a_relay_reaches_fails_at_the_stall_timeout(
    autojump_clock,
):
    # Nobody can reduce by the real rule (a symmetric member among NATed ones), so everyone
    # got a share (`reducers`' fallback): the symmetric member reaches no one and no one it.
    network, _ = with_relay()
    plane = SimDataPlane(network, model_bytes=1e6)
    by_nat, spec = nat_round(plane, network, [SYMMETRIC, CONE, CONE], [1 / 3] * 3)
    symmetric = next(p for p, nat in by_nat.items() if nat is SYMMETRIC)
    cones = {p for p, nat in by_nat.items() if nat is CONE}
    reports = await run_round(plane, spec, stall_timeout=30)
    assert trio.current_time() == pytest.approx(30)
    assert not any(report.complete for report in reports.values())
    assert set(reports[symmetric].failed_reducers) == cones
    for cone in cones:
        assert set(reports[cone].failed_reducers) == {symmetric}
    assert network.nat.tally.reducer_paths[Path.RELAYED] == 4
    assert network.nat.tally.rounds_cut == 1


async def test_a_joiner_downloads_only_from_donors_it_gets_a_direct_connection_to(
    autojump_clock,
):
    network, _ = with_relay()
    plane = SimDataPlane(network, model_bytes=1e6)
    joiner, donor = network.node(PEER_LINK, nat=SYMMETRIC), network.node(PEER_LINK, nat=CONE)
    started = trio.current_time()
    with pytest.raises(RemoteError, match="relays carry no tensors"):
        await plane.download(joiner.peer_id, [donor.peer_id], 1e6)
    # Its data address first, then the circuit, then the wait for a punch that never comes.
    waited = trio.current_time() - started
    assert DIRECT_TIMEOUT + PUNCH_SECONDS < waited < DIRECT_TIMEOUT + PUNCH_SECONDS + 1
    # A reachable joiner gets the symmetric donor's own dial (a reversal): it downloads.
    public, symmetric = network.node(PEER_LINK), network.node(PEER_LINK, nat=SYMMETRIC)
    await plane.download(public.peer_id, [symmetric.peer_id], 1e6)
    assert network.nat.tally.donor_paths == {Path.RELAYED: 1, Path.PUNCHED: 1}


async def test_a_download_takes_the_first_donors_it_reaches_in_its_order_as_the_real_one(
    autojump_clock,
):
    """`StateDownload` asks the first few donors and the next as one fails, from up to
    `parallel` at once; the simulated one charged every holder: a circuit to each behind
    NAT, at 100 simulated peers 2,294 donor connections for 122 downloads."""
    network, _ = with_relay()
    plane = SimDataPlane(network, model_bytes=1e6)
    joiner = network.node(PEER_LINK, nat=SYMMETRIC)
    nated = [network.node(PEER_LINK, nat=SYMMETRIC) for _ in range(2)]
    public = [network.node(PEER_LINK) for _ in range(6)]
    order = [n.peer_id for n in [nated[0], *public[:4], nated[1], *public[4:]]]
    await plane.download(joiner.peer_id, order, 1e6, parallel=3)
    # The first behind NAT failed; the next three reachable served; nobody after was dialed.
    assert network.nat.tally.donor_paths == {Path.RELAYED: 1}
    assert network.nat.tally.connections == {Path.RELAYED: 1}
    sent = [network.uplinks[n.peer_id].carried for n in public]
    assert all(b > 0 for b in sent[:3]) and not any(sent[3:])


def may_reduce(group: tuple[tuple[Nat, bool], ...]) -> list[bool]:
    """The real planner's rule, spelled out (`peer.roles.aggregators`, `reducers`): a reachable
    peer; a punchable one when nobody in the group is behind a symmetric NAT; everyone when
    nobody may."""
    symmetric = any(nat is SYMMETRIC for nat, _ in group)
    able = [nat is PUBLIC or (nat is CONE and not symmetric) for nat, _ in group]
    return able if any(able) else [True] * len(group)


def test_a_collaboration_with_peers_behind_nat_trains_and_plans_only_reachable_reducers():
    scenario = Scenario(
        peers=6, minutes=1, warmup_minutes=1, model_bytes=4e6, target_batch=512,
        churn_per_hour=0, seed=2, nat_share=0.5, symmetric_share=1 / 3,
    )  # fmt: skip
    report = run_collaboration(scenario)
    summary = summarize(report)
    assert (summary.behind_nat, summary.symmetric) == (4, 1)
    assert summary.steps >= 2 and report.digests_agree and not report.violations
    # A symmetric peer joined a punchable leader through a relay.
    assert report.nat.connections[Path.RELAYED] >= 1 and report.nat.relayed_bytes > 0
    assert report.nat.planned
    for group in report.nat.planned:
        reduces = [r for _, r in group]
        assert all(a or not r for a, r in zip(may_reduce(group), reduces, strict=True)), group
    assert any(nat is SYMMETRIC for group in report.nat.planned for nat, _ in group)
