"""An executor whose work runs in the user's training loop, at its next `opt.step()`.

A daemon's torch work runs in a thread of its own, which owns the model. Under
`peertrain.Optimizer` the user's loop owns it: its forward and backward passes run whenever
it likes, and a parameter changed under them breaks autograd ("modified by an inplace
operation"). So the engine's work on the model (a step applied, a state taken, held or
restored) is queued here, and the loop's thread runs it inside `opt.step()`, between two of
its own micro-batches: still one operation at a time, as with the daemon's thread.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Executor, Future
from typing import Any


class Rendezvous(Executor):
    def __init__(self) -> None:
        self._queue: deque[tuple[Future[Any], Callable[..., Any], tuple, dict]] = deque()
        self._guard = threading.Lock()
        self._closed = False
        #: Held by the loop's thread while it runs a step, and by whoever needs a moment
        #: between two steps (`LoopWorker.start_take`).
        self.step_lock = threading.Lock()
        #: Called after each submit (the loop, waiting for its turn, serves the work at once).
        self.on_submit: Callable[[], None] = lambda: None

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        future: Future[Any] = Future()
        with self._guard:
            if self._closed:
                raise RuntimeError("the training loop has ended")
            self._queue.append((future, fn, args, kwargs))
        self.on_submit()
        return future

    def run_pending(self) -> int:
        """Run everything queued so far, and what that queues, in the calling thread; how many."""
        done = 0
        while True:
            with self._guard:
                if not self._queue:
                    return done
                future, fn, args, kwargs = self._queue.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as error:  # the engine's caller gets it, as from a thread
                future.set_exception(error)
                if not isinstance(error, Exception):
                    raise  # Ctrl+C or an exit is the loop's: it goes on up, the engine's too
            done += 1

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._guard:
            self._closed = True
            dropped = list(self._queue) if cancel_futures else []
            if cancel_futures:
                self._queue.clear()
        for future, *_ in dropped:
            future.cancel()


__all__ = ["Rendezvous"]
