"""Admission to a data port: pay before you wait; and the accept loop every listener that
serves anyone shares.

A TCP connection to a data port (all-reduce, state donor) costs us a slot until it has proved
who it is, so unauthenticated connections hold slots per network prefix and in total
(`peer.net.slots.Slots`: a newcomer past its prefix's share takes that prefix's oldest), and
each gets `deadline` seconds to authenticate. Before that, at accept, the prefix's accept-rate
budget (`peer.net.slots.AcceptBudget`) closes a connection over it before a task is started
(`serve_listeners`, which the dashboard, metrics and the libp2p listener use too). In a
private collaboration a connection's first step is to prove the network key: we send a fresh
nonce and it must answer with HMAC-SHA256(network key, domain | nonce) within the same
deadline, so an outsider never reaches the TLS handshake (whose CPU we would pay).

`Admission.accept` admits one connection end to end (slot, key, TLS, first message) and
`Admission.serve` listens with the budget; the dialing side is `connect`.
`check_dial_address` lives here too: a member never dials an address that a peer chose to aim
it at its own machine's other services.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import ipaddress
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import trio

from peer.errors import DECODE_ERRORS, ProtocolError, RemoteError
from peer.net.slots import AcceptBudget, Slots, check_rate, check_slots
from peer.net.tls import TlsStream

log = logging.getLogger("peertrain.admission")
T = TypeVar("T")
# What a connection's failure to authenticate may raise: it is refused, nothing more.
REFUSALS = (
    RemoteError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    *DECODE_ERRORS,
)

DOMAIN = b"peertrain/data-admission/1"
NONCE_BYTES = 16
MAC_BYTES = 32
# accept(2) errors that mean we are out of descriptors or memory, not that the listener broke
# (what trio.serve_listeners retries): wait a little and accept again.
ACCEPT_CAPACITY_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS})
ACCEPT_RETRY_SECONDS = 0.1
NO_ADDRESS = "?"


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    max_total: int = 128
    """Unauthenticated connections held at once; an honest round needs one per member."""
    max_per_prefix: int = 32
    """Of those, from one IPv4 /24 or IPv6 /64 (a site's members in one group); a newcomer
    past it takes its prefix's oldest."""
    deadline: float = 3.0
    """Seconds to prove the network key and finish the TLS handshake (~3 ms on loopback)."""
    accept_rate: float = 32.0
    """Connections a second one prefix may open, sustained; more are closed at accept."""
    accept_burst: int = 64
    """Connections one prefix may open at once (a round's start: one per member)."""

    def __post_init__(self) -> None:
        check_slots(self.max_total, self.max_per_prefix, names=("max_total", "max_per_prefix"))
        check_rate(self.accept_rate, self.accept_burst)
        if not self.deadline > 0:
            raise ValueError(f"deadline={self.deadline!r} must be positive")


class Admission:
    """The unauthenticated connections of one listening port: slots per prefix (see
    `peer.net.slots`), each a cancel scope that carries the deadline and is cancelled when a
    newcomer evicts it, and the port's accept-rate budget."""

    def __init__(self, network_key: bytes | None, limits: AdmissionLimits | None = None) -> None:
        self.network_key = network_key
        self.limits = limits or AdmissionLimits()
        self.slots: Slots[trio.CancelScope] = Slots(
            max_total=self.limits.max_total, max_per_prefix=self.limits.max_per_prefix
        )
        self.budget = AcceptBudget(rate=self.limits.accept_rate, burst=self.limits.accept_burst)

    @contextmanager
    def slot(self, stream: trio.SocketStream) -> Iterator[trio.CancelScope | None]:
        """A cancel scope for this connection's authentication (it carries the deadline and
        is cancelled if the slot is evicted), or None if the connection must be closed now."""
        scope = trio.CancelScope(deadline=trio.current_time() + self.limits.deadline)
        taken, evicted = self.slots.take(scope, peer_address(stream))
        for victim in evicted:
            victim.cancel()
        if not taken:
            yield None
            return
        try:
            yield scope
        finally:
            self.slots.release(scope)

    async def serve(
        self,
        handler: Callable[[trio.SocketStream], Awaitable[object]],
        port: int,
        *,
        host: str | None = None,
        task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
    ) -> NoReturn:
        """`trio.serve_tcp` for this port, with its accept-rate budget asked at accept."""
        listeners = await trio.open_tcp_listeners(port, host=host)
        await serve_listeners(handler, listeners, budget=self.budget, task_status=task_status)

    async def check_network_key(self, stream: trio.SocketStream) -> None:
        """ProtocolError unless the other end proves the network key (no-op without one)."""
        if self.network_key is None:
            return
        nonce = secrets.token_bytes(NONCE_BYTES)
        await stream.send_all(nonce)
        answer = await _receive_exactly(stream, MAC_BYTES)
        if not hmac.compare_digest(answer, _mac(self.network_key, nonce)):
            raise ProtocolError("the connection did not prove the network key")

    async def accept(
        self,
        stream: trio.SocketStream,
        context: ssl.SSLContext,
        greet: Callable[[TlsStream], Awaitable[T | None]],
    ) -> tuple[TlsStream, T] | None:
        """Admit one inbound connection: a slot (else it is closed at once), then within the
        slot's deadline the network key, the TLS handshake and `greet`, which reads the
        connection's first message (None: refuse it). The open stream and what `greet`
        returned, or None with everything closed."""
        with self.slot(stream) as scope:
            if scope is None:
                return None  # over a cap: closed before we read a byte
            with scope:  # the deadline, or an eviction by a fairer newcomer
                return await self._authenticate(stream, context, greet)
        return None

    async def _authenticate(
        self,
        stream: trio.SocketStream,
        context: ssl.SSLContext,
        greet: Callable[[TlsStream], Awaitable[T | None]],
    ) -> tuple[TlsStream, T] | None:
        try:
            await self.check_network_key(stream)
        except REFUSALS as error:
            log.debug("connection not admitted: %r", error)
            return None
        try:
            tls = TlsStream(stream, context, server_side=True)
        except OSError as error:  # out of descriptors: refuse this one, keep serving
            log.warning("cannot take a data connection: %s", error)
            return None
        try:
            await tls.handshake()
            greeting = await greet(tls)
        except REFUSALS as error:
            log.debug("connection not admitted: %r", error)
            greeting = None
        except BaseException:  # the deadline or an eviction: the descriptor still closes
            with trio.CancelScope(shield=True):
                await tls.aclose()
            raise
        if greeting is None:
            await tls.aclose()
            return None
        return tls, greeting

    def statistics(self) -> tuple[int, int]:
        """(unauthenticated connections held, prefixes they come from)."""
        stats = self.slots.statistics()
        return stats.held, stats.prefixes


async def connect(
    host: str,
    port: int,
    context: ssl.SSLContext,
    *,
    network_key: bytes | None,
    certificate: bytes,
) -> TlsStream:
    """A TLS connection to (host, port) after proving the network key, whose other end
    presented exactly `certificate` (ProtocolError if not); closed on any failure."""
    stream = await trio.open_tcp_stream(host, port)
    try:
        tls = TlsStream(stream, context, server_side=False)
    except OSError:  # out of descriptors
        await stream.aclose()
        raise
    try:
        await prove_network_key(stream, network_key)
        await tls.handshake()
        if tls.peer_certificate() != certificate:
            raise ProtocolError("the other end presented another certificate")
    except BaseException:
        with trio.CancelScope(shield=True):
            await tls.aclose()
        raise
    return tls


async def prove_network_key(stream: trio.SocketStream, network_key: bytes | None) -> None:
    """The dialing side of `Admission.check_network_key`."""
    if network_key is None:
        return
    nonce = await _receive_exactly(stream, NONCE_BYTES)
    await stream.send_all(_mac(network_key, nonce))


def check_dial_address(host: str, port: int, *, own_host: str) -> None:
    """ProtocolError unless (host, port) is an address a peer may ask us to dial: an IP
    literal and a valid port, and no loopback, unspecified or link-local address unless our
    own data address is one too (a collaboration on one machine)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ProtocolError(f"data address {host[:64]!r} is not an IP address") from None
    if not 1 <= port <= 65535:
        raise ProtocolError(f"data port {port} is not in 1-65535")
    if _is_local(host) and not _is_local(own_host):
        raise ProtocolError(f"data address {host} is a loopback, unspecified or link-local one")


def unmapped(ip: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """The address `ip` reaches: an IPv4-mapped IPv6 one (a dual-stack socket's IPv4 peer) as
    its IPv4 address. ValueError if `ip` is no IP literal."""
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _is_local(host: str) -> bool:
    """Loopback, unspecified (0.0.0.0 reaches this machine), link-local (cloud metadata),
    multicast or reserved; an IPv4-mapped IPv6 address as the IPv4 address it maps."""
    try:
        address = unmapped(host)
    except ValueError:
        return False
    return (
        address.is_loopback
        or address.is_unspecified
        or address.is_link_local
        or address.is_multicast
        or address.is_reserved
    )


def _mac(network_key: bytes, nonce: bytes) -> bytes:
    return hmac.new(network_key, DOMAIN + nonce, hashlib.sha256).digest()


def peer_address(stream: trio.SocketStream) -> str:
    """The IP address `stream` comes from (NO_ADDRESS if the socket is gone already)."""
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, IndexError):
        return NO_ADDRESS


async def serve_listeners(
    handler: Callable[[trio.SocketStream], Awaitable[object]],
    listeners: list[trio.SocketListener],
    *,
    budget: AcceptBudget,
    handler_nursery: trio.Nursery | None = None,
    task_status: trio.TaskStatus[list[trio.SocketListener]] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """`trio.serve_listeners` with `budget` asked at accept: a connection over its prefix's
    rate is closed there, before a task, buffer or handshake is spent on it (what it costs:
    one accept and one close, benchmarks/accept_flood.py). The others each get a task in
    `handler_nursery` (default: our own), and their stream is closed when it ends."""
    async with trio.open_nursery() as nursery:
        for listener in listeners:
            nursery.start_soon(accept_loop, listener, handler, budget, handler_nursery or nursery)
        task_status.started(listeners)
        await trio.sleep_forever()  # a listener closed under us ends its loop, not the others
    raise AssertionError("unreachable")


async def accept_loop(
    listener: trio.SocketListener,
    handler: Callable[[trio.SocketStream], Awaitable[object]],
    budget: AcceptBudget,
    nursery: Any,
) -> None:
    """Accept on `listener` until cancelled or it is closed (it is closed on the way out);
    see `serve_listeners`. `nursery`: where each admitted connection's task starts (anything
    with `start_soon`)."""
    async with listener:
        while True:
            try:
                stream = await listener.accept()
            except trio.ClosedResourceError:
                return  # closed by its owner (py-libp2p's listener closes its sockets)
            except OSError as error:
                if error.errno not in ACCEPT_CAPACITY_ERRNOS:
                    raise
                log.warning("cannot accept a connection: %s; retrying", error.strerror)
                await trio.sleep(ACCEPT_RETRY_SECONDS)
                continue
            address = peer_address(stream)
            # No address: reset before we got to it, nothing left to serve.
            if address != NO_ADDRESS and budget.allow(address, now=trio.current_time()):
                nursery.start_soon(_run_handler, stream, handler)
            else:
                stream.socket.close()


async def _run_handler(
    stream: trio.SocketStream, handler: Callable[[trio.SocketStream], Awaitable[object]]
) -> None:
    try:
        await handler(stream)
    finally:
        await trio.aclose_forcefully(stream)


async def _receive_exactly(stream: trio.SocketStream, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        piece = await stream.receive_some(count - len(data))
        if not piece:
            raise ProtocolError("the connection closed during admission")
        data += piece
    return bytes(data)
