"""A time-weighted moving average of a rate, for figures that real work keeps refining."""

from __future__ import annotations

import math


class RateEMA:
    """Exponential moving average of a rate (units per second), weighted by time: after
    `half_life` seconds of new observations the old estimate counts half, however the time
    was split into observations."""

    def __init__(self, initial: float, *, half_life: float) -> None:
        self.value = initial
        self.half_life = half_life

    def observe(self, amount: float, seconds: float) -> float:
        """Fold in `amount` units done in `seconds`; returns the new estimate."""
        if seconds > 0:
            keep = math.pow(0.5, seconds / self.half_life)
            self.value = keep * self.value + (1 - keep) * amount / seconds
        return self.value
