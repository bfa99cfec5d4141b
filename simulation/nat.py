"""Peers behind NAT in the simulator: which path each connection takes, what it costs, and what
the real code does with a peer it cannot reach.

The real code's paths
---------------------
- Reachability (`peer.measure.reachability`). A backbone dials each peer back: one it reaches
  is `reachable` (`Nat.PUBLIC`). One it does not checks its NAT's mapping from its listen
  port: the same for every destination (endpoint-independent, `Nat.CONE`) makes it
  `punchable`; a new port per destination (`Nat.SYMMETRIC`) leaves it client-only. Both
  claims go into its `Capabilities` (tickets, presence). A peer not reachable stays a DHT
  client (`DHT.announcing` is False: nobody adds it to a routing table; `peer.daemon`), holds
  a reservation on every backbone (`RelaySlots`; at most `RelayLimits.max_reservations` per
  relay) and announces relayed addresses.
- A connection from a dialer to a listener (`path_between`). To a reachable listener: direct
  (the dialer's own NAT lets its dial out). To a NATed one: through a backbone relay first
  (`route_through_relays`: CONNECT, the relay's STOP, then the network key, Noise and yamux
  inside the circuit), and then the listener, the end that accepted the circuit, starts a
  hole punch (`HolePuncher`: Connect, Connect, Sync over the circuit, then both dial at once
  from their listen ports). It makes a direct connection when the dialer is reachable (the
  listener's own dial goes straight in whatever its NAT: a connection reversal) or when both
  NATs are endpoint-independent; else (a symmetric NAT at one end, a NAT at the other) both
  dials fail after `dial_seconds` and the connection stays relayed, for
  `HolePunchConfig.failed_relay_seconds` more (then it closes, and its circuit is the relay's
  again; the next call opens another). When no relay holds a
  slot for the listener (every backbone down, or full) the dial fails: the relay refuses,
  then the direct dial's SYN is dropped by the listener's router, until the caller's deadline.
- What goes where. A connection serves both ends, whoever dialed: a NATed peer that dialed a
  reachable one is reached back on it directly, and one that holds a slot on a relay is
  reached by that relay on the reservation's connection. Relays carry control traffic only:
  RPCs (matchmaking joins to a punchable leader, ...) go over the circuit while it is the
  only connection, their bytes on both ends' links and on the relay's downlink and uplink,
  one circuit carrying at most `RelayLimits.circuit_bytes` for `circuit_seconds` (the next
  call then opens another, as the RPC client's retry on a fresh stream does). Tensors never
  go through a relay (`peer.net.streamio.open_stream`; the all-reduce and state servers reset
  a relayed stream): a data plane waits for the punch and, without one, gives up on that peer
  (a sender when its stall timeout ends its dial loop).
- Who reduces (`peer.averaging.group.able_to_reduce` -> `peer.roles.aggregators`): reachable
  peers, and punchable ones when every member of the group is reachable or punchable; so
  nobody behind NAT in a group with a symmetric member. Only when nobody can, everyone is
  given a share (`reducers`), and the pairs with no direct path fail the round. A symmetric
  peer never leads a matchmaking group; a punchable one may (`leader_candidates`).

Here `NatBook` keeps the peers' NATs, the relays' reservations and the live connections
between pairs of peers, and decides each new connection's path and timing (`Connection`);
`simulation.network` waits and charges the bytes, `simulation.dataplane` applies the
no-tensors-through-relays rule, `simulation.collaboration` gives each peer the claims the real
code would advertise.

Not modelled: the punch budget (`PunchBudget`), the relays' per-source limits (the simulated
addresses share a few /24s, which real home networks do not), the time before a peer's first
reachability verdict, and a direct connection's own handshakes (the simulator never charged
them: a relayed connection is charged the circuit's setup and the punch's exchange on top).
"""

from __future__ import annotations

import enum
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from libp2p.peer.id import ID

from peer.net.holepunch import HolePunchConfig
from peer.net.relay import RelayLimits

CIRCUIT_ROUND_TRIPS = 3.0
"""Round trips over the relayed path before a circuit carries a first byte: CONNECT, the
relay's STOP and its status (1), Noise XX (1.5) and multistream-select for yamux (0.5)."""
PUNCH_EXCHANGE_ROUND_TRIPS = 1.5
"""The hole punch's Connect, Connect and Sync over the circuit (`peer.net.holepunch`)."""
DIRECT_HANDSHAKE_ROUND_TRIPS = 2.5
"""The punched connection's TCP simultaneous open (1) and Noise XX (1.5) on the direct path."""
GOLDEN = (math.sqrt(5) - 1) / 2


class Nat(enum.Enum):
    """What a backbone's dial-back found of a peer (`peer.measure.reachability`)."""

    PUBLIC = "reachable"
    CONE = "endpoint-independent"
    """Behind a NAT that maps its listen port alike for every destination: punchable."""
    SYMMETRIC = "symmetric"
    """Behind a NAT that maps each destination to a new port: client-only."""


class Path(enum.Enum):
    """How a connection between two peers went."""

    DIRECT = "direct"
    PUNCHED = "hole-punched"
    """Relayed until the punch made a direct connection."""
    RELAYED = "relayed"
    """Relayed for good: the punch failed."""
    FAILED = "failed"
    """No connection: no relay holds a slot for the listener."""


def path_between(dialer: Nat, listener: Nat, *, relay: bool) -> Path:
    """The path a new connection from `dialer` to `listener` takes (pure; module doc): direct
    to a reachable listener; else through a relay (`relay`: one holds a slot for the
    listener), punched when the dialer is reachable or both NATs are endpoint-independent."""
    if listener is Nat.PUBLIC:
        return Path.DIRECT
    if not relay:
        return Path.FAILED
    if dialer is Nat.PUBLIC or (dialer is Nat.CONE and listener is Nat.CONE):
        return Path.PUNCHED
    return Path.RELAYED


@dataclass
class Connection:
    """A libp2p connection between two peers, direct or through `relay` until `direct_at`.
    Times are virtual seconds."""

    path: Path
    relay: ID | None = None
    ready_at: float = 0.0
    """When it carries a first byte (a circuit's setup done)."""
    direct_at: float = math.inf
    """From then on direct (inf: relayed for good)."""
    settled_at: float = 0.0
    """When its punch ended either way: a data plane waiting for it knows."""
    cut_at: float = math.inf
    """When its relay closes the circuit (`circuit_seconds`; after a punch, its grace; after a
    failed one, `failed_relay_seconds`)."""
    relayed_bytes: float = 0.0

    def relay_at(self, now: float) -> ID | None:
        """The relay its bytes go through at `now`, or None: direct."""
        return self.relay if now < self.direct_at else None

    @property
    def carries_tensors(self) -> bool:
        """Whether it is, or becomes, direct: relays carry no tensors."""
        return self.direct_at < math.inf

    def alive(self, now: float) -> bool:
        return now < self.cut_at or self.direct_at <= now


@dataclass
class NatTally:
    """What NAT did to a run's connections (the whole run, warm-up included)."""

    connections: Counter[Path] = field(default_factory=Counter)
    """libp2p connections made, by path (`Path.FAILED`: dials that found no way)."""
    relayed_bytes: float = 0.0
    """Bytes relays carried (each also on the relay's downlink and uplink)."""
    reducer_paths: Counter[Path] = field(default_factory=Counter)
    """All-reduce pairs of a sender and a reducer behind NAT: over a live direct connection
    (`DIRECT`), after waiting for a punch (`PUNCHED`), or none (`RELAYED`: the punch failed;
    `FAILED`: no connection, or not within the sender's stall timeout): no bytes flow."""
    rounds_cut: int = 0
    """All-reduce rounds with a pair of no direct connection (they fail)."""
    donor_paths: Counter[Path] = field(default_factory=Counter)
    """State downloads' pairs of a joiner and a donor behind NAT, as `reducer_paths`."""
    planned: list[tuple[tuple[Nat, bool], ...]] = field(default_factory=list)
    """Each all-reduce round's members as (NAT, holds a share), in spec order."""


class NatDraw:
    """Which NAT each new peer is behind, in join order: a golden-ratio sequence from a seeded
    offset, so that any run of peers holds each share to within about one peer (30 peers at
    50 %: 14 to 16 behind NAT), where independent draws would often miss it by three."""

    def __init__(self, nat_share: float, symmetric_share: float, *, seed: int) -> None:
        if not (0 <= nat_share <= 1 and 0 <= symmetric_share <= 1):
            raise ValueError(
                f"nat_share={nat_share!r} and symmetric_share={symmetric_share!r} must be "
                "shares between 0 and 1"
            )
        self.nat_share = nat_share
        self.symmetric_share = symmetric_share
        self._next = (seed * GOLDEN) % 1.0

    def next(self) -> Nat:
        u, self._next = self._next, (self._next + GOLDEN) % 1.0
        if u >= self.nat_share:
            return Nat.PUBLIC
        return Nat.SYMMETRIC if u < self.nat_share * self.symmetric_share else Nat.CONE


class NatBook:
    """The peers' NATs, the relays' reservations and the live connections (synchronous; the
    caller passes the time and waits)."""

    def __init__(
        self,
        *,
        round_trip: Callable[[ID, ID], float],
        gone: Callable[[ID], bool],
        limits: RelayLimits | None = None,
        punch: HolePunchConfig | None = None,
    ) -> None:
        """`round_trip(a, b)`: seconds; `gone(peer)`: it left (a relay that left relays
        nothing)."""
        self.round_trip = round_trip
        self.gone = gone
        self.limits = limits or RelayLimits()
        self.punch = punch or HolePunchConfig()
        self.kinds: dict[ID, Nat] = {}
        self.relays: list[ID] = []
        """The backbones, in the order every peer was given them (relayed addresses are tried
        in that order)."""
        self.slots: dict[ID, set[ID]] = {}
        """Relay -> the NATed peers holding a reservation on it."""
        self.tally = NatTally()
        self._connections: dict[frozenset[ID], Connection] = {}
        self._circuits: dict[ID, list[tuple[frozenset[ID], ID, Connection]]] = {}
        self._reserving: set[ID] = set()

    def kind(self, peer: ID) -> Nat:
        return self.kinds.get(peer, Nat.PUBLIC)

    def set_relays(self, relays: list[ID]) -> None:
        self.relays = list(relays)
        for relay in relays:
            self.slots.setdefault(relay, set())
            self._circuits.setdefault(relay, [])

    def add(self, peer: ID, kind: Nat) -> None:
        """A new peer; behind NAT, it reserves a slot on every relay with room."""
        self.kinds[peer] = kind
        if kind is not Nat.PUBLIC:
            self._reserving.add(peer)
            for relay in self.relays:
                self._reserve(relay, peer)

    def _reserve(self, relay: ID, peer: ID) -> None:
        slots = self.slots[relay]
        if not self.gone(relay) and len(slots) < self.limits.max_reservations:
            slots.add(peer)

    def forget(self, peer: ID, now: float) -> None:
        """`peer` left: its connections close, its slots end; a relay's circuits die with it
        (a punch not done yet too: it ran over the circuit)."""
        self._reserving.discard(peer)
        for slots in self.slots.values():
            slots.discard(peer)
        if peer in self.slots:
            self.slots[peer] = set()
            for pair, _, _ in self._circuits[peer]:
                connection = self._connections.get(pair)
                if connection is not None and connection.relay_at(now) == peer:
                    del self._connections[pair]
            self._circuits[peer] = []
        for pair in [pair for pair in self._connections if peer in pair]:
            del self._connections[pair]

    def rejoin(self, peer: ID) -> None:
        """A relay restarted: the NATed peers reserve on it again (`RelaySlots` retries)."""
        if peer in self.slots:
            for reserving in sorted(self._reserving, key=lambda p: p.to_bytes()):
                self._reserve(peer, reserving)

    def live(self, a: ID, b: ID, now: float) -> Connection | None:
        connection = self._connections.get(frozenset((a, b)))
        return connection if connection is not None and connection.alive(now) else None

    def drop(self, a: ID, b: ID) -> None:
        """The connection closed (a caller gave up on it): the next call dials again."""
        self._connections.pop(frozenset((a, b)), None)

    def connection(self, dialer: ID, listener: ID, now: float) -> Connection:
        """The live connection between the two, or a new one from `dialer` (counted). A
        relayed one whose circuit is spent (its bytes or its time) is replaced. To a peer that
        left: neither counted nor kept (the caller meets its departure; behind NAT, its slots
        ended with it: no way in)."""
        if self.gone(listener):
            if self.kind(listener) is Nat.PUBLIC:
                return Connection(Path.DIRECT, ready_at=now, direct_at=now)
            return Connection(Path.FAILED)
        pair = frozenset((dialer, listener))
        connection = self._connections.get(pair)
        if connection is not None and connection.alive(now):
            spent = connection.relayed_bytes >= self.limits.circuit_bytes
            if connection.relay_at(now) is None or not spent:
                return connection
        connection = self._open(dialer, listener, now)
        self.tally.connections[connection.path] += 1
        if connection.path is not Path.FAILED:
            self._connections[pair] = connection
        return connection

    def _open(self, dialer: ID, listener: ID, now: float) -> Connection:
        if dialer in self.slots.get(listener, ()) or listener in self.slots.get(dialer, ()):
            return Connection(Path.DIRECT, ready_at=now, direct_at=now)  # a reservation's
        relay = self._relay_for(dialer, listener, now)
        path = path_between(self.kind(dialer), self.kind(listener), relay=relay is not None)
        if path is Path.DIRECT:
            return Connection(path, ready_at=now, direct_at=now)
        if relay is None:
            return Connection(path)
        relayed = self.round_trip(dialer, relay) + self.round_trip(relay, listener)
        ready = now + CIRCUIT_ROUND_TRIPS * relayed
        exchanged = ready + PUNCH_EXCHANGE_ROUND_TRIPS * relayed
        if path is Path.PUNCHED:
            direct = self.round_trip(dialer, listener)
            direct_at = exchanged + direct / 2 + self.punch.sync_margin
            direct_at += DIRECT_HANDSHAKE_ROUND_TRIPS * direct
            connection = Connection(
                path,
                relay,
                ready_at=ready,
                direct_at=direct_at,
                settled_at=direct_at,
                cut_at=direct_at + self.punch.relay_grace_seconds,
            )
        else:
            connection = Connection(
                path,
                relay,
                ready_at=ready,
                settled_at=exchanged + self.punch.dial_seconds,
                cut_at=min(
                    now + self.limits.circuit_seconds,
                    exchanged + self.punch.dial_seconds + self.punch.failed_relay_seconds,
                ),
            )
        self._circuits[relay].append((frozenset((dialer, listener)), listener, connection))
        return connection

    def _relay_for(self, dialer: ID, listener: ID, now: float) -> ID | None:
        """The first relay that holds a slot for `listener` and has a circuit to spare (the
        dialer's own relay is skipped: nothing is relayed through oneself)."""
        for relay in self.relays:
            if relay == dialer or self.gone(relay) or listener not in self.slots[relay]:
                continue
            circuits = self._circuits[relay] = [
                (pair, target, c)
                for pair, target, c in self._circuits[relay]
                if self._connections.get(pair) is c and c.alive(now) and c.relay_at(now)
            ]
            to_listener = sum(target == listener for _, target, _ in circuits)
            if (
                len(circuits) < self.limits.max_circuits
                and to_listener < self.limits.max_circuits_per_peer
            ):
                return relay
        return None
