"""Logging setup: JSON lines, libp2p demotion, idempotent handlers."""

from __future__ import annotations

import datetime
import json
import logging
from collections.abc import Iterator

import pytest

from peer.errors import ConfigError
from peer.logs import get_logger, setup_logging

WATCHED = ("peertrain", "libp2p", "multiaddr")


@pytest.fixture(autouse=True)
def restore_loggers() -> Iterator[None]:
    """Leave the global logging tree as we found it for other tests."""
    saved = {
        name: (lg.level, list(lg.handlers), lg.propagate)
        for name in WATCHED
        for lg in [logging.getLogger(name)]
    }
    yield
    for name, (level, handlers, propagate) in saved.items():
        lg = logging.getLogger(name)
        for handler in list(lg.handlers):
            lg.removeHandler(handler)
        for handler in handlers:
            lg.addHandler(handler)
        lg.setLevel(level)
        lg.propagate = propagate


def json_lines(err: str) -> list[dict]:
    return [json.loads(line) for line in err.splitlines() if line.strip()]


def test_get_logger_is_under_peertrain() -> None:
    assert get_logger("dht").name == "peertrain.dht"
    assert get_logger("peertrain.rpc").name == "peertrain.rpc"


def test_json_line_parses_with_extras(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="info", fmt="json")
    get_logger("dht").info("stored %d keys", 3, extra={"peer": "12D3", "obj": object()})
    get_logger("dht").debug("hidden at info")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["level"] == "info"
    assert line["logger"] == "peertrain.dht"
    assert line["msg"] == "stored 3 keys"
    assert line["peer"] == "12D3"
    assert "obj" not in line  # not JSON-serialisable: dropped, the line still printed
    ts = datetime.datetime.fromisoformat(line["ts"])
    assert ts.utcoffset() == datetime.timedelta(0)
    assert abs((datetime.datetime.now(datetime.UTC) - ts).total_seconds()) < 60


def test_json_includes_exception(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="info", fmt="json")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        get_logger("x").exception("failed")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["level"] == "error" and "RuntimeError: boom" in line["exc"]


def test_libp2p_error_hidden_at_info(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("libp2p").propagate = False  # what libp2p does on import
    setup_logging(level="info", fmt="json")
    logging.getLogger("libp2p.network.swarm").error("routine dial failure")
    logging.getLogger("libp2p").warning("routine warning")
    assert json_lines(capsys.readouterr().err) == []


def test_libp2p_error_demoted_to_debug_at_debug(capsys: pytest.CaptureFixture[str]) -> None:
    logging.getLogger("libp2p").propagate = False
    setup_logging(level="debug", fmt="json")
    logging.getLogger("libp2p.network.swarm").error("routine dial failure")
    (line,) = json_lines(capsys.readouterr().err)
    assert line["msg"] == "routine dial failure"
    assert line["level"] == "debug"
    assert line["logger"] == "libp2p.network.swarm"


def test_libp2p_demotion_leaves_original_record_alone() -> None:
    seen: list[int] = []

    class Spy(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.levelno)

    setup_logging(level="debug", fmt="json")
    spy = Spy()
    logging.getLogger("libp2p").addHandler(spy)
    logging.getLogger("libp2p").error("x")
    assert seen == [logging.ERROR]


def test_multiaddr_capped_at_warning(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="debug", fmt="json")
    assert logging.getLogger("multiaddr").getEffectiveLevel() == logging.WARNING


def test_setup_twice_does_not_duplicate(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="info", fmt="json")
    setup_logging(level="info", fmt="json")
    before = len(logging.getLogger("peertrain").handlers)
    setup_logging(level="warning", fmt="json")
    assert len(logging.getLogger("peertrain").handlers) == before
    get_logger("a").warning("once")
    get_logger("a").info("filtered at warning")
    logging.getLogger("libp2p").setLevel(logging.DEBUG)
    logging.getLogger("libp2p").error("still hidden")
    assert [line["msg"] for line in json_lines(capsys.readouterr().err)] == ["once"]


def test_rich_format_shows_short_name_and_level(capsys: pytest.CaptureFixture[str]) -> None:
    setup_logging(level="info", fmt="rich")
    get_logger("presence").warning("refresh late by %.1f s", 2.5)
    err = capsys.readouterr().err
    assert "presence: refresh late by 2.5 s" in err
    assert "WARNING" in err
    assert "peertrain.presence" not in err


def test_bad_level_or_format() -> None:
    with pytest.raises(ConfigError, match="'loud'"):
        setup_logging(level="loud", fmt="json")
    with pytest.raises(ConfigError, match="'xml'"):
        setup_logging(level="info", fmt="xml")
