"""Admission to a data port: pay before you wait.

A TCP connection to a data port (all-reduce, state donor) costs us a slot until it has proved
who it is, so unauthenticated connections are capped per source address and in total, and each
gets `deadline` seconds to authenticate; a connection over a cap is closed at once, before we
read a byte. In a private collaboration its first step is to prove the network key: we send a
fresh nonce and it must answer with HMAC-SHA256(network key, domain | nonce) within the same
deadline, so an outsider never reaches the TLS handshake (whose CPU we would pay).

`Admission.accept` admits one connection end to end (slot, key, TLS, first message); the
dialing side is `connect`. `check_dial_address` lives here too: a member never dials an
address that a peer chose to aim it at its own machine's other services.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import ssl
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TypeVar

import trio

from peer.errors import DECODE_ERRORS, ProtocolError, RemoteError
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


@dataclass(frozen=True, kw_only=True)
class AdmissionLimits:
    max_total: int = 128
    """Unauthenticated connections held at once; an honest round needs one per member."""
    max_per_address: int = 16
    """Of those, from one source address: one host cannot take every slot."""
    deadline: float = 3.0
    """Seconds to prove the network key and finish the TLS handshake (~3 ms on loopback)."""


class Admission:
    """Counts the unauthenticated connections of one listening port.

    When every slot is taken, a connection from an address holding fewer slots than the
    busiest one evicts that address's oldest: an attacker needs as many addresses as there
    are slots to keep out a newcomer from one more address.
    """

    def __init__(self, network_key: bytes | None, limits: AdmissionLimits | None = None) -> None:
        self.network_key = network_key
        self.limits = limits or AdmissionLimits()
        self._pending: dict[str, list[trio.CancelScope]] = {}  # per address, oldest first
        self._total = 0

    @contextmanager
    def slot(self, stream: trio.SocketStream) -> Iterator[trio.CancelScope | None]:
        """A cancel scope for this connection's authentication (it carries the deadline and
        is cancelled if the slot is evicted), or None if the connection must be closed now."""
        address = _source_address(stream)
        limits = self.limits
        held = self._pending.setdefault(address, [])
        if len(held) >= limits.max_per_address or not self._make_room(len(held)):
            if not held:
                del self._pending[address]
            yield None
            return
        scope = trio.CancelScope(deadline=trio.current_time() + limits.deadline)
        held.append(scope)
        self._total += 1
        try:
            yield scope
        finally:
            self._release(address, scope)

    def _make_room(self, ours: int) -> bool:
        if self._total < self.limits.max_total:
            return True
        busiest = max(self._pending, key=lambda a: len(self._pending[a]))
        if len(self._pending[busiest]) <= ours + 1:
            return False  # evicting would not make the shares fairer
        victim = self._pending[busiest][0]
        victim.cancel()
        self._release(busiest, victim)
        return True

    def _release(self, address: str, scope: trio.CancelScope) -> None:
        held = self._pending.get(address, [])
        if scope in held:  # not if it was evicted (and released) already
            held.remove(scope)
            self._total -= 1
            if not held:
                del self._pending[address]

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
        """(unauthenticated connections held, source addresses they come from)."""
        return self._total, len(self._pending)


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


def _source_address(stream: trio.SocketStream) -> str:
    try:
        return str(stream.socket.getpeername()[0])
    except (OSError, IndexError):
        return "?"


async def _receive_exactly(stream: trio.SocketStream, count: int) -> bytes:
    data = bytearray()
    while len(data) < count:
        piece = await stream.receive_some(count - len(data))
        if not piece:
            raise ProtocolError("the connection closed during admission")
        data += piece
    return bytes(data)
