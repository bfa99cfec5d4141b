"""Connection slots per network prefix and an accept-rate budget per prefix, pure (synchronous,
the clock passed in): what every listener that takes connections from anyone (libp2p inbound,
the data ports, the dashboard, metrics) asks before it spends anything on a connection.

Theory of operation
-------------------
Addresses are nearly free inside one network, so both count by `prefix_of` (the IPv4 /24 or
IPv6 /64 of the caller's address), never by the exact address.

    accept --AcceptBudget.allow--> Slots.take --> held --release--> (gone)
       \\--> over budget: closed      \\--> refused    \\--> evicted: closed by the caller

- `AcceptBudget`: a token bucket per prefix, `rate` connections a second and `burst` at once.
  A connection over its prefix's budget is closed right at accept, before any task, buffer or
  handshake is spent on it: what a flood of throw-away connections from one prefix costs us
  is one accept and one close each (`benchmarks/accept_flood.py`). The table forgets the
  prefix seen least recently past `max_prefixes` (a full bucket is the same as none; a
  forgotten busy one starts full again: an attacker cycling through more prefixes than that
  gets a burst from each, and the slot caps still hold).
- `Slots`: at most `max_per_prefix` held from one prefix and `max_total` in all. A newcomer
  from a prefix at its own cap takes the slot of that prefix's OLDEST connection rather than
  being refused: idle connections from an attacker sharing a member's public address cannot
  keep the member out; the member's handshake takes milliseconds, and to push it out too the
  attacker must open `max_per_prefix` fresh connections within them, which the budget bounds
  (`max_per_prefix / rate` seconds). When all `max_total` are held, a newcomer from a prefix
  holding fewer than the busiest takes the busiest prefix's oldest slot (ties: the one whose
  oldest is oldest); else it is refused. To keep out a newcomer from one more prefix, an
  attacker needs as many prefixes as there are slots.
The victims `take` returns are already off the books; the caller closes them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from itertools import count
from typing import Generic, TypeVar

from peer.net.prefix import prefix_of

H = TypeVar("H", bound=Hashable)

MAX_PREFIXES = 4096
"""Prefixes an `AcceptBudget` remembers (a bucket is ~200 bytes: ~1 MB at most)."""


@dataclass(frozen=True, kw_only=True)
class ListenerLimits:
    """Limits of a listener that serves anyone (the dashboard, metrics): slots per prefix
    (`Slots`) and an accept-rate budget per prefix (`AcceptBudget`)."""

    max_total: int
    """Connections held at once."""
    max_per_prefix: int
    """Of those, from one IPv4 /24 or IPv6 /64; a newcomer past it takes its prefix's oldest."""
    accept_rate: float
    """Connections a second one prefix may open, sustained; more are closed at accept."""
    accept_burst: int
    """Connections one prefix may open at once before `accept_rate` applies."""

    def __post_init__(self) -> None:
        check_slots(self.max_total, self.max_per_prefix, names=("max_total", "max_per_prefix"))
        check_rate(self.accept_rate, self.accept_burst)

    def slots(self) -> Slots:
        return Slots(max_total=self.max_total, max_per_prefix=self.max_per_prefix)

    def budget(self) -> AcceptBudget:
        return AcceptBudget(rate=self.accept_rate, burst=self.accept_burst)


def check_slots(total: int, per_prefix: int, *, names: tuple[str, str]) -> None:
    """ValueError unless 1 <= per_prefix <= total (`names`: the fields, for the message)."""
    if not 1 <= per_prefix <= total:
        raise ValueError(f"{names[1]}={per_prefix!r} must be between 1 and {names[0]}={total!r}")


def check_rate(rate: float, burst: int) -> None:
    """ValueError unless the accept rate is positive and the burst at least one."""
    if not rate > 0:
        raise ValueError(f"accept_rate={rate!r} must be positive")
    if burst < 1:
        raise ValueError(f"accept_burst={burst!r} must be at least 1")


@dataclass(frozen=True)
class BudgetStatistics:
    over_budget: int
    """Connections closed at accept, their prefix over its rate."""
    prefixes: int
    """Prefixes remembered now."""


class AcceptBudget:
    """A token bucket per prefix: `allow` at accept; False: close the connection now."""

    def __init__(self, *, rate: float, burst: int, max_prefixes: int = MAX_PREFIXES) -> None:
        check_rate(rate, burst)
        self.rate = rate
        self.burst = burst
        self.max_prefixes = max_prefixes
        # prefix -> (tokens, when counted); least recently seen first
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._over = 0

    def allow(self, ip: str, *, now: float) -> bool:
        """A connection from `ip` was accepted at `now`: whether its prefix may have it (it
        takes a token if so)."""
        prefix = prefix_of(ip)
        tokens, then = self._buckets.pop(prefix, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + max(0.0, now - then) * self.rate)
        allowed = tokens >= 1.0
        if allowed:
            tokens -= 1.0
        else:
            self._over += 1
        self._buckets[prefix] = (tokens, max(then, now))  # a clock gone back refills nothing
        if len(self._buckets) > self.max_prefixes:
            self._buckets.popitem(last=False)
        return allowed

    def statistics(self) -> BudgetStatistics:
        return BudgetStatistics(over_budget=self._over, prefixes=len(self._buckets))


@dataclass(frozen=True)
class SlotStatistics:
    held: int
    prefixes: int
    """Prefixes holding at least one slot."""
    refused: int
    """Newcomers turned away (every slot held, their prefix not below the busiest; or their
    prefix at its cap, without `evict_own`)."""
    evicted: int
    """Slots taken from an older connection: of the newcomer's own prefix at its cap, or of
    the busiest prefix when all were held."""


class Slots(Generic[H]):
    """The slots of one listener: `take` for a newcomer, `release` when it is done. A holder
    is whatever the caller closes when `take` evicts it (hashable, one slot each)."""

    def __init__(self, *, max_total: int, max_per_prefix: int, evict_own: bool = True) -> None:
        """`evict_own`: a newcomer from a prefix at its cap takes that prefix's oldest slot
        (connections: the newest is the one that may be a member); False refuses it (work we
        do for a caller, such as a dial-back check, where the oldest is nearly done)."""
        check_slots(max_total, max_per_prefix, names=("max_total", "max_per_prefix"))
        self.max_total = max_total
        self.max_per_prefix = max_per_prefix
        self.evict_own = evict_own
        self._held: dict[str, dict[H, int]] = {}  # prefix -> holder -> order taken; oldest first
        self._prefix: dict[H, str] = {}
        self._order = count()
        self._refused = self._evicted = 0

    def take(self, holder: H, ip: str) -> tuple[bool, list[H]]:
        """A slot for `holder`, a connection from `ip`: (whether it got one, the holders it
        evicted to make room: off the books already, the caller closes them)."""
        assert holder not in self._prefix, "one slot per holder"
        prefix = prefix_of(ip)
        mine = self._held.get(prefix, {})
        evicted = []
        if len(mine) >= self.max_per_prefix:  # its own prefix's oldest makes room
            if not self.evict_own:
                self._refused += 1
                return False, []
            evicted.append(next(iter(mine)))
        elif len(self._prefix) >= self.max_total:
            busiest = max(self._held.values(), key=lambda h: (len(h), -next(iter(h.values()))))
            if len(busiest) <= len(mine):
                self._refused += 1
                return False, []
            evicted.append(next(iter(busiest)))
        for victim in evicted:
            self.release(victim)
        self._evicted += len(evicted)
        self._held.setdefault(prefix, {})[holder] = next(self._order)
        self._prefix[holder] = prefix
        return True, evicted

    def release(self, holder: H) -> None:
        """`holder`'s connection is done (or was evicted); idempotent."""
        prefix = self._prefix.pop(holder, None)
        if prefix is None:
            return
        mine = self._held[prefix]
        del mine[holder]
        if not mine:
            del self._held[prefix]

    def held(self, ip: str) -> int:
        """Slots held by `ip`'s prefix."""
        return len(self._held.get(prefix_of(ip), ()))

    def __len__(self) -> int:
        return len(self._prefix)

    def statistics(self) -> SlotStatistics:
        return SlotStatistics(
            held=len(self._prefix),
            prefixes=len(self._held),
            refused=self._refused,
            evicted=self._evicted,
        )
