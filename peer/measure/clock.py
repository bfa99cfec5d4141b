"""The collaboration's clock: our wall clock corrected by its offset to the backbones'.

Gatherings start at wall-clock times that peers read off the DHT (`gather_until`), so a peer
whose clock is a second off declares its ticket after everyone else has read theirs, misses
every gathering and keeps up only by downloading the state. Machines without NTP are common
among volunteers; rather than asking each to fix theirs, a peer measures its offset to the
backbones (pings carry the backbone's wall clock, as in NTP) and reads the time as
`time.time() + offset` for everything it shares: progress records, calls, gatherings, record
expirations. Backbones are the reference and do not correct themselves.

Trust: the median over the backbones a peer was given (`--backbone`; the daemon never asks
ones announced in the DHT) counts, so one lying backbone of three moves nobody; a
correction beyond `MAX_CORRECTION` is refused (a clock that far off, or a backbone that far off,
needs a person: `peer doctor` says which).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import trio
from libp2p.peer.id import ID

from peer.errors import RemoteError
from peer.measure import probe
from peer.net.host import Node

log = logging.getLogger("peertrain.clock")

#: Offsets (seconds) beyond this are reported, not applied.
MAX_CORRECTION = 60.0
#: An offset this large is worth a line in the log (as `peer doctor` warns from it too).
NOTABLE = 0.5
#: Pings per backbone per measurement (the fastest counts).
PINGS = 4
#: Backbones asked per measurement, nearest first as given.
BACKBONES = 3


@dataclass(frozen=True)
class ClockSample:
    """One ping: our wall clock when it left and when the reply came, and the backbone's."""

    sent: float
    received: float
    server_time: float | None
    """None from a backbone older than `Pong.server_time`."""


def clock_offset(samples: Sequence[ClockSample]) -> tuple[float, float] | None:
    """(offset, uncertainty) in seconds: the backbone's clock minus ours, +- half a round trip.

    As in NTP, the sample with the shortest round trip counts: the backbone read its clock
    somewhere between `sent` and `received`, so the midpoint is off by at most half of it.
    Positive: our clock is behind. None when no sample carries the backbone's time.
    """
    timed = [s for s in samples if s.server_time is not None]
    if not timed:
        return None
    best = min(timed, key=lambda s: s.received - s.sent)
    assert best.server_time is not None
    return best.server_time - (best.sent + best.received) / 2, (best.received - best.sent) / 2


def agreed_offset(estimates: Sequence[tuple[float, float]]) -> float | None:
    """The correction to apply from per-backbone (offset, uncertainty) estimates: their median
    (one backbone of three cannot move it), or None when there is none or it exceeds
    MAX_CORRECTION."""
    if not estimates:
        return None
    offset = statistics.median(offset for offset, _ in estimates)
    return offset if abs(offset) <= MAX_CORRECTION else None


class CollaborationClock:
    """Call it for the time: the wall clock plus the measured offset (0 until measured)."""

    def __init__(self, wall: Callable[[], float] = time.time) -> None:
        self.wall = wall
        self.offset = 0.0

    def __call__(self) -> float:
        return self.wall() + self.offset

    def adjust(self, estimates: Sequence[tuple[float, float]]) -> None:
        offset = agreed_offset(estimates)
        if offset is None:
            if estimates:
                far = statistics.median(o for o, _ in estimates)
                log.warning(
                    "our clock is %.1f s off the backbones'; not correcting more than %g s: "
                    "synchronise this machine's clock (`timedatectl set-ntp true`) or check "
                    "the backbones' (`peer doctor`)",
                    far,
                    MAX_CORRECTION,
                )
            return
        if abs(offset) >= NOTABLE and abs(offset - self.offset) >= NOTABLE:
            log.info(
                "our clock is %.2f s %s the backbones'; using theirs for the collaboration",
                abs(offset),
                "behind" if offset > 0 else "ahead of",
            )
        self.offset = offset


async def sample_clock(node: Node, backbone: ID, *, count: int = PINGS) -> list[ClockSample]:
    """`count` pings on one probe stream, each with our wall clock around the backbone's.
    No deadline beyond the probe's own per reply: the caller's covers the whole exchange."""
    pings = await probe.ping(node, backbone, count)
    return [ClockSample(p.sent, p.received, p.server_time) for p in pings]


async def measure_offsets(
    node: Node, backbones: Sequence[ID], *, timeout: float
) -> list[tuple[float, float]]:
    """(offset, uncertainty) to each of the first BACKBONES that answer within `timeout`."""
    estimates: list[tuple[float, float]] = []

    async def one(backbone: ID) -> None:
        try:
            estimate = clock_offset(await sample_clock(node, backbone))
        except RemoteError as error:
            log.debug("clock sample from %s failed: %s", backbone, error)
            return
        if estimate is not None:
            estimates.append(estimate)

    with trio.move_on_after(timeout):
        async with trio.open_nursery() as nursery:
            for backbone in backbones[:BACKBONES]:
                nursery.start_soon(one, backbone)
    return estimates


async def keep_clock(
    node: Node,
    clock: CollaborationClock,
    backbones: Sequence[ID],
    *,
    interval: float,
    timeout: float,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Measure the offset now (started: after the first try), then every `interval` seconds:
    a clock stepped later (NTP coming up, a suspend) is followed."""
    while True:
        clock.adjust(await measure_offsets(node, backbones, timeout=timeout))
        task_status.started()
        task_status = trio.TASK_STATUS_IGNORED
        await trio.sleep(interval)
