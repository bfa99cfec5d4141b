"""The libp2p host every peertrain node runs: TCP, Noise only, yamux.

py-libp2p 0.8.1 defaults that we override, and why (see docs/ARCHITECTURE.md):
- security: its default offers Noise, TLS, SECIO *and plaintext*; a plaintext-only dialer would
  get an unauthenticated session. We offer Noise alone.
- dialing: `Swarm.dial_peer` waits out a 250 ms happy-eyeballs delay after every dial unless the
  per-peer connection limit is reached; with a limit of 1 the first success ends the wait.
- the auto-connector dials up to 200 peers from the peerstore to reach a watermark; our DHT
  decides whom to talk to, so it is stopped.
- a failed dial is retried 3 times with backoff (0.7 s) before failing, which makes every dead
  contact in a DHT lookup cost that much; we dial once and let our own callers retry.
- the negative dial cache blocks a peer for 60 s after one failed dial, which would defeat our
  retries against a restarting backbone; we shorten it.
- its TCP listener sets SO_REUSEPORT (for hole punching), so a second daemon asking for a port
  that is taken binds anyway and the kernel splits incoming connections between the two; we
  check fixed ports with a plain bind first.
- the resource manager refuses connections when the process uses > 80 % of RAM, which a
  training process may well do; memory limits are off (our own caps bound what peers send).
- inbound connections: it takes one of 250 inbound slots at TCP accept, before the pnet/Noise
  handshake, holds it up to 10 s for a connection that sends nothing, and (once authenticated)
  until the *swarm* stops, not until the connection closes: a few hundred idle TCP connections
  kept newcomers out, and after 250 inbound connections in its lifetime a node refused
  everyone (a backbone in the soak). `peer.net.inbound` replaces that handler: per-source and
  total caps on handshakes, a short handshake deadline, pruning of authenticated connections
  well below py-libp2p's caps, and a task that ends when its connection closes.
- a dial tries ONE address per transport class (for TCP: the first the peerstore lists), and
  identify fills the peerstore with the remote's *listen* addresses, 0.0.0.0 included: after a
  partition cut a backbone's connection, its peers redialled 0.0.0.0 and failed for minutes.
  The peerstore hides unspecified addresses, and an explicit `connect` dials the addresses it
  is given.
- three of its classes need fixes no setting reaches (yamux receive windows, IPv6 remote
  addresses, a non-UTF-8 protocol line): `peer.net.libp2p_patches`, applied in `create_host`.
- identify: every new connection runs an identify exchange in the background, from both
  ends: ~40 % of a connection's CPU (measured in one process, both ends: 15-19 ms -> 9-11 ms
  per connection and first stream), taken from the DHT lookup that dialed. Nothing of ours
  reads what it stores (callers give the addresses they dial, Noise authenticates the key),
  so we start none; we still answer a remote's identify request.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import psutil
import trio
from libp2p import new_host
from libp2p.abc import IHost
from libp2p.crypto.x25519 import create_new_key_pair as create_x25519_key_pair
from libp2p.network.config import ConnectionConfig, RetryConfig
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.rcmgr import new_resource_manager
from libp2p.security.noise.transport import PROTOCOL_ID as NOISE_PROTOCOL_ID
from libp2p.security.noise.transport import Transport as NoiseTransport
from multiaddr import Multiaddr

from peer.errors import ConfigError, Unreachable
from peer.net.identity import Identity
from peer.net.inbound import InboundGate, InboundLimits
from peer.net.inbound import install as install_inbound_gate
from peer.net.libp2p_patches import patch_libp2p
from peer.net.relayed import RelayedBook, is_circuit
from peer.net.rpc import TRANSPORT_ERRORS, RpcClient

log = logging.getLogger("peertrain.host")

NEGATIVE_DIAL_CACHE_SECONDS = 1.0
DEFAULT_INBOUND = InboundLimits()
PEERSTORE_ADDR_TTL = 3600


def parse_multiaddr(text: str, *, what: str) -> Multiaddr:
    try:
        return Multiaddr(text)
    except Exception as error:  # the multiaddr package raises several unrelated types
        raise ConfigError(
            f"{what} {text!r} is not a valid multiaddr ({error}); expected e.g. /ip4/203.0.113.5/tcp/31337"
        ) from None


def parse_addrs(texts: Sequence[str]) -> list[Multiaddr]:
    """The transport parts of the addresses that parse (a peer's /p2p/<id> suffix dropped),
    relayed ones (`.../p2p-circuit/p2p/<id>`) whole: `Node.remember_addrs` and `Node.connect`
    check those against our relays. For addresses other peers sent, where a bad one is
    skipped, not fatal."""
    return [addr for addr in map(_parse_addr, texts) if addr is not None]


@functools.lru_cache(maxsize=8192)
def _parse_addr(text: str) -> Multiaddr | None:
    """One address of `parse_addrs`, None if it does not parse. Cached: DHT replies name the
    same nodes' addresses over and over, and parsing them was a tenth of the CPU of a
    300-peer simulation."""
    try:
        return Multiaddr(text if is_circuit(text) else text.split("/p2p/")[0])
    except Exception:  # the multiaddr package raises several unrelated types
        return None


def split_peer_addr(text: str, *, what: str) -> tuple[ID, Multiaddr]:
    """`/ip4/1.2.3.4/tcp/5/p2p/12D3...` -> (peer id, transport address)."""
    maddr = parse_multiaddr(text, what=what)
    try:
        peer_b58 = maddr.value_for_protocol("p2p")
    except Exception:
        peer_b58 = None
    if not peer_b58:
        raise ConfigError(
            f"{what} {text!r} has no /p2p/<peer id> part; copy the full address a backbone prints"
        )
    return ID.from_base58(peer_b58), maddr.decapsulate(Multiaddr(f"/p2p/{peer_b58}"))


def create_host(
    identity: Identity, network_key: str | None = None, *, inbound: InboundGate | None = None
) -> IHost:
    """`network_key` (64 hex digits): a private network, see `peer.net.network_key`.
    `inbound`: the gate for inbound connections (default: one with the default limits)."""
    gate = inbound if inbound is not None else InboundGate(DEFAULT_INBOUND)
    noise = NoiseTransport(identity.key_pair, noise_privkey=create_x25519_key_pair().private_key)
    host = new_host(
        key_pair=identity.key_pair,
        sec_opt={NOISE_PROTOCOL_ID: noise},
        muxer_preference="YAMUX",
        connection_config=ConnectionConfig(
            max_connections_per_peer=1,
            dial_timeout=5.0,
            inbound_upgrade_timeout=gate.limits.handshake_seconds,
        ),
        resource_manager=new_resource_manager(enable_memory_limits=False),
        psk=network_key,
    )
    network = host.get_network()
    install_inbound_gate(network, gate)
    # One dial attempt: retries belong to callers that know whether they are worth it.
    network.retry_config = RetryConfig(max_retries=0)  # type: ignore[attr-defined]
    # Private attribute of the pinned py-libp2p version; see the module docstring.
    network._negative_peer_cache._ttl = NEGATIVE_DIAL_CACHE_SECONDS  # type: ignore[attr-defined]
    # Private method of the pinned py-libp2p version (every identify it starts goes through
    # it: on connect, on a new connection, on a stream); see the module docstring.
    host._schedule_identify = _no_identify  # type: ignore[attr-defined]
    _hide_unspecified_addrs(host.get_peerstore())
    patch_libp2p()
    return host


def _no_identify(peer_id: ID, *, reason: str) -> None:
    """Stands in for `BasicHost._schedule_identify`: start no identify exchange."""


def _hide_unspecified_addrs(peerstore: Any) -> None:
    """Make `peerstore.addrs` leave out 0.0.0.0 and :: (a listener's "every interface", never
    a remote's address): the swarm dials only the first TCP address it returns."""
    every = peerstore.addrs

    def dialable(peer_id: ID) -> list[Multiaddr]:
        return [addr for addr in every(peer_id) if not _unspecified(addr)]

    peerstore.addrs = dialable


def _unspecified(addr: Multiaddr) -> bool:
    for protocol in ("ip4", "ip6"):
        try:
            value = addr.value_for_protocol(protocol)
        except Exception:  # no such part in this address
            continue
        if value and ipaddress.ip_address(value).is_unspecified:
            return True
    return False


def _interface_ips(family: str = "AF_INET") -> list[str]:
    ips = []
    for addrs in psutil.net_if_addrs().values():
        for addr in addrs:
            # An IPv6 link-local address needs its interface (%eth0) to be dialled: left out.
            if addr.family.name == family and "%" not in addr.address:
                ips.append(addr.address)
    # Addresses another machine can use come first; loopback last.
    return sorted(set(ips), key=lambda ip: (ipaddress.ip_address(ip).is_loopback, ip))


def ip_tcp(text: str) -> tuple[str, int] | None:
    """(ip, port) of exactly `/ip4/<ip>/tcp/<port>` or `/ip6/<ip>/tcp/<port>`, else None."""
    try:
        maddr = Multiaddr(text)
        names = [p.name for p in maddr.protocols()]
        if names not in (["ip4", "tcp"], ["ip6", "tcp"]):
            return None
        return str(maddr.value_for_protocol(names[0])), int(maddr.value_for_protocol("tcp"))
    except Exception:  # the multiaddr package raises several unrelated types
        return None


def ip_version(ip: str) -> int:
    """4 or 6; ValueError if `ip` is no IP literal."""
    return ipaddress.ip_address(ip).version


def tcp_multiaddr(ip: str, port: int) -> Multiaddr:
    """`/ip4/<ip>/tcp/<port>` or `/ip6/...`, whichever `ip` is."""
    return Multiaddr(f"/ip{ip_version(ip)}/{ip}/tcp/{port}")


def host_of(text: str) -> str | None:
    """The IP literal an `/ip4/...` or `/ip6/...` multiaddr starts with, else None (also for
    a relayed address: its IP is the relay's)."""
    try:
        maddr = Multiaddr(text)
        names = [p.name for p in maddr.protocols()]
        if names[0] not in ("ip4", "ip6") or "p2p-circuit" in names:
            return None
        return str(maddr.value_for_protocol(names[0]))
    except Exception:  # not a multiaddr, or no parts
        return None


def dialable_addrs(bound: Sequence[Multiaddr]) -> list[Multiaddr]:
    """Expand wildcard listen addresses (0.0.0.0, ::) into one address per local interface
    of that family."""
    out: list[Multiaddr] = []
    for maddr in bound:
        ip = host_of(str(maddr))
        if ip in ("0.0.0.0", "::"):
            kind, family = ("ip4", "AF_INET") if ip == "0.0.0.0" else ("ip6", "AF_INET6")
            rest = str(maddr).removeprefix(f"/{kind}/{ip}")
            out.extend(Multiaddr(f"/{kind}/{local}{rest}") for local in _interface_ips(family))
        else:
            out.append(maddr)
    return out


@dataclass
class Node:
    """A running host with its RPC client and the addresses it advertises."""

    host: IHost
    identity: Identity
    rpc: RpcClient
    announce: list[Multiaddr]
    network_key: str | None = None
    """The private network's key, if any (a second host, e.g. for dial-backs, needs it too)."""
    inbound: InboundGate | None = None
    """The gate in front of inbound connections (its `statistics()` for status views)."""
    relayed: RelayedBook = field(default_factory=RelayedBook)
    """Relayed addresses learned for other peers, checked against our relays (`relayed.relays`:
    the backbones we were configured with); `peer.net.relay.route_through_relays` dials them."""
    relayed_announce: Callable[[], list[str]] = list
    """Our own relayed addresses (a `RelayClient`'s `relayed_addrs` while we hold slots)."""
    punch_observed: list[str] = field(default_factory=list)
    """Where backbones saw a dial from our listen port come from, when that is where peers
    can punch to us and we do not announce it (`peer.measure.reachability.punch_address`):
    offered in hole punches beside `announce` (`peer.net.holepunch.punch_addrs`)."""

    @property
    def peer_id(self) -> ID:
        return self.identity.peer_id

    @property
    def network_key_bytes(self) -> bytes | None:
        """The network key as bytes: the data ports' admission proves it (peer.net.admission)."""
        return bytes.fromhex(self.network_key) if self.network_key else None

    def public_addrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) that other machines can dial: the announced
        direct ones, then the relayed ones while we hold relay slots."""
        return [f"{addr}/p2p/{self.peer_id}" for addr in self.announce] + self.relayed_announce()

    def remember_addrs(self, peer_id: ID, addrs: Sequence[Multiaddr]) -> None:
        """Direct addresses go to the peerstore; relayed ones to `relayed`, if they pass
        `check_relayed_addr` (a relay that is not ours, or another target: dropped)."""
        if peer_id == self.peer_id or not addrs:
            return
        direct = [addr for addr in addrs if not is_circuit(addr)]
        if len(direct) < len(addrs):
            self.relayed.learn(peer_id, [addr for addr in addrs if is_circuit(addr)])
        if direct:
            self.host.get_peerstore().add_addrs(peer_id, direct, PEERSTORE_ADDR_TTL)

    async def connect(self, peer_id: ID, addrs: Sequence[Multiaddr], *, timeout: float) -> None:
        """Connect through `addrs` (e.g. a backbone's address from the command line): direct
        ones replace what identify told the peerstore, since a dial tries only the first one;
        relayed ones are checked and kept (the swarm's dial then goes through the relay,
        see `peer.net.relay.route_through_relays`)."""
        direct = [addr for addr in addrs if not is_circuit(addr)]
        if direct:
            self.host.get_peerstore().clear_addrs(peer_id)
        self.remember_addrs(peer_id, addrs)
        try:
            with trio.fail_after(timeout):
                await self.host.connect(PeerInfo(peer_id, direct))
        except trio.TooSlowError:
            raise Unreachable(f"no answer from {peer_id} within {timeout:.3g}s") from None
        except TRANSPORT_ERRORS as error:
            raise Unreachable(f"cannot connect to {peer_id}: {error}") from None

    async def disconnect(self, peer_id: ID) -> None:
        """Close our connection to a peer that stopped answering: py-libp2p has no keepalive,
        so a connection the network cut (a partition, a blackhole) stays open, and TCP's
        retransmission backoff grows to tens of seconds over a cut; after the heal, calls over
        it stay dead that long. The next call dials afresh."""
        self.rpc.forget(peer_id)
        with trio.move_on_after(1.0):
            await _close_peer(self.host.get_network(), peer_id)


@asynccontextmanager
async def open_node(
    identity: Identity,
    *,
    listen: Sequence[str],
    announce: Sequence[str],
    max_message_bytes: int,
    network_key: str | None = None,
    inbound: InboundLimits = DEFAULT_INBOUND,
) -> AsyncIterator[Node]:
    """`inbound`: limits on inbound connections, see `peer.net.inbound`."""
    listen_addrs = [parse_multiaddr(text, what="listen address") for text in listen]
    announce_addrs = [parse_multiaddr(text, what="announce address") for text in announce]
    _check_ports_free(listen_addrs)
    gate = InboundGate(inbound)
    host = create_host(identity, network_key, inbound=gate)
    started = False
    try:
        async with host.run(listen_addrs=listen_addrs):
            started = True
            # See the module docstring: our DHT chooses connections, not the auto-connector.
            await host.get_network().auto_connector.stop()  # type: ignore[attr-defined]
            bound = [Multiaddr(str(a).split("/p2p/")[0]) for a in host.get_addrs()]
            node = Node(
                host,
                identity,
                RpcClient(host, max_message_bytes=max_message_bytes),
                announce_addrs or dialable_addrs(bound),
                network_key,
                gate,
            )
            try:
                yield node
            finally:
                # py-libp2p's TCP listener accepts in a trio system task that outlives the
                # host; its swarm closes it in a `finally` that runs cancelled, so close() is
                # cancelled at its first await: a stopped node kept its port and went on
                # accepting ("[ADDCONN_FAIL] Cannot schedule task after service has stopped").
                with trio.CancelScope(shield=True), trio.move_on_after(1.0):
                    for listener in list(host.get_network().listeners.values()):
                        await listener.close()
                # Swarm.close() closes connections one by one with sleeps (seconds with ~20
                # peers); cap it so a stopping daemon keeps its 3 s promise.
                await _close_connections(host)
    except OSError as error:
        if started:
            raise
        raise ConfigError(
            f"cannot listen on {', '.join(listen)}: {error.strerror or error}; pick another --port"
        ) from None


def _check_ports_free(listen_addrs: Sequence[Multiaddr]) -> None:
    for maddr in listen_addrs:
        error = bind_error(maddr)
        if error is not None:
            raise ConfigError(
                f"cannot listen on {maddr}: {error.strerror or error}; pick another --port"
            )


def bind_error(maddr: Multiaddr) -> OSError | None:
    """Why a plain bind of an ip4/ip6 tcp address with a fixed port fails (None: it binds, or
    the address is not ip/tcp with a fixed port). libp2p's own listener sets SO_REUSEPORT and
    would bind a taken port anyway."""
    parsed = ip_tcp(str(maddr))
    if parsed is None or parsed[1] == 0:  # not an ip/tcp address: nothing of ours to check
        return None
    ip, port = parsed
    family = socket.AF_INET6 if ip_version(ip) == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is fine
        try:
            probe.bind((ip, port))
        except OSError as error:
            return error
    return None


async def _close_connections(host: IHost) -> None:
    network = host.get_network()
    with trio.CancelScope(shield=True), trio.move_on_after(1.0):
        async with trio.open_nursery() as nursery:
            for peer_id in list(network.connections):
                nursery.start_soon(_close_peer, network, peer_id)


async def _close_peer(network: object, peer_id: ID) -> None:
    with suppress(TRANSPORT_ERRORS):
        await network.close_peer(peer_id)  # type: ignore[attr-defined]


def data_plane_hosts(node: Node, listen: Sequence[str]) -> tuple[str, str]:
    """(address to bind, address others dial) for the data plane's TCP ports: the IP (v4 or
    v6) of the first listen address, and of the first announced one."""
    bind = (host_of(listen[0]) if listen else None) or "0.0.0.0"
    advertised = (host_of(str(node.announce[0])) if node.announce else None) or bind
    return bind, advertised
