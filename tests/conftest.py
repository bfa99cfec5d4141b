"""Ending the test process: after the last report, it exits without the interpreter's teardown.

A full run (1,191 tests, every one passed) once ended in SIGABRT after its summary ("terminate
called without an active exception", exit code 134, so CI failed): torch's C++ teardown at
interpreter exit, as `peer` itself met when a thread was still inside torch at exit
(`tests/test_cli_e2e.py`), and why the daemon ends with `os._exit` once everything is saved
(`cli.common`). Threads alive at the session's end in another run: idle torch worker threads
and trio's idle thread cache, none inside torch. So once pytest has reported and cleaned up,
the process ends with pytest's own exit status and skips that teardown.
"""

from __future__ import annotations

import os
import sys

import pytest

_status: list[int] = []


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _status.append(int(exitstatus))


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _status:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_status[-1])
