"""Logging setup: one handler on stderr for the "peertrain" tree, rich or JSON lines.

py-libp2p sets `logging.getLogger("libp2p").propagate = False` (and clears that logger's
handlers) when it is imported, and logs routine failures (a peer hanging up, a dial that times
out) at ERROR. We attach a separate handler to the "libp2p" logger that demotes all of its records
to DEBUG, so they show only at `level = "debug"` and never look like our own errors. Call
`setup_logging` after libp2p has been imported, or libp2p's import-time setup removes it.

This module identifies libp2p by logger name only; it does not import libp2p.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import sys
from typing import Any

from rich.console import Console
from rich.logging import RichHandler

from peer.errors import ConfigError

__all__ = ["LEVELS", "get_logger", "setup_logging"]

ROOT = "peertrain"
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}
FORMATS = ("rich", "json")
_MARK = "_peertrain_handler"  # attribute set on handlers we own, so a re-setup replaces them
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD_ATTRS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime"}


def get_logger(name: str) -> logging.Logger:
    """The logger "peertrain.<name>" (a name already under "peertrain" is kept)."""
    if name == ROOT or name.startswith(f"{ROOT}."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT}.{name}")


def setup_logging(*, level: str, fmt: str) -> None:
    """Send peertrain's (and demoted libp2p) records to stderr; idempotent."""
    if level not in LEVELS:
        raise ConfigError(f"log.level = {level!r}: expected one of {', '.join(LEVELS)}")
    if fmt not in FORMATS:
        raise ConfigError(f"log.format = {fmt!r}: expected one of {', '.join(FORMATS)}")
    threshold = LEVELS[level]
    handler = _rich_handler() if fmt == "rich" else _json_handler()
    setattr(handler, _MARK, True)

    ours = logging.getLogger(ROOT)
    _replace_handlers(ours, handler)
    ours.setLevel(threshold)

    demoted = _DemotingHandler(handler, threshold)
    setattr(demoted, _MARK, True)
    libp2p = logging.getLogger("libp2p")
    _replace_handlers(libp2p, demoted)
    # Records below the logger's level are never created: let DEBUG through only when we show it.
    libp2p.setLevel(logging.DEBUG if threshold <= logging.DEBUG else logging.WARNING)

    # Parts of libp2p log through the root logger (`logging.debug(...)`), which runs
    # basicConfig when the root has no handler: every one of our records would then print twice.
    root = logging.getLogger()
    if not root.handlers:
        root.addHandler(logging.NullHandler())

    # multiaddr logs every parse at DEBUG; that drowns our own debug output.
    logging.getLogger("multiaddr").setLevel(logging.WARNING)


def _replace_handlers(logger: logging.Logger, handler: logging.Handler) -> None:
    for old in [h for h in logger.handlers if getattr(h, _MARK, False)]:
        logger.removeHandler(old)
        old.close()
    logger.addHandler(handler)


class _DemotingHandler(logging.Handler):
    """Forward a copy of each record at DEBUG to `target`, if DEBUG is shown.

    A copy, because other handlers on the same logger (libp2p's own, under LIBP2P_DEBUG) must
    still see the original level.
    """

    def __init__(self, target: logging.Handler, threshold: int) -> None:
        super().__init__()
        self.target = target
        self.threshold = threshold

    def emit(self, record: logging.LogRecord) -> None:
        if self.threshold > logging.DEBUG:
            return
        copy = logging.makeLogRecord(record.__dict__)
        copy.levelno, copy.levelname = logging.DEBUG, "DEBUG"
        self.target.handle(copy)


class _ShortNameFormatter(logging.Formatter):
    """ "peertrain.dht: message" -> "dht: message"; a rich column already shows time and level."""

    def format(self, record: logging.LogRecord) -> str:
        name = record.name.removeprefix(f"{ROOT}.")
        return f"{name}: {super().format(record)}"


def _rich_handler() -> logging.Handler:
    handler = RichHandler(
        console=Console(stderr=True),
        show_time=True,
        show_level=True,
        show_path=False,
        markup=False,  # messages carry peer ids and multiaddrs, never rich markup
        log_time_format="[%X]",
    )
    handler.setFormatter(_ShortNameFormatter("%(message)s"))
    return handler


def finite(value: Any) -> Any:
    """`value` with every non-finite float as None: JSON has no NaN or Infinity (a browser's
    parser, or a log shipper's, refuses the whole document). Other peers' figures can be
    anything: a sum of two claims of 1e308 is inf."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ts (ISO 8601 UTC), level, logger, msg, then `extra` fields."""

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        line: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in record.__dict__.items():
            if key in _STANDARD_ATTRS or key in line:
                continue
            value = finite(value)
            try:
                json.dumps(value, allow_nan=False)
            except (TypeError, ValueError):
                continue  # a log line must never fail because of one odd `extra` value
            line[key] = value
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def _json_handler() -> logging.Handler:
    # Look sys.stderr up now, not at import: pytest and the CLI runner swap it.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    return handler
