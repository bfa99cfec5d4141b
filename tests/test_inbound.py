"""The gate in front of inbound libp2p connections: the bookkeeping by hand (synchronous), then
the caps, the handshake deadline and pruning on real loopback hosts."""

from __future__ import annotations

import pytest
import trio
from libp2p.peer.id import ID

from peer.net.host import open_node
from peer.net.inbound import Admission, InboundGate, InboundLimits, Phase
from tests.helpers import LOOPBACK, new_identity, nodes


def peer(n: int) -> ID:
    return ID(bytes([n]) * 8)


def gate(**limits) -> InboundGate:
    return InboundGate(InboundLimits(**limits))


# -- pending connections ----------------------------------------------------------------------


def test_a_prefix_past_its_pending_cap_makes_room_with_its_own_oldest():
    """Not refused: idle connections from a member's own public address (or /24) cannot keep
    the member out."""
    g = gate(max_pending=8, max_pending_per_source=2)
    first, _ = (g.admit("10.0.0.1", now=t)[0] for t in (0, 1))
    newcomer, evicted = g.admit("10.0.0.9", now=2)  # the same /24
    assert newcomer is not None and evicted == [first] and first.phase is Phase.GONE
    assert g.admit("10.0.1.1", now=3)[1] == []  # another /24 has its own
    assert g.statistics().pending == 3 and g.statistics().evicted == 1


def test_a_full_gate_lets_a_newcomer_take_the_oldest_slot_of_the_fullest_prefix():
    g = gate(max_pending=4, max_pending_per_source=4)
    a = [g.admit("10.0.1.1", now=t)[0] for t in (0, 1, 2)]
    g.admit("10.0.2.1", now=3)
    newcomer, evicted = g.admit("10.0.3.1", now=4)
    assert newcomer is not None and evicted == [a[0]] and a[0].phase is Phase.GONE
    # 10.0.1.0/24 (2 pending) is still the fullest: a fourth from it is refused ...
    assert g.admit("10.0.1.2", now=5) == (None, [])
    # ... and one from 10.0.2.0/24 (1 pending) takes 10.0.1.0/24's oldest.
    assert g.admit("10.0.2.1", now=6)[1] == [a[1]]
    assert g.statistics().pending == 4 and g.statistics().evicted == 2


def test_when_every_prefix_holds_one_a_new_prefix_takes_the_oldest_slot():
    g = gate(max_pending=3, max_pending_per_source=3)
    first, *_ = [g.admit(f"10.0.{i}.1", now=i)[0] for i in (1, 2, 3)]
    assert g.admit("10.0.9.1", now=9)[1] == [first]
    assert g.admit("10.0.2.1", now=10) == (None, [])  # holds one, as does everyone


def test_a_released_connection_frees_its_slot_and_releasing_twice_is_harmless():
    g = gate(max_pending=2, max_pending_per_source=2)
    admission, _ = g.admit("10.0.0.1", now=0)
    assert admission is not None
    g.admit("10.0.1.1", now=1)
    assert g.admit("10.0.1.2", now=1) == (None, [])  # every prefix holds one
    g.release(admission)
    g.release(admission)
    assert g.statistics().pending == 1
    assert g.admit("10.0.1.2", now=2) != (None, [])


def test_connections_count_under_their_ipv4_slash_24_or_ipv6_slash_64():
    g = gate()
    assert g.admit("203.0.113.5", now=0)[0].source == "203.0.113.0/24"
    assert g.admit("2001:db8:1:2:aaaa::1", now=0)[0].source == "2001:db8:1:2::/64"
    assert g.admit("::ffff:203.0.113.9", now=0)[0].source == "203.0.113.0/24"
    assert g.admit("203.0.113.0/24", now=0)[0].source == "203.0.113.0/24"  # the relay's


@pytest.mark.parametrize(
    ("limits", "match"),
    [
        ({"max_pending": 4, "max_pending_per_source": 5}, "max_pending_per_source=5"),
        ({"max_pending_per_source": 0}, "max_pending_per_source=0"),
        ({"handshake_seconds": 0}, "handshake_seconds=0"),
        ({"max_established": 0}, "max_established=0"),
        ({"accept_rate": 0}, "accept_rate=0"),
        ({"accept_burst": 0}, "accept_burst=0"),
    ],
)
def test_limits_that_cannot_work_are_refused_with_their_value(limits, match):
    with pytest.raises(ValueError, match=match):
        InboundLimits(**limits)


# -- authenticated connections ----------------------------------------------------------------


def established(g: InboundGate, ip: str, n: int, *, now: float, streams: int = 0) -> Admission:
    admission, _ = g.admit(ip, now=now)
    assert admission is not None
    admission.open_streams = lambda: streams
    assert g.authenticate(admission, peer_id=peer(n), now=now, room=1000) == []
    return admission


def test_one_past_max_established_prunes_one_from_the_prefix_holding_most():
    g = gate(max_established=3)
    lone = established(g, "10.0.1.1", 1, now=0)
    crowd = [established(g, f"10.0.2.{n}", n, now=n) for n in (2, 3)]  # one /24
    newcomer, _ = g.admit("10.0.3.1", now=5)
    assert newcomer is not None
    assert g.authenticate(newcomer, peer_id=peer(4), now=5, room=1000) == [crowd[0]]
    assert lone.phase is Phase.ESTABLISHED and newcomer.phase is Phase.ESTABLISHED
    assert g.statistics().established == 3 and g.statistics().pruned == 1


def test_a_connection_with_an_open_stream_outlasts_idle_ones():
    g = gate(max_established=2)
    busy = established(g, "10.0.1.1", 1, now=0, streams=1)  # the oldest, but working
    idle = established(g, "10.0.2.1", 2, now=1)
    newcomer, _ = g.admit("10.0.3.1", now=2)
    assert newcomer is not None
    assert g.authenticate(newcomer, peer_id=peer(3), now=2, room=1000) == [idle]
    assert busy.phase is Phase.ESTABLISHED


def test_a_connection_holding_state_outlasts_idle_ones():
    """A relay reservation: its connection is idle between renewals, and pruning it would only
    make its peer reserve again."""
    g = gate(max_established=2)
    holder = established(g, "10.0.1.1", 1, now=0)  # the oldest, idle ...
    holder.held = lambda: True  # ... but holding a reservation
    idle = established(g, "10.0.2.1", 2, now=1)
    newcomer, _ = g.admit("10.0.3.1", now=2)
    assert newcomer is not None
    assert g.authenticate(newcomer, peer_id=peer(3), now=2, room=1000) == [idle]
    assert holder.phase is Phase.ESTABLISHED


def test_the_longest_idle_goes_first_and_any_stream_counts_as_activity():
    g = gate(max_established=2)
    old = established(g, "10.0.1.1", 1, now=0)
    young = established(g, "10.0.2.1", 2, now=1)
    g.note_activity(peer(1), now=10)  # the old one carried a stream since
    newcomer, _ = g.admit("10.0.3.1", now=11)
    assert newcomer is not None
    assert g.authenticate(newcomer, peer_id=peer(3), now=11, room=1000) == [young]
    assert old.phase is Phase.ESTABLISHED


def test_pruning_keeps_room_in_libp2p_for_every_handshake_still_running():
    """py-libp2p refuses a handshake once it holds max_connections (ours and its own dials):
    below `max_pending` free places, a newcomer prunes even under max_established."""
    g = gate(max_pending=4, max_pending_per_source=4, max_established=100)
    first = established(g, "10.0.1.1", 1, now=0)
    second = established(g, "10.0.1.1", 2, now=1)
    newcomer, _ = g.admit("10.0.2.1", now=2)
    assert newcomer is not None
    assert g.authenticate(newcomer, peer_id=peer(3), now=2, room=2) == [first, second]


def test_a_pending_connection_evicted_meanwhile_is_not_counted_when_it_authenticates():
    g = gate(max_pending=1, max_pending_per_source=1, max_established=1)
    evicted, _ = g.admit("10.0.1.1", now=0)
    assert evicted is not None
    g.admit("10.0.2.1", now=1)
    assert g.authenticate(evicted, peer_id=peer(1), now=2, room=1000) == []
    assert g.statistics().established == 0


# -- real hosts on loopback -------------------------------------------------------------------


async def idle_connection(port: int, source: str) -> trio.socket.SocketType:
    """A TCP connection from `source` (any 127.x.y.z: Linux routes 127/8 to lo) that sends nothing."""
    sock = trio.socket.socket()
    await sock.bind((source, 0))
    await sock.connect(("127.0.0.1", port))
    return sock


async def closed_by_server(sock: trio.socket.SocketType) -> None:
    """Until the server closes `sock` (it may first send its multistream header)."""
    try:
        while await sock.recv(4096):
            pass
    except ConnectionResetError:
        pass


def gated_node(limits: InboundLimits):
    """A node on loopback whose inbound gate has `limits`."""
    return open_node(
        new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1024, inbound=limits
    )


def port_of(node) -> int:
    return int(str(node.announce[0]).split("/tcp/")[1])


async def until(condition) -> None:
    while not condition():
        await trio.sleep(0.01)


async def test_connections_past_a_prefixs_cap_take_the_slots_of_its_oldest():
    limits = InboundLimits(max_pending=8, max_pending_per_source=2, handshake_seconds=60)
    async with gated_node(limits) as server:
        stats = server.inbound.statistics
        socks = []
        try:
            with trio.fail_after(20):
                for n in range(1, 6):  # five addresses of one /24
                    socks.append(await idle_connection(port_of(server), f"127.0.7.{n}"))
                    await until(lambda n=n: stats().pending + stats().evicted == n)
                for sock in socks[:3]:
                    await closed_by_server(sock)
                assert (stats().pending, stats().evicted, stats().refused) == (2, 3, 0)
                # Another /24 gets its own slots.
                socks.append(await idle_connection(port_of(server), "127.0.8.1"))
                await until(lambda: stats().pending == 3)
        finally:
            for sock in socks:
                sock.close()


async def test_idle_connections_from_a_members_own_address_do_not_keep_it_out():
    """An attacker behind the member's NAT (here: on the member's own 127.0.0.1) holds every
    pending slot of that address with connections that never send a byte. Keyed on the exact
    address with no eviction, the gate refused the member at accept (issue 45: 4 joins of 4
    failed); now the member's connection takes the oldest idle one's slot and authenticates."""
    limits = InboundLimits(max_pending_per_source=4, handshake_seconds=60)
    async with gated_node(limits) as server, nodes(1) as (member,):
        idle = []
        try:
            with trio.fail_after(30):
                for n in range(1, 5):
                    idle.append(await idle_connection(port_of(server), "127.0.0.1"))
                    await until(lambda n=n: server.inbound.statistics().pending == n)
                await member.connect(server.peer_id, server.announce, timeout=10)
                assert member.peer_id in server.host.get_network().connections
                await closed_by_server(idle[0])  # the slot it took
        finally:
            for sock in idle:
                sock.close()


async def test_a_prefix_over_its_accept_rate_is_closed_at_accept_and_others_are_not():
    """Closed in the listener's accept loop: no pending slot, handshake or task is spent."""
    limits = InboundLimits(accept_rate=0.001, accept_burst=2, handshake_seconds=60)
    async with gated_node(limits) as server, nodes(1) as (member,):
        stats = server.inbound.statistics
        socks = []
        try:
            with trio.fail_after(30):
                for _ in range(5):
                    socks.append(await idle_connection(port_of(server), "127.0.5.1"))
                for sock in socks[2:]:
                    await closed_by_server(sock)
                await until(lambda: stats().pending == 2)
                assert (stats().over_budget, stats().evicted, stats().refused) == (3, 0, 0)
                await member.connect(server.peer_id, server.announce, timeout=10)
                assert stats().established == 1
        finally:
            for sock in socks:
                sock.close()


async def test_a_connection_that_never_authenticates_is_closed_at_the_handshake_deadline():
    """py-libp2p held it 10 s (its inbound_upgrade_timeout); a deadline of 0.5 s closes it
    long before the 15 s this test allows."""
    limits = InboundLimits(handshake_seconds=0.5)
    async with gated_node(limits) as server:
        sock = await idle_connection(port_of(server), "127.0.0.2")
        try:
            with trio.fail_after(15):
                await closed_by_server(sock)
                while server.inbound.statistics().pending:
                    await trio.sleep(0.01)
        finally:
            sock.close()


async def test_idle_identities_past_max_established_are_pruned_and_a_busy_one_kept():
    """Throw-away identities that authenticate and sit idle: past max_established each new one
    closes the least useful other, so a newcomer always gets in; a peer with a stream open
    (work in flight) stays, though it is the oldest."""
    hold = "/peertrain-test/hold/1"
    async with (
        gated_node(InboundLimits(max_established=3)) as server,
        nodes(6) as clients,
    ):

        async def held(stream) -> None:
            await stream.read(1)  # until the client closes it

        server.host.set_stream_handler(hold, held)
        busy, *idle = clients
        network = server.host.get_network()
        with trio.fail_after(60):
            await busy.connect(server.peer_id, server.announce, timeout=10)
            stream = await busy.host.new_stream(server.peer_id, [hold])
            for client in idle:
                await client.connect(server.peer_id, server.announce, timeout=10)
                assert server.inbound.statistics().established <= 3
            while len(network.connections) > 3:  # the pruned ones finish closing
                await trio.sleep(0.05)
            assert busy.peer_id in network.connections
            assert idle[-1].peer_id in network.connections  # the last newcomer got in
            assert server.inbound.statistics().pruned == 3
            await stream.close()


async def test_a_peer_whose_streams_carried_work_outlasts_a_younger_idle_one():
    echo = "/peertrain-test/echo/1"
    async with (
        gated_node(InboundLimits(max_established=2)) as server,
        nodes(3) as (worker, idle, newcomer),
    ):

        async def answer(stream) -> None:
            await stream.write(await stream.read(1))
            await stream.close()

        server.host.set_stream_handler(echo, answer)
        network = server.host.get_network()
        with trio.fail_after(60):
            await worker.connect(server.peer_id, server.announce, timeout=10)
            await idle.connect(server.peer_id, server.announce, timeout=10)
            stream = await worker.host.new_stream(server.peer_id, [echo])  # after idle's join
            await stream.write(b"x")
            assert await stream.read(1) == b"x"
            await stream.close()
            while network.connections[worker.peer_id][0].get_streams():
                await trio.sleep(0.01)  # until the server has seen it close
            await newcomer.connect(server.peer_id, server.announce, timeout=10)
            while idle.peer_id in network.connections:
                await trio.sleep(0.05)
            assert worker.peer_id in network.connections
            assert newcomer.peer_id in network.connections


def test_the_daemon_takes_the_accept_budget_from_the_config():
    from peer.config import load_config
    from peer.daemon import inbound_limits

    loaded = load_config(
        overrides={"net.inbound_accept_rate": 3.5, "net.inbound_accept_burst": 7}
    ).config
    limits = inbound_limits(loaded)
    assert (limits.accept_rate, limits.accept_burst) == (3.5, 7)
