"""Per-caller token buckets: what one peer may take from a service, refilled over time.

Used wherever one peer could otherwise take a shared resource from the rest: backbone probes
(bytes sent and received), state downloads (fractions of a state), DHT stores (record bytes).
"""

from __future__ import annotations


class ByteBudgets:
    """A token bucket of bytes per caller: `capacity` bytes, refilled over `window` seconds."""

    def __init__(self, *, capacity: int, window: float, max_callers: int = 10_000) -> None:
        self.capacity = capacity
        self.rate = capacity / window
        self.max_callers = max_callers
        self._buckets: dict[object, tuple[float, float]] = {}  # caller -> (tokens, at)

    def available(self, caller: object, *, now: float) -> float:
        """The tokens `caller` could spend at `now` (nothing is spent)."""
        tokens, at = self._buckets.get(caller, (float(self.capacity), now))
        return min(float(self.capacity), tokens + (now - at) * self.rate)

    def try_spend(self, caller: object, amount: int, *, now: float) -> float:
        """Spend `amount` and return 0, or return the seconds until it could be spent."""
        tokens, at = self._buckets.get(caller, (float(self.capacity), now))
        tokens = min(float(self.capacity), tokens + (now - at) * self.rate)
        amount = min(amount, self.capacity)  # a request above capacity waits for a full bucket
        if tokens < amount:
            self._buckets[caller] = (tokens, now)
            return (amount - tokens) / self.rate
        if caller not in self._buckets and len(self._buckets) >= self.max_callers:
            self._forget_full(now)
        self._buckets[caller] = (tokens - amount, now)
        return 0.0

    def _forget_full(self, now: float) -> None:
        """Drop callers whose buckets have refilled: they are indistinguishable from new ones."""
        for caller, (tokens, at) in list(self._buckets.items()):
            if tokens + (now - at) * self.rate >= self.capacity:
                del self._buckets[caller]
