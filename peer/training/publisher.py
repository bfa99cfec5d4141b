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

The progress key (its shards, past 16 records: `ProgressReader`, `peer.training.shards`) is a
hot DHT key (`DHT.get(hot=True)`: two of its replicas, no lookup; one, with our last read of
it merged in, from the second read on: `DHT.get_many(known=)`), and a
read is due every `read_interval`: the configured interval while the records are small, longer
once reading them all would cost more than `READ_BYTES_PER_SECOND` (at 300 simulated trainers
every trainer read 11 Mbit/s of records, and the busiest replica sent 765 Mbit/s). The
windows and waits that count on a read count on one that old (`Timing.reading`). Our record
then goes out every half read interval (`Timing.publishing`), within a third of its life in any
case, and at once when something others act on changed (`publish_now`: a call, a vote,
holding, downloading); the waits that count on a record's age count on that
(`Timing.stale_record`, `projection_horizon`).
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
from peer.dht.node import CARRIED_READ_REPLICAS, DHT
from peer.dht.records import Entry, live, merge
from peer.errors import RemoteError
from peer.net.host import parse_addrs
from peer.training import shards
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
    decode_progress,
    encode_progress,
)
from peer.training.timing import exchange_deadline, publishing_interval

if TYPE_CHECKING:
    from peer.training.statesync import Snapshot

log = logging.getLogger("peertrain.progress")
T = TypeVar("T")

#: Bytes a second a peer spends reading progress records, at most (half a megabit): with
#: 0.7 KB records from one replica a shard (`CARRIED_READ_REPLICAS`), ~90 trainers are read
#: every second, 1,000 every 10.7 s (records of ~1.1 KB, as simulated: every 15 s, the cap).
#: At 1 Mbit/s, reading records was about half the simulator's time at 1,000 peers; halved,
#: 100 and 300 simulated peers stepped as before and 1,000 ran 1.4x faster (docs/scale.md).
READ_BYTES_PER_SECOND = 64 * 1024


def read_interval(read_bytes: int, *, interval: float, longest: float) -> float:
    """Seconds until the next read after one that received `read_bytes`: `interval` while that
    fits `READ_BYTES_PER_SECOND`, longer in proportion, at most `longest` (beyond it the
    gathering windows could no longer count on a read)."""
    return min(max(interval, read_bytes / READ_BYTES_PER_SECOND), max(interval, longest))


#: A record's bytes counted toward the read budget, at most (ours are ~0.7-1.1 KB): owner-signed
#: records of many identities stretch everyone's reads by at most this much each.
MAX_RECORD_BYTES = 2048


def received_bytes(entries: dict[str, Entry], records: list[ProgressRecord]) -> int:
    """About what a hot read of `records` (decoded from `entries`: owner-signed, valid) took
    from its replicas (`CARRIED_READ_REPLICAS` a shard). Only theirs, each at most
    `MAX_RECORD_BYTES`: junk a replica adds under open subkeys must not stretch our reads (and
    miss the gatherings others call)."""
    values = (entries[r.peer_id].value or b"" for r in records if r.peer_id in entries)
    return CARRIED_READ_REPLICAS * sum(min(len(v), MAX_RECORD_BYTES) for v in values)


class ProgressRead(NamedTuple):
    entries: dict[str, Entry]
    records: list[ProgressRecord]
    """`entries` decoded (`decode_progress`)."""

    @property
    def size(self) -> int:
        """The collaboration's size as this read shows it: where the next read reads."""
        return len(self.records)


#: Seconds between two probes of every level by a reader whose level shows nobody else, or
#: who reads the one key.
PROBE_SECONDS = 30.0


class ProgressReader:
    """Reads every progress record of a collaboration, wherever its shards are
    (`peer.training.shards`), remembering the size its last read showed (`size`).

    A read takes every shard of the level of `size`. Where that is the one key (level 0), or
    shows nobody but us (`me`), or nothing, or before any read, one shard of every level is
    probed, at most every `PROBE_SECONDS` (always on a first read), and the level whose shard
    shows the most is read (`shards.probe_level`): so a joiner is not held by a few records on
    the one key of a small collaboration, nor a peer that was cut off by the level of its own
    record (3 of 300 simulated peers wrote to the one key during the joins and read only each
    other there, for minutes). A reader of the one key that sees others there leaves it only
    for a level whose probed shard holds half a shard's records and whose read shows more than
    the one key did: a few identities ground into one deep shard would otherwise pull members
    of a small collaboration, one probe at a time, to where only they are (found in review),
    or make them read 1,024 keys. A read that finds
    nothing after one that found records raises RemoteError (the last view and size stay): an
    unreachable DHT is no empty collaboration. Entries are taken only from the shard their peer
    id names (`shards.record_key`): one identity writing into every shard would count once per
    shard in a probe. Every shard is read strictly, all of them in one fan-out
    (`DHT.get_many(strict=True)`): a shard no replica of which answered fails the read, since a
    view with a shard missing counts part of the trainers (a first step's election counts
    them)."""

    def __init__(
        self, dht: DHT, collaboration: str, *, me: str | None = None, hot: bool = True
    ) -> None:
        self.dht = dht
        self.collaboration = collaboration
        self.me = me
        self.hot = hot
        self.size: int | None = None
        self._probed_at = -math.inf
        self._known: dict[str, dict[str, Entry]] = {}
        """What the replicas showed our last read of a level, by shard key: the entries of
        the records it decoded (owner-signed, valid), merged into the next read of its keys."""

    async def read(self) -> ProgressRead:
        previous = self.size
        current: ProgressRead | None = None
        if previous is not None:
            read = current = await self._read_level(shards.level(previous))
            recent = trio.current_time() - self._probed_at < PROBE_SECONDS
            spread = shards.level(previous) > 0  # on the one key, a few may see only each other
            if (spread and self._others(read)) or (recent and (read.records or not previous)):
                self.size = read.size
                return read
        self._probed_at = trio.current_time()
        found = await self._probe()
        settled = current if current is not None and self._others(current) else None
        if settled is not None:  # the one key shows others: leave it on evidence only
            found = [(at, n) for at, n in found if at == 0 or n >= shards.SHARD_RECORDS // 2]
        at = shards.probe_level(found)
        if current is not None and current.records and at == shards.level(previous or 0):
            read = current  # the level just read, a moment ago (an empty read is read again)
        else:
            known = self._known
            read = await self._read_level(at)
            if settled is not None and len(read.records) <= len(settled.records):
                read, self._known = settled, known
        if not read.records and previous:
            raise RemoteError("no progress records found where there were: the DHT is unreachable")
        self.size = read.size
        return read

    def _others(self, read: ProgressRead) -> bool:
        return any(r.peer_id != self.me for r in read.records)

    async def _read_level(self, at: int) -> ProgressRead:
        """Every shard of level `at`, at once; RemoteError if one could not be read. A shard
        our last read found records in is read from one replica (`DHT.get_many(known=)`), and
        those records are merged in where still live: a record is never seen older than our
        last read saw it, and one that the replicas asked now left out still counts, for this
        read only (only what the replicas showed is carried on: a replica cannot keep
        anything alive in our reads, nor grow them)."""
        shown: dict[str, dict[str, Entry]] = {}
        keys = shards.level_keys(self.collaboration, at)
        shard_of = {key: (at, index) for index, key in enumerate(keys)}
        for key, found in (await self._get(shard_of, known=self._known)).items():
            if isinstance(found, RemoteError):
                raise found
            shown[key] = found
        entries: dict[str, Entry] = {}
        now = self.dht.clock()
        for key in keys:
            merge(entries, shown[key])
            merge(entries, live(self._known.get(key, {}), now=now))
        records = decode_progress(entries, collaboration=self.collaboration)
        ids = {r.peer_id for r in records}
        if ids:  # an empty read (an unreachable DHT: `read`) keeps the last one's
            self._known = {
                key: {sub: e for sub, e in found.items() if sub in ids}
                for key, found in shown.items()
            }
        return ProgressRead(entries, records)

    async def _get(
        self,
        shard_of: dict[str, tuple[int, int]],
        *,
        known: dict[str, dict[str, Entry]] | None = None,
    ) -> dict[str, dict[str, Entry] | RemoteError]:
        """Shard keys (key -> its level and index) read at once: each one's entries under the
        subkeys whose shard it is, or the RemoteError its read met."""
        if not self.hot:
            known = None
        read = await self.dht.get_many(list(shard_of), hot=self.hot, strict=True, known=known)
        return {
            key: found if isinstance(found, RemoteError) else shards.of_shard(found, *shard_of[key])
            for key, found in read.items()
        }

    async def _probe(self) -> list[tuple[int, int]]:
        """(level, records) of one shard of every level, chosen at random."""
        drawn = [(at, self.dht.rng.randrange(2**at)) for at in range(shards.MAX_LEVEL + 1)]
        shard_of = {shards.shard_key(self.collaboration, *shard): shard for shard in drawn}
        return [
            (shard_of[key][0], len(decode_progress(entries, collaboration=self.collaboration)))
            for key, entries in (await self._get(shard_of)).items()
            if not isinstance(entries, RemoteError)
        ]


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
        self.deadline = exchange_deadline(interval, config.net.rpc_timeout)
        self.me = dht.node.peer_id.to_base58()
        self.reader = ProgressReader(dht, self.collaboration, me=self.me)
        self._written: dict[str, float] = {}
        """The shards our record went to -> until when it lives there (our farewell's)."""
        self.longest_read_interval = longest_read_interval
        self.read_interval = interval
        """Seconds between two of our reads (`read_interval`), after the last read."""
        self._next_read = -math.inf
        self._next_store = -math.inf
        self._now = trio.Event()
        self._stored = False

    def publish_now(self) -> None:
        """Our record changed in a way others act on: the next exchange starts at once."""
        self._now.set()

    async def read(self) -> None:
        """Read every record now (RemoteError if the DHT cannot be reached)."""
        started = trio.current_time()
        entries, records = await self.reader.read()
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
            asked = True
            while True:
                await self._exchange(asked)
                with trio.move_on_after(self.interval):
                    await self._now.wait()
                asked, self._now = self._now.is_set(), trio.Event()
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
            await self._store(None, expiration=now + self.ttl + 1, everywhere=True)
            return
        last = msgspec.structs.replace(record, leaving=True, updated_at=now)
        await self._store(last, expiration=now + self.ttl, everywhere=True)

    def _keys(self) -> list[str]:
        """The shards our record goes to (`shards.write_levels`)."""
        levels = shards.write_levels(self.reader.size or 0)
        return [shards.record_key(self.collaboration, self.me, at) for at in levels]

    async def _store(
        self, record: ProgressRecord | None, *, expiration: float, everywhere: bool = False
    ) -> None:
        """`record` (None: a withdrawal) into each of our shards at once; `everywhere`: also
        into those of other levels it still lives in (a farewell: readers of a level we left
        would count us until it expired)."""
        value = None if record is None else encode_progress(record)
        now = self.clock()
        self._written = {k: until for k, until in self._written.items() if until > now}
        keys = set(self._keys()) | (set(self._written) if everywhere else set())
        async with trio.open_nursery() as nursery:
            for key in sorted(keys):
                self._written[key] = max(self._written.get(key, 0.0), expiration)
                nursery.start_soon(
                    functools.partial(
                        self.dht.store, key, self.me, value, expiration=expiration, hot=True
                    )
                )

    async def _exchange(self, asked: bool) -> None:
        """Store our record where one is due (`asked`: at once) and read where a read is."""
        record = self.record()
        now = trio.current_time()
        store_due = asked or now >= self._next_store
        started, timed, read, skipped = now, record is None or not store_due, False, 0.0
        try:
            with trio.move_on_after(self.deadline):
                if record is not None and store_due:
                    if self.reader.size is None:  # where our record goes depends on a read
                        await self.read()
                        started, read = trio.current_time(), True
                    # What the windows size is a store with a lookup (a ticket's); a hot store
                    # that skipped it adds our lookups' time (at 300 simulated peers the store
                    # times halved without it, the declare margin with them, and tickets
                    # landed after the close).
                    key = self._keys()[0]
                    skipped = 0.0 if self.dht.looks_up(key) else self.dht.lookup_seconds
                    # Within a third of its life, whatever the reads: the keeper's record
                    # lives 3 s (review: absent a third of the time at 1,000 records).
                    self._next_store = started + min(
                        publishing_interval(self.interval, self.read_interval), self.ttl / 3
                    )
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
