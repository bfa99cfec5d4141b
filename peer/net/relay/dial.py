"""Dialing a peer behind NAT through a circuit (any node): CONNECT through its relay, then the
network key, Noise with the target's peer id expected, and yamux inside the circuit."""

from __future__ import annotations

import logging
from typing import Any

import trio
from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.pb.circuit_pb2 import HopMessage
from libp2p.relay.circuit_v2.pb.circuit_pb2 import PeerId as PeerIdMessage
from libp2p.relay.circuit_v2.utils import read_delimited_msg, write_delimited_msg
from multiaddr import Multiaddr

from peer.errors import Unreachable
from peer.net.host import Node
from peer.net.relay.internals import live_conn, mark_relayed, upgrade_outbound
from peer.net.relay.wire import (
    HOP_PROTOCOL,
    MESSAGE_ERRORS,
    RelayRefused,
    check_status,
    parse_relayed_addr,
    relayed_addr,
    reset_stream,
)
from peer.net.rpc import TRANSPORT_ERRORS

log = logging.getLogger("peertrain.relay")


async def dial_via_relay(node: Node, address: str | Multiaddr, *, timeout: float) -> None:
    """Connect to the target of a relayed address through its relay (nothing to do if already
    connected). The network key and Noise run inside the circuit as on a direct connection,
    with the target's peer id expected: the relay cannot answer in its place. Raises
    Unreachable (RelayRefused when the relay or target said no)."""
    relay_id, relay_transport, target = parse_relayed_addr(address)
    network: Any = node.host.get_network()
    if live_conn(network, target) is not None:
        return
    try:
        with trio.fail_after(timeout):
            if live_conn(network, relay_id) is None:
                await node.connect(relay_id, [relay_transport], timeout=timeout)
            await _circuit_to(node, network, relay_id, relay_transport, target)
    except trio.TooSlowError:
        raise Unreachable(f"no circuit to {target} via {relay_id} within {timeout:.3g}s") from None


async def _circuit_to(
    node: Node, network: Any, relay_id: ID, relay_transport: Multiaddr, target: ID
) -> None:
    try:
        stream = await node.host.new_stream(relay_id, [HOP_PROTOCOL])
    except TRANSPORT_ERRORS as error:
        raise Unreachable(f"relay {relay_id} refused a hop stream: {error}") from error
    try:
        await write_delimited_msg(
            stream, HopMessage(type=HopMessage.CONNECT, peer=PeerIdMessage(id=target.to_bytes()))
        )
        reply = await read_delimited_msg(stream, HopMessage)
        check_status(reply.type == HopMessage.STATUS, reply.status, f"relay {relay_id}")
        circuit = Multiaddr(relayed_addr(relay_id, relay_transport, target))
        conn = await upgrade_outbound(network, stream, circuit, target)
    except BaseException as error:
        await reset_stream(stream)
        if isinstance(error, MESSAGE_ERRORS) and not isinstance(error, RelayRefused):
            raise Unreachable(f"circuit to {target} via {relay_id} failed: {error}") from error
        raise
    mark_relayed(conn, conn.muxed_conn, circuit, network=network)


def route_through_relays(node: Node, *, timeout: float) -> None:
    """Make the swarm's own dial (every `host.new_stream`, `host.connect`, hence every RPC)
    reach a peer through a relay when we know a checked relayed address for it
    (`node.relayed`): tried before its direct addresses, since a peer announces relayed
    addresses only while it is not reachable inbound. A relay that says the peer holds no
    slot there drops that address; if every circuit fails, the direct dial runs as before.
    One circuit dial per peer at a time (concurrent calls wait for it)."""
    network: Any = node.host.get_network()
    direct_dial = network.dial_peer
    dialing: dict[ID, trio.Event] = {}

    async def dial_peer(peer_id: ID) -> Any:
        while peer_id in dialing:
            await dialing[peer_id].wait()
        conn = live_conn(network, peer_id)
        if conn is not None:
            return [conn]
        if peer_id in node.relayed.relays:  # a relay's own dial: never through a relay
            return await direct_dial(peer_id)
        addrs = [a for a in node.relayed.addrs_of(peer_id) if f"/p2p/{node.peer_id}/" not in a]
        if addrs:
            done = dialing[peer_id] = trio.Event()
            try:
                for addr in addrs:
                    try:
                        await dial_via_relay(node, addr, timeout=timeout)
                    except RelayRefused as error:
                        log.debug("no circuit to %s through %s: %s", peer_id, addr, error)
                        node.relayed.forget(peer_id, addr)
                        continue
                    except Unreachable as error:
                        log.debug("no circuit to %s through %s: %s", peer_id, addr, error)
                        continue
                    conn = live_conn(network, peer_id)
                    if conn is not None:
                        return [conn]
            finally:
                del dialing[peer_id]
                done.set()
        return await direct_dial(peer_id)

    network.dial_peer = dial_peer
