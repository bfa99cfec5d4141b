"""Scheduling priority of torch work: below the event loops, which move the network's bytes."""

from __future__ import annotations

import contextlib
import os
import sys
import threading

#: How much lower than the event loop the torch thread runs (Linux nice levels, per thread).
#: Where cores are short (3 trainers and a backbone on 2 cores) the scheduler then runs the
#: event loops first: they move the bytes of averagings and state downloads, and a loop that
#: waits for a core stalled for 0.5-1.7 s at 40 M parameters. The torch thread still gets
#: every cycle the loops leave idle.
NICENESS = 10


def lower_priority() -> None:
    """Lower the calling thread's priority by `NICENESS` (best effort: Linux only). For a
    thread of its own: an unprivileged thread cannot raise its priority back."""
    if not hasattr(os, "setpriority") or sys.platform != "linux":
        return
    thread = threading.get_native_id()
    with contextlib.suppress(OSError):
        os.setpriority(
            os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + NICENESS)
        )
