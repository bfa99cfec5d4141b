"""Moshpit groups for any number of peers, pure: who averages with whom in each round, and
with what weight, so that after the last round every peer holds the exact weighted mean.

The N peers ready to average are numbered 0..N-1 in peer-id order. With group size m, the plan
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
Moshpit grid: every round mixes a different axis. The plan is exact only if every planned
member takes part in every round with the value the plan says; `matchmaking` and `averager`
refuse the step otherwise. A failed round taints the groups of later rounds that hold one of
its members: after a failure in round 0 every peer refuses, later on only those groups (the
others still hold every block, from members whose rounds completed).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass


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
    """Its number (position in peer-id order)."""
    block: int
    """The lowest peer number of its basis: contributions are added in this order."""
    weight: float
    """The total weight of its basis if it is the basis's contributor in this group, else 0."""


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
            seats.append(Seat(i, basis[0], total))
        return seats


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
