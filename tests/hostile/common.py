"""What the hostile real-process tests share: the fast-stepping environment, loopback source
addresses for an attacker, a free port, and a wait that fails at once if a process exits."""

from __future__ import annotations

import selectors
import socket
import threading
import time
from collections.abc import Callable

from tests.collab_processes import Collaboration

# Small steps, short gatherings and deadlines: many steps in a minute on 2 cores.
ENV = {
    "PEERTRAIN_TASK_MICRO_BATCH": "16",
    "PEERTRAIN_TASK_TARGET_BATCH": "128",
    "PEERTRAIN_TRAINING_GATHER_WINDOW": "1.0",
    "PEERTRAIN_TRAINING_PROGRESS_INTERVAL": "0.3",
    "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "0",
    "PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": "3600",
    "PEERTRAIN_AVERAGING_TIMEOUT_FLOOR": "2.0",
    "PEERTRAIN_AVERAGING_JOIN_TIMEOUT": "2.0",
}
SOURCES = [f"127.0.0.{i}" for i in range(2, 10)]  # Linux routes all of 127/8 to lo


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def check_alive(collab: Collaboration, what: str) -> None:
    exited = [p for p in collab.procs if p.popen.poll() is not None]
    assert not exited, (what, [(p.name, p.log.read_text()[-3000:]) for p in exited])


def wait_until(
    condition: Callable[[], bool],
    *,
    timeout: float,
    what: str | Callable[[], str],
    collab: Collaboration,
) -> None:
    """Poll `condition`; fail at once, with the logs, if a process exits meanwhile. `what`
    (or what it returns, read when it is needed) names the wait in a failure."""
    deadline = time.monotonic() + timeout
    while not condition():
        check_alive(collab, what if isinstance(what, str) else what())
        assert time.monotonic() < deadline, (
            f"timed out waiting for {what if isinstance(what, str) else what()}"
        )
        time.sleep(0.2)


class FloodThread:
    """A flood of raw sockets driven by one selector in a thread of its own, owned by the
    `with` block: on exit the thread stops and every socket it registered is closed.
    Subclasses write `_run`, looping until `_stop` is set."""

    NAME = "flood"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._selector = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, name=self.NAME, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for key in list(self._selector.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()

    def _run(self) -> None:
        raise NotImplementedError
