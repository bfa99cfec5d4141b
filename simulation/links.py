"""Access links shared by everything a simulated node sends and receives at once.

Each node has an uplink and a downlink (`SharedLink`), each a processor-sharing server: the
transfers on it at a moment share its capacity equally, as TCP flows through one bottleneck
roughly do. A message, an all-reduce round's parts or a state download is carried on the
sender's uplink and the receiver's downlink at once (`carry`) and ends when both have carried
all its bytes; so a node whose replicas serve a hot DHT key slows its own replies, its
averaging and its downloads, and they slow each other.

How, cheaply (a thousand nodes, millions of messages): a link keeps a virtual clock, the bytes
each transfer on it has been served since it started (it advances at capacity / transfers);
a transfer of b bytes that starts at virtual time v ends when the virtual clock reaches v + b.
Only the transfer that ends first on a link holds a timer (`_arm`); each start or end moves it.
"""

from __future__ import annotations

import itertools
import math
from heapq import heappop, heappush

import trio

_order = itertools.count()


MAX_WAKEUPS = 1000
"""Timer wakeups of one transfer that does not end: more is a livelock of the simulator's
own (a clock that cannot resolve what is left), raised instead of spinning for ever."""


class _Transfer:
    __slots__ = ("done", "ends_at", "tag", "waiter", "wakeups")

    def __init__(self, tag: float, waiter: _Waiter) -> None:
        self.tag = tag
        self.waiter = waiter
        self.done = False
        self.wakeups = 0
        self.ends_at = math.inf  # armed only while it is its link's next to end


class _Waiter:
    """One task waiting for its transfers (one per link they cross) to end."""

    __slots__ = ("event", "scope", "transfers")

    def __init__(self) -> None:
        self.transfers: list[tuple[SharedLink, _Transfer]] = []
        self.event = trio.Event()
        self.scope: trio.CancelScope | None = None

    def rearm(self) -> None:
        if self.scope is not None:
            self.scope.deadline = min(
                (t.ends_at for _, t in self.transfers if not t.done), default=-math.inf
            )

    def ended(self) -> None:
        if all(t.done for _, t in self.transfers):
            self.event.set()
        else:
            self.rearm()


class SharedLink:
    """One direction of a node's access link: `capacity` bytes/s, shared equally."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.carried = 0.0
        """Bytes carried in all (what `Traffic` reads per node)."""
        self._virtual = 0.0
        self._at = 0.0
        self._active = 0
        self._heap: list[tuple[float, int, _Transfer]] = []

    def _advance(self, now: float) -> None:
        if self._active:
            self._virtual += (now - self._at) * self.capacity / self._active
        self._at = now

    def _start(self, size: float, waiter: _Waiter) -> _Transfer:
        self._advance(trio.current_time())
        transfer = _Transfer(self._virtual + size, waiter)
        heappush(self._heap, (transfer.tag, next(_order), transfer))
        self._active += 1
        self.carried += size
        self._arm()
        return transfer

    def _cancel(self, transfer: _Transfer) -> None:
        """A transfer whose task was cancelled (a caller's deadline): it stops sharing."""
        if not transfer.done:
            self._advance(trio.current_time())
            transfer.done = True  # left in the heap, skipped when it comes up
            self._active -= 1
            self._finish()

    def _finish(self) -> None:
        """End every transfer the virtual clock has reached, then arm the next."""
        heap = self._heap
        while heap:
            tag, _, transfer = heap[0]
            if transfer.done:  # cancelled: already uncounted
                heappop(heap)
                continue
            if tag > self._virtual + 1e-9 * max(1.0, tag):
                break
            heappop(heap)
            transfer.done = True
            transfer.ends_at = math.inf
            self._active -= 1
            transfer.waiter.ended()
        self._arm()

    def _arm(self) -> None:
        heap = self._heap
        while heap and heap[0][2].done:
            heappop(heap)
        if heap:
            tag, _, transfer = heap[0]
            transfer.ends_at = self._at + (tag - self._virtual) * self._active / self.capacity
            transfer.waiter.rearm()

    def _woken(self, transfer: _Transfer) -> None:
        """Its timer fired: bring the clock to now and end what it reached. The next to end
        ends now whatever the rounding says: a sliver of bytes left at a time too large for
        the sliver's seconds to move the clock would wake it for ever (a simulation froze at
        142 virtual seconds that way)."""
        transfer.ends_at = math.inf
        transfer.wakeups += 1
        if transfer.wakeups > MAX_WAKEUPS:
            raise RuntimeError(f"a transfer on a link was woken {MAX_WAKEUPS} times: livelock")
        self._advance(trio.current_time())
        self._arm()  # drops cancelled ones off the top
        if self._heap and self._heap[0][2] is transfer:
            self._virtual = max(self._virtual, transfer.tag)
        self._finish()


async def carry(size: float, *links: SharedLink) -> None:
    """Carry `size` bytes over `links` at once (a sender's uplink, a receiver's downlink):
    return when every one of them has."""
    await carry_parts([(link, size) for link in links])


async def carry_parts(parts: list[tuple[SharedLink, float]]) -> None:
    """Carry each (link, bytes) at once (a state download: the joiner's downlink carries it
    all, each donor's uplink its part); return when all have ended."""
    parts = [(link, size) for link, size in parts if size > 0]
    if not parts:
        await trio.lowlevel.checkpoint()
        return
    waiter = _Waiter()
    try:
        for link, size in parts:
            waiter.transfers.append((link, link._start(size, waiter)))
        while not waiter.event.is_set():
            with trio.CancelScope() as waiter.scope:
                waiter.rearm()
                await waiter.event.wait()
            waiter.scope = None
            for link, transfer in waiter.transfers:
                if not transfer.done and transfer.ends_at <= trio.current_time():
                    link._woken(transfer)
    finally:
        waiter.scope = None
        for link, transfer in waiter.transfers:
            link._cancel(transfer)
