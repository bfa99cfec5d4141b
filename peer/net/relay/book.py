"""The relay's limits and bookkeeping: reservations and circuits, counted in all, per
destination and per source address (synchronous, clock passed in; the I/O shell in
`peer.net.relay.service` asks before it spends anything)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from libp2p.peer.id import ID
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode


@dataclass(frozen=True, kw_only=True)
class RelayLimits:
    """What a relay gives to peers behind NAT (sized for control traffic, not tensors)."""

    max_reservations: int = 128
    """Reservations held at once. Full, a newcomer takes one from the busiest site (IPv4 /24,
    IPv6 /48) while that site holds at least two more than the newcomer's (`site_of`)."""
    max_reservations_per_source: int = 8
    """Of those, from one IPv4 /24 or IPv6 /64 (`prefix_of`: peer ids are free, and so are
    addresses inside one network)."""
    reservation_seconds: int = 900
    """Lifetime of a reservation; clients renew at half of it."""
    max_circuits: int = 64
    """Circuits relayed at once."""
    max_circuits_per_peer: int = 8
    """Of those, to one reserved peer."""
    max_circuits_per_source: int = 8
    """Of those, opened from one IPv4 /24 or IPv6 /64."""
    max_circuits_per_source_to_peer: int = 2
    """Of those, from one /24 or /64 to one reserved peer: else one source held every circuit
    to a peer (`max_circuits_per_peer`) and left it unreachable for `circuit_seconds`."""
    circuit_bytes: int = 4 << 20
    """Bytes one circuit carries (both directions together) before the relay cuts it."""
    circuit_seconds: int = 600
    """Seconds one circuit lives before the relay cuts it."""
    message_seconds: float = 5.0
    """Seconds for a hop or stop control message to arrive or be answered."""

    def __post_init__(self) -> None:
        for name in ("max_reservations", "max_reservations_per_source", "reservation_seconds"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least 1")
        for name in (
            "max_circuits", "max_circuits_per_peer", "max_circuits_per_source",
            "max_circuits_per_source_to_peer",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be at least 1")
        if self.circuit_bytes < 1 or self.circuit_seconds < 1 or not self.message_seconds > 0:
            raise ValueError(
                f"circuit_bytes={self.circuit_bytes!r}, circuit_seconds="
                f"{self.circuit_seconds!r} and message_seconds={self.message_seconds!r} "
                "must be positive"
            )


def site_of(source: str) -> str:
    """The site a per-source key (`peer.net.prefix.prefix_of`: an IPv4 /24 or an IPv6 /64;
    an address counts as its own) belongs to, for fair shares when the relay is full: its
    IPv4 /24 (the source itself) or IPv6 /48."""
    try:
        network = ipaddress.ip_network(source, strict=False)
    except ValueError:
        return source
    prefix = 24 if network.version == 4 else 48
    return str(network.supernet(new_prefix=prefix)) if network.prefixlen > prefix else str(network)


@dataclass(eq=False)
class _Slot:
    peer_id: ID
    source: str
    conn: object
    """The connection it arrived on: the slot ends with it."""
    expire: float


@dataclass(eq=False)
class Circuit:
    src: ID
    dst: ID
    source: str


@dataclass(frozen=True)
class RelayStatistics:
    reservations: int
    circuits: int
    refused: int
    """Reservations and circuits refused (limits, no reservation, a forged peer id)."""
    cut: int
    """Circuits cut at their byte or time limit."""
    evicted: int = 0
    """Reservations ended early to give a newcomer from a less busy site its share."""


class RelayBook:
    """Reservations and circuits of one relay; the I/O shell asks before it spends anything."""

    def __init__(self, limits: RelayLimits) -> None:
        self.limits = limits
        self._slots: dict[ID, _Slot] = {}
        self._circuits: set[Circuit] = set()
        self.refused = self.cut = self.evicted = 0

    def reserve(self, peer_id: ID, *, source: str, conn: object, now: float) -> StatusCode:
        """Reserve (or renew) a slot for `peer_id`, authenticated on `conn` from `source`."""
        self._expire(now)
        held = self._slots.get(peer_id)
        # A renewal from another address counts against that address too: else renewing
        # slots made from A over connections from B parked any number of them on B.
        if held is None or held.source != source:
            per_source = sum(
                s.source == source for s in self._slots.values() if s.peer_id != peer_id
            )
            full = held is None and len(self._slots) >= self.limits.max_reservations
            if per_source >= self.limits.max_reservations_per_source or (
                full and not self._evict_for(site_of(source))
            ):
                self.refused += 1
                return StatusCode.RESERVATION_REFUSED
        self._slots[peer_id] = _Slot(peer_id, source, conn, now + self.limits.reservation_seconds)
        return StatusCode.OK

    def _evict_for(self, site: str) -> bool:
        """Full: make room for a newcomer from `site` by ending the reservation nearest its
        expiry of the site holding the most, if that site holds at least two more than the
        newcomer's would. Every site then keeps a fair share: a few sites (or one /56 split
        into /64 sources) no longer hold every slot until the reservations expire."""
        held: dict[str, list[_Slot]] = {}
        for slot in self._slots.values():
            held.setdefault(site_of(slot.source), []).append(slot)
        busiest = max(held.values(), key=len)
        if len(busiest) < len(held.get(site, ())) + 2:
            return False
        victim = min(busiest, key=lambda s: s.expire)
        del self._slots[victim.peer_id]
        self.evicted += 1
        return True

    def expiry(self, peer_id: ID) -> float | None:
        slot = self._slots.get(peer_id)
        return None if slot is None else slot.expire

    def connection_of(self, peer_id: ID, *, now: float) -> object | None:
        """The connection a peer's live reservation arrived on."""
        self._expire(now)
        slot = self._slots.get(peer_id)
        return None if slot is None else slot.conn

    def holds(self, conn: object, *, now: float) -> bool:
        """Whether a live reservation arrived on `conn`."""
        self._expire(now)
        return any(slot.conn is conn for slot in self._slots.values())

    def connection_closed(self, conn: object) -> list[ID]:
        """A connection closed: the reservations made on it end. Returns their peers."""
        gone = [peer for peer, slot in self._slots.items() if slot.conn is conn]
        for peer in gone:
            del self._slots[peer]
        return gone

    def open_circuit(
        self, src: ID, dst: ID, *, source: str, now: float
    ) -> tuple[StatusCode, Circuit | None]:
        self._expire(now)
        if dst not in self._slots:
            self.refused += 1
            return StatusCode.NO_RESERVATION, None
        to_dst = sum(c.dst == dst for c in self._circuits)
        from_source = sum(c.source == source for c in self._circuits)
        pair = sum(c.dst == dst and c.source == source for c in self._circuits)
        if (
            len(self._circuits) >= self.limits.max_circuits
            or to_dst >= self.limits.max_circuits_per_peer
            or from_source >= self.limits.max_circuits_per_source
            or pair >= self.limits.max_circuits_per_source_to_peer
        ):
            self.refused += 1
            return StatusCode.RESOURCE_LIMIT_EXCEEDED, None
        circuit = Circuit(src, dst, source)
        self._circuits.add(circuit)
        return StatusCode.OK, circuit

    def close_circuit(self, circuit: Circuit) -> None:
        self._circuits.discard(circuit)

    def statistics(self) -> RelayStatistics:
        return RelayStatistics(
            len(self._slots), len(self._circuits), self.refused, self.cut, self.evicted
        )

    def _expire(self, now: float) -> None:
        for peer in [p for p, slot in self._slots.items() if slot.expire <= now]:
            del self._slots[peer]
