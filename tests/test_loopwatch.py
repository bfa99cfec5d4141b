"""The event-loop lag monitor (peer.loopwatch): the pure tally, then the trio task on virtual
time, where a synchronous block of the loop is a jump of the mock clock with no checkpoint."""

from __future__ import annotations

import dataclasses
import logging
import time
from types import SimpleNamespace

import pytest
import trio
import trio.testing
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

import peer.metrics as metrics
from peer.dht.node import DhtStatistics
from peer.loopwatch import LagTally, LoopStatistics, LoopWatch, log_statistics_on_stop

# ---------------------------------------------------------------------------- the pure tally


def test_the_tally_keeps_the_longest_lateness_when_it_came_and_counts_stalls_over_threshold():
    tally = LagTally(threshold=0.1, warn_threshold=1.0)
    for lateness, now in [(0.001, 0.01), (0.05, 0.07), (0.3, 0.4), (0.1, 0.51), (0.2, 0.72)]:
        tally.observe(lateness, now)
    assert tally.statistics() == LoopStatistics(
        longest_stall=0.3,
        longest_stall_at=0.4,
        stalls_over_threshold=2,  # 0.3 and 0.2; exactly 0.1 is not over
        threshold=0.1,
        wakeups=5,
        watched=0.72,
        worst_stalls=((0.3, 0.4), (0.2, 0.72)),
    )


def test_the_tally_lists_the_five_longest_stalls_longest_first():
    tally = LagTally(threshold=0.1, warn_threshold=10.0)
    for i, lateness in enumerate([0.2, 0.7, 0.3, 0.9, 0.15, 0.5, 0.4, 0.6]):
        tally.observe(lateness, float(i))
    assert tally.statistics().worst_stalls == (
        (0.9, 3.0), (0.7, 1.0), (0.6, 7.0), (0.5, 5.0), (0.4, 6.0),
    )  # fmt: skip


def test_a_wake_up_a_hair_early_counts_as_on_time():
    tally = LagTally()
    tally.observe(-1e-9, 0.01)
    assert tally.statistics().longest_stall == 0.0
    assert tally.statistics().longest_stall_at is None


def test_warnings_come_for_long_stalls_only_and_at_most_one_per_period():
    tally = LagTally(threshold=0.1, warn_threshold=1.0, warn_every=60.0)
    assert not tally.observe(0.5, 1.0)  # counted, not warned
    assert tally.observe(1.5, 2.0)  # the first long one
    assert not tally.observe(2.0, 30.0)  # within 60 s of the last warning
    assert not tally.observe(1.2, 61.9)
    assert tally.unwarned == 2
    assert tally.observe(1.1, 62.0)  # 60 s after the last warning
    assert tally.statistics().stalls_over_threshold == 5


def test_the_statistics_are_a_frozen_snapshot():
    tally = LagTally()
    before = tally.statistics()
    tally.observe(0.2, 1.0)
    assert before.longest_stall == 0.0  # the snapshot did not change
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.longest_stall = 1.0  # type: ignore[misc]


def test_the_log_fields_are_milliseconds():
    stats = LoopStatistics(
        longest_stall=0.12345, longest_stall_at=4.0, stalls_over_threshold=3, wakeups=9,
        watched=5.0,
    )  # fmt: skip
    assert stats.as_log_fields() == {
        "longest_stall_ms": 123.5,
        "longest_stall_at_s": 4.0,
        "stalls_over_threshold": 3,
        "threshold_ms": 100.0,
        "wakeups": 9,
        "watched_s": 5.0,
        "worst_stalls": [],
        "longest_stall_where": None,
    }


# ---------------------------------------------------------------------------- the trio task


def block_the_loop(clock: trio.testing.MockClock, seconds: float) -> None:
    """What a synchronous computation on the event-loop thread does: time passes, and no
    task runs until it returns (no checkpoint in between)."""
    clock.jump(seconds)


async def test_an_idle_loop_wakes_on_time(autojump_clock):
    watch = LoopWatch(trace=False, interval=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await trio.sleep(1.0)
        nursery.cancel_scope.cancel()
    stats = watch.statistics()
    assert stats.longest_stall == pytest.approx(0.0, abs=1e-9)
    assert stats.stalls_over_threshold == 0
    assert 99 <= stats.wakeups <= 100  # one every 10 ms of virtual time
    assert stats.watched == pytest.approx(1.0, abs=0.011)


async def test_a_blocked_loop_is_measured_from_when_the_wake_up_was_due(autojump_clock):
    watch = LoopWatch(trace=False, interval=0.01, threshold=0.1)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)  # at t = 0: wake-ups due at 0.01, 0.02, ...
        await trio.sleep(0.105)  # the watcher last woke at 0.10; next due at 0.11
        block_the_loop(autojump_clock, 0.25)  # until 0.355
        await trio.sleep(0.5)
        block_the_loop(autojump_clock, 0.05)  # a short one: measured, not counted
        await trio.sleep(0.5)
        nursery.cancel_scope.cancel()
    stats = watch.statistics()
    assert stats.longest_stall == pytest.approx(0.355 - 0.11)
    assert stats.longest_stall_at == pytest.approx(0.355)
    [(lateness, at)] = stats.worst_stalls  # the 0.05 s one is under the threshold
    assert (lateness, at) == (stats.longest_stall, stats.longest_stall_at)
    # One stall, not a burst: the next wake-up counts from the late one.
    assert stats.stalls_over_threshold == 1


async def test_a_long_stall_is_logged_as_a_warning_once_per_period(autojump_clock, caplog):
    watch = LoopWatch(trace=False, interval=0.01, warn_threshold=1.0, warn_every=60.0)
    with caplog.at_level(logging.WARNING, logger="peertrain.loop"):
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            for _ in range(3):  # three stalls of ~1.5 s, 10 s apart
                await trio.sleep(10.0)
                block_the_loop(autojump_clock, 1.5)
            await trio.sleep(60.0)
            block_the_loop(autojump_clock, 2.0)  # a period later: warned, with the count
            await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    warnings = [r for r in caplog.records if r.name == "peertrain.loop"]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    assert "stalled for 1.4" in warnings[0].getMessage()  # 1.5 s less up to one interval
    assert "2 more such stalls since the last warning" in warnings[1].getMessage()
    assert watch.statistics().stalls_over_threshold == 4


async def test_the_daemons_metrics_show_the_loop_figures(autojump_clock):
    watch = LoopWatch(trace=False, interval=0.01)
    async with trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await trio.sleep(0.1)
        block_the_loop(autojump_clock, 0.3)
        await trio.sleep(0.1)
        nursery.cancel_scope.cancel()
    dht = SimpleNamespace(statistics=lambda: DhtStatistics(0, 0, 0, 0, {}))
    sources = metrics.Sources("backbone", "p", "0.1.0", dht, loop=watch)  # type: ignore[arg-type]
    text = generate_latest(metrics.registry_for(sources)).decode()
    got = {
        s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
    }
    expected = watch.statistics().longest_stall
    assert expected > 0.2
    assert got["peertrain_event_loop_longest_stall_seconds"] == pytest.approx(expected)
    assert got["peertrain_event_loop_stalls_total"] == 1


# ---------------------------------------------------------------------------- the daemon's record


def loop_records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.loop for r in caplog.records if r.name == "peertrain.loop" and hasattr(r, "loop")]


async def watch_then(autojump_clock, ending) -> LoopWatch:
    """A watched nursery that sees one 0.3 s block, then ends by `ending(nursery)`."""
    watch = LoopWatch(trace=False, interval=0.01)
    async with log_statistics_on_stop(watch), trio.open_nursery() as nursery:
        await nursery.start(watch.run)
        await trio.sleep(0.1)
        block_the_loop(autojump_clock, 0.3)
        await trio.sleep(0.1)
        ending(nursery)
        await trio.sleep_forever()
    return watch


def stop(nursery: trio.Nursery) -> None:
    nursery.cancel_scope.cancel()


async def test_a_stopped_daemon_logs_its_figures_once_as_a_json_field(autojump_clock, caplog):
    with caplog.at_level(logging.INFO, logger="peertrain.loop"):
        watch = await watch_then(autojump_clock, stop)
    [fields] = loop_records(caplog)
    assert fields == watch.statistics().as_log_fields()
    assert fields["stalls_over_threshold"] == 1
    assert 200 < fields["longest_stall_ms"] <= 300


async def test_a_daemon_cancelled_from_outside_logs_its_figures(autojump_clock, caplog):
    with caplog.at_level(logging.INFO, logger="peertrain.loop"):
        with trio.move_on_after(5):  # as the CLI's grace period ends a slow stop
            await watch_then(autojump_clock, lambda nursery: None)
    [fields] = loop_records(caplog)
    assert fields["stalls_over_threshold"] == 1


async def test_a_daemon_that_failed_logs_only_its_error(autojump_clock, caplog):
    def fail(nursery: trio.Nursery) -> None:
        raise RuntimeError("no backbone answered")

    with caplog.at_level(logging.INFO, logger="peertrain.loop"), pytest.RaisesGroup(RuntimeError):
        await watch_then(autojump_clock, fail)
    assert loop_records(caplog) == []


# ---------------------------------------------------------------------------- where it stalled


def sort_a_big_list_on_the_loop() -> None:
    """Synchronous work on the event-loop thread (real time: the tracer watches real time)."""
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:
        sorted(range(10_000), key=lambda i: -i)


def sleep_in_a_c_call_on_the_loop() -> None:
    time.sleep(1.0)  # releases the GIL, as a large copy or a hash does


@pytest.mark.parametrize("block", [sort_a_big_list_on_the_loop, sleep_in_a_c_call_on_the_loop])
async def test_a_stall_says_where_the_loop_was(block, caplog):
    """The monitor hears of a stall when it has ended; the tracer looked while it lasted, and
    the warning and the statistics name the code that blocked the loop."""
    watch = LoopWatch(interval=0.01, threshold=0.1, warn_threshold=0.5)
    with caplog.at_level(logging.WARNING, logger="peertrain.loop"):
        async with trio.open_nursery() as nursery:
            await nursery.start(watch.run)
            await trio.sleep(0.05)
            block()
            await trio.sleep(0.05)
            nursery.cancel_scope.cancel()
    where = watch.statistics().longest_stall_where
    assert where is not None and block.__name__ in where, where
    assert any(block.__name__ in r.getMessage() for r in caplog.records), caplog.text
