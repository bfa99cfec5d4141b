"""Where the event loop was when it stalled: a watchdog thread beside `peer.loopwatch`.

The lag monitor learns of a stall only when the loop wakes again, by then the code that blocked
it has returned. This thread looks while it lasts: every `interval` it compares the loop's last
heartbeat (`beat`, called at each of the monitor's wake-ups) with the time, and once a stall is
older than `threshold` it notes the loop thread's innermost frames. Three cases:

- the loop thread runs synchronous Python code (it releases the GIL every switch interval, so
  this thread gets in): the frames name that code;
- it is in a C call that released the GIL (a large copy, a hash, a blocking syscall): the frames
  name the Python line that made it;
- another thread holds the GIL in a long C call: this thread cannot run either, and notes what
  it finds once it can, with its own lateness ("the tracer was late too").

Cost: one wake-up per `interval` (20 ms) that takes the GIL for a comparison; a frame walk only
during a stall.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

__all__ = ["StallTracer"]

#: Seconds between the watchdog's looks.
INTERVAL = 0.02
#: Innermost frames named per stall.
FRAMES = 4
#: trio's own wait for I/O: a loop thread found here is not blocked by code but waiting for a
#: core or the GIL.
_IDLE = ("trio/_core/_io_epoll.py", "trio/_core/_io_kqueue.py", "trio/_core/_io_windows.py")


class StallTracer:
    def __init__(
        self,
        *,
        threshold: float,
        interval: float = INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.threshold = threshold
        self.interval = interval
        self.clock = clock
        self._beat = clock()
        self._loop_thread: int | None = None
        self._noted_for: float | None = None  # the heartbeat whose stall we noted
        self._where: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def beat(self) -> None:
        """The loop is running (called on its thread, at each of the monitor's wake-ups)."""
        self._beat = self.clock()

    def take(self) -> str | None:
        """Where the loop was during the stall that just ended, if noted (then forgotten)."""
        where, self._where = self._where, None
        return where

    def start(self) -> None:
        """Watch the calling thread's loop, from a daemon thread, until `stop`."""
        self._loop_thread = threading.get_ident()
        self._beat = self.clock()
        self._thread = threading.Thread(target=self._watch, name="peertrain-stalls", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)

    def _watch(self) -> None:
        last = self.clock()
        while not self._stop.wait(self.interval):
            now = self.clock()
            late = now - last - self.interval  # our own lateness: the GIL was elsewhere
            last = now
            beat = self._beat
            if now - beat > self.threshold and self._noted_for != beat:
                self._noted_for = beat
                where = self._loop_frames()
                if late > self.threshold / 2:
                    where += f" (the tracer was late too, {late:.2f} s: a thread held the GIL)"
                self._where = where

    def _loop_frames(self) -> str:
        frame = sys._current_frames().get(self._loop_thread or -1)
        if frame is None:
            return "unknown (the loop thread is gone)"
        if frame.f_code.co_filename.replace("\\", "/").endswith(_IDLE):
            return "waiting for a core or the GIL (in trio's I/O wait)"
        return " < ".join(_describe(f) for f in _innermost(frame, FRAMES))


def _innermost(frame: FrameType | None, count: int) -> list[FrameType]:
    frames = []
    while frame is not None and len(frames) < count:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _describe(frame: FrameType) -> str:
    path = frame.f_code.co_filename.replace("\\", "/")
    short = "/".join(path.split("/")[-2:])
    return f"{frame.f_code.co_name} ({short}:{frame.f_lineno})"
