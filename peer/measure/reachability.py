"""Reachability: a backbone dials a peer back on its announced addresses (AutoNAT-like).

Protocol `/peertrain/dialback/1`, one check per stream:

    DialBack{addrs} -> DialBackResult{reachable: [addr], unreachable: {addr: why}, observed}

`observed` is where the request's connection came from, as the backbone saw it. A peer the
dial-back did not reach then checks its NAT's mapping (`observed_from_listen_port`): it dials
the backbone from its listen port, as a hole punch dials, and asks with no addresses on that
connection (nothing is dialed, only `observed` answered). A NAT that maps the listen port to
the address the peer announces, or that keeps its listen port, or that several backbones saw
alike (endpoint-independent mapping) lets peers punch through to it (`punch_address`): the
peer is `punchable`, offers that address in hole punches, and may aggregate for peers that
reach it (`peer.roles.aggregators`). A symmetric NAT shows another port, and the peer stays
client-only.

The backbone dials from a second host with its own throw-away identity, because its main host
already has a connection to the caller and would reuse it. The Noise handshake proves that
whoever answers at the address holds the caller's key. As in libp2p's AutoNAT, only addresses
whose IP is the one the caller's connection comes from are dialed, so nobody can make a
backbone dial third parties; a peer behind NAT announces private addresses, none match, and it
is (correctly) found client-only. IPv4 and IPv6 addresses are checked alike: a peer whose
connection comes over IPv6 has its IPv6 addresses with that IP dialed. Checks run one at a
time per caller and at most `MAX_CONCURRENT` at once (beyond that the answer is "busy" at
once, so the caller keeps its previous verdict), each dial bounded by `DIAL_TIMEOUT`.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from typing import Annotated, Any

import msgspec
import trio
from libp2p.abc import IHost, INetStream
from libp2p.peer.id import ID
from multiaddr import Multiaddr

from peer.errors import DECODE_ERRORS, DeadlineExceeded, ProtocolError, RemoteError, Unreachable
from peer.net.admission import unmapped
from peer.net.holepunch import listen_source
from peer.net.host import (
    Node,
    create_host,
    host_of,
    ip_tcp,
    ip_version,
    parse_multiaddr,
    tcp_multiaddr,
)
from peer.net.identity import Identity, ephemeral_identity
from peer.net.relay import stream_on
from peer.net.rpc import TRANSPORT_ERRORS, FramedStream

log = logging.getLogger("peertrain.reachability")

PROTOCOL = "/peertrain/dialback/1"
MAX_ADDRS = 8
MAX_CONTROL_BYTES = 8192
DIAL_TIMEOUT = 5.0
MAX_CONCURRENT = 8
BUSY = "not checked, busy"

Addr = Annotated[str, msgspec.Meta(max_length=256)]


class DialBack(msgspec.Struct):
    addrs: Annotated[list[Addr], msgspec.Meta(max_length=MAX_ADDRS)]


class DialBackResult(msgspec.Struct):
    reachable: list[str]
    unreachable: dict[str, str]
    observed: Addr = ""
    """Where the request's connection came from, as the backbone saw it (`/ip4/<ip>/tcp/<port>`;
    "" from older backbones). A request with no addresses only asks for this."""


_encode = msgspec.msgpack.Encoder().encode


def same_ip(addr: Multiaddr, observed_ip: str) -> bool:
    """Whether `addr` is an IPv4 or IPv6 address with the IP the caller's connection comes from
    (an IPv4-mapped IPv6 one, as a dual-stack listener reports IPv4 callers, as its IPv4)."""
    try:
        return ipaddress.ip_address(host_of(str(addr)) or "") == unmapped(observed_ip)
    except ValueError:  # not an ip address, or not parseable: never dialed
        return False


def observed_addr(remote: tuple[str, int] | None) -> str:
    """A connection's remote (ip, port) as a multiaddr string ("" if unknown); an
    IPv4-mapped IPv6 address (a dual-stack listener's IPv4 caller) as `/ip4/`."""
    if not remote:
        return ""
    try:
        return str(tcp_multiaddr(str(unmapped(remote[0])), int(remote[1])))
    except ValueError:
        return ""


def punch_address(observed: Sequence[tuple[str, int]], announced: Sequence[str]) -> str | None:
    """Where peers can punch through our NAT to us (pure), or None. `observed`: per backbone
    asked, (where it saw a dial from our listen port come from, that listen port). Every one
    (at least one) saw the same address, and it is one we announce (we know our router's
    outside address), or it keeps our listen port, or at least two backbones saw it (a NAT
    that maps the port alike for different destinations: endpoint-independent). A symmetric
    NAT gives each new connection another port (`--random-fully`): one backbone sees a new
    port, two see two."""
    seen = {address for address, _ in observed}
    if len(seen) != 1 or "" in seen:
        return None
    address, listen_port = observed[0]
    if address in set(announced):
        return address
    parsed = ip_tcp(address)
    if parsed is None:
        return None
    return address if parsed[1] == listen_port or len(observed) >= 2 else None


class DialBackServer:
    """Answers dial-back checks on a backbone, dialing from `dialer` (a second host)."""

    def __init__(self, host: IHost, dialer: IHost) -> None:
        self.dialer = dialer
        self._limit = trio.CapacityLimiter(MAX_CONCURRENT)
        self._checking: set[ID] = set()
        host.set_stream_handler(PROTOCOL, self._serve)

    async def _serve(self, stream: INetStream) -> None:
        caller = stream.muxed_conn.peer_id
        framed = FramedStream(stream, MAX_CONTROL_BYTES)
        try:
            frame = None  # stays None if the caller says nothing in time
            with trio.move_on_after(DIAL_TIMEOUT):
                frame = await framed.read_frame()
            if frame is None:
                await framed.reset()
                return
            request = msgspec.msgpack.decode(frame, type=DialBack)
            remote = stream.get_remote_address()
            if request.addrs:
                result = await self.check(
                    caller, request.addrs, observed_ip=remote[0] if remote else ""
                )
            else:  # only where we see it: nothing dialed, nothing held
                result = DialBackResult([], {})
            result.observed = observed_addr(remote)
            await framed.write_frame(_encode(result))
            with trio.move_on_after(1.0):
                await stream.close()
        except (ProtocolError, *DECODE_ERRORS, *TRANSPORT_ERRORS) as error:
            log.debug("dial-back request from %s failed: %r", caller, error)
            await framed.reset()

    async def check(self, caller: ID, addrs: Sequence[str], *, observed_ip: str) -> DialBackResult:
        if caller in self._checking:
            return DialBackResult([], dict.fromkeys(addrs, BUSY + ": a check for you is running"))
        try:
            self._limit.acquire_nowait()
        except trio.WouldBlock:
            return DialBackResult([], dict.fromkeys(addrs, BUSY + ": too many checks at once"))
        self._checking.add(caller)
        try:
            return await self._dial_each(caller, addrs, observed_ip)
        finally:
            self._checking.discard(caller)
            self._limit.release()

    async def _dial_each(
        self, caller: ID, addrs: Sequence[str], observed_ip: str
    ) -> DialBackResult:
        reachable: list[str] = []
        unreachable: dict[str, str] = {}
        for text in addrs:
            try:
                addr = parse_multiaddr(text, what="address")
            except Exception:
                unreachable[text] = "not a multiaddr"
                continue
            if not same_ip(addr, observed_ip):
                unreachable[text] = f"not the address your connection comes from ({observed_ip})"
                continue
            try:
                with trio.fail_after(DIAL_TIMEOUT):
                    # Exactly this address (no peerstore lookup), and Noise checks the key.
                    await self.dialer.get_network().dial_addr(addr, caller)  # type: ignore[attr-defined]
                reachable.append(text)
            except trio.TooSlowError:
                unreachable[text] = f"no answer within {DIAL_TIMEOUT:.3g}s"
            except TRANSPORT_ERRORS as error:
                unreachable[text] = f"dial failed: {error}"[:200]
            finally:
                await self._hang_up(caller)
        return DialBackResult(reachable, unreachable)

    async def _hang_up(self, caller: ID) -> None:
        # Forget the addresses identify may have taught the dialer. (Not clear_peerdata: in
        # py-libp2p 0.8.1 the connection's background tasks then fail on the missing peer.)
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(TRANSPORT_ERRORS):
            await self.dialer.get_network().close_peer(caller)  # type: ignore[attr-defined]
        self.dialer.get_peerstore().clear_addrs(caller)


async def observed_from_listen_port(node: Node, backbone: ID) -> tuple[str, int] | None:
    """(Where `backbone` sees a connection from our listen port come from, that port): a
    connection dialed from the port (as a hole punch dials) by a throw-away host, so that no
    call of ours can pick it (it is closed after one question); asked on that connection.
    None when we have no listen port, no direct address of the backbone, or it did not answer
    (an older backbone answers ""). Raises nothing: it only ever leaves a peer client-only."""
    addrs = [
        (addr, parsed)
        for addr in node.host.get_peerstore().addrs(backbone)[:MAX_ADDRS]
        if (parsed := ip_tcp(str(addr))) is not None
    ]
    if not addrs:  # relayed or non-TCP addresses only: not the backbone's own
        return None
    try:
        async with open_dialer(ephemeral_identity(), node.network_key) as dialer:
            for addr, (ip, _) in addrs:
                seen = await _observed_once(dialer, node, backbone, addr, ip_version(ip))
                if seen is not None:
                    return seen
    except Exception as error:  # py-libp2p's host start and stop raise several types
        log.debug("mapping check with %s: %r", backbone, error)
    return None


async def _observed_once(
    dialer: IHost, node: Node, backbone: ID, addr: Multiaddr, family: int
) -> tuple[str, int] | None:
    source = listen_source(node, family)
    if source is None:  # we listen on no port of that IP version
        return None
    network: Any = dialer.get_network()
    conn = None
    try:
        with trio.fail_after(DIAL_TIMEOUT):
            conn = await network.dial_addr(addr, backbone, source)
            stream = await stream_on(conn, PROTOCOL, timeout=DIAL_TIMEOUT)
            framed = FramedStream(stream, MAX_CONTROL_BYTES)
            try:
                await framed.write_frame(_encode(DialBack([])))
                frame = await framed.read_frame()
            finally:
                await framed.reset()
        if frame is None:
            return None
        return msgspec.msgpack.decode(frame, type=DialBackResult).observed, source[1]
    except (trio.TooSlowError, *DECODE_ERRORS) as error:
        log.debug("mapping check with %s at %s: %r", backbone, addr, error)
    except Exception as error:  # py-libp2p's dials raise several unrelated types
        log.debug("mapping check with %s at %s failed: %r", backbone, addr, error)
    finally:
        if conn is not None:
            with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(Exception):
                await conn.close()
    return None


@asynccontextmanager
async def open_dialer(identity: Identity, network_key: str | None = None) -> AsyncIterator[IHost]:
    """A host that only dials out (no listen address), for dial-back checks."""
    host = create_host(identity, network_key)
    async with host.run(listen_addrs=[]):
        await host.get_network().auto_connector.stop()  # type: ignore[attr-defined]
        yield host


async def check_reachable(node: Node, backbone: ID) -> DialBackResult:
    """Ask `backbone` to dial us back on our announced addresses."""
    try:
        stream = await node.host.new_stream(backbone, [PROTOCOL])
    except TRANSPORT_ERRORS as error:
        raise Unreachable(f"cannot open {PROTOCOL} to {backbone}: {error}") from error
    framed = FramedStream(stream, MAX_CONTROL_BYTES)
    try:
        await framed.write_frame(_encode(DialBack([str(a) for a in node.announce[:MAX_ADDRS]])))
        timeout = DIAL_TIMEOUT * (MAX_ADDRS + 1)
        with trio.move_on_after(timeout):
            frame = await framed.read_frame()
            if frame is None:
                raise ProtocolError(f"{backbone} closed the dial-back stream without a reply")
            return msgspec.msgpack.decode(frame, type=DialBackResult)
        raise DeadlineExceeded(f"{backbone} did not report a dial-back within {timeout:.3g}s")
    except DECODE_ERRORS as error:
        raise ProtocolError(f"{backbone} sent a malformed dial-back reply: {error}") from None
    except TRANSPORT_ERRORS as error:
        raise RemoteError(f"dial-back check with {backbone} failed: {error!r}") from error
    finally:
        await framed.reset()
