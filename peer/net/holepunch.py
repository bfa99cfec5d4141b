"""Hole punching: turn a relayed connection into a direct TCP one (DCUtR's steps, our wire).

Theory of operation (libp2p/specs relay/DCUtR.md; messages of our own, framed msgpack)
-----------------------------------------------------------------------------------------
A reached B through a relay (B is behind NAT and accepted the circuit). B, the end that
accepted it, opens `/peertrain/holepunch/1` over the relayed connection:

    B -> A  Connect{addrs}   B's direct addresses (IP/TCP, what it announces)
    A -> B  Connect{addrs}   A's                             (B measures the round trip)
    B -> A  Sync             A dials B's addresses at once;
                             B waits rtt/2 + `sync_margin`, then dials A's addresses

Both dial *from their listen port* (py-libp2p's listener sets SO_REUSEPORT, and
`Swarm.dial_addr(..., source=)` binds the dial to it), so each NAT maps the dial to the
address its peer announced, and each NAT lets the other's SYN in once its own SYN has gone
out: TCP simultaneous open merges the two dials into one connection. The roles on it are
fixed: A upgrades as the initiator (`Swarm.dial_addr`), B as the responder
(`Swarm.dial_addr_as_responder`). B dials last, so where nothing filters (loopback, a
full-cone NAT) A's SYN reaches B's listener first, and B's listener answers as responder
too; B's own dial then finds the connection exists. The direct connection is upgraded by the
swarm as any other: the network key (pnet), Noise with the expected peer id (a connection
that authenticates as anyone else is closed), yamux.

On success the relayed connection is closed after `relay_grace_seconds` (streams opened on
it before the upgrade get to finish), and `connected_directly(peer)` says so. On failure
(a symmetric NAT maps every destination to a new port: nothing to aim at) both stay on the
relayed connection; nothing is retried until a new relayed connection is made.

What the remote sends is hostile: at most `MAX_ADDRS` distinct addresses, each
`/ip4|ip6/<ip>/tcp/<port>` and acceptable to `check_dial_address` (no loopback, link-local or
unspecified address unless ours is one too; no private-network address unless ours is one too),
dialed once per attempt, each dial bounded, with the peer id Noise must prove: the remote
cannot make us talk to a third party beyond a few SYNs. Nor can it ask again and again: as
DCUtR, A answers only on a relayed connection that A dialed (`relayed_inbound` is False: the
end that accepted the circuit asks), and only once per relayed connection; and every attempt,
at either end, takes a token from the peer's bucket and from one that all peers share
(`PunchBudget`), so neither reconnecting nor fresh peer ids buy more than `total_attempts`
attempts per `total_window_seconds`. One attempt per peer at a time, `max_concurrent` in all;
the stream and each message are bounded in time and size; a peer's bad message ends that
attempt only.
"""

from __future__ import annotations

import ipaddress
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
import trio
from libp2p.abc import IMuxedConn, INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.errors import DECODE_ERRORS, ProtocolError
from peer.net.admission import check_dial_address, unmapped
from peer.net.host import Node, ip_tcp, ip_version, tcp_multiaddr
from peer.net.ratelimit import ByteBudgets
from peer.net.relay.internals import (
    direct_conn,
    is_relayed,
    note_punch,
    relayed_inbound,
    stream_on,
    watch_relayed,
)
from peer.net.rpc import TRANSPORT_ERRORS, FramedStream

log = logging.getLogger("peertrain.holepunch")

PROTOCOL = "/peertrain/holepunch/1"
MAX_ADDRS = 8
MAX_MESSAGE_BYTES = 4096
MAX_OUTCOMES = 4096

Addr = Annotated[str, msgspec.Meta(max_length=128)]


class Connect(msgspec.Struct, tag="connect"):
    addrs: Annotated[list[Addr], msgspec.Meta(max_length=MAX_ADDRS)]


class Sync(msgspec.Struct, tag="sync"):
    pass


Message = Connect | Sync
_encode = msgspec.msgpack.Encoder().encode
_decoder = msgspec.msgpack.Decoder(Message)


@dataclass(frozen=True, kw_only=True)
class HolePunchConfig:
    """How two peers joined through a relay try for a direct connection."""

    message_seconds: float = 10.0
    """Seconds for each message of the exchange to arrive."""
    dial_seconds: float = 5.0
    """Seconds each direct dial may take."""
    sync_margin: float = 0.05
    """Seconds the accepting end waits beyond rtt/2, so that the other end's SYN leaves first."""
    relay_grace_seconds: float = 2.0
    """Seconds the relayed connection stays open after a direct one is made."""
    failed_relay_seconds: float = 60.0
    """Seconds the relayed connection stays open after its punch failed. It carries control
    RPCs only (no tensors go through a relay), and holds one of the relay's `max_circuits`
    while open: kept for the circuit's whole `circuit_seconds` (600), the relayed
    connections that never punched held every circuit of both relays at 100 simulated peers,
    and every new connection to a peer behind NAT failed. The next RPC dials a new circuit."""
    max_concurrent: int = 16
    """Attempts running at once (more relayed connections wait for a turn)."""
    peer_attempts: int = 3
    """Attempts with one peer (either end) in a burst, refilled over `peer_window_seconds`:
    each dials up to `MAX_ADDRS` addresses that peer named."""
    peer_window_seconds: float = 600.0
    """Seconds over which a peer's `peer_attempts` refill."""
    total_attempts: int = 64
    """Attempts with all peers together in a burst, refilled over `total_window_seconds`
    (peer ids are free: this bounds the dials that many of them can buy)."""
    total_window_seconds: float = 60.0
    """Seconds over which `total_attempts` refill."""


@dataclass(frozen=True)
class HolePunchStatistics:
    attempts: int
    direct: int
    failed: int
    refused: int
    """Requests not answered (wrong end of the circuit, asked again, over budget, busy)."""


class PunchBudget:
    """Which hole punch attempts may start, pure (the clock is passed in): a token bucket per
    peer (`peer_attempts` per `peer_window_seconds`) and one for all peers together
    (`total_attempts` per `total_window_seconds`). The peer's bucket is asked first, so a
    peer that asks too often does not spend the others' tokens."""

    def __init__(self, config: HolePunchConfig) -> None:
        self._per_peer = ByteBudgets(
            capacity=config.peer_attempts, window=config.peer_window_seconds
        )
        self._total = ByteBudgets(
            capacity=config.total_attempts, window=config.total_window_seconds, max_callers=1
        )

    def try_start(self, peer_id: object, *, now: float) -> bool:
        """Take a token for an attempt with `peer_id` at `now` from both buckets; False: one
        of them has none left, refuse it and take none (a refusal for the shared bucket,
        which free identities can drain, costs the peer nothing: review find)."""
        if self._per_peer.available(peer_id, now=now) < 1:
            return False
        if self._total.try_spend(None, 1, now=now):
            return False
        return not self._per_peer.try_spend(peer_id, 1, now=now)


def punch_addrs(node: Node) -> list[str]:
    """Our addresses worth aiming at: the announced IP/TCP ones (a NATed peer may announce its
    router's outside address; see docs/ARCHITECTURE.md, "Relay"), then the one backbones saw
    our listen port mapped to (`Node.punch_observed`)."""
    out = []
    for addr in [*node.announce, *node.punch_observed]:
        parsed = ip_tcp(str(addr))
        if parsed is not None and str(addr) not in out:
            out.append(str(addr))
    return out[:MAX_ADDRS]


PRIVATE_NETWORKS = tuple(
    ipaddress.ip_network(n)
    for n in (
        "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "fc00::/7",
        "fec0::/10",
    )
)  # fmt: skip
"""RFC 1918, carrier-grade NAT (RFC 6598), unique local (RFC 4193) and site-local IPv6."""
NAT64 = ipaddress.ip_network("64:ff9b::/96")


def in_private_network(ip: str) -> bool:
    """Whether `ip` is in a private network; an IPv4-mapped or NAT64 IPv6 address as the
    IPv4 address it carries (a socket dials that)."""
    address = unmapped(ip)
    if address in NAT64:
        address = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return any(address in network for network in PRIVATE_NETWORKS)


def private_targets_ok(own_addrs: list[str]) -> bool:
    """Whether we may aim punches at private-network addresses: only if all of our own punch
    addresses (`punch_addrs`) are private (one site, or the NAT testbed). A peer that
    announces, or was seen at, a public address is reached from the internet, and its peers'
    private addresses are not on its site."""
    hosts = [parsed[0] for a in own_addrs if (parsed := ip_tcp(a)) is not None]
    return bool(hosts) and all(in_private_network(h) for h in hosts)


def check_punch_addrs(
    addrs: list[str], *, own_host: str, private_ok: bool | None = None
) -> list[Multiaddr]:
    """The addresses a peer sent that we may dial (see the module docstring); others skipped.
    An address in a private network only if `private_ok` (default: `own_host` is in one): a
    peer cannot aim our SYNs into the networks behind a public one. Each address once,
    however it is written (an IPv4-mapped IPv6 address as the IPv4 one it dials)."""
    out = []
    seen = set()
    own_private = in_private_network(own_host) if private_ok is None else private_ok
    for text in addrs[:MAX_ADDRS]:
        parsed = ip_tcp(text)
        if parsed is None:
            continue
        try:
            check_dial_address(*parsed, own_host=own_host)
        except ProtocolError:
            continue
        if in_private_network(parsed[0]) and not own_private:
            continue
        target = (unmapped(parsed[0]), parsed[1])
        if target not in seen:
            seen.add(target)
            out.append(tcp_multiaddr(*parsed))
    return out


def listen_source(node: Node, family: int = 4) -> tuple[str, int] | None:
    """(ip, port) of our first TCP listener of IP version `family`: dials leave from it."""
    for addr in node.host.get_addrs():
        parsed = ip_tcp(str(addr).split("/p2p/")[0])
        if parsed is not None and parsed[1] and ip_version(parsed[0]) == family:
            return parsed
    return None


class HolePuncher:
    """Upgrades relayed connections to direct ones; `run` inside the owner's nursery."""

    def __init__(self, node: Node, config: HolePunchConfig | None = None) -> None:
        self.node = node
        self.config = config or HolePunchConfig()
        self._limit = trio.CapacityLimiter(self.config.max_concurrent)
        self._budget = PunchBudget(self.config)
        self._busy: set[ID] = set()
        # Relayed connections a hole punch was asked for on (A's end): one each, as DCUtR.
        self._asked: weakref.WeakSet[IMuxedConn] = weakref.WeakSet()
        self._outcomes: dict[ID, bool] = {}
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._attempts = self._direct = self._failed = self._refused = 0

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        host = self.node.host
        host.set_stream_handler(PROTOCOL, self._handle)
        unwatch = watch_relayed(host.get_network(), self._on_relayed)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started()
                await trio.sleep_forever()
        finally:
            self._nursery = None
            unwatch()
            host.remove_stream_handler(PROTOCOL)

    def connected_directly(self, peer_id: ID) -> bool:
        """Whether we hold a connection to `peer_id` that does not run through a relay."""
        return direct_conn(self.node.host.get_network(), peer_id) is not None

    def outcome(self, peer_id: ID) -> bool | None:
        """The last attempt with `peer_id`: True (direct), False (failed), None (none yet)."""
        return self._outcomes.get(peer_id)

    async def wait_outcome(self, peer_id: ID) -> bool:
        """Until an attempt with `peer_id` has ended; its result."""
        while peer_id not in self._outcomes:
            await self._changed.wait()
        return self._outcomes[peer_id]

    def statistics(self) -> HolePunchStatistics:
        return HolePunchStatistics(self._attempts, self._direct, self._failed, self._refused)

    # ------------------------------------------------------------------ both ends

    def _on_relayed(self, peer_id: ID, inbound: bool) -> None:
        """A relayed connection came up: the end that accepted it starts the exchange, if
        the budget allows (a peer can dial us through a relay again and again)."""
        self._outcomes.pop(peer_id, None)
        if not inbound or self._nursery is None or peer_id in self._busy:
            return
        if not self._budget.try_start(peer_id, now=trio.current_time()):
            self._refuse(peer_id)
            return
        self._busy.add(peer_id)
        self._nursery.start_soon(self._initiate, peer_id)

    def _refuse(self, peer_id: ID) -> None:
        """An attempt refused for the budget: it failed, so data planes stop waiting for it."""
        self._refused += 1
        log.debug("hole punch with %s refused: over the attempt budget", peer_id)
        self._settle(peer_id, False)

    def _record(self, peer_id: ID, direct: bool) -> None:
        self._settle(peer_id, direct)
        if direct:
            self._direct += 1
            if self._nursery is not None:
                self._nursery.start_soon(self._close_relayed, peer_id)
        else:
            self._failed += 1
            if self._nursery is not None:
                self._nursery.start_soon(self._close_failed_relayed, self._relayed(peer_id))
        log.info(
            "hole punch with %s: %s", peer_id, "direct connection" if direct else "failed, relayed"
        )

    def _settle(self, peer_id: ID, direct: bool) -> None:
        self._outcomes[peer_id] = direct
        note_punch(self.node.host.get_network(), peer_id, direct)
        while len(self._outcomes) > MAX_OUTCOMES:
            del self._outcomes[next(iter(self._outcomes))]
        self._changed.set()
        self._changed = trio.Event()

    def _targets(self, addrs: list[str]) -> list[Multiaddr]:
        """Those of a peer's punch addresses we dial (`check_punch_addrs`), judged against
        our own punch addresses: their host, and whether they are all private."""
        ours = punch_addrs(self.node)
        own_host = ip_tcp(ours[0])[0] if ours else "0.0.0.0"  # type: ignore[index]
        return check_punch_addrs(addrs, own_host=own_host, private_ok=private_targets_ok(ours))

    async def _read(self, framed: FramedStream, kind: type) -> Any:
        with trio.fail_after(self.config.message_seconds):
            frame = await framed.read_frame()
        if frame is None:
            raise ProtocolError("the hole punch stream ended early")
        message = _decoder.decode(frame)
        if not isinstance(message, kind):
            raise ProtocolError(f"expected {kind.__name__}, got {type(message).__name__}")
        return message

    # ------------------------------------------------------------------ B: accepted the circuit

    async def _initiate(self, peer_id: ID) -> None:
        direct = False
        try:
            async with self._limit:
                self._attempts += 1
                direct = await self._initiate_once(peer_id)
        finally:
            self._busy.discard(peer_id)
            self._record(peer_id, direct)

    async def _initiate_once(self, peer_id: ID) -> bool:
        network: Any = self.node.host.get_network()
        if direct_conn(network, peer_id) is not None:
            return True
        # On the relayed connection the peer dialed: A answers on no other (`host.new_stream`
        # may pick one we dialed through a relay too).
        conn = next(
            (
                c
                for c in network.connections.get(peer_id, ())
                if relayed_inbound(c.muxed_conn) and not c.muxed_conn.is_closed
            ),
            None,
        )
        if conn is None:
            return False
        try:
            stream = await stream_on(conn, PROTOCOL, timeout=self.config.message_seconds)
        except (trio.TooSlowError, *TRANSPORT_ERRORS) as error:
            log.debug("%s takes no hole punch: %r", peer_id, error)
            return False
        framed = FramedStream(stream, MAX_MESSAGE_BYTES)
        try:
            sent = time.monotonic()
            await framed.write_frame(_encode(Connect(punch_addrs(self.node))))
            reply = await self._read(framed, Connect)
            rtt = time.monotonic() - sent
            theirs = self._targets(reply.addrs)
            await framed.write_frame(_encode(Sync()))
        except (trio.TooSlowError, ProtocolError, *DECODE_ERRORS, *TRANSPORT_ERRORS) as error:
            log.debug("hole punch exchange with %s failed: %r", peer_id, error)
            return False
        finally:
            await framed.reset()
        if not theirs:
            return False
        await trio.sleep(rtt / 2 + self.config.sync_margin)
        return await self._dial(peer_id, theirs, as_responder=True)

    # ------------------------------------------------------------------ A: dialed through the relay

    async def _handle(self, stream: INetStream) -> None:
        muxed = stream.muxed_conn
        peer_id = muxed.peer_id
        framed = FramedStream(stream, MAX_MESSAGE_BYTES)
        # Only on a relayed connection we dialed (the end that accepted it asks), once: any
        # other request is a peer making us dial addresses of its choice for it.
        ours = relayed_inbound(muxed) is False and muxed not in self._asked
        if ours:
            self._asked.add(muxed)
        if not ours or peer_id in self._busy or self._nursery is None:
            self._refused += 1
            await framed.reset()
            return
        if not self._budget.try_start(peer_id, now=trio.current_time()):
            await framed.reset()
            self._refuse(peer_id)
            return
        self._busy.add(peer_id)
        direct = False
        try:
            try:
                self._limit.acquire_nowait()
            except trio.WouldBlock:
                self._refused += 1
                await framed.reset()
                return
            try:
                self._attempts += 1
                request = await self._read(framed, Connect)
                theirs = self._targets(request.addrs)
                await framed.write_frame(_encode(Connect(punch_addrs(self.node))))
                await self._read(framed, Sync)
                await framed.reset()
                if theirs:
                    direct = await self._dial(peer_id, theirs, as_responder=False)
            except (trio.TooSlowError, ProtocolError, *DECODE_ERRORS, *TRANSPORT_ERRORS) as error:
                log.debug("hole punch exchange with %s failed: %r", peer_id, error)
            finally:
                self._limit.release()
                self._record(peer_id, direct)
        finally:
            self._busy.discard(peer_id)
            await framed.reset()

    # ------------------------------------------------------------------ dialing

    async def _dial(self, peer_id: ID, addrs: list[Multiaddr], *, as_responder: bool) -> bool:
        """Dial every address at once from our listen port; True once a direct connection
        to `peer_id` exists (ours, or the one the other end's dial made)."""
        network: Any = self.node.host.get_network()
        dial = network.dial_addr_as_responder if as_responder else network.dial_addr

        async def one(addr: Multiaddr) -> None:
            # From our listen port of the address's family (IPv6 firewalls keep state too).
            source = listen_source(self.node, ip_version(ip_tcp(str(addr))[0]))  # type: ignore[index]
            try:
                with trio.fail_after(self.config.dial_seconds):
                    await dial(addr, peer_id, source)
            except Exception as error:
                # py-libp2p wraps what a dial meets in several types (SwarmException,
                # OpenConnectionError, ...); whatever it is, this address failed.
                log.debug("hole punch dial to %s at %s failed: %r", peer_id, addr, error)

        async with trio.open_nursery() as nursery:
            for addr in addrs:
                nursery.start_soon(one, addr)
        return direct_conn(network, peer_id) is not None

    async def _close_relayed(self, peer_id: ID) -> None:
        """After the grace period, close the relayed connections to a peer we now reach
        directly (never the last way to it)."""
        await trio.sleep(self.config.relay_grace_seconds)
        if direct_conn(self.node.host.get_network(), peer_id) is not None:
            await self._close_relayed_now(peer_id)

    async def _close_failed_relayed(self, relayed: list[Any]) -> None:
        """`failed_relay_seconds` after a failed punch, close the relayed connections that
        punch was about (not those made since), giving their circuits back to the relays."""
        await trio.sleep(self.config.failed_relay_seconds)
        await _close(relayed)

    async def _close_relayed_now(self, peer_id: ID) -> None:
        await _close(self._relayed(peer_id))

    def _relayed(self, peer_id: ID) -> list[Any]:
        """Our relayed connections to `peer_id`, as they are now."""
        network: Any = self.node.host.get_network()
        return [c for c in network.connections.get(peer_id, ()) if is_relayed(c.muxed_conn)]


async def _close(connections: list[Any]) -> None:
    """Close `connections` (relayed ones) that are still open."""
    for conn in connections:
        if not conn.muxed_conn.is_closed:
            with trio.move_on_after(1.0):
                try:
                    await conn.close()
                except TRANSPORT_ERRORS as error:
                    log.debug("closing a relayed connection: %r", error)
