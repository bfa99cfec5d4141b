"""Probation: a member that sent nothing in our round sits out the next gatherings, pure.

A member that joins every averaging and never sends its contribution (or never returns the
part it reduces) costs each round a stall timeout before the others drop it and retry without
it: the step rate of a collaboration halved beside one. Dropping it is each member's own
finding; who sits out must be one decision, or the peers would plan from different views.

- Each peer remembers the members it dropped (`Probation.strike`: as a reducer, senders it
  stopped waiting for; as a sender, reducers that did not return its part), each for
  `PROBATION_SECONDS`, doubling with every strike up to `MAX_PROBATION_SECONDS`. A member that
  completes a round with us again has proved it sends: its strikes are forgotten (`cleared`).
- Its tickets name them (`Ticket.probation`, at most `MAX_NAMED`).
- Every reader leaves out of the view a ticket that at least `ACCUSERS` *other* tickets of the
  same view name (`seated`). A view is a set of tickets, so peers that read the same tickets
  seat the same members: the plan, its digest and the single group's leader agree. Only while
  accusers keep naming it: when their strikes expire it is seated again, and if it still sends
  nothing it is struck again, for twice as long.

Why two accusers: one peer's claim decides nothing (one hostile member could otherwise keep
any honest peer out of every averaging); a silent member of a group of three or more is named
by every other member of it. Two hostile members can keep one honest peer out while they stay:
it then takes the state by download, losing its contributions, not the model (SECURITY.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from peer.averaging.group import Ticket

PROBATION_SECONDS = 60.0
"""How long a first strike keeps a member out (the collaboration's clock)."""
MAX_PROBATION_SECONDS = 3600.0
"""The longest a repeated strike keeps it out."""
ACCUSERS = 2
"""Distinct other tickets of a view that must name a member before it sits out."""
MAX_NAMED = 8
"""Members one ticket may name (`Ticket.probation`'s bound)."""
MAX_REMEMBERED = 256
"""Members a peer keeps strikes for (the oldest expiry goes first)."""


@dataclass
class _Strikes:
    count: int
    until: float


class Probation:
    """The members this peer saw send nothing, and until when it names them."""

    def __init__(self, *, base: float = PROBATION_SECONDS, cap: float = MAX_PROBATION_SECONDS):
        self.base = base
        self.cap = cap
        self._strikes: dict[str, _Strikes] = {}

    def strike(self, peer_id: str, *, now: float) -> float:
        """`peer_id` sent us nothing in a round: name it until `now` + its probation, which
        doubles with each strike; returns that time."""
        known = self._strikes.get(peer_id)
        count = 1 if known is None else known.count + 1
        until = now + min(self.cap, self.base * 2 ** (count - 1))
        self._strikes[peer_id] = _Strikes(count, until)
        if len(self._strikes) > MAX_REMEMBERED:
            oldest = min(self._strikes, key=lambda p: self._strikes[p].until)
            del self._strikes[oldest]
        return until

    def cleared(self, peer_ids: Iterable[str]) -> None:
        """These members completed a round with us: they send, strikes forgotten."""
        for peer_id in peer_ids:
            self._strikes.pop(peer_id, None)

    def named(self, *, now: float) -> list[str]:
        """The members our ticket names now: on probation at `now`, latest expiry first."""
        current = [(s.until, p) for p, s in self._strikes.items() if s.until > now]
        return [p for _, p in sorted(current, reverse=True)[:MAX_NAMED]]


def seated(view: Sequence[Ticket], *, accusers: int = ACCUSERS) -> tuple[list[Ticket], set[str]]:
    """(The tickets of `view` that take part, the peer ids left out): a ticket is left out when
    at least `accusers` other tickets of the view name it (a ticket naming itself, or a peer
    twice, counts once). The same tickets give the same answer to every reader."""
    present = {t.peer_id for t in view}
    named = Counter(
        peer_id
        for t in view
        for peer_id in set(t.probation[:MAX_NAMED])
        if peer_id != t.peer_id and peer_id in present
    )
    out = {peer_id for peer_id, n in named.items() if n >= accusers}
    return [t for t in view if t.peer_id not in out], out


def silent_members(
    dropped_senders: Iterable[str], failed_reducers: Iterable[str], me: str
) -> set[str]:
    """Whom a round's report says sent us nothing: senders we stopped waiting for, reducers
    that did not return our part (not ourselves)."""
    return {p for p in (*dropped_senders, *failed_reducers) if p != me}
