"""Moshpit groups for any number of peers, pure: who averages with whom in each round, and
with what weight, so that after the last round every peer holds the exact weighted mean.

The N peers ready to average are numbered 0..N-1 (in peer-id order, or seated by who can dial
whom: `placement`, `peer.averaging.group.placed`). With group size m, the plan
takes k = ceil(log_m N) rounds (the fewest groups of m allow) and is built recursively:

    plan(peers, k):  k = 1: one group of all of them.
                     else: cut the peers into t = ceil(N / m^(k-1)) contiguous blocks of
                     nearly equal size (each fits in k-1 rounds), plan every block on its own
                     for rounds 0..k-2, and in round k-1 deal each block's members out over
                     h = (smallest block size) groups, one per group, the few left over
                     doubling up in a group.

**Theory of operation.** Entering a round, a member's value is the exact weighted mean of a
set of peers, its *basis* ({itself} before round 0), and stands for the total weight of that
basis. By induction over the recursion, after a block's own rounds every member of the block
holds the block's mean, so in the last round every group holds at least one member of every
block and nothing else: the bases within a group are disjoint and together cover all peers.
A group reduces with **one contribution per basis**: its lowest-numbered member holding that
basis contributes with the basis's total weight, the others (the left-over ones) weight 0.
So every group of the last round computes sum_B W_B x_B / sum_B W_B = the exact weighted mean
over all N peers. The contributions are added in a fixed order (by the lowest peer number of
their basis), so every group does the same float32 operations on the same bits: all peers end
bit-identical, which is what lets them apply one optimizer step and compare parameter digests.

Groups have at most m + 1 members (checked for N < 400, m <= 8), fewer where N is not a power of
m (a peer may even be alone in a round and wait it out); with N = m^k this is the classic
Moshpit grid: every round mixes a different axis.

**Failures.** With every planned member in every round, every peer ends on the mean over all
N. A member that is missing (it left, it is late, its round failed) does not void the others'
rounds: every member carries its *actual* basis S, the set of peers its value is the exact
weighted mean of (a subset of its planned basis: {itself} again after a failed round, when it
goes back to its own contribution), and a group seats the members that came (`seating`): one
contributor per planned basis, the lowest-numbered member of it that came (as in the full
plan), with weight W(S) = the sum of its peers' weights; the others weight 0. (Not the largest
S: S is the member's own claim, and a member that would weigh nothing in the full plan could
then claim its whole planned basis, unchecked, and displace an honest holder of it.) The group's result is then
the exact weighted mean over the union of its contributors' S. So every value stays the exact
mean over its S, and **two members that end with the same S hold the same bits**: the planned
bases partition the peers, so S splits into one part per contributor, the same contributors'
parts, by induction the same bits, added in the same order. Where a member missing in one
group holds the only copy of a basis in it, that group ends with a smaller S than the others;
its members apply another average than the rest, and the step's certificate (the digest most
peers sign) has them download the state (`peer.training.progress`). One failure thus costs
its own group, not the step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from peer.errors import ProtocolError

MAX_BASIS_BYTES = 1024
"""A basis mask's longest (8,192 peers): what a joiner or a leader's spec may carry."""


def rounds_for(count: int, group_size: int) -> int:
    """k: base-`group_size` digits needed to number `count` peers (at least 1)."""
    if group_size < 2:
        raise ValueError(f"group size must be at least 2, got {group_size}")
    rounds, capacity = 1, group_size
    while capacity < count:
        rounds, capacity = rounds + 1, capacity * group_size
    return rounds


@dataclass(frozen=True)
class Seat:
    """One member of a planned group, as the round's spec must hold it."""

    member: int
    """Its number (`peer.averaging.group.placed`)."""
    block: int
    """The lowest peer number of its basis: contributions are added in this order."""
    weight: float
    """The total weight of its basis if it is the basis's contributor in this group, else 0."""
    contributes: bool = True
    """It is its planned basis's contributor in this group (its weight may still be 0)."""


@dataclass(frozen=True)
class Plan:
    count: int
    group_size: int
    rounds: tuple[tuple[tuple[int, ...], ...], ...]
    """rounds[r]: the groups of round r, each its member numbers in ascending order."""
    bases: tuple[tuple[tuple[int, ...], ...], ...]
    """bases[r][i]: the peers member i's value stands for entering round r (r = k: the end)."""

    def group(self, round_index: int, member: int) -> tuple[int, ...]:
        return self._group_of[round_index][member]

    @functools.cached_property
    def _group_of(self) -> list[dict[int, tuple[int, ...]]]:
        return [{i: g for g in groups for i in g} for groups in self.rounds]

    def seats(self, round_index: int, member: int, weights: Sequence[float]) -> list[Seat]:
        """`member`'s group in round `round_index`, each with its block and weight
        (`weights[i]`: peer i's own weight)."""
        bases = self.bases[round_index]
        seats, seen = [], set()
        for i in self.group(round_index, member):
            basis = bases[i]
            contributes = basis not in seen
            seen.add(basis)
            total = math.fsum(weights[j] for j in basis) if contributes else 0.0
            seats.append(Seat(i, basis[0], total, contributes))
        return seats

    def seating(
        self,
        round_index: int,
        present: Mapping[int, Collection[int]],
        weights: Sequence[float],
    ) -> dict[int, Seat]:
        """The seats of one group of round `round_index` when the members in `present` came,
        each with its actual basis (the peers its value stands for now, module doc): one
        contributor per planned basis, the lowest-numbered member of it that came, at its
        actual basis's total weight. Members whose basis is empty or not within their planned
        one are left out (a liar's claim, or a bug)."""
        planned = self.bases[round_index]
        valid = {
            m: frozenset(basis)
            for m, basis in present.items()
            if 0 <= m < self.count and basis and set(basis) <= set(planned[m])
        }
        best: dict[int, int] = {}  # planned block -> its contributor
        for m in sorted(valid):
            best.setdefault(planned[m][0], m)
        seats = {}
        for m in sorted(valid):
            block = planned[m][0]
            contributes = best[block] == m
            total = math.fsum(weights[j] for j in valid[m]) if contributes else 0.0
            seats[m] = Seat(m, block, total, contributes)
        return seats


def basis_mask(basis: Collection[int], count: int) -> bytes:
    """`basis` (peer numbers below `count`) as a little-endian bit mask."""
    bits = sum(1 << i for i in set(basis))
    if bits >> count:
        raise ValueError(f"a basis names peers past {count}")
    return bits.to_bytes(-(-count // 8), "little")


def basis_of(mask: bytes, count: int) -> frozenset[int]:
    """The peers a basis mask names; ProtocolError unless it is a mask over `count` peers."""
    if len(mask) != -(-count // 8) or len(mask) > MAX_BASIS_BYTES:
        raise ProtocolError(f"a basis mask of {len(mask)} bytes for {count} peers")
    bits = int.from_bytes(mask, "little")
    if bits >> count:
        raise ProtocolError(f"a basis mask names peers past the {count} planned")
    return frozenset(i for i in range(count) if bits >> i & 1)


def plan(count: int, group_size: int) -> Plan:
    """The plan for `count` peers in groups of `group_size` (see the module doc)."""
    if count < 1:
        raise ValueError(f"cannot plan averaging for {count} peers")
    return _plan(count, group_size)


@functools.lru_cache(maxsize=64)
def _plan(count: int, group_size: int) -> Plan:
    k = rounds_for(count, group_size)
    rounds = tuple(
        tuple(tuple(g) for g in groups) for groups in _build(list(range(count)), k, group_size)
    )
    bases: list[tuple[tuple[int, ...], ...]] = [tuple((i,) for i in range(count))]
    for groups in rounds:
        now = list(bases[-1])
        after = list(now)
        for group in groups:
            distinct = {now[i] for i in group}
            covered = sorted(j for basis in distinct for j in basis)
            assert len(covered) == len(set(covered)), "bases in a group must be disjoint"
            for i in group:
                after[i] = tuple(covered)
        bases.append(tuple(after))
    assert all(b == tuple(range(count)) for b in bases[-1]), "every peer must end on the mean"
    return Plan(count, group_size, rounds, tuple(bases))


def placement(count: int, group_size: int) -> tuple[int, ...]:
    """The plan's member numbers in the order in which peers able to reduce should take them,
    so that the first few sit in as many groups (over every round) as they can: the group not
    yet holding one that has the fewest members (the lowest first) takes the member of it in
    the most such groups (the lowest first); once every group holds one the next pass spreads
    a second. A group behind NAT with nobody its members can dial fails its round, and below
    `averaging.partial_from` the step with it (`peer.averaging.group.placed`). Greedy (covering
    every group with the fewest is NP-hard past two rounds); tests measure it against the
    widest round's group count, a lower bound. Deterministic: every member of a view derives
    the same order."""
    return _placement(count, group_size)


@functools.lru_cache(maxsize=64)
def _placement(count: int, group_size: int) -> tuple[int, ...]:
    groups = [g for groups in plan(count, group_size).rounds for g in groups if len(g) > 1]
    of_member: list[list[int]] = [[] for _ in range(count)]
    for index, group in enumerate(groups):
        for member in group:
            of_member[member].append(index)
    hardest_first = sorted(range(len(groups)), key=lambda g: (len(groups[g]), g))
    order: list[int] = []
    placed = [False] * count
    while len(order) < count:
        hit = [False] * len(groups)
        for g in hardest_first:
            free = [m for m in groups[g] if not placed[m]]
            if hit[g] or not free:
                continue
            best = min(free, key=lambda m: (-sum(not hit[h] for h in of_member[m]), m))
            order.append(best)
            placed[best] = True
            for h in of_member[best]:
                hit[h] = True
        if not any(hit):  # the rest are alone in every round: no group to seat them in
            order.extend(m for m in range(count) if not placed[m])
            break
    return tuple(order)


def _split(members: list[int], parts: int) -> list[list[int]]:
    """`members` cut into `parts` contiguous blocks whose sizes differ by at most one."""
    size, larger = divmod(len(members), parts)
    blocks, start = [], 0
    for i in range(parts):
        end = start + size + (i < larger)
        blocks.append(members[start:end])
        start = end
    return blocks


def _build(members: list[int], rounds: int, group_size: int) -> list[list[list[int]]]:
    """`rounds` rounds of groups over `members` after which each holds the exact mean."""
    if rounds == 1:
        return [[members]]
    blocks = _split(members, -(-len(members) // group_size ** (rounds - 1)))
    inner = [_build(block, rounds - 1, group_size) for block in blocks]
    plan = [[group for sub in inner for group in sub[r]] for r in range(rounds - 1)]
    width = min(len(block) for block in blocks)
    last: list[list[int]] = [[] for _ in range(width)]
    extra = 0  # the left-over members go round the groups, so sizes differ by at most one
    for block in blocks:
        for j, member in enumerate(block):
            if j < width:
                last[j].append(member)
            else:
                last[extra % width].append(member)
                extra += 1
    plan.append([sorted(group) for group in last])
    return plan
