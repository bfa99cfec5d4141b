"""Access links shared by everything a simulated node sends and receives at once.

Each node has an uplink and a downlink (`SharedLink`), each a processor-sharing server: the
transfers on it at a moment share its capacity equally, as TCP flows through one bottleneck
roughly do. A message, an all-reduce round's parts or a state download is carried on the
sender's uplink and the receiver's downlink at once (`carry`) and ends when both have carried
all its bytes; so a node whose replicas serve a hot DHT key slows its own replies, its
averaging and its downloads, and they slow each other. A message's bytes start after its
latency (`carry(..., after=)`).

How, cheaply (a thousand nodes, millions of messages): a link keeps a virtual clock, the bytes
each transfer on it has been served since it started (it advances at capacity / transfers);
a transfer of b bytes that starts at virtual time v ends when the virtual clock reaches v + b.
A link is brought up to date only when something looks at it (`_advance`: the starts and ends
since, in time order), so nothing on it needs a timer of its own. A task that carries bytes
sleeps until its transfers would all end if nothing else started on their links (`_Waiter`):
a lower bound, since a start only slows the others. Waking, it brings its links up to date and
sleeps again if one of its transfers has not ended (something started meanwhile); a transfer
that stops early (its task cancelled) speeds the others on its link, which then sleep again
from the new bound. A message is then one wait, not a sleep for its latency and a wait for its
bytes on each link (trio's wake-ups were most of the simulator's CPU).
"""

from __future__ import annotations

import bisect
import itertools
import math
from heapq import heappop, heappush

import trio

_order = itertools.count()


MAX_WAKEUPS = 10_000
"""Wake-ups of one task whose transfers do not end (of a fan-out, this many for each of its
messages: `carry_groups`): more is a livelock of the simulator's own
(a clock that cannot resolve what is left), raised instead of spinning for ever. A wake-up
comes early only when something started on its links since it slept, and each brings its
bound closer by what started: a few for a message, tens for a long transfer on a busy link."""


EXACT_PROJECTION = 32
"""Transfers ahead of one on its link past which its projected end is a cheap lower bound (as
if those ahead had ended at once; one yet to start, as if it were alone): the exact walk is
O(transfers), and a hot holder's uplink carries hundreds at once (review: 2x the messages on
one link cost 4x the CPU)."""


def _slack(now: float) -> float:
    """How far past `now` an end still counts as now: a sliver of bytes left at a time too large
    for the sliver's seconds to move the clock would otherwise be woken for ever (a simulation
    froze at 142 virtual seconds that way)."""
    return 1e-12 * max(1.0, abs(now))


class _Transfer:
    __slots__ = ("done", "key", "size", "starts_at", "waiter")

    def __init__(self, size: float, starts_at: float, waiter: _Waiter) -> None:
        self.size = size
        self.starts_at = starts_at
        self.waiter = waiter
        self.done = False
        self.key: tuple[float, int] | None = None
        """(its end on the link's virtual clock, order) once started."""


class _Waiter:
    """One task waiting for its transfers (one per link they cross) to end."""

    __slots__ = ("cap", "scope", "transfers")

    def __init__(self, cap: float = math.inf) -> None:
        self.transfers: list[tuple[SharedLink, _Transfer]] = []
        self.scope: trio.CancelScope | None = None
        self.cap = cap
        """When it wakes at the latest, whatever its transfers (a fan-out's deadline)."""

    def deadline(self, now: float) -> float:
        """When its transfers would all have ended if nothing else started (-inf: they have):
        link by link (`SharedLink._latest_end`), as a fan-out's messages share the caller's."""
        by_link: dict[SharedLink, list[_Transfer]] = {}
        for link, transfer in self.transfers:
            if not transfer.done:
                by_link.setdefault(link, []).append(transfer)
        return max(
            (link._latest_end(transfers, now) for link, transfers in by_link.items()),
            default=-math.inf,
        )

    def rearm(self, now: float) -> None:
        if self.scope is not None:
            self.scope.deadline = min(self.deadline(now), self.cap)


class SharedLink:
    """One direction of a node's access link: `capacity` bytes/s, shared equally."""

    def __init__(self, capacity: float) -> None:
        self.capacity = capacity
        self.carried = 0.0
        """Bytes carried in all (what `Traffic` reads per node)."""
        self._virtual = 0.0
        self._at = 0.0
        self._running: list[tuple[float, int, _Transfer]] = []
        """Started transfers by the virtual time they end at."""
        self._pending: list[tuple[float, int, _Transfer]] = []
        """Transfers to start later (a message's latency), by start time."""

    def _advance(self, now: float) -> None:
        """Bring the link to `now`: its starts and ends since the last look, in time order."""
        pending = self._pending
        while pending and pending[0][0] <= now:
            at, _, transfer = heappop(pending)
            if not transfer.done:  # else cancelled before it started
                self._run_to(at)
                self._begin(transfer)
        self._run_to(now)

    def _begin(self, transfer: _Transfer) -> None:
        transfer.key = (self._virtual + transfer.size, next(_order))
        bisect.insort(self._running, (*transfer.key, transfer))

    def _run_to(self, now: float) -> None:
        running = self._running
        until = now + _slack(now)  # once a call: this loop runs for every message's link
        while running:
            tag, _, transfer = running[0]
            ends = self._at + (tag - self._virtual) * len(running) / self.capacity
            if ends > until:
                break
            self._virtual = max(self._virtual, tag)
            self._at = max(self._at, min(ends, now))
            del running[0]
            transfer.done = True
        if running and now > self._at:
            self._virtual += (now - self._at) * self.capacity / len(running)
        self._at = max(self._at, now)

    def _start(self, size: float, waiter: _Waiter, after: float, now: float) -> _Transfer:
        transfer = _Transfer(size, now + after, waiter)
        self.carried += size
        if after > 0:
            heappush(self._pending, (now + after, next(_order), transfer))
        else:
            self._advance(now)
            self._begin(transfer)
        return transfer

    def _cancel(self, transfer: _Transfer) -> list[_Waiter]:
        """A transfer whose task was cancelled (a caller's deadline): it stops sharing. The
        others on the link are sped up: their waiters, returned, must sleep again from their
        new bounds (`_Waiter.rearm`)."""
        if transfer.done:
            return []
        self._advance(trio.current_time())
        if transfer.done:
            return []
        transfer.done = True  # pending: skipped when it comes up
        if transfer.key is None:
            return []
        del self._running[self._index(transfer)]
        others = [other.waiter for _, _, other in self._running]
        return others + [other.waiter for _, _, other in self._pending if not other.done]

    def _index(self, transfer: _Transfer) -> int:
        """Where a started transfer is among the running (by its end tag and order)."""
        return bisect.bisect_left(self._running, transfer.key, key=lambda e: e[:2])

    def _latest_end(self, transfers: list[_Transfer], now: float) -> float:
        """When the last of `transfers` (all on this link) ends if nothing else starts on it
        (-inf: they have ended), each as `_end_of` projects it, with one walk of the
        transfers ahead for all of those it is exact for: the started ones end in their
        order, so the deepest of them ends last. (A fan-out's replies share the caller's
        downlink: the waiter of a read of 32 shards walked up to 32 transfers for each of
        its 32 replies, at each wake-up.)"""
        self._advance(now)
        latest, deepest = -math.inf, -1
        for transfer in transfers:
            if transfer.done:
                continue
            if transfer.key is not None and (index := self._index(transfer)) <= EXACT_PROJECTION:
                deepest = max(deepest, index)
            else:
                latest = max(latest, self._end_of(transfer))
        return latest if deepest < 0 else max(latest, self._walk(deepest))

    def _end_of(self, transfer: _Transfer) -> float:
        """When a transfer that has not ended ends if nothing else starts on this link, the
        link brought up to now (`_advance`)."""
        at, virtual, share = self._at, self._virtual, len(self._running)
        if transfer.key is None and share > EXACT_PROJECTION:  # a busy link: as if alone
            return transfer.starts_at + transfer.size / self.capacity
        if transfer.key is None:  # starts later: play the link to its start first
            rest = iter(self._running)
            for tag, _, _ in rest:
                ends = at + (tag - virtual) * share / self.capacity
                if ends > transfer.starts_at:
                    rest = itertools.chain([(tag, 0, transfer)], rest)
                    break
                at, virtual, share = ends, tag, share - 1
            if share:
                virtual += (transfer.starts_at - at) * self.capacity / share
            at, share, own = transfer.starts_at, share + 1, virtual + transfer.size
            for tag, _, _ in rest:
                if tag >= own:
                    break
                at, virtual, share = at + (tag - virtual) * share / self.capacity, tag, share - 1
            return at + (own - virtual) * share / self.capacity
        index = self._index(transfer)
        if index > EXACT_PROJECTION:  # a busy link: a lower bound, as if those ahead had ended
            tag = transfer.key[0]
            return at + (tag - virtual) * (share - index) / self.capacity
        return self._walk(index)

    def _walk(self, index: int) -> float:
        """When the started transfer at `index` ends if nothing else starts: the transfers
        ahead of it end one by one, each share growing as they leave."""
        at, virtual, share = self._at, self._virtual, len(self._running)
        for tag, _, _ in itertools.islice(self._running, index + 1):
            at, virtual = at + (tag - virtual) * share / self.capacity, tag
            share -= 1
        return at


async def carry(size: float, *links: SharedLink, after: float = 0.0) -> None:
    """Carry `size` bytes over `links` at once (a sender's uplink, a receiver's downlink),
    starting `after` seconds from now (a message's latency): return when every one of them
    has."""
    await carry_parts([(link, size) for link in links], after=after)


async def carry_groups(
    groups: list[tuple[float, list[tuple[SharedLink, float]]]], *, deadline: float = math.inf
) -> list[bool]:
    """Several messages at once (a fan-out's requests or its replies: `SimRpc.call_each`),
    each (after, parts) carrying its parts (link, bytes) from `after` seconds from now; one
    wait until every one has ended, or until `deadline`: which of them ended (those that had
    not stop sharing their links)."""
    waiter = _Waiter(cap=deadline)
    owned: list[list[_Transfer]] = []
    now = trio.current_time()  # read once: every transfer of the fan-out starts now
    try:
        for after, parts in groups:
            started = []
            for link, size in parts:
                if size > 0:
                    started.append(link._start(size, waiter, after, now))
                    waiter.transfers.append((link, started[-1]))
            owned.append(started)
        for wakeups in range(MAX_WAKEUPS * max(1, len(groups))):
            now = trio.current_time()
            ends = waiter.deadline(now)
            if ends == -math.inf or now >= deadline:
                if not wakeups:  # nothing to wait for: still a checkpoint
                    await trio.lowlevel.checkpoint()
                break
            with trio.CancelScope(deadline=min(ends, deadline)) as waiter.scope:
                await trio.sleep_forever()
            waiter.scope = None
        else:
            raise RuntimeError(f"a transfer on a link was woken {wakeups + 1} times: livelock")
        return [all(t.done for t in transfers) for transfers in owned]
    finally:
        waiter.scope = None
        # Each waiter sped up sleeps again once, from the links as every cancel left them: a
        # fan-out cut at its deadline cancels many transfers on a busy link, and re-arming
        # every waiter on it at each (a walk of each one's transfers) was an eighth of the
        # CPU of 1,000 simulated peers once they averaged.
        sped_up: dict[_Waiter, None] = {}
        for link, transfer in waiter.transfers:
            sped_up.update(dict.fromkeys(link._cancel(transfer)))
        now = trio.current_time()
        for other in sped_up:
            other.rearm(now)


async def carry_parts(parts: list[tuple[SharedLink, float]], *, after: float = 0.0) -> None:
    """Carry each (link, bytes) at once (a state download: the joiner's downlink carries it
    all, each donor's uplink its part), starting `after` seconds from now; return when all
    have ended."""
    if not any(size > 0 for _, size in parts):
        await trio.sleep(after)
        return
    await carry_groups([(after, parts)])
