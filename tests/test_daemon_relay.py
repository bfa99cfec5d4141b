"""The daemon wires circuit relay v2 in (peer.daemon, in process, on loopback): a backbone
serves relay; a peer not (yet) found reachable holds a slot on it and announces its relayed
address in its presence record; a third node that knows only that record reaches the peer
through the relay. And relayed addresses from records go through our own relays only."""

from __future__ import annotations

from contextlib import AsyncExitStack
from pathlib import Path

import pytest
import trio
from libp2p.peer.id import ID
from multiaddr import Multiaddr

import peer.dht.protocol as p
from peer.config import PeerConfig, load_config
from peer.daemon import run_daemon
from peer.dht.node import DHT
from peer.errors import ConfigError
from peer.net.host import parse_addrs
from peer.net.relay import direct_conn, is_relayed, route_through_relays
from peer.net.relayed import RelayedAddrError, RelayedBook, check_relayed_addr, is_circuit
from peer.presence import decode_presence, presence_key
from tests.test_relay import WAIT, start_node

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def config_for(tmp_path: Path, name: str, **overrides: object) -> PeerConfig:
    return load_config(
        file=CONFIGS / "debug.toml",
        overrides={"identity.path": str(tmp_path / f"{name}.key"), **overrides},
    ).config


async def test_a_natted_peer_reserves_announces_and_is_reached_through_the_backbone(tmp_path):
    stop = trio.Event()
    with trio.fail_after(WAIT * 3):
        await _natted_peer_reached_through_the_backbone(tmp_path, stop)


async def _natted_peer_reached_through_the_backbone(tmp_path: Path, stop: trio.Event) -> None:
    async with trio.open_nursery() as nursery, AsyncExitStack() as stack:
        backbone = await nursery.start(
            lambda task_status: run_daemon(
                config_for(tmp_path, "bb"), stop, role="backbone", task_status=task_status
            )
        )
        seed = backbone.public_addrs()[0]
        # It announces a port nobody listens on: the backbone's dial-back fails, and once it
        # says so (its first measurement, after a second of training: a batch it cannot fill
        # alone keeps it computing) the peer reserves a slot.
        peer_config = config_for(
            tmp_path,
            "p1",
            **{
                "collaboration.backbones": [seed],
                "relay.holepunch": False,
                "net.announce": ["/ip4/127.0.0.1/tcp/9"],
                "task.target_batch": 1 << 30,
            },
        )
        peer = await nursery.start(
            lambda task_status: run_daemon(peer_config, stop, role="peer", task_status=task_status)
        )
        relayed = f"/p2p/{backbone.peer_id}/p2p-circuit/p2p/{peer.peer_id}"
        with trio.fail_after(WAIT):
            while not any(a.endswith(relayed) for a in peer.public_addrs()):
                await trio.sleep(0.05)

        # A third node, told only the backbone, reads the peer's presence from the DHT.
        reader = await start_node(stack)
        reader.relayed.relays = {backbone.peer_id: Multiaddr(seed.split("/p2p/")[0])}
        route_through_relays(reader, timeout=WAIT)
        dht = DHT(reader, PeerConfig().dht, server=False, rpc_timeout=10)
        reading = await stack.enter_async_context(trio.open_nursery())
        await reading.start(dht.run)
        with trio.fail_after(WAIT):
            await dht.bootstrap([(backbone.peer_id, Multiaddr(seed.split("/p2p/")[0]))])
            record = None
            while record is None or not any(is_circuit(a) for a in record.addrs):
                records = decode_presence(await dht.get(presence_key("default")))
                record = next((r for r in records if r.peer_id == str(peer.peer_id)), None)
                await trio.sleep(0.1)
        # The backbone could not dial the peer, so the peer never announced itself to the
        # DHT (not even while joining): nobody's lookups wait out a dial to it.
        with trio.fail_after(WAIT):
            known = await reader.rpc.call(
                backbone.peer_id, p.SERVICE, "find_node", p.FindNode(bytes(32), None), p.Nodes,
                timeout=WAIT,
            )  # fmt: skip
        assert str(peer.peer_id) not in {c.peer_id for c in known.nodes}
        # Only the relayed address: the direct one would work on loopback (the reader's DHT
        # lookups may have met the peer directly: forgotten).
        await reader.disconnect(peer.peer_id)
        reader.host.get_peerstore().clear_addrs(peer.peer_id)
        reader.remember_addrs(peer.peer_id, [a for a in parse_addrs(record.addrs) if is_circuit(a)])
        assert peer.peer_id not in reader.host.get_peerstore().peers_with_addrs()
        with trio.fail_after(WAIT):
            nodes = await reader.rpc.call(
                peer.peer_id, p.SERVICE, "find_node", p.FindNode(bytes(32), None), p.Nodes,
                timeout=WAIT,
            )  # fmt: skip
        assert isinstance(nodes, p.Nodes)
        conns = reader.host.get_network().connections[peer.peer_id]
        assert [is_relayed(c.muxed_conn) for c in conns] == [True]
        assert direct_conn(reader.host.get_network(), peer.peer_id) is None
        reading.cancel_scope.cancel()
        stop.set()


def test_relayed_addresses_from_records_go_through_our_relays_only():
    relay = ID.from_base58("12D3KooWGzh7oyZ5oHBHnGN5BfKbv6ADfxAFS1wH3UAXYkHhEyUU")
    stranger = ID.from_base58("12D3KooWHFx1vyDGCsEX4dzUjmdUyPRhqoAv4gFtU3KtWq7C6QzP")
    target = ID.from_base58("12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK")
    ours = {relay: Multiaddr("/ip4/198.51.100.1/tcp/31337")}
    good = f"/ip4/203.0.113.9/tcp/1/p2p/{relay}/p2p-circuit/p2p/{target}"
    # Our relay, at the address *we* know for it (not the one in the record).
    assert check_relayed_addr(good, peer_id=target, relays=ours) == (
        f"/ip4/198.51.100.1/tcp/31337/p2p/{relay}/p2p-circuit/p2p/{target}"
    )
    refused = {
        f"/ip4/198.51.100.1/tcp/31337/p2p/{stranger}/p2p-circuit/p2p/{target}": "not one of our",
        f"/ip4/198.51.100.1/tcp/31337/p2p/{relay}/p2p-circuit/p2p/{stranger}": "names target",
        f"/ip4/198.51.100.1/tcp/31337/p2p/{relay}/p2p-circuit": "is not of the form",
        f"/ip4/198.51.100.1/tcp/31337/p2p-circuit/p2p/{target}": "is not of the form",
    }
    for addr, why in refused.items():
        with pytest.raises(RelayedAddrError, match=why):
            check_relayed_addr(addr, peer_id=target, relays=ours)
    book = RelayedBook(ours)
    assert book.learn(target, [*refused, good]) == [
        check_relayed_addr(good, peer_id=target, relays=ours)
    ]
    assert book.refused == len(refused)
    assert RelayedBook().learn(target, [good]) == []  # no relays configured: none accepted
    # A backbone is never dialled through a relay, itself included (that dial waited on
    # itself until its timeout, at every redial).
    looped = f"/ip4/198.51.100.1/tcp/31337/p2p/{relay}/p2p-circuit/p2p/{relay}"
    with pytest.raises(RelayedAddrError, match="names a backbone"):
        check_relayed_addr(looped, peer_id=relay, relays=ours)


def test_dht_contacts_teach_no_relayed_addresses():
    """In a lookup's reply the replier names each contact: a relayed address there could route
    our dials to anyone through a relay of the replier's choosing. Only a peer's own signed
    records teach those (DHT servers are reachable inbound and need none)."""
    from peer.dht.node import direct_addrs

    relay = "12D3KooWGzh7oyZ5oHBHnGN5BfKbv6ADfxAFS1wH3UAXYkHhEyUU"
    target = "12D3KooWRBy97UB99e3J6hiPesre1MZeuNQvfan4gBziswrRJsNK"
    circuit = f"/ip4/198.51.100.1/tcp/31337/p2p/{relay}/p2p-circuit/p2p/{target}"
    direct = "/ip4/203.0.113.9/tcp/4001"
    assert direct_addrs([circuit, f"{direct}/p2p/{target}"]) == [Multiaddr(direct)]
    assert direct_addrs(["/unix/%2Fp2p-circuit"]) == []  # a circuit once parsed (review)


async def test_a_node_keeps_relayed_addresses_of_strangers_out_of_its_peerstore():
    async with AsyncExitStack() as stack:
        node = await start_node(stack)
        relay = await start_node(stack)
        target = await start_node(stack)
        node.relayed.relays = {relay.peer_id: relay.announce[0]}
        foreign = f"{target.announce[0]}/p2p/{target.peer_id}/p2p-circuit/p2p/{target.peer_id}"
        ours = f"/ip4/192.0.2.1/tcp/9/p2p/{relay.peer_id}/p2p-circuit/p2p/{target.peer_id}"
        node.remember_addrs(target.peer_id, parse_addrs([foreign, ours]))
        assert node.relayed.addrs_of(target.peer_id) == [
            f"{relay.announce[0]}/p2p/{relay.peer_id}/p2p-circuit/p2p/{target.peer_id}"
        ]
        # Neither went to the peerstore (the swarm would dial the relay's address as the
        # target's).
        assert target.peer_id not in node.host.get_peerstore().peers_with_addrs()


def test_relay_limits_that_contradict_each_other_are_one_line_config_errors():
    with pytest.raises(ConfigError, match=r"relay\.max_circuits_per_peer = 100.*max_circuits"):
        load_config(overrides={"relay.max_circuits_per_peer": 100})
    with pytest.raises(ConfigError, match=r"relay\.circuit_bytes = 0"):
        load_config(overrides={"relay.circuit_bytes": 0})
    config = load_config(env={"PEERTRAIN_RELAY_SERVE": "false"}).config
    assert config.relay.serve is False and config.relay.reserve is True
