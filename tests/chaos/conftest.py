"""The chaos suite is invoked on its own: `.venv/bin/python -m pytest -n 0 -m chaos tests/chaos`.

Every test here is marked `chaos`. Unless the run's mark expression selects `chaos`, this folder's
test files are not collected at all, so `pytest` and `pytest -m slow` collect exactly what they
did before the suite existed (not even as deselected items)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "chaos: fault-injection runs of real processes (minutes each); only with -m chaos",
    )


def _selects_chaos(markexpr: str) -> bool:
    """Whether the mark expression `markexpr` asks for chaos tests: it selects a test marked
    only `chaos` and not a test without marks (so the default `-m 'not slow'` does not)."""
    if not markexpr:
        return False
    try:
        from _pytest.mark.expression import Expression

        expression = Expression.compile(markexpr)
        return bool(
            expression.evaluate(lambda name, **_: name == "chaos")
            and not expression.evaluate(lambda name, **_: False)
        )
    except Exception:  # a private API: fall back to reading the expression
        return re.search(r"(?<!not )\bchaos\b", markexpr) is not None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    path = collection_path.resolve()
    ours = path.parent == HERE and path.name.startswith("test_")
    if ours and not _selects_chaos(config.getoption("markexpr", "")):
        return True
    return None
