"""What a trainer and the state keeper share: the progress exchange (our record into
`<collaboration>/progress` and everyone's out of it, every interval or when asked) and the
certified catch-up (`fetch_certified`, `check_certified`).

Each exchange stores our record (if we have one) and, when a read is due, reads every record,
under one deadline (`max(interval, 2 net.rpc_timeout)`: a replica that went silent fails the
store's call to it at `rpc_timeout` and is dropped, and the read still has its time; with the
deadline at `rpc_timeout` the exchange was cut at the very instant the call failed, the
replica was never dropped, and every exchange after a silent departure ran out: a simulated
collaboration of 8 stopped stepping); how long the store took is reported
(`on_store_time`, also when it was cut short: over high-latency links a store slower than the
deadline must still widen the windows; a hot store that skipped its lookup counts one, since
the windows are for tickets, which are stored with one). Reads are decoded here, at the boundary
(`decode_progress`: owner-signed entries, valid step signatures only). On the way out our
record is left `leaving` (its vote and signatures count on, the peer no more), so others stop
counting us at once instead of when it expires.

The progress key is a hot DHT key (`DHT.get(hot=True)`: two of its replicas, no lookup), and a
read is due every `read_interval`: the configured interval while the records are small, longer
once reading them all would cost more than `READ_BYTES_PER_SECOND` (at 300 simulated trainers
every trainer read 11 Mbit/s of records, and the busiest replica sent 765 Mbit/s). The
windows and waits that count on a read count on one that old (`Timing.reading`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import msgspec
import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import DHT, HOT_READ_REPLICAS
from peer.dht.records import Entry, merge
from peer.errors import RemoteError
from peer.net.host import parse_addrs
from peer.training import shards
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
    decode_progress,
    encode_progress,
)

if TYPE_CHECKING:
    from peer.training.statesync import Snapshot

log = logging.getLogger("peertrain.progress")
T = TypeVar("T")

#: Bytes a second a peer spends reading progress records, at most (2 Mbit/s, what a volunteer's
#: link spares): with 0.7 KB records from two replicas, ~180 trainers are read every second,
#: 1,000 every 5.3 s.
READ_BYTES_PER_SECOND = 256 * 1024


def read_interval(read_bytes: int, *, interval: float, longest: float) -> float:
    """Seconds until the next read after one that received `read_bytes`: `interval` while that
    fits `READ_BYTES_PER_SECOND`, longer in proportion, at most `longest` (beyond it the
    gathering windows could no longer count on a read)."""
    return min(max(interval, read_bytes / READ_BYTES_PER_SECOND), max(interval, longest))


#: A record's bytes counted toward the read budget, at most (ours are ~0.7 KB).
MAX_RECORD_BYTES = 4096


def received_bytes(entries: dict[str, Entry], records: list[ProgressRecord]) -> int:
    """About what a hot read of `records` (decoded from `entries`: owner-signed, valid) took
    from two replicas. Only theirs, each at most `MAX_RECORD_BYTES`: junk a replica adds under
    open subkeys must not stretch our reads (and miss the gatherings others call)."""
    values = (entries[r.peer_id].value or b"" for r in records if r.peer_id in entries)
    return HOT_READ_REPLICAS * sum(min(len(v), MAX_RECORD_BYTES) for v in values)


class ProgressRead(NamedTuple):
    entries: dict[str, Entry]
    records: list[ProgressRecord]
    """`entries` decoded (`decode_progress`)."""

    @property
    def size(self) -> int:
        """The collaboration's size as this read shows it: where the next read reads."""
        return len(self.records)


async def read_progress(
    dht: DHT, collaboration: str, size: int | None, *, hot: bool = True
) -> ProgressRead:
    """Every progress record of `collaboration`: the shards of the level of `size` (the size our
    last read showed). With no `size` (nothing read yet), or none found at its level, the one
    key of a small collaboration is read, and where it shows a larger one (or nothing), one
    shard of every other level, then the level where they show the most (`shards.probe_level`). RemoteError if
    no shard of the level could be read."""
    at = None if size is None else shards.level(size)
    if at is not None:
        read = await _read_level(dht, collaboration, at, hot=hot)
        if read.records:
            return read
    if at != 0:
        read = await _read_level(dht, collaboration, 0, hot=hot)
        if read.records and shards.level(read.size) == 0:
            return read
    probed = shards.probe_level([(0, read.size), *await _probe(dht, collaboration, hot=hot)])
    return read if probed == 0 else await _read_level(dht, collaboration, probed, hot=hot)


async def _read_level(dht: DHT, collaboration: str, at: int, *, hot: bool) -> ProgressRead:
    """Every shard of level `at`, at once; RemoteError if one could not be read. A view with a
    shard missing is no view: a first step's election counts the trainers in view (`StepPolicy.
    _most_trainers_voted`), and views with a shard left out each let a minority certify its
    own first step (100 simulated peers took step 1 as two states)."""
    keys = shards.level_keys(collaboration, at)
    entries: dict[str, Entry] = {}
    failures: list[RemoteError] = []

    async def read(key: str) -> None:
        try:
            merge(entries, await dht.get(key, hot=hot))
        except RemoteError as error:
            failures.append(error)

    async with trio.open_nursery() as nursery:
        for key in keys:
            nursery.start_soon(read, key)
    if failures:
        raise failures[0]
    records = decode_progress(entries, collaboration=collaboration)
    return ProgressRead(entries, records)


async def _probe(dht: DHT, collaboration: str, *, hot: bool) -> list[tuple[int, int]]:
    """(level, records) of one shard of each level above 0, chosen at random."""
    found: list[tuple[int, int]] = []

    async def probe(at_level: int) -> None:
        key = shards.shard_key(collaboration, at_level, dht.rng.randrange(2**at_level))
        with contextlib.suppress(RemoteError):
            entries = await dht.get(key, hot=hot)
            found.append((at_level, len(decode_progress(entries, collaboration=collaboration))))

    async with trio.open_nursery() as nursery:
        for at_level in range(1, shards.MAX_LEVEL + 1):
            nursery.start_soon(probe, at_level)
    return found


class ProgressPublisher:
    def __init__(
        self,
        dht: DHT,
        config: PeerConfig,
        *,
        record: Callable[[], ProgressRecord | None],
        on_read: Callable[[CollaborationView], None],
        interval: float,
        ttl: float,
        longest_read_interval: float,
        on_store_time: Callable[[float], None] = lambda seconds: None,
        on_read_time: Callable[[float], None] = lambda seconds: None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.clock = clock
        self.dht = dht
        self.record = record
        self.on_read = on_read
        self.on_store_time = on_store_time
        self.on_read_time = on_read_time
        self.interval = interval
        self.ttl = ttl
        self.collaboration = config.collaboration.name
        self.quorum = config.averaging.min_group_size
        self.deadline = max(interval, 2 * config.net.rpc_timeout)
        self.me = dht.node.peer_id.to_base58()
        self.size: int | None = None
        """The collaboration's size as our last read showed it: where the shards are."""
        self.longest_read_interval = longest_read_interval
        self.read_interval = interval
        """Seconds between two of our reads (`read_interval`), after the last read."""
        self._next_read = -math.inf
        self._now = trio.Event()
        self._stored = False

    def publish_now(self) -> None:
        """Our record changed in a way others act on: the next exchange starts at once."""
        self._now.set()

    async def read(self) -> None:
        """Read every record now (RemoteError if the DHT cannot be reached)."""
        started = trio.current_time()
        entries, records = read = await read_progress(self.dht, self.collaboration, self.size)
        self.size = read.size
        self.on_read_time(trio.current_time() - started)
        self.read_interval = read_interval(
            received_bytes(entries, records),
            interval=self.interval,
            longest=self.longest_read_interval,
        )
        self._next_read = trio.current_time() + self.read_interval
        self.on_read(CollaborationView(records, self.quorum))

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        try:
            while True:
                await self._exchange()
                with trio.move_on_after(self.interval):
                    await self._now.wait()
                self._now = trio.Event()
        finally:
            if self._stored:
                with (
                    trio.CancelScope(shield=True),
                    trio.move_on_after(1.0),
                    contextlib.suppress(RemoteError),
                ):
                    await self._farewell()

    async def _farewell(self) -> None:
        """Our last record, `leaving`: others stop counting us as a trainer at once, and still
        count the vote and signatures it carries until it expires (`ProgressRecord.leaving`);
        withdrawn where we have no record to leave."""
        record = self.record()
        now = self.clock()
        if record is None:
            await self._store(None, expiration=now + self.ttl + 1)
            return
        last = msgspec.structs.replace(record, leaving=True, updated_at=now)
        await self._store(last, expiration=now + self.ttl)

    def _keys(self) -> list[str]:
        """The shards our record goes to (`shards.write_levels`)."""
        levels = shards.write_levels(self.size or 0)
        return [shards.record_key(self.collaboration, self.me, at) for at in levels]

    async def _store(self, record: ProgressRecord | None, *, expiration: float) -> None:
        """`record` (None: a withdrawal) into each of our shards at once."""
        value = None if record is None else encode_progress(record)
        async with trio.open_nursery() as nursery:
            for key in self._keys():
                nursery.start_soon(
                    functools.partial(
                        self.dht.store, key, self.me, value, expiration=expiration, hot=True
                    )
                )

    async def _exchange(self) -> None:
        record = self.record()
        started, timed, read, skipped = trio.current_time(), record is None, False, 0.0
        try:
            with trio.move_on_after(self.deadline):
                if record is not None:
                    if self.size is None:  # where our record goes depends on what we read
                        await self.read()
                        started, read = trio.current_time(), True
                    # What the windows size is a store with a lookup (a ticket's); a hot store
                    # that skipped it adds our lookups' time (at 300 simulated peers the store
                    # times halved without it, the declare margin with them, and tickets
                    # landed after the close).
                    key = self._keys()[0]
                    skipped = 0.0 if self.dht.looks_up(key) else self.dht.lookup_seconds
                    await self._store(record, expiration=record.updated_at + self.ttl)
                    self._stored = timed = True
                    self.on_store_time(trio.current_time() - started + skipped)
                # Stretched reads wait their turn; at the configured interval every exchange
                # reads, as every publication of ours expects an answer soon.
                due = self.read_interval <= self.interval or trio.current_time() >= self._next_read
                if due and not read:
                    await self.read()
        except RemoteError as error:
            log.debug("progress exchange failed: %s", error)
        if not timed:  # cut short or failed: it took at least this long (testbed, 4 s+)
            self.on_store_time(trio.current_time() - started + skipped)


async def fetch_certified(
    dht: DHT,
    download: Callable[[list[ProgressRecord], int], Awaitable[Snapshot]],
    donors: list[ProgressRecord],
    target: int,
    *,
    view: Callable[[], CollaborationView],
    parse: Callable[[Snapshot], Awaitable[tuple[T, str]]],
    lowest: int,
) -> tuple[Snapshot, T, str]:
    """The catch-up a trainer and the keeper share: fetch `target`'s state from `donors`,
    parse and digest it (`parse`, off the event loop) and take it only if it is at least
    `lowest` and certified (`check_certified`): a donor cannot hand over a state of its own
    making, whatever its record claims. RemoteError otherwise."""
    remember_donors(dht, donors)
    began = view()
    snapshot = await download(donors, target)
    parsed, digest = await parse(snapshot)
    check_certified(began, view(), snapshot.step, digest, lowest=lowest, target=target)
    return snapshot, parsed, digest


def remember_donors(dht: DHT, donors: list[ProgressRecord]) -> None:
    """Dial `donors` at the addresses their records give."""
    for record in donors:
        dht.node.remember_addrs(ID.from_base58(record.peer_id), parse_addrs(record.addrs))


def check_certified(
    began: CollaborationView,
    now: CollaborationView,
    step: int,
    digest: str,
    *,
    lowest: int,
    target: int,
) -> None:
    """RemoteError unless a state of `step` with `digest` is at least `lowest` and certified in
    the view a download began with (`began`) or in the view as it is `now`. Signatures cannot
    be forged, so a step certified once stays certified; the view as it is now may have moved
    past the step (its signers' records name the next one, and signatures of the step before
    leave with them)."""
    if step < lowest:
        raise RemoteError(f"donors sent step {step}, expected {target}")
    if not (began.certified(step, digest) or now.certified(step, digest)):
        consensus = now.consensus(step) or began.consensus(step)
        raise RemoteError(
            f"donors sent step {step} with digest {digest[:12]}, which fewer than "
            f"{now.quorum} peers signed (the collaboration's at that step: "
            f"{consensus[:12] if consensus else 'none'})"
        )
