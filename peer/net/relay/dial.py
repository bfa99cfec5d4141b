"""Dialing a peer behind NAT through a circuit (any node): CONNECT through its relay, then the
network key, Noise with the target's peer id expected, and yamux inside the circuit."""

from __future__ import annotations

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
    mark_relayed(conn, conn.muxed_conn, circuit)
