"""Dial-back checks: the gate's bookkeeping by hand (synchronous), its shell with a stand-in
dialer on virtual time, then real libp2p on loopback."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import pytest
import trio
import trio.testing
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.measure.reachability import (
    BUSY,
    DIAL_TIMEOUT,
    MAX_ADDRS,
    MAX_CONCURRENT,
    MAX_CONTROL_BYTES,
    PROTOCOL,
    Admitted,
    DialBack,
    DialBackGate,
    DialBackLimits,
    DialBackServer,
    Refused,
    check_reachable,
    observed_addr,
    observed_from_listen_port,
    open_dialer,
    punch_address,
    same_ip,
)
from peer.net.holepunch import listen_source
from peer.net.host import open_node
from peer.net.rpc import FramedStream
from tests.helpers import needs_ipv6, new_identity, nodes

SILENT_ADDRS = [f"/ip4/127.0.0.1/tcp/{4000 + n}" for n in range(MAX_ADDRS)]


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_only_the_callers_own_ip_is_dialed():
    assert same_ip(Multiaddr("/ip4/127.0.0.1/tcp/5"), "127.0.0.1")
    assert not same_ip(Multiaddr("/ip4/10.0.0.1/tcp/5"), "127.0.0.1")
    assert not same_ip(Multiaddr("/ip6/::1/tcp/5"), "127.0.0.1")


# -- the gate, by hand --------------------------------------------------------------------------


def gate(**limits: Any) -> DialBackGate:
    return DialBackGate(DialBackLimits(**limits))


def test_the_gate_counts_checks_per_network_prefix_not_per_identity():
    g = gate(max_checks=8, max_per_prefix=1)
    assert isinstance(g.admit("a", "127.0.0.1", now=0), Admitted)
    # Seven more identities on the same /24, from other addresses too: one network, one slot.
    for n in range(2, 9):
        refused = g.admit(f"sybil{n}", f"127.0.0.{n}", now=n)
        assert refused == Refused("a check from your network (127.0.0.0/24) is running")
    assert isinstance(g.admit("b", "127.0.5.1", now=9), Admitted)  # another /24
    # IPv6 counts by /64; an IPv4-mapped address as the IPv4 one it carries.
    assert isinstance(g.admit("c", "2001:db8::1", now=10), Admitted)
    assert isinstance(g.admit("d", "2001:db8::ffff:2", now=11), Refused)
    assert isinstance(g.admit("e", "2001:db8:0:1::1", now=12), Admitted)
    assert isinstance(g.admit("f", "::ffff:127.0.5.9", now=13), Refused)
    assert g.statistics().running == 4 and g.statistics().refused == 9


def test_one_check_per_caller_from_wherever_it_comes():
    g = gate(max_checks=8, max_per_prefix=2)
    admitted = g.admit("a", "10.0.0.1", now=0)
    assert isinstance(admitted, Admitted)
    assert g.admit("a", "10.0.9.1", now=1) == Refused("a check for you is running")
    g.release(admitted.check)
    g.release(admitted.check)  # idempotent
    assert isinstance(g.admit("a", "10.0.9.1", now=2), Admitted)
    assert g.statistics().running == 1


def test_a_full_gate_lets_a_less_busy_network_displace_the_busiest_networks_oldest_check():
    g = gate(max_checks=4, max_per_prefix=3)
    a = [g.admit(f"a{t}", "10.0.0.1", now=t) for t in (0, 1, 2)]
    assert all(isinstance(x, Admitted) for x in a)
    g.admit("b0", "10.0.1.1", now=3)
    newcomer = g.admit("c0", "10.0.2.1", now=4)
    assert isinstance(newcomer, Admitted) and isinstance(a[0], Admitted)
    assert newcomer.displaced is a[0].check
    # 10.0.0.0/24 (2 running) is still the busiest: another from it is refused ...
    assert g.admit("a9", "10.0.0.7", now=5) == Refused("too many checks at once")
    # ... and one from 10.0.1.0/24 (1 running) takes 10.0.0.0/24's oldest.
    taken = g.admit("b1", "10.0.1.2", now=6)
    assert isinstance(taken, Admitted) and isinstance(a[1], Admitted)
    assert taken.displaced is a[1].check
    assert g.statistics().running == 4 and g.statistics().displaced == 2
    # When every network holds one, a new network takes the oldest check.
    g = gate(max_checks=3, max_per_prefix=1)
    first, *_ = [g.admit(f"p{n}", f"10.0.{n}.1", now=n) for n in (1, 2, 3)]
    taken = g.admit("new", "10.0.9.1", now=9)
    assert isinstance(first, Admitted) and isinstance(taken, Admitted)
    assert taken.displaced is first.check
    assert g.admit("again", "10.0.2.9", now=10) == Refused(
        "a check from your network (10.0.2.0/24) is running"
    )


def test_a_displaced_check_frees_its_slot_at_once_and_its_caller_when_its_task_ends():
    g = gate(max_checks=1, max_per_prefix=1)
    old = g.admit("a", "10.0.0.1", now=0)
    new = g.admit("b", "10.0.1.1", now=1)
    assert isinstance(old, Admitted) and isinstance(new, Admitted)
    assert new.displaced is old.check and g.statistics().running == 1
    # Its task still hangs up its dials: the caller waits for that before asking again.
    assert g.admit("a", "10.0.2.1", now=2) == Refused("a check for you is running")
    g.release(old.check)  # its task ended: the newcomer's slot is untouched
    assert g.statistics().running == 1
    assert g.admit("a", "10.0.1.9", now=3) == Refused(
        "a check from your network (10.0.1.0/24) is running"
    )


def test_the_limits_refuse_nonsense():
    with pytest.raises(ValueError, match="max_per_prefix"):
        DialBackLimits(max_checks=2, max_per_prefix=3)
    with pytest.raises(ValueError, match="max_per_prefix"):
        DialBackLimits(max_per_prefix=0)
    with pytest.raises(ValueError, match="check_seconds"):
        DialBackLimits(check_seconds=0)


# -- the shell, with a stand-in dialer ------------------------------------------------------------


class StandInDialer:
    """A dialer host (network and peerstore in one) whose dials wait like addresses that
    accept TCP and never speak, except to `answering` ones, which answer at once."""

    def __init__(self, answering: tuple[str, ...] = ()) -> None:
        self.answering = set(answering)

    def get_network(self) -> StandInDialer:
        return self

    def get_peerstore(self) -> StandInDialer:
        return self

    async def dial_addr(self, addr: Multiaddr, peer_id: object) -> None:
        if str(addr) not in self.answering:
            await trio.sleep_forever()

    async def close_peer(self, peer_id: object) -> None:
        pass

    def clear_addrs(self, peer_id: object) -> None:
        pass


def peer_id(n: int) -> ID:
    return ID(bytes([n]) * 8)


class NoHost:
    def set_stream_handler(self, protocol: str, handler: object) -> None:
        pass


async def test_a_check_of_silent_addresses_holds_its_slot_for_one_deadline(autojump_clock):
    """Its addresses are dialed at once under one deadline (the default `check_seconds`,
    DIAL_TIMEOUT), not one after another (eight addresses held a slot for 40 s)."""
    server = DialBackServer(NoHost(), StandInDialer())  # type: ignore[arg-type]
    start = trio.current_time()
    result = await server.check(peer_id(1), SILENT_ADDRS, observed_ip="127.0.0.1")
    assert trio.current_time() - start == pytest.approx(DIAL_TIMEOUT)
    assert result.reachable == [] and set(result.unreachable) == set(SILENT_ADDRS)
    assert all(why.startswith("no answer within") for why in result.unreachable.values())


async def test_a_displaced_check_is_answered_busy_and_the_newcomer_is_checked():
    """Every slot held by silent checks from as many networks: a caller from one more network
    is checked (and found reachable) in the place of the oldest, which is answered busy."""
    honest = "/ip4/10.9.9.9/tcp/4001"
    server = DialBackServer(NoHost(), StandInDialer((honest,)))  # type: ignore[arg-type]
    answers: dict[int, Any] = {}

    async def hostile(n: int) -> None:
        addr = f"/ip4/10.0.{n}.1/tcp/4001"
        answers[n] = await server.check(peer_id(n), [addr], observed_ip=f"10.0.{n}.1")

    async with trio.open_nursery() as nursery:
        for n in range(MAX_CONCURRENT):
            nursery.start_soon(hostile, n)
            await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(1):
            result = await server.check(peer_id(99), [honest], observed_ip="10.9.9.9")
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    assert result.reachable == [honest], result
    assert list(answers) == [0]  # the oldest, and only it
    assert answers[0].unreachable["/ip4/10.0.0.1/tcp/4001"].startswith(BUSY)


async def test_a_listening_peer_is_reachable_and_one_announcing_a_dead_address_is_not():
    async with nodes(2) as (backbone, peer), open_dialer(new_identity()) as dialer:
        DialBackServer(backbone.host, dialer)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        result = await check_reachable(peer, backbone.peer_id)
        assert result.reachable == [str(a) for a in peer.announce] and not result.unreachable

        dead = f"/ip4/127.0.0.1/tcp/{unused_port()}"
        elsewhere = "/ip4/198.51.100.7/tcp/4001"  # not where its connection comes from
        async with open_node(
            new_identity(), listen=[], announce=[dead, elsewhere], max_message_bytes=1 << 20
        ) as hidden:
            await hidden.connect(backbone.peer_id, backbone.announce, timeout=5)
            result = await check_reachable(hidden, backbone.peer_id)
        assert result.reachable == []
        assert "dial failed" in result.unreachable[dead]
        assert "not the address your connection comes from" in result.unreachable[elsewhere]
        # The first peer's answer did not change: checks do not leak into each other.
        assert (await check_reachable(peer, backbone.peer_id)).reachable


async def test_someone_answering_with_another_key_does_not_count():
    """The dial-back must reach the caller itself, not whoever listens at the address."""
    async with nodes(3) as (backbone, liar, bystander), open_dialer(new_identity()) as dialer:
        server = DialBackServer(backbone.host, dialer)
        result = await server.check(
            liar.peer_id, [str(bystander.announce[0])], observed_ip="127.0.0.1"
        )
        assert result.reachable == [] and "dial failed" in next(iter(result.unreachable.values()))


async def test_checks_beyond_the_limit_are_answered_busy_at_once():
    async with nodes(2) as (backbone, peer), open_dialer(new_identity()) as dialer:
        server = DialBackServer(backbone.host, dialer)
        # Every slot taken, one of them from the peer's own /24: nothing for it to displace.
        for n in range(MAX_CONCURRENT):
            server.gate.admit(n, "127.0.0.9" if n == 0 else f"10.0.{n}.1", now=0)
        addr = str(peer.announce[0])
        with trio.fail_after(1):
            result = await server.check(peer.peer_id, [addr], observed_ip="127.0.0.1")
        assert result.reachable == [] and result.unreachable[addr].startswith(BUSY)


async def test_throwaway_identities_on_one_network_do_not_keep_a_caller_from_another_out():
    """Eight throw-away identities on 127.0.0.0/24 keep asking for checks of eight addresses
    that accept TCP and never speak (each such check held a slot for 40 s, and they held all
    eight); a caller whose connection comes from 127.0.5.1 still gets its verdict."""
    accepted = [0] * MAX_ADDRS  # connections each silent listener took

    async def silent(n: int, stream: trio.SocketStream) -> None:
        accepted[n] += 1
        await trio.sleep_forever()

    async with AsyncExitStack() as stack:
        nursery = await stack.enter_async_context(trio.open_nursery())
        silent_addrs = []
        for n in range(MAX_ADDRS):
            listeners = await nursery.start(
                trio.serve_tcp, lambda stream, n=n: silent(n, stream), 0
            )
            port = listeners[0].socket.getsockname()[1]
            silent_addrs.append(f"/ip4/127.0.0.1/tcp/{port}")
        (backbone,) = await stack.enter_async_context(nodes(1))
        dialer = await stack.enter_async_context(open_dialer(new_identity()))
        DialBackServer(backbone.host, dialer)
        options: dict[str, Any] = dict(announce=silent_addrs, max_message_bytes=1 << 20)
        hostile = [
            await stack.enter_async_context(open_node(new_identity(), listen=[], **options))
            for _ in range(8)
        ]
        honest = await stack.enter_async_context(
            open_node(
                new_identity(),
                listen=["/ip4/127.0.5.1/tcp/0"],
                announce=[],
                max_message_bytes=1 << 20,
            )
        )
        for node in hostile:
            await node.connect(backbone.peer_id, backbone.announce, timeout=5)
        # The honest caller's connection comes from another /24 of loopback.
        with trio.fail_after(5):
            await honest.host.get_network().dial_addr(
                backbone.announce[0], backbone.peer_id, ("127.0.5.1", 0)
            )
        answered = 0

        async def keep_asking(node: Any) -> None:
            nonlocal answered
            while True:  # at once again, as an attacker would: no backing off
                stream = await node.host.new_stream(backbone.peer_id, [PROTOCOL])
                framed = FramedStream(stream, MAX_CONTROL_BYTES)
                await framed.write_frame(msgspec.msgpack.encode(DialBack(silent_addrs)))
                await framed.read_frame()
                await framed.reset()
                answered += 1
                await trio.sleep(0.1)

        for node in hostile:
            nursery.start_soon(keep_asking, node)
        # Every hostile request is running (dialing the first silent listener) or answered.
        with trio.fail_after(20):
            while accepted[0] + answered < len(hostile):
                await trio.sleep(0.05)
        with trio.fail_after(20):
            result = await check_reachable(honest, backbone.peer_id)
        nursery.cancel_scope.cancel()
    assert result.reachable == [str(a) for a in honest.announce], result
    assert result.observed.startswith("/ip4/127.0.5.1/tcp/")


async def test_a_peer_answered_busy_asks_again():
    """Another peer of its /24 holds the network's slot: `check_reachable` asks again (after
    a second or so) and gets its verdict once that check ended."""
    async with nodes(2) as (backbone, peer), open_dialer(new_identity()) as dialer:
        server = DialBackServer(backbone.host, dialer, limits=DialBackLimits(max_per_prefix=1))
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        neighbour = server.gate.admit("a peer of the same /24", "127.0.0.9", now=0)
        assert isinstance(neighbour, Admitted)
        results = []

        async def ask() -> None:
            results.append(await check_reachable(peer, backbone.peer_id))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(ask)
            with trio.fail_after(10):
                while server.gate.statistics().refused == 0:
                    await trio.sleep(0.05)
            server.gate.release(neighbour.check)
    assert results[0].reachable == [str(a) for a in peer.announce], results


def test_the_punch_address_is_where_every_backbone_saw_the_listen_port_mapped_alike():
    router, lan = "/ip4/198.51.100.7/tcp/4001", "/ip4/10.0.0.2/tcp/4001"
    moved = "/ip4/198.51.100.7/tcp/61234"  # a new port for this destination: symmetric
    assert punch_address([(router, 4001)], [router, lan]) == router  # announced
    assert punch_address([(router, 4001)], [lan]) == router  # not announced: the port kept
    assert punch_address([(moved, 4001)], [lan]) is None  # one backbone, another port
    assert punch_address([(moved, 4001), (moved, 4001)], [lan]) == moved  # two saw it alike
    assert punch_address([(router, 4001), (moved, 4001)], [router]) is None  # they differ
    assert punch_address([(router, 4001), ("", 4001)], [router]) is None  # one did not say
    assert punch_address([], [router]) is None  # nobody looked
    assert punch_address([("/dns4/x.example/tcp/4001", 4001)], []) is None
    assert observed_addr(("198.51.100.7", 4001)) == router
    assert observed_addr(("2001:db8::1", 4001)) == "/ip6/2001:db8::1/tcp/4001"
    assert observed_addr(None) == "" and observed_addr(("not an ip", 1)) == ""
    assert observed_addr(("::ffff:198.51.100.7", 4001)) == router  # a dual-stack listener's


async def test_a_backbone_tells_where_a_dial_from_our_listen_port_comes_from():
    """The mapping check dials the backbone from our listen port on a connection of its own
    (beside the one we hold), asks on it, and closes it: on loopback the backbone sees our
    listen address itself. A backbone that does not serve the protocol leaves it None."""
    async with nodes(3) as (backbone, peer, plain), open_dialer(new_identity()) as dialer:
        DialBackServer(backbone.host, dialer)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        network = peer.host.get_network()
        held = list(network.connections[backbone.peer_id])
        listening = listen_source(peer)
        assert listening is not None and listening[1] > 0
        with trio.fail_after(20):
            seen = await observed_from_listen_port(peer, backbone.peer_id)
        assert seen == (f"/ip4/127.0.0.1/tcp/{listening[1]}", listening[1])
        assert network.connections[backbone.peer_id] == held  # its own connection closed

        await peer.connect(plain.peer_id, plain.announce, timeout=5)
        with trio.fail_after(20):
            assert await observed_from_listen_port(peer, plain.peer_id) is None


def test_ipv6_addresses_are_checked_like_ipv4_ones():
    assert same_ip(Multiaddr("/ip6/2001:db8::7/tcp/5"), "2001:db8::7")
    assert not same_ip(Multiaddr("/ip6/2001:db8::8/tcp/5"), "2001:db8::7")
    assert same_ip(Multiaddr("/ip4/198.51.100.7/tcp/5"), "::ffff:198.51.100.7")  # dual stack
    assert not same_ip(Multiaddr("/ip4/198.51.100.7/tcp/5/p2p-circuit"), "198.51.100.7")


@needs_ipv6
async def test_a_peer_on_ipv6_alone_is_dialed_back_and_mapped_over_ipv6():
    """A peer that listens and announces on IPv6 only, reaching the backbone over IPv6: the
    dial-back reaches it there, and its listen port's mapping is checked over IPv6."""
    async with (
        open_node(new_identity(), listen=["/ip6/::1/tcp/0"], announce=[],
                  max_message_bytes=1 << 20) as backbone,
        open_node(new_identity(), listen=["/ip6/::1/tcp/0"], announce=[],
                  max_message_bytes=1 << 20) as peer,
        open_dialer(new_identity()) as dialer,
    ):  # fmt: skip
        DialBackServer(backbone.host, dialer)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        with trio.fail_after(20):
            result = await check_reachable(peer, backbone.peer_id)
        assert [a.startswith("/ip6/::1/tcp/") for a in result.reachable] == [True], result
        assert result.observed.startswith("/ip6/::1/tcp/")
        listening = listen_source(peer, 6)
        assert listening is not None and listen_source(peer, 4) is None
        with trio.fail_after(20):
            seen = await observed_from_listen_port(peer, backbone.peer_id)
        assert seen == (f"/ip6/::1/tcp/{listening[1]}", listening[1])


async def test_py_libp2p_s_autonat_vouches_for_a_dead_address_and_our_dial_back_does_not():
    """Why reachability is our dial-back, not py-libp2p 0.8.1's AutoNAT: its server dials with
    the host that already holds the caller's connection (`host.connect` returns at once), so
    every caller is "reachable", at any address. Ours dials from a second host."""
    from libp2p.host.autonat.autonat import AutoNATService

    dead = Multiaddr(f"/ip4/127.0.0.1/tcp/{unused_port()}")
    async with nodes(2) as (backbone, caller), open_dialer(new_identity()) as dialer:
        AutoNATService(backbone.host, serve=True)
        asker = AutoNATService(caller.host, serve=False)
        await caller.connect(backbone.peer_id, backbone.announce, timeout=5)
        with trio.fail_after(20):
            status, addr = await asker.query_server(backbone.peer_id, [dead.to_bytes()])
        assert status == 0 and addr is not None and Multiaddr(addr) == dead  # OK: wrong
        server = DialBackServer(backbone.host, dialer)
        with trio.fail_after(20):
            ours = await server.check(caller.peer_id, [str(dead)], observed_ip="127.0.0.1")
        assert ours.reachable == [] and "dial failed" in ours.unreachable[str(dead)]
