"""The progress exchange at the scale of hundreds of trainers: reads of the records are
stretched to `READ_BYTES_PER_SECOND` while our own record still goes out every interval, and
every wait that counts on a read counts on one that old (`Timing.reading`)."""

from __future__ import annotations

import random
import time
from collections import Counter
from types import SimpleNamespace

import msgspec
import pytest
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.records import Entry
from peer.errors import RemoteError
from peer.training import shards
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
    decode_progress,
    encode_progress,
)
from peer.training.publisher import (
    MAX_RECORD_BYTES,
    PROBE_SECONDS,
    READ_BYTES_PER_SECOND,
    ProgressPublisher,
    ProgressReader,
    read_interval,
    received_bytes,
)
from peer.training.timing import SLOW_BATCH, Timing
from tests.test_progress import rec

RECORD_BYTES = 700  # a progress record with its signatures


def progress_entries(count: int, rng: random.Random | None = None) -> dict[str, Entry]:
    """`count` peers' records of about `RECORD_BYTES` each, under their own subkeys; the
    peers' keys drawn from `rng` where given (the shards their records fall in then too)."""
    entries = {}
    for _ in range(count):
        seed = None if rng is None else rng.randbytes(32)
        peer_id = ID.from_pubkey(create_new_key_pair(seed).public_key).to_base58()
        record = ProgressRecord(
            peer_id=peer_id, role="trainer", addrs=["/ip4/203.0.113.9/tcp/4001" * 6],
            step=3, digest="d" * 64, samples=0, samples_per_second=1.0, updated_at=1.0,
            task="t" * 200, fingerprint="f" * 64,
        )  # fmt: skip
        entries[peer_id] = Entry(encode_progress(record), 2e9)
    return entries


async def get_each(
    dht: CountingDht | ShardedDht,
    keys: list[str],
    *,
    hot: bool = False,
    strict: bool = False,
    known: dict[str, dict[str, Entry]] | None = None,
) -> dict[str, dict[str, Entry] | RemoteError]:
    """`DHT.get_many` of a fake: its `get` of each key in turn (`known`, merged in by the real
    one, is noted in `dht.known` where the fake has one: every read of a fake is whole)."""
    noted = getattr(dht, "known", None)
    if noted is not None:
        noted.append(known)
    found: dict[str, dict[str, Entry] | RemoteError] = {}
    for key in keys:
        try:
            found[key] = await dht.get(key, hot=hot, strict=strict)
        except RemoteError as error:
            found[key] = error
    return found


class CountingDht:
    """The DHT as the publisher sees it: `records` records of about a real one's size, each in
    its shard at every level (`peer.training.shards`), and `junk` values of 64 KiB under open
    subkeys in every shard (a lying replica's)."""

    def __init__(self, records: int, junk: int = 0) -> None:
        self.node = SimpleNamespace(peer_id=SimpleNamespace(to_base58=lambda: "me"))
        self.rng = random.Random(0)
        self.entries = progress_entries(records)
        self.junk = {f"junk-{i}": Entry(b"x" * 65536, 2e9) for i in range(junk)}
        self.stores: Counter[str] = Counter()
        self.gets = 0
        self.clock = time.time
        self.known: list[dict[str, dict[str, Entry]] | None] = []
        self.hot: set[bool] = set()
        self.lookup_seconds = 0.5
        self.cached = True  # a hot store skips its lookup

    def looks_up(self, key: str) -> bool:
        return not self.cached

    async def store(self, key, subkey, value, *, expiration, hot=False) -> int:
        self.stores[key] += 1
        self.last = value
        self.hot.add(hot)
        await trio.sleep(0.1 if self.cached else 0.6)
        return 1

    async def withdraw(self, key, subkey, *, expiration, hot=False) -> int:
        return 1

    async def get(self, key, *, hot=False, strict=False) -> dict[str, Entry]:
        self.gets += 1
        self.hot.add(hot)
        *_, level, index = ["0", "0", *key.split("/")[2:]]
        shard = {
            peer_id: entry
            for peer_id, entry in self.entries.items()
            if shards.shard_index(peer_id, int(level)) == int(index)
        }
        return shard | self.junk

    get_many = get_each


def test_reads_are_stretched_to_the_byte_budget_and_capped():
    small = read_interval(30 * RECORD_BYTES, interval=1.0, longest=15.0)
    assert small == 1.0
    thousand = read_interval(1000 * RECORD_BYTES, interval=1.0, longest=15.0)  # one replica's
    assert thousand == pytest.approx(1000 * RECORD_BYTES / READ_BYTES_PER_SECOND)
    assert 10 < thousand < 11
    assert read_interval(10**9, interval=1.0, longest=15.0) == 15.0
    assert read_interval(10**9, interval=20.0, longest=15.0) == 20.0  # never below the interval


def test_a_record_counts_toward_the_read_budget_at_most_2_kib():
    """Owner-signed records of many identities stretch everyone's reads: each by at most
    `MAX_RECORD_BYTES`, twice a record of ours, whatever it weighs (4 KB is the most a record
    may be)."""
    entries = progress_entries(3)
    records = decode_progress(entries, collaboration="default")
    ours = received_bytes(entries, records)
    assert 3 * 600 < ours < 3 * MAX_RECORD_BYTES / 2
    heavy = {peer_id: Entry(b"x" * 4096, e.expiration) for peer_id, e in entries.items()}
    assert received_bytes(heavy, records) == 3 * MAX_RECORD_BYTES == 3 * 2048


def test_a_thousand_trainers_records_are_read_every_half_window_and_a_call_still_fits_one():
    """1,000 trainers' records, as simulated (~1.1 KB each with their votes and signatures),
    are read at the cap, half the widest gathering window: the budget asks ~16.7 s. (At a
    quarter of the window, 7.5 s, and 1 Mbit/s, every simulated read of 1,000 peers took
    ~140 KiB/s, and reads were about half the simulator's time.) A call made that late still
    leaves the others a store, a read and a slow micro-batch inside the widest window."""
    timing = Timing(
        gather_window=2.0, progress_interval=1.0, solo_after=10.0, presence_ttl=30.0,
        download_timeout=20.0, rpc_timeout=5.0,
    )  # fmt: skip
    cap = timing.longest_read_interval
    every = read_interval(1000 * 1100, interval=1.0, longest=cap)
    assert every == cap == timing.max_window / 2
    assert 1000 * 1100 / every < 1.25 * READ_BYTES_PER_SECOND  # the cap binds, a little
    stretched = timing.reading_every(every)
    store = read = batch = 1.0
    needed = store + read + every + SLOW_BATCH * batch
    assert needed < stretched.window(store, batch, read) < timing.max_window


@pytest.mark.parametrize(
    ("records", "junk", "reads", "stored"),
    [(30, 0, (50, 61), (50, 61)), (1000, 0, (8, 13), (12, 22)), (30, 100, (50, 61), (50, 61))],
)
async def test_a_large_collaboration_is_read_less_often_and_our_record_goes_out_twice_a_read(
    autojump_clock, records: int, junk: int, reads: tuple[int, int], stored: tuple[int, int]
):
    """(A replica's junk under open subkeys, 6 MiB a read, stretches nothing: were it
    counted, its readers would read every 7.5 s and miss the others' 2 s gatherings.)"""
    dht = CountingDht(records, junk)
    seen: list[CollaborationView] = []
    publisher = ProgressPublisher(
        dht,
        PeerConfig(),
        record=lambda: rec(0),
        on_read=seen.append,
        interval=1.0,
        longest_read_interval=7.5,
        ttl=30.0,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(59.5)
        nursery.cancel_scope.cancel()
    # The last store is our farewell (`ProgressRecord.leaving`): our vote stays, we go.
    assert msgspec.msgpack.decode(dht.last, type=ProgressRecord).leaving
    # Our record goes to each shard of our levels (`shards.write_levels`) every second, or
    # at the first exchange past half a read interval where reads are stretched
    # (`Timing.publishing`: 2.7 s at 1,000; exchanges are a second and a store apart).
    keys = [shards.record_key("default", "me", at) for at in shards.write_levels(records)]
    assert set(dht.stores) == set(keys)
    stores = dht.stores[keys[0]] - 1
    assert all(count == stores + 1 for count in dht.stores.values())
    assert stored[0] <= stores <= stored[1]  # each store takes 0.1 s
    assert reads[0] <= len(seen) <= reads[1], len(seen)
    assert stores - len(seen) <= 1 or records > 180  # the last read was cut short
    # Every view shows every record, read from every shard of the level of their number, once
    # the first read (the one key, then a probe of one shard of every level) showed it.
    assert all(len(view.records) == records for view in seen)
    # (The first read's level is the probe's: any.)
    probe, per_read, first = 1 + shards.MAX_LEVEL, 2 ** shards.level(records), 2**shards.MAX_LEVEL
    later = probe + (len(seen) - 1) * per_read
    assert later + 1 <= dht.gets <= later + first + per_read
    assert dht.hot == {True}


def stretched_publisher(dht: CountingDht, *, ttl: float) -> ProgressPublisher:
    """A publisher of a record living `ttl` seconds, among records its reads stretch."""
    return ProgressPublisher(
        dht,
        PeerConfig(),
        record=lambda: rec(0),
        on_read=lambda view: None,
        interval=1.0,
        longest_read_interval=7.5,
        ttl=ttl,
    )


async def test_a_record_that_changed_goes_out_at_once_however_stretched_the_stores(
    autojump_clock,
):
    dht = CountingDht(1000, 0)
    publisher = stretched_publisher(dht, ttl=30.0)
    key = shards.record_key("default", "me", shards.write_levels(1000)[0])
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(10.0)
        before = dht.stores[key]
        while dht.stores[key] == before:  # a routine store...
            await trio.sleep(0.01)
        await trio.sleep(1.5)  # ...the exchanges after it store nothing (due in ~2.7 s)...
        assert dht.stores[key] == before + 1
        publisher.publish_now()  # ...but a call, a vote or a step goes out at once
        await trio.sleep(0.2)
        assert dht.stores[key] == before + 2
        nursery.cancel_scope.cancel()


async def test_a_short_lived_record_goes_out_within_a_third_of_its_life(autojump_clock):
    """The keeper's record lives 3 s: stores stretched to half a read interval (~2.7 s at
    1,000 records, landing up to ~4.6 s apart) left it absent a third of the time (review)."""
    dht = CountingDht(1000, 0)
    publisher = stretched_publisher(dht, ttl=3.0)
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(59.5)
        nursery.cancel_scope.cancel()
    key = shards.record_key("default", "me", shards.write_levels(1000)[0])
    assert dht.stores[key] >= 45  # every exchange, as at the configured interval


def test_what_counts_on_a_read_counts_on_one_as_old_as_the_reads_are_apart():
    timing = Timing(
        gather_window=2.0, progress_interval=1.0, solo_after=10.0, presence_ttl=30.0,
        download_timeout=20.0, rpc_timeout=5.0,
    )  # fmt: skip
    stretched = timing.reading_every(5.6)
    assert timing.reading == 1.0 and stretched.reading == 5.6
    assert timing.reading_every(0.2).reading == 1.0
    # A record published every second, read every 5.6 s, is up to ~6.6 s old and not silent;
    # published every half read interval (2.8 s), up to ~8.4 s.
    assert timing.publishing == 1.0 and stretched.publishing == pytest.approx(2.8)
    assert timing.stale_record == 3.0 and stretched.stale_record >= 5.6 + 2.8
    assert stretched.projection_horizon >= 5.6 + 2.8
    # A caller's window leaves the others a read to see its call.
    assert stretched.window(0.5) - timing.window(0.5) == pytest.approx(4.6)
    assert stretched.latest_call(0.0) - timing.latest_call(0.0) == pytest.approx(4.6)
    assert stretched.longest_read_interval == timing.longest_read_interval == 30.0 / 2


@pytest.mark.parametrize("cached", [True, False])
async def test_a_hot_store_that_skipped_its_lookup_reports_the_time_of_one_with_it(
    autojump_clock, cached: bool
):
    """The gathering windows are sized for tickets, whose stores look up their replicas: a
    progress store that did not must not shrink them (at 300 simulated peers tickets then
    landed after the close)."""
    dht = CountingDht(10)
    dht.cached = cached
    times: list[float] = []
    publisher = ProgressPublisher(
        dht,
        PeerConfig(),
        record=lambda: rec(0),
        on_read=lambda view: None,
        interval=1.0,
        longest_read_interval=7.5,
        ttl=30.0,
        on_store_time=times.append,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(publisher.run)
        await trio.sleep(5)
        nursery.cancel_scope.cancel()
    assert times and all(t == pytest.approx(0.6) for t in times)


class ShardedDht:
    """A DHT whose progress records lie where their writers put them: at the levels of the
    number of records each writer read (`shards.write_levels`)."""

    def __init__(self, *writers: tuple[int, int]) -> None:
        """`writers`: (how many, the count they read). Seeded: which shard each record falls
        in, and which shard a probe draws, are the same at every run (a probe is a sample, and
        with identities drawn anew a level-4 shard of a few records lost to a level-6 shard of
        one about once in 60 runs)."""
        self.rng = random.Random(0)
        self.keys: dict[str, dict[str, Entry]] = {}
        self.gets: list[str] = []
        self.clock = time.time
        self.known: list[dict[str, dict[str, Entry]] | None] = []
        self.failing: set[str] = set()
        for count, read in writers:
            for peer_id, entry in progress_entries(count, self.rng).items():
                for at in shards.write_levels(read):
                    self.put(shards.record_key("default", peer_id, at), peer_id, entry)

    def put(self, key: str, peer_id: str, entry: Entry) -> None:
        self.keys.setdefault(key, {})[peer_id] = entry

    async def get(self, key, *, hot=False, strict=False) -> dict[str, Entry]:
        self.gets.append(key)
        if key in self.failing:
            raise RemoteError(f"no replica of {key} answered")
        return dict(self.keys.get(key, {}))

    get_many = get_each


def reader(dht: ShardedDht, size: int | None = None, me: str | None = None) -> ProgressReader:
    progress = ProgressReader(dht, "default", me=me)  # type: ignore[arg-type]
    progress.size = size
    return progress


async def test_a_reader_carries_what_the_replicas_showed_its_last_read_for_one_read():
    """Each full read of a level hands the DHT the records its last read of that level found
    (`DHT.get_many(known=)`: one replica a shard) and counts them where the replicas asked now
    leave them out, for that read only; what it carries is what the replicas showed, of
    records it decoded (open subkeys' junk is never carried). A failed read keeps it."""
    dht = ShardedDht((200, 200))
    progress = reader(dht, 200)
    keys = shards.level_keys("default", 4)
    junk = next(
        f"junk-{i}" for i in range(1000) if shards.record_key("default", f"junk-{i}", 4) == keys[0]
    )
    dht.put(keys[0], junk, Entry(b"x" * 1000, 2e9))
    first = await progress.read()
    assert dht.known == [{}]  # level 4 at once, nothing read of it before
    assert junk in first.entries and len(first.records) == 200
    await progress.read()
    assert list(dht.known[-1]) == keys
    carried = {p for key in keys for p in dht.known[-1][key]}
    assert carried == {r.peer_id for r in first.records}  # no junk
    gone = first.records[7].peer_id
    del dht.keys[shards.record_key("default", gone, 4)][gone]  # a replica leaves it out
    assert gone in {r.peer_id for r in (await progress.read()).records}  # carried, once
    assert gone not in {r.peer_id for r in (await progress.read()).records}
    dht.failing.add(keys[3])
    with pytest.raises(RemoteError):
        await progress.read()
    dht.failing.clear()
    await progress.read()
    assert len({p for key in keys for p in dht.known[-1][key]}) == 199


@pytest.mark.parametrize("size", [None, 0, 20, 200, 5000])
async def test_a_reader_finds_every_record_whatever_size_it_last_read(size: int | None):
    """200 writers that read 200 records each wrote to the 16 shards of level 4 alone. A reader
    that has read nothing, or whose last read showed another size (an empty level: 0, 20,
    5000), probes one shard of every level, then reads all of level 4."""
    dht = ShardedDht((200, 200))
    progress = reader(dht, size)
    read = await progress.read()
    assert len(read.records) == read.size == progress.size == 200
    assert set(shards.level_keys("default", 4)) <= set(dht.gets)
    dht.gets.clear()
    await progress.read()
    assert sorted(dht.gets) == sorted(shards.level_keys("default", 4))  # nothing else


async def test_a_reader_of_a_level_few_writers_wrote_reads_where_the_rest_are_next():
    """10 writers write level 6 (they read 1,000: a lie or a collaboration that shrank), 200
    write level 4. A reader of level 6 finds the 10, and reads the one key next: empty, so it
    probes and finds the 200 (the 10 are never all it sees for long)."""
    progress = reader(ShardedDht((10, 1000), (200, 200)), 1000)
    assert (await progress.read()).size == 10
    assert (await progress.read()).size == 200


async def test_a_joiner_is_not_held_by_a_record_on_the_one_key():
    """(Found in review.) One record stored under the one key of a small collaboration: a joiner
    that read it and stopped there saw one peer for ever, wrote its own record there, and held
    the next joiners too. A joiner probes every level first."""
    dht = ShardedDht((200, 200))
    stray = next(iter(progress_entries(1).items()))
    dht.put(shards.shard_key("default", 0, 0), *stray)
    assert (await reader(dht).read()).size == 200


async def test_a_record_counts_only_in_the_shard_its_peer_id_names():
    """(Found in review.) Four identities writing into all 64 shards of level 6 counted 64
    times each in a probe (256 against the 192 a level-4 shard of 200 shows), and a joiner read
    level 6: four peers."""
    dht = ShardedDht((200, 200))
    for peer_id, entry in progress_entries(4).items():
        for key in shards.level_keys("default", 6):
            dht.put(key, peer_id, entry)
    assert (await reader(dht).read()).size == 200


async def test_a_reader_cut_off_keeps_its_size_and_one_alone_probes_again(autojump_clock):
    """An unreachable DHT is no empty collaboration: a read that finds nothing where records
    were raises (the last view and size stay). And a peer that sees only its own record (it
    wrote it where a partition left it) probes every level again within `PROBE_SECONDS`."""
    dht = ShardedDht((200, 200))
    progress = reader(dht, 200)
    keys, dht.keys = dht.keys, {}
    with pytest.raises(RemoteError, match="unreachable"):
        await progress.read()
    assert progress.size == 200
    me, entry = next(iter(progress_entries(1).items()))
    alone = reader(ShardedDht(), None, me=me)
    alone.dht.put(shards.shard_key("default", 0, 0), me, entry)  # type: ignore[attr-defined]
    assert (await alone.read()).size == 1
    alone.dht.keys |= keys  # type: ignore[attr-defined]
    assert (await alone.read()).size == 1  # probed a moment ago
    await trio.sleep(PROBE_SECONDS)
    assert (await alone.read()).size == 200


async def test_peers_that_see_only_each_other_on_the_one_key_probe_for_the_rest(
    autojump_clock,
):
    """(Simulated at 300 peers.) Three peers wrote their records to the one key during the
    joins and read each other there for minutes: a reader probed only where its level showed
    nobody else. A reader of the one key probes every level, at most every `PROBE_SECONDS`."""
    three = progress_entries(3, random.Random(1))
    dht = ShardedDht()
    for peer_id, entry in three.items():
        dht.put(shards.shard_key("default", 0, 0), peer_id, entry)
    progress = reader(dht, None, me=next(iter(three)))
    assert (await progress.read()).size == 3  # a probe: nobody else anywhere
    dht.keys |= ShardedDht((200, 200)).keys  # the rest wrote where 200 readers write
    assert (await progress.read()).size == 3  # probed a moment ago
    await trio.sleep(PROBE_SECONDS)
    assert (await progress.read()).size == 200


def ground_into(dht: ShardedDht, at: int, count: int) -> dict[str, Entry]:
    """`count` records whose peer ids fall in the shard of level `at` that the next probe of
    `dht` draws (`ProgressReader._probe` draws one shard a level, in order, from `dht.rng`)."""
    draws = random.Random()
    draws.setstate(dht.rng.getstate())
    index = [draws.randrange(2**level) for level in range(shards.MAX_LEVEL + 1)][at]
    found: dict[str, Entry] = {}
    rng = random.Random(7)
    while len(found) < count:
        found |= {
            peer_id: entry
            for peer_id, entry in progress_entries(1, rng).items()
            if shards.shard_index(peer_id, at) == index
        }
    for peer_id, entry in found.items():
        dht.put(shards.record_key("default", peer_id, at), peer_id, entry)
    return found


@pytest.mark.parametrize(("at", "count"), [(4, 9), (6, 1)])
async def test_a_few_identities_in_a_deep_shard_do_not_pull_members_off_the_one_key(
    autojump_clock, at: int, count: int
):
    """(Found in review.) Members of a small collaboration probe every level every
    `PROBE_SECONDS`: 9 identities ground into the level-4 shard a probe draws project 144
    records, and pulled a member of 10 to a level where only they are; one at level 6 made it
    read all 64 shards. A member leaves the one key only for a level whose probed shard holds
    half a shard's records and whose read shows more than the one key."""
    ten = progress_entries(10, random.Random(1))
    dht = ShardedDht()
    for peer_id, entry in ten.items():
        dht.put(shards.shard_key("default", 0, 0), peer_id, entry)
    progress = reader(dht, None, me=next(iter(ten)))
    assert (await progress.read()).size == 10  # a member probed when it joined
    await trio.sleep(PROBE_SECONDS)
    ground_into(dht, at, count)
    dht.gets.clear()
    read = await progress.read()
    assert {r.peer_id for r in read.records} == set(ten) and progress.size == 10
    level = set(shards.level_keys("default", at))
    deep = [key for key in dht.gets if key in level]
    assert len(deep) == 1 + (2**at if count >= shards.SHARD_RECORDS // 2 else 0)  # the probe


async def test_a_probe_that_points_at_the_level_just_read_reads_it_once():
    """A peer alone at its level probes every level; where the probe points back at the level
    it just read, that read stands (it read the level twice, every `PROBE_SECONDS`)."""
    me, entry = next(iter(progress_entries(1).items()))
    alone = reader(ShardedDht(), 1, me=me)
    alone.dht.put(shards.shard_key("default", 0, 0), me, entry)  # type: ignore[attr-defined]
    assert (await alone.read()).size == 1
    # The one key, then one shard of every level (the one key among them), and no more.
    assert len(alone.dht.gets) == 1 + (1 + shards.MAX_LEVEL)  # type: ignore[attr-defined]


async def test_an_empty_read_of_a_level_is_read_again_when_the_probe_points_back_at_it():
    """(Found in review.) The probe's level was the one just read, and that read came back
    empty: reusing it raised "unreachable" where a second read finds everyone."""

    class BlankFirst(ShardedDht):
        blank = 2**4  # the first read of level 4 finds nothing

        async def get(self, key, *, hot=False, strict=False) -> dict[str, Entry]:
            entries = await super().get(key, hot=hot, strict=strict)
            if self.blank:
                self.blank -= 1
                return {}
            return entries

    assert (await reader(BlankFirst((200, 200)), 200).read()).size == 200


async def test_a_small_collaboration_is_read_from_its_one_key_after_the_first_read():
    dht = ShardedDht((10, 10))
    progress = reader(dht)
    assert len((await progress.read()).records) == 10  # a probe of every level, then the key
    dht.gets.clear()
    assert len((await progress.read()).records) == 10
    assert dht.gets == [shards.shard_key("default", 0, 0)]


async def test_a_read_with_a_shard_that_could_not_be_read_is_no_read():
    """A view with a shard left out would count a fraction of the trainers, and a first step's
    election is won by more than half of the trainers in view: two such views each let their
    own minority certify step 1 (100 simulated peers took it as two states)."""
    dht = ShardedDht((200, 200))
    dht.failing.add(shards.level_keys("default", 4)[5])
    with pytest.raises(RemoteError, match="no replica"):
        await reader(dht, 200).read()
