"""The libp2p host as we configure it: Noise only, no happy-eyeballs wait, dialable addresses."""

from __future__ import annotations

import libp2p.network.swarm
import pytest
import trio
from libp2p import new_host
from libp2p.abc import INetStream
from libp2p.identity.identify.identify import ID as IDENTIFY
from libp2p.io.utils import read_exactly
from libp2p.peer.peerinfo import PeerInfo
from libp2p.security.insecure.transport import PLAINTEXT_PROTOCOL_ID, InsecureTransport
from multiaddr import Multiaddr

from peer.errors import ConfigError
from peer.net.host import dialable_addrs, open_node, split_peer_addr
from tests.helpers import LOOPBACK, needs_ipv6, new_identity, nodes


async def test_plaintext_only_dialer_is_rejected():
    async with nodes(1) as (server,):
        identity = new_identity()
        plaintext = new_host(
            key_pair=identity.key_pair,
            sec_opt={PLAINTEXT_PROTOCOL_ID: InsecureTransport(identity.key_pair)},
            muxer_preference="YAMUX",
        )
        async with plaintext.run(listen_addrs=[Multiaddr(LOOPBACK)]):
            with trio.fail_after(20), pytest.raises(Exception, match="unable to connect"):
                await plaintext.connect(PeerInfo(server.peer_id, server.announce))
            assert server.host.get_network().connections.get(identity.peer_id) is None


async def test_noise_dialer_connects_and_the_session_is_authenticated():
    async with nodes(2) as (a, b):
        await a.connect(b.peer_id, b.announce, timeout=5)
        conn = a.host.get_network().connections[b.peer_id]
        conn = conn[0] if isinstance(conn, list) else conn
        assert conn.muxed_conn.peer_id == b.peer_id


async def test_connect_does_not_wait_out_happy_eyeballs(monkeypatch):
    # py-libp2p waits this long after each dial unless the first success ends the wait. Made
    # huge here, a connect that returns at all proves the wait is skipped.
    monkeypatch.setattr(libp2p.network.swarm, "_HAPPY_EYEBALLS_DELAY", 3600.0)
    async with nodes(2) as (a, b):
        with trio.fail_after(30):
            await a.connect(b.peer_id, b.announce, timeout=30)


async def test_a_new_connection_runs_no_identify_exchange():
    """py-libp2p starts identify on every new connection, from both ends: ~40 % of a
    connection's CPU, taken from the DHT lookup that dialed, for addresses we never read."""
    asked: list[object] = []

    async def count_identify(stream: INetStream) -> None:
        asked.append(stream.muxed_conn.peer_id)
        await stream.reset()

    async def echo(stream: INetStream) -> None:
        while data := await stream.read(64):
            await stream.write(data)

    async with nodes(2) as (a, b):
        for node in (a, b):
            node.host.set_stream_handler(IDENTIFY, count_identify)
            node.host.set_stream_handler("/test/echo/1", echo)
        with trio.fail_after(20):
            await a.connect(b.peer_id, b.announce, timeout=10)
            # Round trips both ways after the connect: an identify it started comes first.
            for caller, callee in ((a, b), (b, a)):
                stream = await caller.host.new_stream(callee.peer_id, ["/test/echo/1"])
                for _ in range(20):
                    await stream.write(b"ping")
                    assert await read_exactly(stream, 4) == b"ping"
                await stream.close()
        assert asked == []


def test_wildcard_listen_expands_to_interface_addresses():
    expanded = [str(a) for a in dialable_addrs([Multiaddr("/ip4/0.0.0.0/tcp/4001")])]
    assert expanded, "at least loopback exists"
    assert all(a.endswith("/tcp/4001") and "0.0.0.0" not in a for a in expanded)
    assert "/ip4/127.0.0.1/tcp/4001" in expanded
    assert expanded[-1] == "/ip4/127.0.0.1/tcp/4001"  # loopback is listed last
    kept = dialable_addrs([Multiaddr("/ip4/10.1.2.3/tcp/5")])
    assert [str(a) for a in kept] == ["/ip4/10.1.2.3/tcp/5"]


@needs_ipv6
def test_an_ipv6_wildcard_expands_to_this_machine_s_ipv6_addresses():
    six = [str(a) for a in dialable_addrs([Multiaddr("/ip6/::/tcp/4001")])]
    assert "/ip6/::1/tcp/4001" in six and six[-1] == "/ip6/::1/tcp/4001"  # loopback last
    # No link-local address: it needs its interface (a zone) to be dialled.
    assert all(a.startswith("/ip6/") and "/ip6/::/" not in a and "fe80" not in a for a in six)


async def test_announce_addresses_replace_the_listen_ones():
    announce = "/ip4/203.0.113.7/tcp/31337"
    async with open_node(
        new_identity(), listen=[LOOPBACK], announce=[announce], max_message_bytes=1024
    ) as node:
        assert node.public_addrs() == [f"{announce}/p2p/{node.peer_id}"]


def test_peer_address_parsing_errors_are_one_line_config_errors():
    with pytest.raises(ConfigError, match="no /p2p/"):
        split_peer_addr("/ip4/127.0.0.1/tcp/4001", what="backbone address")
    with pytest.raises(ConfigError, match="not a valid multiaddr"):
        split_peer_addr("127.0.0.1:4001", what="backbone address")
    peer_id = new_identity().peer_id
    got_id, addr = split_peer_addr(
        f"/ip4/127.0.0.1/tcp/4001/p2p/{peer_id}", what="backbone address"
    )
    assert got_id == peer_id and str(addr) == "/ip4/127.0.0.1/tcp/4001"


async def test_port_in_use_is_a_config_error():
    async with nodes(1) as (first,):
        port = str(first.announce[0]).split("/tcp/")[1]
        with pytest.raises(ConfigError, match="pick another --port"):
            async with open_node(
                new_identity(),
                listen=[f"/ip4/127.0.0.1/tcp/{port}"],
                announce=[],
                max_message_bytes=1024,
            ):
                pass


async def test_a_stopped_node_closes_its_port_and_a_restart_can_take_it():
    """py-libp2p's TCP listener accepts in a system task that outlives the host: a stopped
    node went on accepting on its port, and a node restarted on that port was refused."""
    async with nodes(1) as (first,):
        addr = first.announce[0]
    with trio.fail_after(20), pytest.raises(OSError):
        await trio.open_tcp_stream("127.0.0.1", int(addr.value_for_protocol("tcp")))
    async with open_node(
        new_identity(), listen=[str(addr)], announce=[], max_message_bytes=1024
    ) as again:
        assert again.announce == [addr]


async def test_a_closed_inbound_connection_frees_its_slot_and_newcomers_are_served():
    """py-libp2p 0.8.1 kept each inbound slot until the swarm stopped: after 250 connections in
    its lifetime a node refused everyone (a backbone in the soak)."""
    async with nodes(1) as (server,):
        for _ in range(5):
            async with nodes(1) as (client,):
                await client.connect(server.peer_id, server.announce, timeout=5)
                assert server.inbound.statistics().established >= 1
        with trio.fail_after(10):
            while server.inbound.statistics().established:  # the server notices each close
                await trio.sleep(0.05)
        assert server.inbound.statistics().pruned == 0
        async with nodes(1) as (client,):
            await client.connect(server.peer_id, server.announce, timeout=5)


async def test_idle_tcp_connections_from_many_addresses_do_not_keep_a_newcomer_out():
    """py-libp2p gave each accepted TCP connection one of 250 inbound slots before any
    handshake and held it up to 10 s: 300 connections that never send a byte (from 8
    networks other than the newcomer's 127.0.0.0/24; Linux routes all of 127/8 to lo)
    refused every newcomer. (From the newcomer's own /24, such a burst spends that prefix's
    accept budget: tests/test_inbound.py shows what that costs.)"""
    async with nodes(1) as (server,):
        port = int(str(server.announce[0]).split("/tcp/")[1])
        idle = []
        try:
            with trio.fail_after(60):
                for i in range(300):
                    sock = trio.socket.socket()
                    idle.append(sock)
                    await sock.bind((f"127.0.{2 + i % 8}.1", 0))
                    await sock.connect(("127.0.0.1", port))
                async with nodes(1) as (newcomer,):
                    await newcomer.connect(server.peer_id, server.announce, timeout=10)
                    assert server.host.get_network().connections.get(newcomer.peer_id)
            # What they cost us meanwhile: a bounded number of sockets in the handshake.
            assert server.inbound.statistics().pending <= server.inbound.limits.max_pending
        finally:
            for sock in idle:
                sock.close()


async def test_a_redial_skips_the_unspecified_listen_address_identify_stored():
    """py-libp2p dials one TCP address per peer, the first its peerstore lists; identify put a
    backbone's 0.0.0.0 listen address there, and after a partition its peers redialled that,
    failing for minutes, rather than the address they had joined through."""
    async with nodes(2) as (a, b):
        store = a.host.get_peerstore()
        nowhere = Multiaddr("/ip4/0.0.0.0/tcp/9")  # discard port: nothing listens
        store.add_addrs(b.peer_id, [nowhere, *b.announce], 3600)
        assert store.addrs(b.peer_id) == b.announce
        with trio.fail_after(20):
            await a.host.get_network().dial_peer(b.peer_id)  # what a new stream does first
        assert a.host.get_network().connections.get(b.peer_id)


async def test_an_explicit_connect_dials_the_given_address_first():
    async with nodes(2) as (a, b):
        store = a.host.get_peerstore()
        store.add_addrs(b.peer_id, [Multiaddr("/ip4/127.0.0.1/tcp/9")], 3600)  # stale
        with trio.fail_after(20):
            await a.connect(b.peer_id, b.announce, timeout=10)
        assert store.addrs(b.peer_id) == b.announce


async def test_a_protocol_name_that_is_not_utf8_is_a_libp2p_error_not_a_crash():
    """py-libp2p decoded a remote's multistream-select line as UTF-8 outside its own error
    handling: a member or donor answering `\\xff\\xfe` raised UnicodeDecodeError through the
    averaging, past every handler of libp2p's errors (found in review). Now its own error."""
    from libp2p.exceptions import BaseLibp2pError
    from libp2p.protocol_muxer.multiselect_client import MultiselectClient
    from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
    from libp2p.utils.varint import encode_varint_prefixed

    async with nodes(1):  # a host is made: py-libp2p's class is patched by then
        pass

    class Remote:
        """Answers the handshake, then a protocol line of invalid UTF-8."""

        def __init__(self) -> None:
            self.pending = encode_varint_prefixed(b"/multistream/1.0.0\n")
            self.pending += encode_varint_prefixed(b"\xff\xfe\n")

        async def write(self, data: bytes) -> None:
            pass

        async def read(self, n: int | None = None) -> bytes:
            n = len(self.pending) if n is None else n
            out, self.pending = self.pending[:n], self.pending[n:]
            return out

        async def close(self) -> None:
            pass

    with pytest.raises(BaseLibp2pError):
        await MultiselectClient().select_one_of(
            ["/peertrain/test/1"], MultiselectCommunicator(Remote()), 5
        )
