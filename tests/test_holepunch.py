"""Hole punching (peer.net.holepunch) on loopback: two peers joined through a relay upgrade
to a direct connection and close the relayed one; a peer's addresses are checked before
anything is dialed; a peer that does not take part leaves the connection relayed.
(Through real NAT routers: tests/test_nat_testbed.py.)"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import pytest
import trio
from multiaddr import Multiaddr

from peer.net.holepunch import HolePunchConfig, HolePuncher, check_punch_addrs
from peer.net.host import ip_tcp
from peer.net.relay import RelayClient, RelayService, dial_via_relay, direct_conn, is_relayed
from tests.test_relay import FAST_RETRY, WAIT, Echo, serve_echo, start_node

FAST = HolePunchConfig(relay_grace_seconds=0.2)


@asynccontextmanager
async def punched(
    *, key: str | None = None, dialer_punches: bool = True, config: HolePunchConfig = FAST
) -> AsyncIterator[tuple[object, ...]]:
    """A relay, a NATed peer holding a slot on it, a dialer: both run a HolePuncher (the
    dialer only if `dialer_punches`). Yields (relay, nated, dialer, nated's, dialer's)."""
    async with AsyncExitStack() as stack:
        relay = await start_node(stack, key=key)
        nated = await start_node(stack, key=key)
        dialer = await start_node(stack, key=key)
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(RelayService(relay).run)
        client = RelayClient(nated, relay.public_addrs(), FAST_RETRY)
        await nursery.start(client.run)
        nated_punch = HolePuncher(nated, config)
        await nursery.start(nated_punch.run)
        dialer_punch = HolePuncher(dialer, config)
        if dialer_punches:
            await nursery.start(dialer_punch.run)
        with trio.fail_after(WAIT):
            await client.wait_reserved()
        serve_echo(nated)
        yield relay, nated, dialer, nated_punch, dialer_punch, client
        nursery.cancel_scope.cancel()


async def test_a_relayed_connection_is_upgraded_to_a_direct_one_and_the_relayed_one_closes():
    async with punched(key=secrets.token_hex(32)) as (_relay, nated, dialer, np, dp, client):
        with trio.fail_after(WAIT):
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            assert await np.wait_outcome(dialer.peer_id) is True
            assert await dp.wait_outcome(nated.peer_id) is True
        assert np.connected_directly(dialer.peer_id) and dp.connected_directly(nated.peer_id)
        conn = direct_conn(dialer.host.get_network(), nated.peer_id)
        assert conn is not None and not is_relayed(conn.muxed_conn)
        # The relayed connection goes after the grace period; calls use the direct one.
        with trio.fail_after(WAIT):
            while any(
                is_relayed(c.muxed_conn) and not c.muxed_conn.is_closed
                for c in dialer.host.get_network().connections.get(nated.peer_id, ())
            ):
                await trio.sleep(0.05)
            reply = await dialer.rpc.call(
                nated.peer_id, "echo", "echo", Echo("direct"), Echo, timeout=WAIT
            )
        assert reply.text == "direct"
        assert np.statistics().direct == 1 and dp.statistics().direct == 1


async def test_without_the_other_end_taking_part_the_connection_stays_relayed():
    async with punched(dialer_punches=False) as (_relay, nated, dialer, np, _dp, client):
        with trio.fail_after(WAIT):
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            assert await np.wait_outcome(dialer.peer_id) is False
        assert not np.connected_directly(dialer.peer_id)
        conns = dialer.host.get_network().connections.get(nated.peer_id, ())
        assert [is_relayed(c.muxed_conn) for c in conns] == [True]
        with trio.fail_after(WAIT):
            reply = await dialer.rpc.call(
                nated.peer_id, "echo", "echo", Echo("relayed"), Echo, timeout=WAIT
            )
        assert reply.text == "relayed"


def test_only_plain_ip_tcp_addresses_a_peer_may_ask_for_are_dialed():
    sent = [
        "/ip4/198.51.100.7/tcp/4001",  # fine
        "/ip6/2001:db8::7/tcp/4001",  # fine too
        "/ip4/127.0.0.1/tcp/22",  # loopback: only if ours is loopback too
        "/ip4/169.254.169.254/tcp/80",  # link-local (cloud metadata)
        "/ip4/0.0.0.0/tcp/4001",
        "/ip4/198.51.100.7/tcp/0",
        "/ip6/::1/tcp/4001",
        "/ip4/198.51.100.7/udp/4001/quic",
        "/ip4/198.51.100.7/tcp/4001/p2p-circuit",
        "/dns4/example.com/tcp/4001",
        "not an address",
    ]
    assert check_punch_addrs(sent, own_host="203.0.113.1") == [
        Multiaddr("/ip4/198.51.100.7/tcp/4001"),
        Multiaddr("/ip6/2001:db8::7/tcp/4001"),
    ]
    on_one_machine = check_punch_addrs(sent, own_host="127.0.0.1")
    assert Multiaddr("/ip4/127.0.0.1/tcp/22") in on_one_machine
    assert Multiaddr("/ip6/::1/tcp/4001") in on_one_machine
    assert len(check_punch_addrs(sent * 3, own_host="203.0.113.1")) == 2  # at most 8 read
    # Private networks: only from a peer in one itself (a site's LAN, the NAT testbed).
    lan = ["/ip4/10.0.0.5/tcp/4001", "/ip4/192.168.1.9/tcp/22", "/ip6/fd00::5/tcp/4001"]
    assert check_punch_addrs(lan, own_host="203.0.113.1") == []
    assert check_punch_addrs(lan, own_host="10.68.0.2") == [Multiaddr(a) for a in lan]
    # ...however it is written: an IPv4-mapped or NAT64 address dials the IPv4 one.
    disguised = ["/ip6/::ffff:10.0.0.1/tcp/22", "/ip6/64:ff9b::a00:1/tcp/22"]
    assert check_punch_addrs(disguised, own_host="203.0.113.1") == []
    # A peer also seen at a public address is not on its peers' private networks.
    assert check_punch_addrs(lan, own_host="10.68.0.2", private_ok=False) == []
    assert ip_tcp("/ip4/10.0.0.1/tcp/5") == ("10.0.0.1", 5)
    assert ip_tcp("/ip6/2001:db8::7/tcp/5") == ("2001:db8::7", 5)
    assert ip_tcp("/ip6/2001:db8::7/tcp/5/p2p-circuit") is None


def test_a_peer_offers_its_announced_addresses_then_the_one_backbones_saw():
    from types import SimpleNamespace

    from peer.net.holepunch import private_targets_ok, punch_addrs

    node = SimpleNamespace(
        announce=[Multiaddr("/ip4/10.0.0.2/tcp/4001"), Multiaddr("/dns4/x.example/tcp/1")],
        punch_observed=["/ip4/198.51.100.7/tcp/61234", "/ip4/10.0.0.2/tcp/4001"],
    )
    assert punch_addrs(node) == ["/ip4/10.0.0.2/tcp/4001", "/ip4/198.51.100.7/tcp/61234"]  # type: ignore[arg-type]
    # Seen at a public address: its peers' private addresses are not on its site.
    assert private_targets_ok(punch_addrs(node)) is False  # type: ignore[arg-type]
    assert private_targets_ok(["/ip4/10.0.0.2/tcp/4001"]) is True
    assert private_targets_ok([]) is False


async def test_a_relayed_connection_carries_no_tensors_either_way():
    """The relay carries control traffic only: a data-plane stream over a relayed connection is
    refused by the dialer before it sends and by the receiver before it reads (a round between
    two NATed peers through a relay stalled on its circuit)."""
    from peer.net.streamio import ALLREDUCE_PROTOCOL, Libp2pStream, open_stream

    async with punched(dialer_punches=False) as (_relay, nated, dialer, nated_punch, _dp, client):
        seen: list[bool] = []

        async def handler(raw) -> None:
            seen.append(Libp2pStream(raw).relayed)
            await raw.reset()

        nated.host.set_stream_handler(ALLREDUCE_PROTOCOL, handler)
        with trio.fail_after(WAIT):
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            with pytest.raises(OSError, match="relays carry no tensors"):
                await open_stream(dialer.host, nated.peer_id, ALLREDUCE_PROTOCOL, punch_seconds=0.2)
            await dialer.host.new_stream(nated.peer_id, [ALLREDUCE_PROTOCOL])
            while not seen:
                await trio.sleep(0.01)
        assert seen and all(seen)  # both streams, ours refused and this one, were relayed
        # The NATed end ran the punch, and it failed: its data planes stop waiting for one.
        with trio.fail_after(WAIT):
            assert await nated_punch.wait_outcome(dialer.peer_id) is False
        with trio.fail_after(1), pytest.raises(OSError, match="relays carry no tensors"):
            await open_stream(nated.host, dialer.peer_id, ALLREDUCE_PROTOCOL, punch_seconds=60)


async def test_a_data_stream_waits_for_the_punch_and_takes_the_direct_connection():
    """Opened at once after a relayed connection came up, a data-plane stream waits for the hole
    punch and goes over the direct connection, while the relayed one is still open beside it
    (`host.new_stream` may pick either)."""
    from peer.net.streamio import ALLREDUCE_PROTOCOL, Libp2pStream, open_stream

    keep_relayed = HolePunchConfig(relay_grace_seconds=60)
    async with punched(config=keep_relayed) as (_relay, nated, dialer, np, _dp, client):
        seen: list[bool] = []

        async def handler(raw) -> None:
            seen.append(Libp2pStream(raw).relayed)
            with contextlib.suppress(Exception):  # held until the dialer resets it
                await raw.read(1)
            await raw.reset()

        nated.host.set_stream_handler(ALLREDUCE_PROTOCOL, handler)
        with trio.fail_after(WAIT):
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            streams = [await open_stream(dialer.host, nated.peer_id, ALLREDUCE_PROTOCOL)]
            assert await np.wait_outcome(dialer.peer_id) is True
            for _ in range(4):  # again and again: never the relayed connection beside it
                streams.append(await open_stream(dialer.host, nated.peer_id, ALLREDUCE_PROTOCOL))
            while len(seen) < len(streams):
                await trio.sleep(0.01)
        conns = dialer.host.get_network().connections.get(nated.peer_id, ())
        assert sorted(is_relayed(c.muxed_conn) for c in conns) == [False, True]
        assert [s.relayed for s in streams] == [False] * 5 and seen == [False] * 5
        for stream in streams:
            await stream.reset()
