"""Dial-back checks over real libp2p on loopback."""

from __future__ import annotations

import socket

import trio
from multiaddr import Multiaddr

from peer.measure.reachability import (
    BUSY,
    MAX_CONCURRENT,
    DialBackServer,
    check_reachable,
    observed_addr,
    observed_from_listen_port,
    open_dialer,
    punch_address,
    same_ip,
)
from peer.net.holepunch import listen_source
from peer.net.host import open_node
from tests.helpers import needs_ipv6, new_identity, nodes


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_only_the_callers_own_ip_is_dialed():
    assert same_ip(Multiaddr("/ip4/127.0.0.1/tcp/5"), "127.0.0.1")
    assert not same_ip(Multiaddr("/ip4/10.0.0.1/tcp/5"), "127.0.0.1")
    assert not same_ip(Multiaddr("/ip6/::1/tcp/5"), "127.0.0.1")


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
        for _ in range(MAX_CONCURRENT):
            server._limit.acquire_on_behalf_of_nowait(object())
        addr = str(peer.announce[0])
        with trio.fail_after(1):
            result = await server.check(peer.peer_id, [addr], observed_ip="127.0.0.1")
        assert result.reachable == [] and result.unreachable[addr].startswith(BUSY)


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
