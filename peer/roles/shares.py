"""Aggregation shares for a fixed set of computing peers: the all-reduce LP, solved exactly.

For fixed roles (c_i) the shares solve the linear program

    minimise t  subject to  (c_i + g_i (K - 2 c_i)) / b_i <= t  for every peer i,
                            sum g_i = 1,  g_i >= 0,  g_i = 0 if i cannot aggregate,

with t in seconds per byte of P and b_i = min(u_i, d_i) (see `model.py`). Its optimum has a
closed form, water-filling: at a time budget t, aggregator i can hold up to

    cap_i(t) = (t b_i - 1) / (K - 2)   if it computes (nothing below t = 1/b_i),
    cap_i(t) = t b_i / K               if it does not,

and the optimum is the lowest "water level" t_w where the capacities add up to 1, except that
no level can go below t_c = max over computing peers of 1/b_i (each must at least send and
receive its own gradient once). So the optimal round time is P * max(t_c, t_w), and below t_c
the capacities at t_w give every non-bottleneck peer as little traffic as possible.
Solving t_w for the breakpoints sorted once gives, for K >= 3,

    t* = K (K - 2 + K_R) / ((K - 2) B_R + 2 W)         (no capacity clipped at 0)

where B_R is the bandwidth of all aggregators, K_R the number of computing aggregators and W
their bandwidth: `round_time_per_byte` uses that O(1) form to score a computing set in the
search. K = 2 and K = 1 are special (see the functions).

Why not hand the LP to HiGHS at run time: when the optimum is not unique (K = 2, or t_c above
t_w) a simplex solver returns whichever optimal vertex it meets first, which may differ between
scipy builds, and peers that disagree on shares cannot partition the vector. The closed form
picks one canonical optimum with the same float operations on every machine. `peer.roles.lp`
solves the textbook LP with HiGHS; tests check both give the same optimal time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from peer.errors import RoleAssignmentError
from peer.roles.model import PeerCapacity


def no_aggregator_error() -> RoleAssignmentError:
    return RoleAssignmentError(
        "no peer can aggregate: at least one publicly reachable peer or backbone is needed "
        "(start a backbone, or give a peer a public address with --announce)"
    )


def round_time_per_byte(
    *,
    computing: int,
    computing_aggregators: int,
    computing_aggregator_bw: float,
    aggregator_bw: float,
    min_computing_bw: float,
) -> float:
    """Optimal seconds per byte of P for a computing set described by its sums (O(1)).

    `computing_aggregators` / `computing_aggregator_bw`: computing peers that can aggregate and
    their total bandwidth; `aggregator_bw`: bandwidth of every peer that can aggregate.
    Returns inf when no share assignment is feasible.
    """
    k = computing
    if k == 1:
        return 0.0
    if min_computing_bw <= 0 or aggregator_bw <= 0:
        return math.inf
    t_c = 1.0 / min_computing_bw
    if k == 2:
        # A computing aggregator sends P whatever its share: it absorbs all at no cost.
        if computing_aggregators:
            return t_c
        return max(t_c, 2.0 / aggregator_bw)
    t_star = (k * (k - 2 + computing_aggregators)) / (
        (k - 2) * aggregator_bw + 2.0 * computing_aggregator_bw
    )
    return max(t_c, t_star)


def optimal_shares(
    peers: Sequence[PeerCapacity], computes: Sequence[bool]
) -> tuple[list[float], float]:
    """The canonical optimal shares and the round time per byte of P, for fixed roles.

    Raises RoleAssignmentError when K >= 2 and no peer can aggregate.
    """
    n = len(peers)
    k = sum(computes)
    if k == 0:
        raise ValueError("no computing peer: there is nothing to average")
    shares = [0.0] * n
    if k == 1:
        shares[list(computes).index(True)] = 1.0
        return shares, 0.0
    bw = [p.bandwidth for p in peers]
    aggregators = [i for i in range(n) if peers[i].can_aggregate]
    if not aggregators:
        raise no_aggregator_error()
    min_bw = min(bw[i] for i in range(n) if computes[i])
    t_c = 1.0 / min_bw if min_bw > 0 else math.inf
    if k == 2:
        holders = [i for i in aggregators if computes[i]] or aggregators
        total = math.fsum(bw[i] for i in holders)
        for i in holders:
            shares[i] = bw[i] / total
        t = t_c if computes[holders[0]] else max(t_c, 2.0 / total)
        return shares, t
    t_w = _water_level(bw, computes, aggregators, k)
    for i in aggregators:
        cap = (t_w * bw[i] - 1.0) / (k - 2) if computes[i] else t_w * bw[i] / k
        shares[i] = max(0.0, cap)
    total = math.fsum(shares)
    shares = [g / total for g in shares]  # removes the last bits of rounding
    return shares, max(t_c, t_w)


def _water_level(
    bw: list[float], computes: Sequence[bool], aggregators: list[int], k: int
) -> float:
    """Lowest t where the aggregators' capacities add up to 1 (K >= 3).

    Capacity at t is t * slope - offset over the active aggregators; non-computing ones are
    active from t = 0, computing ones from t = 1/b_i (their breakpoints, visited in order).
    """
    slope = math.fsum(bw[i] for i in aggregators if not computes[i]) / k
    offset = 0.0
    breakpoints = sorted((1.0 / bw[i], i) for i in aggregators if computes[i])
    for at, i in breakpoints:
        if slope > 0 and (1.0 + offset) / slope <= at:
            break
        slope += bw[i] / (k - 2)
        offset += 1.0 / (k - 2)
    return (1.0 + offset) / slope


MAX_SHARE_RATIO = 1.5
"""No member reduces more than this many times an equal share of the vector: among m members
that can reduce, at most min(1, 1.5 / m) of it (3/4 for m = 2, 1/2 for 3, 3/8 for 4). A
constant, not a setting: every member checks its leader's shares against it
(`peer.averaging.averager`), and members with different values would refuse honest leaders."""


def share_cap(reducers: int, *, ratio: float = MAX_SHARE_RATIO) -> float:
    """The largest share one of `reducers` members may hold (1 with none or one)."""
    return 1.0 if reducers <= 1 else min(1.0, ratio / reducers)


def cap_shares(
    shares: Sequence[float], eligible: Sequence[bool], *, ratio: float = MAX_SHARE_RATIO
) -> list[float]:
    """`shares` normalised, then none above `share_cap(m)` (m = eligible members), the excess
    spread over the eligible members below the cap.

    Water-filling on the cap: members above it are held at it, the rest 1 - cap |held| is
    spread over the others in proportion to their shares (equally where those are all 0), and
    whoever that lifts above the cap is held too, until nobody is. It ends within m passes, and
    it always can: m caps add up to min(m, ratio) >= 1. Shares of ineligible members must be 0
    (the solver gives client-only members none). Pure Python floats in a fixed order: every
    member computes the same bits from the same inputs.
    """
    total = math.fsum(shares)
    if total <= 0:
        raise ValueError(f"shares {list(shares)!r} add up to {total!r}; expected > 0")
    normal = [g / total for g in shares]
    members = [i for i, ok in enumerate(eligible) if ok]
    cap = share_cap(len(members), ratio=ratio)
    if ratio < 1 or any(normal[i] > 0 for i, ok in enumerate(eligible) if not ok):
        raise ValueError("shares for ineligible members, or a ratio below 1, cannot be capped")
    held: set[int] = set()
    while True:
        free = [i for i in members if i not in held]
        room = 1.0 - cap * len(held)
        # Proportions from the shares as given: normalising first can lose a tiny share's bits.
        weight = math.fsum(shares[i] for i in free)
        spread = {i: room * (shares[i] / weight) if weight > 0 else room / len(free) for i in free}
        lifted = {i for i in free if spread[i] > cap}
        if not lifted:
            break
        held |= lifted
    return [cap if i in held else spread.get(i, 0.0) for i in range(len(normal))]
