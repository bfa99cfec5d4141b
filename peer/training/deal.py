"""Who computes how much of a DeDLOC step, pure: the target's micro-batches dealt among the
trainers by their published rates (`shares`, `deal`).

Every peer deals from the records it read, so peers that read the same rates deal the same
quotas, and the quotas of one deal add up to the target exactly. Three rules keep a step at
its target wherever the rates come from (before, 16 peers applied 512 samples at step 1 and
a mean of 283 for a target of 256: docs/benchmarks.md):

- A rate not known yet (a peer's first micro-batch is torch's warm-up, no rate) counts as the
  median known one, and all as equal when none is known: peers just started share the
  target, they do not each compute one micro-batch on top.
- Every share is at least 1/`REMEASURE_STEPS` of a micro-batch, taken from the others: the
  rate is the only input of the deal and is measured only by computing, so a peer whose rate
  fell (a slow warm-up) computes one about every `REMEASURE_STEPS` steps, within the target.
- A rate counts for at most `MAX_RATE_CLAIM` times the median rate: a record claiming a huge
  rate (its own word) cannot take the whole deal and, computing nothing, shrink every step.

Systematic rounding (`deal`): the shares laid end to end by peer id cover [0, units); a peer
gets the points u, u + 1, ... that fall in its piece, u = frac(0.5 + step x DEAL_ROTATION).
Each quota is its share rounded down or up, and over the steps each peer's quotas average its
share. A quota changes only where a rate moves a piece's end across a point (largest
remainder, before, ranked the fractional parts of the shares, which near-equal rates reorder
with every published record).
"""

from __future__ import annotations

import math
import statistics

REMEASURE_STEPS = 10
"""Steps within which a peer however slow computes a micro-batch (its share's floor)."""
DEAL_ROTATION = (math.sqrt(5) - 1) / 2
"""How far the deal's points move a step, in micro-batches (the golden ratio's fraction: the
turns of every share come evenly spread; a share of 0.1 at most 13 steps apart)."""
MAX_RATE_CLAIM = 8.0
"""A rate counts for at most this many times the median rate (of the known ones)."""


def shares(units: int, rates: dict[str, float]) -> dict[str, float]:
    """Each peer's share of `units` micro-batches: in proportion to its rate (0: not known,
    counts as the median known one), each rate at most `MAX_RATE_CLAIM` times the median,
    and at least 1/REMEASURE_STEPS (the others' shares scaled down to make room, a
    water-fill). They add up to `units`."""
    known = [rate for rate in rates.values() if rate > 0]
    median = statistics.median(known) if known else 1.0
    weights = {
        peer: min(rate, MAX_RATE_CLAIM * median) if rate > 0 else median
        for peer, rate in rates.items()
    }
    most = max(weights.values())
    weights = {peer: weight / most for peer, weight in weights.items()}  # no overflow
    least = 1 / REMEASURE_STEPS
    if least * len(weights) >= units:
        return dict.fromkeys(weights, units / len(weights))
    raised: set[str] = set()
    while True:  # ends: the fastest peer's share stays above `least`
        left = units - least * len(raised)
        total = sum(w for peer, w in weights.items() if peer not in raised)
        low = {p for p, w in weights.items() if p not in raised and left * w / total < least}
        if not low:
            return {
                peer: least if peer in raised else left * weight / total
                for peer, weight in weights.items()
            }
        raised |= low


def deal(units: int, rates: dict[str, float], step: int) -> dict[str, int]:
    """`units` micro-batches dealt among the peers of `rates` for the step after `step`: the
    same for every peer that deals from the same rates, `units` in all, each peer's quota its
    share (`shares`) rounded down or up (module docstring)."""
    pieces = shares(units, rates)
    offset = (0.5 + step * DEAL_ROTATION) % 1.0

    def points_below(end: float) -> int:
        return min(units, max(0, math.ceil(end - offset)))

    dealt: dict[str, int] = {}
    peers = sorted(pieces)
    end = 0.0
    for i, peer in enumerate(peers):
        start, end = end, float(units) if i == len(peers) - 1 else end + pieces[peer]
        dealt[peer] = points_below(end) - points_below(start)
    return dealt
