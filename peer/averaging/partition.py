"""Who reduces which elements: the flat vector cut by the role solver's shares, pure.

Every member computes the same cut from the same (sorted) shares: sizes are the largest-
remainder rounding of share * total, ties broken by position, so the parts are contiguous,
cover the vector exactly once, and need no float agreement beyond the shares themselves
(which the solver produces bit-identically everywhere). A round cuts in whole chunks of
`chunk_elements` (`unit`), so chunk boundaries sit at the same absolute offsets in every group
whatever its members and shares: whatever a codec or a robust reducer does per chunk (int8
blocks, CenteredClip norms) is then the same computation in every group of a Moshpit round.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def valid_shares(shares: Sequence[float]) -> bool:
    """Shares a vector can be cut by: finite, >= 0, not all 0."""
    return (
        bool(shares) and all(math.isfinite(g) and g >= 0 for g in shares) and math.fsum(shares) > 0
    )


def part_sizes(total: int, shares: Sequence[float]) -> list[int]:
    """Element counts proportional to `shares` (>= 0, not all 0) that add up to `total`."""
    if total < 0 or not shares or any(not (math.isfinite(g) and g >= 0) for g in shares):
        raise ValueError(f"cannot cut {total} elements by shares {list(shares)!r}")
    weight = math.fsum(shares)
    if weight <= 0:
        raise ValueError("every share is 0: nobody reduces")
    exact = [total * g / weight for g in shares]
    sizes = [math.floor(x) for x in exact]
    short = total - sum(sizes)
    by_remainder = sorted(range(len(shares)), key=lambda i: (-(exact[i] - sizes[i]), i))
    for i in by_remainder[:short]:
        sizes[i] += 1
    return sizes


def part_ranges(total: int, shares: Sequence[float], *, unit: int = 1) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, one per share, in order, cut at multiples of `unit`
    elements (the last range ends at `total`)."""
    if unit <= 0:
        raise ValueError(f"unit must be > 0, got {unit}")
    ranges, start = [], 0
    for units in part_sizes(-(-total // unit), shares):
        end = min(total, start + units * unit)
        ranges.append((start, end))
        start = end
    return ranges


def chunk_ranges(start: int, end: int, chunk_elements: int) -> list[tuple[int, int]]:
    """[start, end) cut into pieces of `chunk_elements` (the last may be shorter)."""
    if chunk_elements <= 0:
        raise ValueError(f"chunk_elements must be > 0, got {chunk_elements}")
    return [(s, min(s + chunk_elements, end)) for s in range(start, end, chunk_elements)]
