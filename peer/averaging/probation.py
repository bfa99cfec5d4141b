"""Probation: a member that sent nothing in our round sits out the next gatherings, pure.

A member that joins every averaging and never sends its contribution (or never returns the
part it reduces) costs each round a stall timeout before the others drop it and retry without
it: the step rate of a collaboration halved beside one. Dropping it is each member's own
finding; who sits out must be one decision, or the peers would plan from different views.

- Each peer strikes the members that sent it nothing at all in a round while others did
  (`RoundReport.silent`: a sender dropped holding no chunk of our part, a reducer that
  returned no chunk of its own; one that delivered part of it was slowed, perhaps by another)
  and names each for `PROBATION_SECONDS`, doubling with every strike up to
  `MAX_PROBATION_SECONDS` (`Probation.strike`). Strikes are forgotten `MEMORY_SECONDS` after
  the last probation ended: sending once in between earns nothing, so alternating costs as
  much as staying silent.
- Its tickets name them (`Ticket.probation`, at most `MAX_NAMED`).
- Every reader leaves out of the view a ticket that at least `ACCUSERS` *other* tickets of the
  same view name, not counting the names given by tickets that are themselves named that often
  (`seated`). A view is a set of tickets, so peers that read the same tickets seat the same
  members: the plan, its digest and the single group's leader agree. Only while accusers keep
  naming it: when their strikes expire it is seated again, and if it still sends nothing it is
  struck again, for twice as long.

Why two accusers and two names: one peer's claim decides nothing (one hostile member could
otherwise keep any honest peer out of every averaging); a silent member of a group of three
or more is named by every other member of it that holds a part. c colluding tickets keep at
most c honest peers out while they stay (each gives two names, each exclusion takes two):
those peers then take the state by download, losing their contributions, not the model
(SECURITY.md). Fresh identities are free: a silent member that comes back under a new peer id
costs a stall and a retry again, as before probation.
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
MAX_NAMED = 2
"""Members one ticket names at most (`Ticket.probation` takes up to 8): a group's failures
rarely come two at a time, and each name is a vote a liar could give."""
MEMORY_SECONDS = 3600.0
"""How long after its last probation ended a member's strikes are remembered."""
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
        doubles with each strike (strikes are forgotten MEMORY_SECONDS after the last
        probation ended); returns that time."""
        known = self._strikes.get(peer_id)
        count = 1 if known is None or now - known.until >= MEMORY_SECONDS else known.count + 1
        until = max(now + min(self.cap, self.base * 2 ** (count - 1)), known.until if known else 0)
        self._strikes[peer_id] = _Strikes(count, until)
        if len(self._strikes) > MAX_REMEMBERED:
            oldest = min(self._strikes, key=lambda p: self._strikes[p].until)
            del self._strikes[oldest]
        return until

    def named(self, *, now: float) -> list[str]:
        """The members our ticket names now: on probation at `now`, latest expiry first."""
        current = [(s.until, p) for p, s in self._strikes.items() if s.until > now]
        return [p for _, p in sorted(current, reverse=True)[:MAX_NAMED]]


def seated(view: Sequence[Ticket], *, accusers: int = ACCUSERS) -> tuple[list[Ticket], set[str]]:
    """(The tickets of `view` that take part, the peer ids left out): a ticket is left out when
    at least `accusers` other tickets of the view name it (its first `MAX_NAMED` names; a
    ticket naming itself, or a peer twice, counts once), not counting the names of tickets
    that are themselves named that often. The same tickets give the same answer to every
    reader, in whatever order."""
    present = {t.peer_id for t in view}
    names = {
        t.peer_id: {p for p in t.probation[:MAX_NAMED] if p != t.peer_id and p in present}
        for t in view
    }

    def named_by(counted: Iterable[str]) -> Counter[str]:
        return Counter(p for accuser in counted for p in names[accuser])

    suspects = {p for p, n in named_by(names).items() if n >= accusers}
    votes = named_by(a for a in names if a not in suspects)
    out = {p for p, n in votes.items() if n >= accusers}
    return [t for t in view if t.peer_id not in out], out
