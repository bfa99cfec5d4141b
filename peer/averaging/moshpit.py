"""Moshpit groups, pure: who averages with whom in each round (Ryabinin et al., 2021).

The peers that are ready to average are numbered 0..N-1 in peer-id order and placed on a
virtual grid of side m (the target group size), one coordinate per base-m digit of their
number. In round r, peers whose coordinates agree everywhere except digit r mod k form a group
(k = the number of digits). Every round mixes along a different axis, so with N = m^k every
group has exactly m members and after k rounds every peer holds the exact global average
(each round averages one axis of the grid, like a butterfly over groups instead of pairs).
With other N some groups are smaller; averaging still converges, just not exactly in k rounds.
"""

from __future__ import annotations

from collections.abc import Sequence


def rounds_for(count: int, group_size: int) -> int:
    """k: base-`group_size` digits needed to number `count` peers (at least 1)."""
    if group_size < 2:
        raise ValueError(f"group size must be at least 2, got {group_size}")
    rounds, capacity = 1, group_size
    while capacity < count:
        rounds, capacity = rounds + 1, capacity * group_size
    return rounds


def group_of(peer_ids: Sequence[str], me: str, *, group_size: int, round_index: int) -> list[str]:
    """The members of `me`'s group in round `round_index`, sorted by peer id.

    `peer_ids` are all peers ready to average (any order; duplicates are an error).
    """
    ordered = sorted(peer_ids)
    if len(set(ordered)) != len(ordered):
        raise ValueError("a peer is listed twice")
    number = {peer_id: i for i, peer_id in enumerate(ordered)}
    if me not in number:
        raise ValueError(f"{me} is not among the peers ready to average")
    k = rounds_for(len(ordered), group_size)
    axis = round_index % k
    step = group_size**axis

    def others_digits(i: int) -> tuple[int, int]:
        """The number with digit `axis` removed: equal for exactly the members of a group."""
        return (i // (step * group_size), i % step)

    mine = others_digits(number[me])
    return [p for p in ordered if others_digits(number[p]) == mine]
