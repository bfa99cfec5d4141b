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
connection comes over IPv6 has its IPv6 addresses with that IP dialed.

A check holds one of a backbone's few dial-back slots while it dials, and identities are free,
so slots are counted by where the caller's connection comes from, not by who it says it is
(`DialBackGate`): at most `max_per_prefix` running checks per network prefix (the IPv4 /24 or
IPv6 /64, `peer.net.prefix.prefix_of`), `max_checks` in all, one per caller. When every slot
is taken, a caller from a network holding fewer checks than the busiest one takes that
network's oldest check's slot (that check is answered "busy"). Throw-away identities on one
network hold one slot; to keep out a caller from another network an attacker needs as many
networks as there are slots, and to displace its check it must ask again `max_checks` times
while that check runs (about a second for a reachable peer). A check dials all its addresses
at once under one deadline (`check_seconds`), so a request of addresses that accept TCP and
never speak holds its slot for that long, not once per address (it was 8 x 5 s).
A caller refused or displaced is answered "busy" at once; `check_reachable` asks again a
few times (another peer of its network may be checked), then it keeps its previous verdict.
"""

from __future__ import annotations

import ipaddress
import logging
import random
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
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
from peer.net.prefix import prefix_of
from peer.net.relay import stream_on
from peer.net.rpc import TRANSPORT_ERRORS, FramedStream

log = logging.getLogger("peertrain.reachability")

PROTOCOL = "/peertrain/dialback/1"
MAX_ADDRS = 8
MAX_CONTROL_BYTES = 8192
DIAL_TIMEOUT = 5.0
MAX_CONCURRENT = 8
BUSY = "not checked, busy"
BUSY_WAITS = (1.0, 2.0, 4.0)
"""A caller's waits before asking again after a busy answer: another peer of its own network
(a /24 of public addresses) holds the slot for `check_seconds` at most."""
REPLY_TIMEOUT = DIAL_TIMEOUT * (MAX_ADDRS + 1)
"""How long a caller waits for the answer: as long as backbones before `DialBackGate` took
(they dialed one address after another, `DIAL_TIMEOUT` each)."""

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


@dataclass(frozen=True, kw_only=True)
class DialBackLimits:
    """Limits on the dial-back checks a backbone runs (see the module docstring)."""

    max_checks: int = MAX_CONCURRENT
    """Checks running at once, over all callers."""
    max_per_prefix: int = 4
    """Of those, from one network prefix (IPv4 /24, IPv6 /64): identities there are free, but
    a campus or a NAT pool may hold several honest joiners at once (a newcomer from another
    network displaces the busiest network's oldest check)."""
    check_seconds: float = DIAL_TIMEOUT
    """One check's dials, all its addresses together (a reachable peer answers in ~1 s)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_per_prefix <= self.max_checks:
            raise ValueError(
                f"max_per_prefix={self.max_per_prefix!r} must be between 1 and "
                f"max_checks={self.max_checks!r}"
            )
        if not self.check_seconds > 0:
            raise ValueError(f"check_seconds={self.check_seconds!r} must be positive")


def _nothing() -> None:
    pass


@dataclass(eq=False)
class Check:
    """One dial-back check the gate let in."""

    caller: Hashable
    prefix: str
    since: float
    cancel: Callable[[], None] = field(default=_nothing, repr=False)
    """Set by the I/O shell: stops this check's dials; callable from any task, never blocks."""


@dataclass(frozen=True)
class Admitted:
    check: Check
    displaced: Check | None = None
    """The check whose slot it took, already off the books: the caller cancels it."""


@dataclass(frozen=True)
class Refused:
    why: str


@dataclass(frozen=True)
class DialBackStatistics:
    running: int
    refused: int
    """Requests answered "busy" at once (their caller's, network's or every slot taken)."""
    displaced: int
    """Checks stopped to let a caller from a less busy network in."""


class DialBackGate:
    """The bookkeeping of dial-back slots (synchronous, clock passed in): `admit` when a
    request with addresses to dial arrives, `release` when its check's task ends."""

    def __init__(self, limits: DialBackLimits) -> None:
        self.limits = limits
        self._running: dict[str, list[Check]] = {}  # by prefix, oldest first
        self._callers: set[Hashable] = set()  # until their task ends, even if displaced
        self._refused = self._displaced = 0

    def admit(self, caller: Hashable, ip: str, *, now: float) -> Admitted | Refused:
        """A request from `caller`, whose connection comes from `ip`."""
        prefix = prefix_of(ip)
        mine = self._running.get(prefix, [])
        if caller in self._callers:
            return self._refuse("a check for you is running")
        if len(mine) >= self.limits.max_per_prefix:
            return self._refuse(f"a check from your network ({prefix}) is running")
        displaced = None
        if self.running_count() >= self.limits.max_checks:
            busiest = max(self._running.values(), key=lambda q: (len(q), -q[0].since))
            if len(busiest) <= len(mine):  # we are (among) the busiest ourselves
                return self._refuse("too many checks at once")
            displaced = busiest[0]
            self._drop(displaced)
            self._displaced += 1
        check = Check(caller, prefix, now)
        self._running.setdefault(prefix, []).append(check)
        self._callers.add(caller)
        return Admitted(check, displaced)

    def release(self, check: Check) -> None:
        """The check's task ended (answered, failed or displaced); idempotent."""
        self._drop(check)
        self._callers.discard(check.caller)

    def running_count(self) -> int:
        return sum(len(q) for q in self._running.values())

    def statistics(self) -> DialBackStatistics:
        return DialBackStatistics(self.running_count(), self._refused, self._displaced)

    def _refuse(self, why: str) -> Refused:
        self._refused += 1
        return Refused(why)

    def _drop(self, check: Check) -> None:
        queue = self._running.get(check.prefix, [])
        with suppress(ValueError):
            queue.remove(check)
        if not queue:
            self._running.pop(check.prefix, None)


class DialBackServer:
    """Answers dial-back checks on a backbone, dialing from `dialer` (a second host)."""

    def __init__(self, host: IHost, dialer: IHost, *, limits: DialBackLimits | None = None) -> None:
        self.dialer = dialer
        self.gate = DialBackGate(limits or DialBackLimits())
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
        """Dial `caller` back at those of `addrs` that have the IP its connection comes from;
        a request with none such holds no slot."""
        targets, unreachable = _targets(addrs, observed_ip)
        if not targets:
            return DialBackResult([], unreachable)
        admission = self.gate.admit(caller, observed_ip, now=trio.current_time())
        if isinstance(admission, Refused):
            return DialBackResult([], dict.fromkeys(addrs, f"{BUSY}: {admission.why}"))
        check = admission.check
        if admission.displaced is not None:
            admission.displaced.cancel()
        try:
            with trio.CancelScope() as scope:
                check.cancel = scope.cancel
                result = await self._dial_all(caller, targets)
                result.unreachable.update(unreachable)
                return result
            why = f"{BUSY}: a caller from a less busy network took this check's place"
            return DialBackResult([], dict.fromkeys(addrs, why))
        finally:
            self.gate.release(check)

    async def _dial_all(self, caller: ID, targets: dict[str, Multiaddr]) -> DialBackResult:
        # All at once under one deadline: addresses that accept TCP and never speak cost the
        # slot `check_seconds` in all (one after another, it was 5 s each: 40 s for eight).
        seconds = self.gate.limits.check_seconds
        deadline = trio.current_time() + seconds
        outcome: dict[str, str | None] = {}  # None: reached

        async def dial(text: str, addr: Multiaddr) -> None:
            try:
                with trio.fail_at(deadline):
                    # Exactly this address (no peerstore lookup), and Noise checks the key.
                    await self.dialer.get_network().dial_addr(addr, caller)  # type: ignore[attr-defined]
                outcome[text] = None
            except trio.TooSlowError:
                outcome[text] = f"no answer within {seconds:.3g}s"
            except TRANSPORT_ERRORS as error:
                outcome[text] = f"dial failed: {error}"[:200]

        try:
            async with trio.open_nursery() as nursery:
                for text, addr in targets.items():
                    nursery.start_soon(dial, text, addr)
        finally:
            await self._hang_up(caller)
        return DialBackResult(
            [text for text in targets if outcome[text] is None],
            {text: why for text, why in outcome.items() if why is not None},
        )

    async def _hang_up(self, caller: ID) -> None:
        # Forget the addresses identify may have taught the dialer. (Not clear_peerdata: in
        # py-libp2p 0.8.1 the connection's background tasks then fail on the missing peer.)
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(TRANSPORT_ERRORS):
            await self.dialer.get_network().close_peer(caller)  # type: ignore[attr-defined]
        self.dialer.get_peerstore().clear_addrs(caller)


def _targets(addrs: Sequence[str], observed_ip: str) -> tuple[dict[str, Multiaddr], dict[str, str]]:
    """(The addresses to dial, each once; why each other one is not dialed)."""
    targets: dict[str, Multiaddr] = {}
    unreachable: dict[str, str] = {}
    for text in addrs:
        try:
            addr = parse_multiaddr(text, what="address")
        except Exception:  # the multiaddr package raises several unrelated types
            unreachable[text] = "not a multiaddr"
            continue
        if same_ip(addr, observed_ip):
            targets[text] = addr
        else:
            unreachable[text] = f"not the address your connection comes from ({observed_ip})"
    return targets, unreachable


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


def answered_busy(result: DialBackResult) -> bool:
    """Whether the backbone checked nothing because its slots were taken."""
    return bool(result.unreachable) and all(
        why.startswith(BUSY) for why in result.unreachable.values()
    )


async def check_reachable(
    node: Node, backbone: ID, *, busy_waits: Sequence[float] = BUSY_WAITS
) -> DialBackResult:
    """Ask `backbone` to dial us back on our announced addresses. After a busy answer, ask
    again after each of `busy_waits` seconds (times a random 0.5-1, so that peers that asked
    together do not again) while it stays busy; the last answer is returned."""
    for wait in busy_waits:
        result = await _ask(node, backbone)
        if not answered_busy(result):
            return result
        await trio.sleep(wait * random.uniform(0.5, 1.0))
    return await _ask(node, backbone)


async def _ask(node: Node, backbone: ID) -> DialBackResult:
    try:
        stream = await node.host.new_stream(backbone, [PROTOCOL])
    except TRANSPORT_ERRORS as error:
        raise Unreachable(f"cannot open {PROTOCOL} to {backbone}: {error}") from error
    framed = FramedStream(stream, MAX_CONTROL_BYTES)
    try:
        await framed.write_frame(_encode(DialBack([str(a) for a in node.announce[:MAX_ADDRS]])))
        timeout = REPLY_TIMEOUT
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
