"""Run inside a testbed namespace by tests/test_nat_testbed.py (hole punching through NATs):

    python -m tests.nat_holepunch relay IP                   a relay on IP:31337; prints its address
    python -m tests.nat_holepunch nated OUTSIDE_IP RELAY     reserves on RELAY; prints its relayed address
    python -m tests.nat_holepunch dialer OUTSIDE_IP RELAYED  dials RELAYED through the relay, waits for
                                                             the hole punch, prints a JSON summary

Peers listen on 0.0.0.0:4001 and announce OUTSIDE_IP:4001 (their NAT router's address), as
the testbed's peers do. Every process exits by itself within its deadline.
"""

from __future__ import annotations

import json
import sys

import trio

from peer.net.holepunch import HolePuncher
from peer.net.host import open_node
from peer.net.identity import ephemeral_identity
from peer.net.relay import (
    RelayClient,
    RelayClientConfig,
    RelayService,
    dial_via_relay,
    direct_conn,
    is_relayed,
)
from peer.net.relayed import parse_relayed_addr
from peer.net.rpc import RpcServer

DEADLINE = 90
PORT = 4001


async def main(role: str, ip: str, other: str = "") -> None:
    port = 31337 if role == "relay" else PORT
    async with (
        open_node(
            ephemeral_identity(),
            listen=[f"/ip4/0.0.0.0/tcp/{port}"],
            announce=[f"/ip4/{ip}/tcp/{port}"],
            max_message_bytes=1 << 20,
        ) as node,
        trio.open_nursery() as nursery,
    ):
        if role == "relay":
            await nursery.start(RelayService(node).run)
            print(node.public_addrs()[0], flush=True)
            await trio.sleep(DEADLINE)
            nursery.cancel_scope.cancel()
            return
        puncher = HolePuncher(node)
        await nursery.start(puncher.run)
        if role == "nated":
            server = RpcServer(node.host, "echo", max_message_bytes=1 << 20)

            async def echo(caller: object, text: str) -> str:
                return text

            server.add_unary("echo", str, echo)
            client = RelayClient(node, [other], RelayClientConfig(retry_seconds=1.0))
            await nursery.start(client.run)
            with trio.fail_after(30):
                await client.wait_reserved()
            print(client.relayed_addrs()[0], flush=True)
            await trio.sleep(DEADLINE)
            nursery.cancel_scope.cancel()
            return
        with trio.fail_after(60):
            await dial_via_relay(node, other, timeout=20)
            peer_id = parse_relayed_addr(other)[2]
            try:
                with trio.fail_after(30):
                    direct = await puncher.wait_outcome(peer_id)
            except trio.TooSlowError:
                direct = None
            await trio.sleep(3.0)  # the relayed connection goes after its grace period (2 s)
            echoed = await node.rpc.call(peer_id, "echo", "echo", "hi", str, timeout=20)
        network = node.host.get_network()
        conn = direct_conn(network, peer_id)
        address = conn.muxed_conn.get_remote_address() if conn is not None else None
        kinds = [is_relayed(c.muxed_conn) for c in network.connections.get(peer_id, ())]
        print(
            json.dumps(
                {
                    "outcome": direct,
                    "direct_to": list(address) if address else None,
                    "relayed_conns": kinds,
                    "echo": echoed,
                }
            ),
            flush=True,
        )
        nursery.cancel_scope.cancel()


if __name__ == "__main__":
    trio.run(main, *sys.argv[1:])
