"""The simulation's clock: virtual time that jumps to the next deadline whenever no task can
run, as trio's `MockClock(autojump_threshold=0)` does, for less.

A simulation reads the time tens of millions of times (every deadline, sleep and link
transfer) and jumps it millions of times. `MockClock` reads the real clock at every read (and
scales it by its rate, 0 here), and jumps one loop turn after trio found nothing to run, by
asking for the whole run's statistics: about 6 % of a 100-peer simulation's CPU, and a loop
turn per jump. This clock jumps when trio asks how long it may sleep (it asks only when no
task is ready): the same deadlines expire in the same order at the same times, one turn
sooner. Unlike `MockClock` it does not wait for `trio.testing.wait_all_tasks_blocked`
callers, which the simulated code has none of.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import trio


class VirtualClock(trio.abc.Clock):
    """`on_jump(now)` is told every jump (a long run's progress): it is called outside any
    task and schedules nothing, so the run is the same with it as without."""

    def __init__(self, on_jump: Callable[[float], None] | None = None) -> None:
        self._now = 0.0
        self._on_jump = on_jump

    def start_clock(self) -> None:
        pass

    def current_time(self) -> float:
        return self._now

    def deadline_to_sleep_time(self, deadline: float) -> float:
        if deadline == math.inf:
            return math.inf  # nothing will ever wake: trio waits for I/O
        if deadline > self._now:
            self._now = deadline
            if self._on_jump is not None:
                self._on_jump(deadline)
        return 0.0
