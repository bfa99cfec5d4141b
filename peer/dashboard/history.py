"""What the dashboard draws, gathered from successive status reports (pure): the training
loss and validation loss at each global step, and the collaboration's samples/s and peers
online over time. Points are the public records' claims, summarised as `peer status` does."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field

from peer.status import StatusReport

#: Points kept per series: about a day of 10-second polls, a few hundred KB of JSON.
MAX_POINTS = 8640


@dataclass
class History:
    max_points: int = MAX_POINTS
    loss: dict[int, float] = field(default_factory=dict)
    """Global step -> mean training loss of the trainers at it."""
    validation: dict[int, float] = field(default_factory=dict)
    throughput: deque[tuple[float, float]] = field(default_factory=deque)
    """(wall time, the collaboration's samples/s)."""
    peers: deque[tuple[float, int]] = field(default_factory=deque)
    """(wall time, peers online)."""
    latest: StatusReport | None = None

    def add(self, report: StatusReport) -> None:
        self.latest = report
        now = report.collaboration.queried_at
        summary = report.collaboration.training
        _append(self.peers, (now, report.collaboration.peers_online), self.max_points)
        if summary is None:
            return
        _append(self.throughput, (now, summary.samples_per_s), self.max_points)
        # The trend holds the mean loss at each of the last few steps, oldest first: steps
        # that came and went between two polls are drawn too.
        trend = summary.loss_trend
        first = summary.global_step - len(trend) + 1
        for step, value in enumerate(trend, start=first):
            if step > 0 and math.isfinite(value):
                self.loss.setdefault(step, value)
        if summary.loss is not None and math.isfinite(summary.loss) and summary.global_step > 0:
            self.loss[summary.global_step] = summary.loss
        if summary.validation is not None and math.isfinite(summary.validation[1]):
            step, value = summary.validation
            self.validation[step] = value
        for series in (self.loss, self.validation):
            while len(series) > self.max_points:  # the oldest added goes, not the lowest
                del series[next(iter(series))]  # step: one forged high step would stay

    def to_json(self) -> dict:
        latest = self.latest
        return {
            "collaboration": _collaboration(latest) if latest else None,
            "peers": [asdict(row) for row in latest.peers] if latest else [],
            "loss": sorted(self.loss.items()),
            "validation": sorted(self.validation.items()),
            "throughput": list(self.throughput),
            "peers_online": list(self.peers),
        }


def _collaboration(report: StatusReport) -> dict:
    summary = asdict(report.collaboration)
    summary.pop("assignment", None)  # the table shows each peer's work
    return summary


def _append(series: deque, point: tuple, limit: int) -> None:
    series.append(point)
    while len(series) > limit:
        series.popleft()


__all__ = ["History"]
