"""The busiest node window by window: what a whole run's mean hides.

A run's "busiest node" row divides a node's reply bytes by the whole run, so a burst is
spread over minutes: at 1,000 simulated peers the busiest node of a gathering's window sent
31.6 Mbit/s for 30 virtual seconds (11.6x the mean DHT server's then), 29 of them ticket
replies, while the whole run's figure was 6.6 Mbit/s. `WindowWatch` cuts the measured run into
windows of `WINDOW_SECONDS` and keeps the one whose busiest node sent the most, with what its
replies answered (`Traffic.served_as`: the method and the key's family).

It reads the clock's jumps (`VirtualClock(on_jump=...)`), which schedule nothing, so the run
is the same with it as without.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WINDOW_SECONDS = 30.0
"""Virtual seconds of one window (a gathering's reads fall within one)."""
WHAT = 3
"""Kinds of reply named for a window's busiest node, the largest first."""


@dataclass(frozen=True)
class Window:
    start: float
    end: float
    """Virtual seconds: a window ends at the first clock jump past its length."""
    busiest: float
    """Bytes/s of replies the busiest node sent in it."""
    mean_server: float
    """Bytes/s of replies the mean DHT server sent in it (all replies over the servers alive
    at its end: backbones up and volunteers not behind NAT)."""
    what: tuple[tuple[str, float], ...]
    """The busiest node's replies by what they answered (`network.served_as_what`), as shares,
    the largest first (at most `WHAT`)."""

    @property
    def ratio(self) -> float:
        return self.busiest / self.mean_server if self.mean_server > 0 else 0.0


class WindowWatch:
    """Keeps the window of the measured run whose busiest node sent the most (`busiest`).

    `traffic` gives the run's current `Traffic` (a new one when measuring starts: the windows
    start with it), `servers` the DHT servers alive now, and `measuring` whether the run is
    measured yet (the warm-up has no windows)."""

    def __init__(
        self,
        traffic: Callable[[], Any],
        servers: Callable[[], int],
        measuring: Callable[[], bool],
        *,
        seconds: float = WINDOW_SECONDS,
    ) -> None:
        self._traffic = traffic
        self._servers = servers
        self._measuring = measuring
        self.seconds = seconds
        self.busiest: Window | None = None
        self._seen: Any = None  # the Traffic the last window ended on
        self._start = 0.0
        self._served: Counter[Any] = Counter()
        self._served_as: Counter[tuple[Any, str]] = Counter()

    def on_jump(self, now: float) -> None:
        if not self._measuring():
            return
        traffic = self._traffic()
        if traffic is not self._seen:  # measuring started: the first window starts now
            self._seen, self._start = traffic, now
            self._served, self._served_as = Counter(), Counter()
            return
        if now - self._start >= self.seconds:
            self._close(traffic, now)

    def _close(self, traffic: Any, now: float) -> None:
        seconds = now - self._start
        served = traffic.served - self._served  # what each node sent in this window
        node, sent = max(served.items(), key=lambda item: item[1], default=(None, 0))
        if sent > 0 and (self.busiest is None or sent / seconds > self.busiest.busiest):
            what: Counter[str] = Counter()
            for (by, kind), total in traffic.served_as.items():
                if by == node:
                    what[kind] = total - self._served_as.get((by, kind), 0)
            self.busiest = Window(
                start=self._start,
                end=now,
                busiest=sent / seconds,
                mean_server=sum(served.values()) / seconds / max(1, self._servers()),
                what=tuple((kind, n / sent) for kind, n in what.most_common(WHAT) if n > 0),
            )
        self._start = now
        self._served = Counter(traffic.served)
        self._served_as = Counter(traffic.served_as)
