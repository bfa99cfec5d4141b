"""The collaboration's clock: a peer reads the time as the backbones do (peer.measure.clock)."""

from __future__ import annotations

import time
from functools import partial

import pytest
import trio

from peer.config import ProbeConfig
from peer.measure.clock import (
    MAX_CORRECTION,
    CollaborationClock,
    agreed_offset,
    keep_clock,
    measure_offsets,
)
from peer.measure.probe import ProbeServer
from tests.helpers import nodes


def test_the_median_of_the_backbones_counts_and_a_wild_one_is_refused():
    assert agreed_offset([]) is None
    assert agreed_offset([(3.0, 0.01)]) == 3.0
    # One backbone of three lies by an hour: the median is one of the honest two.
    assert agreed_offset([(3.0, 0.01), (3600.0, 0.01), (2.9, 0.02)]) == 3.0
    assert agreed_offset([(MAX_CORRECTION + 1, 0.01)]) is None


def test_the_clock_applies_the_agreed_offset_and_keeps_it_when_none_is_agreed(caplog):
    wall = [1000.0]
    clock = CollaborationClock(lambda: wall[0])
    assert clock() == 1000.0  # uncorrected until measured
    clock.adjust([(2.5, 0.01), (2.4, 0.01)])
    assert clock() == pytest.approx(1002.45)
    wall[0] = 1010.0
    assert clock() == pytest.approx(1012.45)  # follows the wall clock
    with caplog.at_level("WARNING", logger="peertrain.clock"):
        clock.adjust([(500.0, 0.01)])
    assert clock() == pytest.approx(1012.45)  # refused: the last good offset stays
    assert "not correcting" in caplog.text and "timedatectl" in caplog.text
    clock.adjust([])  # no backbone answered: unchanged
    assert clock.offset == pytest.approx(2.45)


@pytest.mark.parametrize("skew", [3.0, -2.0])
async def test_a_peer_measures_the_backbones_clock_over_pings_and_reads_the_time_by_it(skew):
    """Loopback: two backbones whose clocks run `skew` seconds off ours; a third node (the
    peer) measures its offset and corrects its clock; a later step of the backbones' clocks
    (NTP catching up) is followed at the next measurement."""
    shift = [skew]
    async with nodes(3) as (first, second, peer):
        for backbone in (first, second):
            ProbeServer(backbone.host, ProbeConfig(), wall_clock=lambda: time.time() + shift[0])
            await peer.connect(backbone.peer_id, backbone.announce, timeout=10)
        backbones = [first.peer_id, second.peer_id]
        with trio.fail_after(30):
            estimates = await measure_offsets(peer, backbones, timeout=10)
        assert len(estimates) == 2
        assert all(offset == pytest.approx(skew, abs=0.5) for offset, _ in estimates)

        clock = CollaborationClock()
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(keep_clock, peer, clock, backbones, interval=0.5, timeout=10)
                )
                assert clock() - time.time() == pytest.approx(skew, abs=0.5)
                shift[0] = 0.0  # the backbones' clocks are stepped back to ours
                while abs(clock() - time.time()) > 0.5:
                    await trio.sleep(0.1)
                nursery.cancel_scope.cancel()


async def test_a_backbone_that_does_not_answer_leaves_the_clock_as_it_was():
    async def silent(stream):
        await trio.sleep_forever()

    from peer.measure import probe

    async with nodes(2) as (backbone, peer):
        backbone.host.set_stream_handler(probe.PROTOCOL, silent)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=10)
        clock = CollaborationClock()
        clock.offset = 1.5

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(
                    partial(keep_clock, peer, clock, [backbone.peer_id], interval=60, timeout=0.5)
                )
                nursery.cancel_scope.cancel()
        assert clock.offset == 1.5
