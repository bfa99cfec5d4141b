"""The gate in front of py-libp2p's inbound connections: who may start a handshake, and which
authenticated connections make room for a newcomer.

Theory of operation
-------------------
py-libp2p 0.8.1 (`Swarm._handle_inbound_connection`) takes one of its 250 inbound slots (a
`trio.CapacityLimiter` of `max_connections - min_connections`) at TCP accept, before the pnet
nonce and the Noise handshake, and holds it for up to `inbound_upgrade_timeout` (10 s) even if
the other side never sends a byte. 250 idle TCP connections, which cost an attacker no key and
no identity, kept every newcomer out; 250 throw-away identities that authenticate and then sit
idle would keep them out for good. We replace that handler (`serve_inbound`) and the TCP
listener's accept loop (`GatedTCPListener`); its slot limiter is no longer used on TCP, these
limits take its place, all counted per network prefix (`peer.net.prefix.prefix_of`: IPv4 /24,
IPv6 /64; see `peer.net.slots`):

    accept --budget--> PENDING --authenticate--> ESTABLISHED --release--> (gone)
       \\--> closed        \\--> evicted: socket closed   \\--> pruned: connection closed

- at accept: a prefix over its accept rate (`accept_rate`, `accept_burst`) is closed right
  there, in the listener's accept loop, before a task is started or a byte read.
- PENDING (TCP accepted; pnet, Noise and yamux negotiation running): at most
  `max_pending_per_source` from one prefix and `max_pending` in all, each for
  `handshake_seconds`. A newcomer from a prefix at its cap takes that prefix's oldest pending
  slot: an attacker's idle connections from a member's own public address cannot keep the
  member out (its handshake takes milliseconds; the attacker must open that many fresh
  connections meanwhile, which the accept rate bounds). When all are taken, a newcomer from a
  prefix with fewer pending connections than the fullest takes that prefix's oldest slot: to
  keep out a newcomer from one more prefix, an attacker needs as many prefixes as there are
  slots.
- ESTABLISHED (authenticated and registered by the swarm): when one more than `max_established`
  are held, or py-libp2p's `max_connections` (inbound and outbound together; it refuses a
  handshake at the cap) has less room left than the handshakes that may still finish, the
  newcomer's arrival prunes the least useful others: from the prefix holding the most
  connections first, then one with no stream of ours open and nothing held on it (a relay
  reservation, see `InboundGate.holds`), then the one idle longest (libp2p's own identify and
  ping streams do not count). Pruning starts well below py-libp2p's caps, so a newcomer always
  finds a slot.

`InboundGate` is the bookkeeping alone (synchronous, clock passed in); `serve_inbound` and
`GatedTCPListener` move the bytes and own the waits. Evicting a pending connection closes its
socket rather than cancelling its handshake: py-libp2p's upgrade then fails like any broken
connection and frees its resource-manager scope, which a cancellation in its cleanup would
skip (after 1,000 such leaks its resource manager refuses every connection).
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any

import trio
from libp2p.abc import IMuxedConn, INotifee
from libp2p.io.trio import TrioTCPStream
from libp2p.network.connection.raw_connection import RawConnection
from libp2p.peer.id import ID
from libp2p.transport.exceptions import OpenConnectionError
from libp2p.transport.tcp.tcp import TCP, TCPListener, _open_reuseport_listeners
from libp2p.utils.multiaddr_utils import extract_ip_from_multiaddr
from multiaddr import Multiaddr

from peer.net.admission import accept_loop
from peer.net.prefix import prefix_of
from peer.net.slots import AcceptBudget, Slots, check_rate

log = logging.getLogger("peertrain.inbound")

LIBP2P_OWN_PROTOCOLS = ("/ipfs/", "/libp2p/")
"""Protocol prefixes of libp2p's housekeeping (identify, ping, relay ...); ours are /peertrain/."""

PRUNE_CLOSE_SECONDS = 2.0
"""How long a pruned connection's close may take (yamux GoAway, stream resets, a 0.1 s sleep
in py-libp2p's SwarmConn.close); its socket goes with the task either way."""


@dataclass(frozen=True, kw_only=True)
class InboundLimits:
    """Limits on inbound libp2p connections (see the module docstring)."""

    max_pending: int = 64
    """Inbound connections still in the handshake, in all."""
    max_pending_per_source: int = 16
    """Of those, from one IPv4 /24 or IPv6 /64 (room for a NAT'd site's burst of joins); a
    newcomer past it takes its prefix's oldest."""
    handshake_seconds: float = 5.0
    """Seconds from TCP accept to an authenticated, multiplexed connection (our dials: 5 s)."""
    max_established: int = 160
    """Authenticated inbound connections kept; beyond it a newcomer prunes the least useful."""
    accept_rate: float = 20.0
    """TCP connections a second one prefix may open, sustained; more are closed at accept.
    An attacker must open `max_pending_per_source` within a member's handshake to push it
    out: at this rate that takes 0.8 s (a handshake takes milliseconds)."""
    accept_burst: int = 64
    """TCP connections one prefix may open at once (a NAT'd site's members joining)."""

    def __post_init__(self) -> None:
        if not 1 <= self.max_pending_per_source <= self.max_pending:
            raise ValueError(
                f"max_pending_per_source={self.max_pending_per_source!r} must be between 1 "
                f"and max_pending={self.max_pending!r}"
            )
        if not self.handshake_seconds > 0:
            raise ValueError(f"handshake_seconds={self.handshake_seconds!r} must be positive")
        if self.max_established < 1:
            raise ValueError(f"max_established={self.max_established!r} must be at least 1")
        check_rate(self.accept_rate, self.accept_burst)


class Phase(enum.Enum):
    PENDING = "pending"
    ESTABLISHED = "established"
    GONE = "gone"


def _nothing() -> None:
    pass


def _no_streams() -> int:
    return 0


def _not_held() -> bool:
    return False


def _holds_nothing(muxed_conn: object) -> bool:
    return False


@dataclass(eq=False)
class Admission:
    """One inbound connection the gate let in."""

    source: str
    """The network prefix it came from (`prefix_of`)."""
    since: float
    """When it was accepted (then: when it authenticated)."""
    phase: Phase = Phase.PENDING
    peer_id: ID | None = None
    last_active: float = 0.0
    """When a useful stream on it last closed (authentication counts)."""
    close: Callable[[], None] = field(default=_nothing, repr=False)
    """Set by the I/O shell: stops this connection; callable from any task, never blocks."""
    open_streams: Callable[[], int] = field(default=_no_streams, repr=False)
    """Set by the I/O shell: how many useful streams the connection has open now."""
    held: Callable[[], bool] = field(default=_not_held, repr=False)
    """Set by the I/O shell: whether something is held on the connection now (see
    `InboundGate.holds`); it then counts as busy as one with a stream open."""


@dataclass(frozen=True)
class InboundStatistics:
    pending: int
    established: int
    refused: int
    """Connections closed at accept, every pending slot taken by prefixes no busier."""
    evicted: int
    """Pending connections closed to let a newcomer in (of its own prefix at its cap, or of
    the fullest prefix)."""
    pruned: int
    """Authenticated connections closed to make room."""
    over_budget: int = 0
    """TCP connections closed at accept, their prefix over its accept rate."""


class InboundGate:
    """The bookkeeping of inbound connections: `admit` at accept, `authenticate` when the
    handshake is done, `release` when the connection's task ends. The victims these return
    are already off the books; the caller closes them (`Admission.close`)."""

    def __init__(self, limits: InboundLimits) -> None:
        self.limits = limits
        self._pending: Slots[Admission] = Slots(
            max_total=limits.max_pending, max_per_prefix=limits.max_pending_per_source
        )
        self.budget = AcceptBudget(rate=limits.accept_rate, burst=limits.accept_burst)
        """Asked at accept, by the listener (`GatedTCPListener`)."""
        self._established: set[Admission] = set()
        self._by_peer: dict[ID, set[Admission]] = {}
        self._pruned = 0
        # Set by a service that keeps state bound to a connection: whether a muxed connection
        # holds some. The relay's reservations: the hop stream closes once answered, so the
        # connection looks idle, and pruning it only makes its peer reserve again (churn).
        self.holds: Callable[[object], bool] = _holds_nothing

    def admit(self, ip: str, *, now: float) -> tuple[Admission | None, list[Admission]]:
        """A connection from `ip` (or from a prefix: the relay passes its caller's) starts
        its handshake: its admission (None: close it now) and the pending connections to
        close to make room for it."""
        admission = Admission(prefix_of(ip), now)
        taken, evicted = self._pending.take(admission, ip)
        for victim in evicted:
            victim.phase = Phase.GONE
        return (admission if taken else None), evicted

    def authenticate(
        self, admission: Admission, *, peer_id: ID, now: float, room: int
    ) -> list[Admission]:
        """`admission` finished its handshake as `peer_id`. `room`: how many more connections
        py-libp2p would register (its max_connections less all it holds, this one included).
        Returns the established connections to close to make room."""
        if admission.phase is not Phase.PENDING:  # evicted meanwhile: its socket is closed
            return []
        self._drop(admission)
        admission.phase = Phase.ESTABLISHED
        admission.peer_id = peer_id
        admission.since = admission.last_active = now
        self._established.add(admission)
        self._by_peer.setdefault(peer_id, set()).add(admission)
        excess = max(
            len(self._established) - self.limits.max_established,
            self.limits.max_pending - room,  # room for every handshake now running to finish
        )
        victims = choose_prunable(self._established - {admission}, excess)
        for victim in victims:
            self._drop(victim)
        self._pruned += len(victims)
        return victims

    def note_activity(self, peer_id: ID, *, now: float) -> None:
        """A useful stream to or from `peer_id` closed."""
        for admission in self._by_peer.get(peer_id, ()):
            admission.last_active = now

    def release(self, admission: Admission) -> None:
        """The connection's task ended (closed, failed or refused); idempotent."""
        self._drop(admission)

    def pending_count(self) -> int:
        return len(self._pending)

    def statistics(self) -> InboundStatistics:
        pending = self._pending.statistics()
        return InboundStatistics(
            pending=pending.held,
            established=len(self._established),
            refused=pending.refused,
            evicted=pending.evicted,
            pruned=self._pruned,
            over_budget=self.budget.statistics().over_budget,
        )

    def _drop(self, admission: Admission) -> None:
        if admission.phase is Phase.PENDING:
            self._pending.release(admission)
        elif admission.phase is Phase.ESTABLISHED:
            self._established.discard(admission)
            assert admission.peer_id is not None
            peers = self._by_peer.get(admission.peer_id, set())
            peers.discard(admission)
            if not peers:
                self._by_peer.pop(admission.peer_id, None)
        admission.phase = Phase.GONE


def choose_prunable(candidates: set[Admission], count: int) -> list[Admission]:
    """The `count` least useful of `candidates`: from the prefix holding the most of them
    first (one site's many identities go before many sites' one each), then those with no open
    stream or held state (a stream in use is work in flight), then the longest idle."""
    if count <= 0 or not candidates:
        return []
    per_source = Counter(a.source for a in candidates)

    def usefulness(admission: Admission) -> tuple[int, bool, float]:
        busy = admission.open_streams() > 0 or admission.held()
        return (-per_source[admission.source], busy, admission.last_active)

    return sorted(candidates, key=usefulness)[:count]


def useful(stream: Any) -> bool:
    """Whether a stream is work: any of ours, not libp2p's own identify or ping (every new
    connection opens those, a throw-away identity's included) nor one still negotiating."""
    protocol = stream.get_protocol()
    return protocol is not None and not str(protocol).startswith(LIBP2P_OWN_PROTOCOLS)


class ActivityNotifee(INotifee):
    """Tells the gate when a useful stream closes, in either direction (its protocol is not
    known yet when it opens; while it is open it counts through `Admission.open_streams`)."""

    def __init__(self, gate: InboundGate) -> None:
        self.gate = gate

    async def opened_stream(self, network: Any, stream: Any) -> None:
        pass

    async def closed_stream(self, network: Any, stream: Any) -> None:
        peer_id = getattr(getattr(stream, "muxed_conn", None), "peer_id", None)
        if peer_id is not None and useful(stream):
            self.gate.note_activity(peer_id, now=trio.current_time())

    async def connected(self, network: Any, conn: Any) -> None:
        pass

    async def disconnected(self, network: Any, conn: Any) -> None:
        pass

    async def listen(self, network: Any, multiaddr: Multiaddr) -> None:
        pass

    async def listen_close(self, network: Any, multiaddr: Multiaddr) -> None:
        pass


def install(swarm: Any, gate: InboundGate) -> None:
    """Put the gate in front of `swarm`'s inbound connections: its TCP listeners accept with
    the gate's budget (`GatedTCPListener`) and its handler is `serve_inbound`. The handshake
    deadline is the swarm's own `inbound_upgrade_timeout`, set from the limits when the swarm
    is made."""

    async def handle(read_write_closer: Any, maddr: Multiaddr) -> None:
        await serve_inbound(swarm, gate, read_write_closer, maddr)

    # Private method of the pinned py-libp2p version; see the module docstring.
    swarm._handle_inbound_connection = handle
    swarm.register_notifee(ActivityNotifee(gate))
    for transport in swarm.transport_manager.get_transports():
        if isinstance(transport, TCP):  # this swarm's own instance: other hosts keep theirs
            transport.create_listener = lambda handler: GatedTCPListener(handler, gate)


class GatedTCPListener(TCPListener):
    """py-libp2p's TCP listener (SO_REUSEPORT sockets for hole punching, a system task that
    outlives `listen`, `close`), with our accept loop: a connection over its prefix's accept
    rate is closed right at accept (`InboundGate.budget`), before py-libp2p's per-connection
    task, stream wrapper and handler; the others go on as py-libp2p's would."""

    def __init__(self, handler_function: Any, gate: InboundGate) -> None:
        super().__init__(handler_function)
        self.gate = gate

    async def listen(self, maddr: Multiaddr) -> None:
        """Listen on `maddr` (OpenConnectionError if we cannot); returns once accepting."""
        try:
            port = int(maddr.value_for_protocol("tcp"))
        except Exception:
            raise OpenConnectionError(f"cannot listen on {maddr}: no TCP port") from None
        # Private members of the pinned version's TCPListener (see its `listen`): its lock,
        # system-task nursery and listeners, which its `close` and `get_addrs` use.
        async with self._lifecycle_lock:
            if self._closed:
                raise OpenConnectionError(f"cannot listen on {maddr}: listener is closed")
            if self._nursery is None:
                await self._spawn_background_task()
            nursery = self._nursery
            if nursery is None:
                raise OpenConnectionError(f"cannot listen on {maddr}: no background task")
            listeners = await _open_reuseport_listeners(extract_ip_from_multiaddr(maddr), port)
            for listener in listeners:
                nursery.start_soon(accept_loop, listener, self._serve, self.gate.budget, nursery)
            self.listeners.extend(listeners)

    async def _serve(self, stream: trio.SocketStream) -> None:
        """One admitted connection, as py-libp2p's listener hands it on."""
        try:
            await self.handler(TrioTCPStream(stream))
        except Exception as error:  # a failed connection, not a bug of ours (py-libp2p's)
            log.debug("inbound connection failed: %r", error)


async def serve_inbound(
    swarm: Any, gate: InboundGate, read_write_closer: Any, maddr: Multiaddr
) -> None:
    """One inbound connection from accept to close, instead of py-libp2p's handler."""
    if isinstance(read_write_closer, IMuxedConn):  # QUIC-like, already secured: not ours
        await type(swarm)._handle_inbound_connection(swarm, read_write_closer, maddr)
        return
    address = read_write_closer.get_remote_address()
    admission, evicted = gate.admit(address[0] if address else "", now=trio.current_time())
    for victim in evicted:
        victim.close()
    if admission is None:
        log.debug("inbound connection from %s refused: its pending slots are taken", address)
        with suppress(Exception):
            await read_write_closer.close()
        return
    admission.close = lambda: _abort(read_write_closer)
    try:
        await _serve_admitted(swarm, gate, admission, read_write_closer, maddr)
    finally:
        gate.release(admission)


async def _serve_admitted(
    swarm: Any, gate: InboundGate, admission: Admission, read_write_closer: Any, maddr: Multiaddr
) -> None:
    remote = swarm._build_remote_multiaddr(read_write_closer)
    if remote is not None and not await swarm.connection_gate.is_allowed(remote):
        with suppress(Exception):
            await read_write_closer.close()
        return
    raw = RawConnection(read_write_closer, False)
    try:
        # Bounded by inbound_upgrade_timeout (InboundLimits.handshake_seconds).
        muxed = await swarm.upgrade_inbound_raw_conn(raw, maddr)
    except Exception as error:  # what py-libp2p's own handler does: a failed peer, not a bug
        log.debug("inbound connection from %s failed: %r", maddr, error)
        with suppress(Exception):
            await raw.close()
        return
    conn = next(
        (c for c in swarm.connections.get(muxed.peer_id, ()) if c.muxed_conn is muxed), None
    )
    with trio.CancelScope() as pruned:
        admission.close = pruned.cancel
        if conn is not None:
            admission.open_streams = lambda: sum(map(useful, conn.get_streams()))
        admission.held = lambda: gate.holds(muxed)
        room = swarm.connection_config.max_connections - len(swarm.get_connections())
        victims = gate.authenticate(
            admission, peer_id=muxed.peer_id, now=trio.current_time(), room=room
        )
        for victim in victims:
            victim.close()
        # Returning frees this task when the connection closes (py-libp2p's handler waited
        # for the swarm to stop).
        closed = getattr(muxed, "event_closed", None)
        await (closed.wait() if closed is not None else swarm.manager.wait_finished())
    if pruned.cancelled_caught:
        log.debug("pruned the inbound connection from %s (%s)", muxed.peer_id, maddr)
        with trio.move_on_after(PRUNE_CLOSE_SECONDS), suppress(Exception):
            await (conn.close() if conn is not None else muxed.close())


def _abort(read_write_closer: Any) -> None:
    """Close a pending connection's socket at once, from any task: the handshake's blocked
    read raises and py-libp2p cleans up as for any broken connection."""
    socket = getattr(getattr(read_write_closer, "stream", None), "socket", None)
    if socket is not None:
        socket.close()
