"""Hole punching (peer.net.holepunch) on loopback: two peers joined through a relay upgrade
to a direct connection and close the relayed one; a peer's addresses are checked before
anything is dialed; a peer that does not take part leaves the connection relayed; a peer
cannot make us dial addresses of its choice again and again (one answer per relayed
connection we dialed, none on one we accepted, an attempt budget).
(Through real NAT routers: tests/test_nat_testbed.py.)"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager

import msgspec
import pytest
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.net.holepunch import (
    MAX_MESSAGE_BYTES,
    PROTOCOL,
    Connect,
    HolePunchConfig,
    HolePuncher,
    Sync,
    check_punch_addrs,
)
from peer.net.host import Node, ip_tcp
from peer.net.relay import (
    RelayClient,
    RelayService,
    dial_via_relay,
    direct_conn,
    is_relayed,
    stream_on,
)
from peer.net.relay.internals import live_conn, punch_failed
from peer.net.rpc import TRANSPORT_ERRORS, FramedStream
from tests.test_relay import FAST_RETRY, WAIT, Echo, serve_echo, start_node

FAST = HolePunchConfig(relay_grace_seconds=0.2)


@asynccontextmanager
async def punched(
    *, key: str | None = None, dialer_punches: bool = True, nated_punches: bool = True,
    config: HolePunchConfig = FAST,
) -> AsyncIterator[tuple[object, ...]]:  # fmt: skip
    """A relay, a NATed peer holding a slot on it, a dialer: both run a HolePuncher (the
    dialer only if `dialer_punches`, the NATed peer only if `nated_punches`). Yields (relay,
    nated, dialer, nated's, dialer's, the NATed peer's relay client)."""
    async with AsyncExitStack() as stack:
        relay = await start_node(stack, key=key)
        nated = await start_node(stack, key=key)
        dialer = await start_node(stack, key=key)
        nursery = await stack.enter_async_context(trio.open_nursery())
        await nursery.start(RelayService(relay).run)
        client = RelayClient(nated, relay.public_addrs(), FAST_RETRY)
        await nursery.start(client.run)
        nated_punch = HolePuncher(nated, config)
        if nated_punches:
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


async def test_a_relayed_connection_whose_punch_failed_closes_and_gives_back_its_circuit():
    """A relayed connection carries control RPCs only and holds one of the relay's circuits
    while open: `failed_relay_seconds` after its punch failed, it closes (at 100 simulated
    peers, kept for the circuit's 600 s, they held every circuit of both relays). The next
    call dials a new circuit."""
    config = HolePunchConfig(relay_grace_seconds=0.2, failed_relay_seconds=0.3)
    async with punched(dialer_punches=False, config=config) as (_r, nated, dialer, np, _dp, client):

        def relayed() -> list[object]:
            conns = dialer.host.get_network().connections.get(nated.peer_id, ())
            return [c for c in conns if is_relayed(c.muxed_conn) and not c.muxed_conn.is_closed]

        with trio.fail_after(WAIT):
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            assert await np.wait_outcome(dialer.peer_id) is False
            while relayed():
                await trio.sleep(0.05)
            await dial_via_relay(dialer, client.relayed_addrs()[0], timeout=WAIT)
            reply = await dialer.rpc.call(
                nated.peer_id, "echo", "echo", Echo("again"), Echo, timeout=WAIT
            )
        assert reply.text == "again" and len(relayed()) == 1


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


# ---------------------------------------------------------------------------- dials for others


def test_attempts_are_budgeted_per_peer_and_in_total():
    from peer.net.holepunch import PunchBudget

    budget = PunchBudget(
        HolePunchConfig(
            peer_attempts=2, peer_window_seconds=100, total_attempts=3, total_window_seconds=30
        )
    )
    assert [budget.try_start("a", now=0) for _ in range(3)] == [True, True, False]
    assert budget.try_start("b", now=0) is True  # a's refusal took none of the shared tokens
    assert budget.try_start("c", now=0) is False  # all spent: a fresh peer id buys nothing
    assert budget.try_start("c", now=15) is True  # 3 per 30 s: 1.5 back
    assert budget.try_start("a", now=20) is False  # 2 per 100 s: 0.4 back
    # c's refusal at 0 (the shared bucket empty) cost c nothing: its second of two.
    assert budget.try_start("c", now=25) is True
    assert budget.try_start("a", now=60) is True


def test_each_address_is_dialed_once_however_it_is_written():
    same = ["/ip4/198.51.100.7/tcp/4001", "/ip6/::ffff:198.51.100.7/tcp/4001"] * 4
    assert check_punch_addrs(same, own_host="203.0.113.1") == [
        Multiaddr("/ip4/198.51.100.7/tcp/4001")
    ]


@asynccontextmanager
async def third_parties(n: int) -> AsyncIterator[tuple[list[str], list[int]]]:
    """`n` TCP listeners on loopback (127.0.9.1, .2, ...) standing for machines that take no
    part: each connection made to them is counted and closed. Yields (their addresses, [count])."""
    accepted = [0]

    async def count(stream: trio.SocketStream) -> None:
        accepted[0] += 1
        await stream.aclose()

    async with trio.open_nursery() as nursery:
        listeners = []
        for i in range(n):
            listeners += await trio.open_tcp_listeners(0, host=f"127.0.9.{i + 1}")
        addrs = [
            f"/ip4/{listener.socket.getsockname()[0]}/tcp/{listener.socket.getsockname()[1]}"
            for listener in listeners
        ]
        await nursery.start(trio.serve_listeners, count, listeners)
        yield addrs, accepted
        nursery.cancel_scope.cancel()


async def ask_for_punches(
    asker: Node, target: ID, target_punch: HolePuncher, addrs: list[str], *, times: int
) -> int:
    """The asker opens the hole punch `times` times over its relayed connection to `target`,
    naming `addrs` each time, and waits for every answered request's dials to end; how many
    were answered."""
    answered = 0
    for _ in range(times):
        conn = next(
            c for c in asker.host.get_network().connections.get(target, ())
            if is_relayed(c.muxed_conn)
        )  # fmt: skip
        stats = target_punch.statistics()
        ended = stats.direct + stats.failed
        try:
            framed = FramedStream(await stream_on(conn, PROTOCOL, timeout=WAIT), MAX_MESSAGE_BYTES)
        except TRANSPORT_ERRORS:
            continue
        try:
            await framed.write_frame(msgspec.msgpack.encode(Connect(addrs)))
            if await framed.read_frame() is None:
                continue  # refused: the target closed the stream
            await framed.write_frame(msgspec.msgpack.encode(Sync()))
            answered += 1
            while (lambda s: s.direct + s.failed)(target_punch.statistics()) == ended:
                await trio.sleep(0.01)
        except TRANSPORT_ERRORS:  # refused: the target reset the stream
            continue
        finally:
            await framed.reset()
    return answered


async def test_a_peer_asking_again_on_a_relayed_connection_we_dialed_is_answered_once():
    """The amplifier: a peer we reach through a relay asks for a hole punch 20 times, naming 8
    machines that take no part each time. Answered every time, that was 160 connections to
    them; as DCUtR, a relayed connection gets one answer: 8."""
    async with (
        third_parties(8) as (addrs, accepted),
        punched(nated_punches=False) as (_relay, asker, victim, _np, victim_punch, client),
    ):
        with trio.fail_after(WAIT):
            await dial_via_relay(victim, client.relayed_addrs()[0], timeout=WAIT)
            answered = await ask_for_punches(asker, victim.peer_id, victim_punch, addrs, times=20)
            while accepted[0] < 8 * answered:  # the last connections being accepted
                await trio.sleep(0.01)
        assert (answered, accepted[0]) == (1, 8)


async def test_the_end_that_accepted_the_circuit_answers_no_hole_punch_request():
    """A peer that dialed us through a relay is the end that answers a hole punch, never the
    one that asks: its requests make us dial nothing (it was 8 connections per request)."""
    async with (
        third_parties(8) as (addrs, accepted),
        punched(dialer_punches=False) as (_relay, victim, asker, victim_punch, _dp, client),
    ):
        with trio.fail_after(WAIT):
            await dial_via_relay(asker, client.relayed_addrs()[0], timeout=WAIT)
            # Our own request to it went unanswered (it runs no hole punch).
            assert await victim_punch.wait_outcome(asker.peer_id) is False
            answered = await ask_for_punches(asker, victim.peer_id, victim_punch, addrs, times=20)
        assert (answered, accepted[0]) == (0, 0)


async def test_a_peer_dialing_us_through_a_relay_again_and_again_is_punched_within_budget():
    """Each relayed connection a peer makes to us starts a hole punch from our end, to the
        addresses it answers with: reconnecting is bounded by the attempt budget (`peer_attempts`,
    3 per 10 minutes by default): 5 connections, 3 hole punches."""
    async with (
        third_parties(8) as (addrs, accepted),
        punched(dialer_punches=False) as (_relay, victim, asker, _vp, _dp, client),
    ):
        asked = [0]

        async def answer(stream) -> None:  # the asker's end of the exchange, with others' addrs
            framed = FramedStream(stream, MAX_MESSAGE_BYTES)
            asked[0] += 1
            with contextlib.suppress(*TRANSPORT_ERRORS):
                await framed.read_frame()
                await framed.write_frame(msgspec.msgpack.encode(Connect(addrs)))
                await framed.read_frame()
            await framed.reset()

        asker.host.set_stream_handler(PROTOCOL, answer)
        victim_network = victim.host.get_network()
        asker_network = asker.host.get_network()
        with trio.fail_after(WAIT):
            for _ in range(5):
                await dial_via_relay(asker, client.relayed_addrs()[0], timeout=WAIT)
                while not punch_failed(victim_network, asker.peer_id):  # tried, or refused
                    await trio.sleep(0.01)
                await live_conn(asker_network, victim.peer_id).close()
                while live_conn(victim_network, asker.peer_id) or live_conn(
                    asker_network, victim.peer_id
                ):
                    await trio.sleep(0.01)
            while accepted[0] < 8 * asked[0]:
                await trio.sleep(0.01)
        assert (asked[0], accepted[0]) == (3, 24)
