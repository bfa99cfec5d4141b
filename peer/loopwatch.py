"""An event-loop lag monitor: how long the trio loop went without running its tasks.

Theory of operation. A task owned by the daemon's nursery sleeps `interval` (10 ms) on the
trio clock, over and over, and notes how late each wake-up came after it was due. A loop that
runs its tasks keeps that lateness at a millisecond or less; a loop blocked by synchronous work
(a tensor copy or a hash on the event-loop thread, or a worker thread in a C call that holds
the GIL: safetensors' serialization of a 129 MB state held it ~0.3 s) wakes the watcher only
when the block ends, so the lateness is the block's
length, less up to one interval (the block may have begun just before a wake-up was due). So
`longest_stall` is a lower bound on the longest block, `interval` at most below it.

Why it matters: libp2p's yamux resets a stream whose reader stalls 5 s, a gathering closes
within a window of 1-2 s, and a stop has 2.5 s of grace; a stall of a second already costs
averagings. The cost: one trio wake-up per interval, ~0.1-0.2 ms of CPU on the 2-core
machines of `docs/benchmarks.md` (1-2 % of a core).

`LagTally` is the pure part (what a wake-up's lateness adds to the figures, and when a
warning is due); `LoopWatch` is the trio shell around it; `log_statistics_on_stop` logs its
figures as one INFO record (JSON field `loop`) when a daemon stops.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import trio

from peer.stalltrace import StallTracer

__all__ = ["LagTally", "LoopStatistics", "LoopWatch", "log_statistics_on_stop"]

log = logging.getLogger("peertrain.loop")

#: Seconds between wake-ups: the resolution of the measurement, and its cost.
INTERVAL = 0.01
#: A stall longer than this is counted (the scale issue's goal: none over 100 ms).
THRESHOLD = 0.1
#: A stall longer than this is logged as a warning: shorter ones are routine on a busy
#: machine, and a warning per 100 ms would drown the log.
WARN_THRESHOLD = 1.0
#: At most one warning per this many seconds; the next one says how many it left out.
WARN_EVERY = 60.0
#: How many of the longest stalls the statistics list (with when they came).
WORST = 5


@dataclass(frozen=True, kw_only=True)
class LoopStatistics:
    """The event loop's lateness so far (a snapshot: `LoopWatch.statistics()`)."""

    longest_stall: float = 0.0
    """Seconds: the latest a wake-up came after it was due (0.0: never late)."""
    longest_stall_at: float | None = None
    """When that wake-up came, in seconds since watching began (None: no stall yet)."""
    stalls_over_threshold: int = 0
    """Wake-ups that came more than `threshold` seconds late."""
    threshold: float = THRESHOLD
    wakeups: int = 0
    watched: float = 0.0
    """Seconds from the start of watching to the last wake-up."""
    worst_stalls: tuple[tuple[float, float], ...] = ()
    """(lateness, when) of the `WORST` longest stalls over `threshold`, longest first: tells
    a stall at start-up from one in steady work."""
    longest_stall_where: str | None = None
    """Where the loop thread was during the longest stall (`peer.stalltrace`), if seen."""

    def as_log_fields(self) -> dict[str, Any]:
        """The JSON log's `loop` field: milliseconds, rounded to 0.1 ms."""
        return {
            "longest_stall_ms": round(self.longest_stall * 1000, 1),
            "longest_stall_at_s": (
                None if self.longest_stall_at is None else round(self.longest_stall_at, 3)
            ),
            "stalls_over_threshold": self.stalls_over_threshold,
            "threshold_ms": round(self.threshold * 1000, 1),
            "wakeups": self.wakeups,
            "watched_s": round(self.watched, 3),
            "worst_stalls": [[round(s * 1000, 1), round(at, 3)] for s, at in self.worst_stalls],
            "longest_stall_where": self.longest_stall_where,
        }


class LagTally:
    """What the wake-ups' lateness adds up to; pure (times are given, not read).

    `observe` takes each wake-up's lateness and the time since watching began; it says whether
    a warning is due: the stall is over `warn_threshold` and no warning came in the last
    `warn_every` seconds (the stalls in between are counted in `unwarned`).
    """

    def __init__(
        self,
        *,
        threshold: float = THRESHOLD,
        warn_threshold: float = WARN_THRESHOLD,
        warn_every: float = WARN_EVERY,
    ) -> None:
        assert 0 < threshold <= warn_threshold, (threshold, warn_threshold)
        self.threshold = threshold
        self.warn_threshold = warn_threshold
        self.warn_every = warn_every
        self.unwarned = 0
        """Stalls over `warn_threshold` since the last warning, not warned about."""
        self._last_warning: float | None = None
        self._stats = LoopStatistics(threshold=threshold)

    def observe(self, lateness: float, now: float, where: str | None = None) -> bool:
        """Note one wake-up `lateness` seconds after it was due, `now` seconds into watching
        (`where`: where the loop was meanwhile, if seen); True if a warning is due for it."""
        lateness = max(0.0, lateness)  # a clock's rounding can wake us a hair early
        s = self._stats
        longest = lateness > s.longest_stall
        worst = s.worst_stalls
        if lateness > self.threshold:
            worst = tuple(sorted([*worst, (lateness, now)], reverse=True)[:WORST])
        self._stats = LoopStatistics(
            longest_stall=lateness if longest else s.longest_stall,
            longest_stall_at=now if longest else s.longest_stall_at,
            stalls_over_threshold=s.stalls_over_threshold + (lateness > self.threshold),
            threshold=self.threshold,
            wakeups=s.wakeups + 1,
            watched=now,
            worst_stalls=worst,
            longest_stall_where=where if longest else s.longest_stall_where,
        )
        if lateness <= self.warn_threshold:
            return False
        if self._last_warning is not None and now - self._last_warning < self.warn_every:
            self.unwarned += 1
            return False
        self._last_warning = now
        return True

    def statistics(self) -> LoopStatistics:
        return self._stats


class LoopWatch:
    """Watches the current trio loop while `run` runs (start it with `nursery.start`)."""

    def __init__(
        self,
        *,
        interval: float = INTERVAL,
        threshold: float = THRESHOLD,
        warn_threshold: float = WARN_THRESHOLD,
        warn_every: float = WARN_EVERY,
        trace: bool = True,
    ) -> None:
        """`trace`: a watchdog thread notes where the loop was during each stall
        (`peer.stalltrace`); off where the clock is trio's virtual one (tests)."""
        assert interval > 0, interval
        self.interval = interval
        self.trace = trace
        self.tally = LagTally(
            threshold=threshold, warn_threshold=warn_threshold, warn_every=warn_every
        )

    def statistics(self) -> LoopStatistics:
        return self.tally.statistics()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Wake every `interval` and note how late each wake-up was, until cancelled."""
        started = trio.current_time()
        tracer = StallTracer(threshold=self.tally.threshold) if self.trace else None
        if tracer is not None:
            tracer.start()
        task_status.started()
        due = started + self.interval
        try:
            while True:
                await trio.sleep_until(due)
                now = trio.current_time()
                lateness = now - due
                where = None
                if tracer is not None:
                    tracer.beat()
                    # Taken at every wake-up: a note of a stall the tally does not count (the
                    # tracer measures from the last wake-up, we from when it was due) is dropped.
                    where = tracer.take()
                    if lateness <= self.tally.threshold:
                        where = None
                if self.tally.observe(lateness, now - started, where):
                    left_out, self.tally.unwarned = self.tally.unwarned, 0
                    log.warning(
                        "the event loop stalled for %.2f s (%s)%s",
                        lateness,
                        f"in {where}"
                        if where
                        else "no task ran: synchronous work on its "
                        "thread, or another thread holding the GIL",
                        f"; {left_out} more such stalls since the last warning" if left_out else "",
                        extra={"loop_stall_ms": round(lateness * 1000, 1)},
                    )
                elif where:
                    log.debug("the event loop stalled for %.3f s in %s", lateness, where)
                # The next wake-up counts from now: after a stall, no catch-up wake-ups.
                due = now + self.interval
        finally:
            if tracer is not None:
                tracer.stop()


@asynccontextmanager
async def log_statistics_on_stop(watch: LoopWatch) -> AsyncIterator[None]:
    """On leaving: log `watch`'s figures as one INFO record, with the JSON field `loop`
    (`LoopStatistics.as_log_fields`), if the body ended or was cancelled (a daemon that
    stopped); not if it failed: the error is the news then, and a daemon that could not
    join prints one line only."""
    try:
        yield
    except BaseException as error:
        if _stopped(error):
            _log_statistics(watch.statistics())
        raise
    _log_statistics(watch.statistics())


def _stopped(error: BaseException) -> bool:
    """A cancellation or an interrupt, or a group of nothing else."""
    if isinstance(error, BaseExceptionGroup):
        return all(_stopped(inner) for inner in error.exceptions)
    return isinstance(error, trio.Cancelled | KeyboardInterrupt)


def _log_statistics(stats: LoopStatistics) -> None:
    log.info(
        "event loop: longest stall %.0f ms, %d stalls over %.0f ms in %.0f s",
        stats.longest_stall * 1000,
        stats.stalls_over_threshold,
        stats.threshold * 1000,
        stats.watched,
        extra={"loop": stats.as_log_fields()},
    )
