"""State download: the pure plan (`peer.training.chunks`) synchronously, then real donors.

Network tests run in-process libp2p nodes on loopback, one `StateDonor` each. Misbehaving donors
get their faults through `StateDonor(wrap_stream=...)`: a data connection that corrupts what it
sends, or that stops after a few chunks while the test kills its donor.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import msgspec
import pytest
import trio
from blake3 import blake3

from peer.errors import RemoteError
from peer.net.host import Node, open_node
from peer.net.tls import TlsStream, certificate_peer_id, pinned_client_context
from peer.training.chunks import (
    MAX_CHUNK_BYTES,
    MAX_MEMBERS,
    MAX_PEER_ID_CHARS,
    MIN_CHUNK_BYTES,
    SERVICE,
    BadManifest,
    ChunkState,
    DonorState,
    DownloadPlan,
    Manifest,
    ManifestRequest,
    Release,
    Released,
    check_manifest,
    choose_manifest,
    chunk_ends,
    chunk_span,
    donor_chunk_bytes,
    fixed_ends,
    servable_chunks,
)
from peer.training.statesync import (
    REPLY,
    Snapshot,
    SnapshotSource,
    StateDonor,
    StateDownload,
    StateDownloadFailed,
    held,
)
from peer.training.statesync import donor as donor_module
from peer.training.statesync import download as download_module
from peer.training.statesync.donor import fitting
from peer.training.statesync.download import YIELD_BYTES, receive_into
from peer.training.statesync.wire import KIND_ERROR, MAGIC, REQUEST
from tests.helpers import LOOPBACK, ForwardingStream, new_identity, nodes

KIB = 1024
CHUNK = 256 * KIB
BLOB_BYTES = 8 * 1024 * KIB + 12_345  # ~8 MB, a short last chunk
TIMEOUT = 30


# ---------------------------------------------------------------------------- pure: plan


def manifest(
    hashes: list[bytes],
    *,
    step: int = 7,
    chunk_bytes: int = MIN_CHUNK_BYTES,
    total_bytes: int | None = None,
) -> Manifest:
    if total_bytes is None:
        total_bytes = len(hashes) * chunk_bytes
    return Manifest(
        step=step,
        total_bytes=total_bytes,
        ends=fixed_ends(total_bytes, chunk_bytes),
        hashes=hashes,
        data_host="127.0.0.1",
        data_port=1,
        ticket=bytes(32),
        data_cert=b"",
    )


TWO = 2 * MIN_CHUNK_BYTES  # two chunks' bytes


def ends(given: Manifest, new: list[int]) -> Manifest:
    return msgspec.structs.replace(given, ends=new)


def digests(count: int, *, differ: tuple[int, ...] = (), salt: int = 1) -> list[bytes]:
    return [bytes([i % 256, salt if i in differ else 0]) + bytes(30) for i in range(count)]


def test_fixed_chunks_cover_the_state_with_a_short_last_chunk():
    assert fixed_ends(0, 10) == []
    assert fixed_ends(30, 10) == [10, 20, 30]
    assert fixed_ends(31, 10) == [10, 20, 30, 31]
    assert manifest(digests(4), chunk_bytes=10, total_bytes=31).chunk(3) == (30, 31)


def test_chunks_follow_the_layout_large_tensors_cut_from_their_own_start():
    # A header of 100 bytes, a 10-byte tensor, a 90-byte one, three small ones of 30, 30 and
    # 50, then one of 25. Pieces of 40: every part is large (10 bytes or more).
    parts = [100, 110, 200, 230, 260, 310, 335]
    assert chunk_ends(335, parts, 40) == [40, 80, 100, 110, 150, 190, 200, 230, 260, 300, 310, 335]
    # Pieces of 200: parts under 50 bytes share chunks (the two of 30), large ones start theirs.
    assert chunk_ends(335, parts, 200) == [100, 110, 200, 260, 310, 335]
    # Pieces of 1000: all small, one chunk.
    assert chunk_ends(335, parts, 1000) == [335]
    # Small parts share a chunk up to a piece: six of 9 bytes in pieces of 40.
    assert chunk_ends(54, [9, 18, 27, 36, 45, 54], 40) == [36, 54]
    # Empty tensors (parts ending where the one before did) change nothing.
    assert chunk_ends(335, [100, 100, *parts[1:]], 40) == chunk_ends(335, parts, 40)
    # Parts that do not tile the blob: fixed chunks.
    assert chunk_ends(335, [100, 90, 335], 200) == [200, 335]
    assert chunk_ends(335, [100, 300], 200) == [200, 335]


def test_donor_chunk_size_is_clamped_and_grows_to_fit_one_manifest():
    assert donor_chunk_bytes(10**6, 1) == MIN_CHUNK_BYTES
    assert donor_chunk_bytes(10**6, 1 << 40) == MAX_CHUNK_BYTES
    assert donor_chunk_bytes(10**6, 4 << 20) == 4 << 20
    # 1 GB in at most 100 chunks: 10 MB chunks
    assert donor_chunk_bytes(10**9, 4 << 20, max_chunks=100) == 10**7


def test_a_well_formed_manifest_passes():
    good = manifest(digests(3), total_bytes=3 * MIN_CHUNK_BYTES - 5)
    check_manifest(good, min_step=7, max_total_bytes=1 << 30)


@pytest.mark.parametrize(
    ("bad", "complaint"),
    [
        (manifest(digests(3), step=6), "step 6, but step >= 7"),
        (manifest(digests(2), total_bytes=3 * MIN_CHUNK_BYTES), "2 chunk hashes for 3 chunks"),
        (manifest(digests(4), total_bytes=3 * MIN_CHUNK_BYTES), "4 chunk hashes for 3 chunks"),
        (manifest([], total_bytes=1), "0 chunk hashes for 1 chunks"),
        (ends(manifest(digests(3), total_bytes=TWO), [10, 5, TWO]), "chunk 1 ends at 5 after 10"),
        (ends(manifest(digests(2)), [TWO, TWO]), f"chunk 1 ends at {TWO} after {TWO}"),
        (ends(manifest(digests(2)), [5, TWO - 1]), "do not end at the state's"),
        (manifest(digests(40)), "state of 2621440 bytes, above the 1048576"),
    ],
)
def test_malformed_manifests_are_rejected_with_the_value(bad: Manifest, complaint: str):
    with pytest.raises(BadManifest, match=complaint):
        check_manifest(bad, min_step=7, max_total_bytes=1 << 20)


def test_a_chunk_over_the_largest_size_is_rejected():
    with pytest.raises(BadManifest, match="chunk 0 ends at 67108865 after 0"):
        check_manifest(
            manifest(digests(1), chunk_bytes=MAX_CHUNK_BYTES + 1),
            min_step=7,
            max_total_bytes=1 << 30,
        )


def test_the_schema_rejects_wrong_hash_and_ticket_lengths_and_ports():
    good = msgspec.msgpack.encode(manifest(digests(2)))
    msgspec.msgpack.decode(good, type=Manifest)
    for field, value in [
        ("hashes", [bytes(31)]),
        ("ticket", bytes(8)),
        ("data_port", 0),
        ("step", -1),
        ("data_host", ""),
        ("members", ["x" * (MAX_PEER_ID_CHARS + 1)]),
        ("members", ["p"] * (MAX_MEMBERS + 1)),
    ]:
        raw = msgspec.structs.asdict(manifest(digests(2)))
        raw[field] = value
        with pytest.raises(msgspec.ValidationError, match=field):
            msgspec.msgpack.decode(msgspec.msgpack.encode(raw), type=Manifest)


def test_a_donor_leaves_out_a_member_list_a_manifest_cannot_carry():
    """Review: a Moshpit plan can hold up to 8,192 peers, a manifest's list 4,096; one too
    long failed every download of the state. Now the list is left out (the downloader loses
    only its first step), as is one over the message's room."""
    ids = [f"12D3KooW{i:044d}" for i in range(MAX_MEMBERS + 1)]
    assert fitting(ids[:MAX_MEMBERS], room=1 << 20) == ids[:MAX_MEMBERS]
    assert fitting(ids, room=1 << 20) == []
    assert fitting(ids[:10], room=10 * 55) == ids[:10]
    assert fitting(ids[:10], room=10 * 55 - 1) == []
    assert fitting(["x" * (MAX_PEER_ID_CHARS + 1)], room=1 << 20) == []
    full = msgspec.structs.replace(
        manifest(digests(2)), members=fitting(ids[:MAX_MEMBERS], room=1 << 20)
    )
    msgspec.msgpack.decode(msgspec.msgpack.encode(full), type=Manifest)  # within its schema


def test_a_donor_serves_the_chunks_it_holds_byte_for_byte():
    chosen = manifest(digests(4), total_bytes=4 * MIN_CHUNK_BYTES - 10)
    assert servable_chunks(chosen, chosen) == {0, 1, 2, 3}
    assert servable_chunks(chosen, manifest(digests(4, differ=(1,)))) == {0, 2}  # last: length
    same_length = manifest(digests(4, differ=(1,)), total_bytes=chosen.total_bytes)
    assert servable_chunks(chosen, same_length) == {0, 2, 3}
    assert servable_chunks(chosen, manifest(digests(4), step=8)) == set()
    assert servable_chunks(chosen, manifest(digests(2), chunk_bytes=2 * MIN_CHUNK_BYTES)) == set()
    # Chunks 0 and 1 of the same hashes but other bytes (a boundary moved): not servable.
    shifted = ends(chosen, [MIN_CHUNK_BYTES - 1, *chosen.ends[1:]])
    assert servable_chunks(chosen, shifted) == {2, 3}


def test_the_step_most_donors_hold_wins_then_the_higher_one():
    assert choose_manifest({}) is None
    offers = {
        "a": manifest(digests(2), step=9),
        "b": manifest(digests(2)),
        "c": manifest(digests(2)),
    }
    assert choose_manifest(offers) == "b"
    offers = {"a": manifest(digests(2), step=9), "b": manifest(digests(2))}
    assert choose_manifest(offers) == "a"


def test_among_donors_at_one_step_the_most_shared_manifest_is_followed():
    odd = manifest(digests(4, differ=(1, 2)))
    common = manifest(digests(4))
    assert choose_manifest({"odd": odd, "x": common, "y": common}) == "x"
    # a tie in coverage: the caller's order decides
    assert choose_manifest({"odd": odd, "x": common}) == "odd"


def test_a_donor_cutting_many_chunks_only_it_holds_does_not_outweigh_donors_that_agree():
    """Counted in chunks, one donor's 8 chunks beat two donors' 2 chunks each of the same
    bytes: it was followed, and could stall the download (a catch-up in place then left the
    peer's state torn). Counted in bytes, the two win."""
    total = 8 * MIN_CHUNK_BYTES
    agreed = manifest(digests(2), chunk_bytes=total // 2)
    liar = manifest(digests(8, differ=tuple(range(8))), chunk_bytes=MIN_CHUNK_BYTES)
    assert choose_manifest({"liar": liar, "a": agreed, "b": agreed}) == "a"


def test_donors_steal_the_lowest_chunk_they_may_serve():
    plan = DownloadPlan("a", manifest(digests(4)), parallel=2)
    assert plan.add_donor("b", manifest(digests(4, differ=(0,)))) is None
    assert plan.add_donor("c", manifest(digests(4, differ=(0, 1, 2, 3)))) is not None
    assert plan.donors_to_start() == ["a", "b"]
    assert plan.claim("b") == 1  # b does not hold chunk 0
    assert plan.claim("a") == 0
    assert plan.claim("a") == 2
    assert plan.claim("b") == 3
    assert plan.claim("b") is None
    for donor, index in [("a", 0), ("b", 1), ("a", 2), ("b", 3)]:
        plan.received(donor, index)
        plan.verified(donor, index)
    assert plan.complete
    assert plan.statistics().chunks_from == {"a": 2, "b": 2}


def test_held_back_chunks_wait_to_be_admitted_and_skipped_ones_are_never_fetched():
    """A download into our own tensors goes in rounds (`statesync.inplace`): the header, what
    the state's check needs, then the rest, less what we have no use for."""
    plan = DownloadPlan("a", manifest(digests(5)), parallel=1, held_back=True)
    assert plan.settled and not plan.complete
    assert plan.donors_to_start() == [] and plan.unservable() == []  # nothing to do yet
    plan.admit([3])
    assert not plan.settled and plan.donors_to_start() == ["a"]
    assert plan.claim("a") == 3 and plan.claim("a") is None
    plan.received("a", 3)
    plan.verified("a", 3)
    assert plan.settled and plan.held_back() == [0, 1, 2, 4]
    plan.stopped("a", None)  # idle until more is admitted
    plan.skip([1, 4])
    plan.admit([0, 2])
    assert plan.donors_to_start() == ["a"]
    assert [plan.claim("a"), plan.claim("a"), plan.claim("a")] == [0, 2, None]
    for index in (0, 2):
        plan.received("a", index)
        plan.verified("a", index)
    assert plan.complete and plan.statistics().done == 5
    assert plan.statistics().chunks_from == {"a": 3}


def test_a_bad_chunk_is_refetched_and_drops_its_donor():
    plan = DownloadPlan("a", manifest(digests(3)), parallel=1)
    plan.add_donor("b", manifest(digests(3)))
    assert plan.donors_to_start() == ["a"]
    assert plan.claim("a") == 0
    assert plan.claim("a") == 1
    plan.received("a", 0)
    plan.rejected("a", 0)
    assert plan.donors["a"] is DonorState.DROPPED
    assert plan.claim("a") is None  # a dropped donor gets nothing more
    # chunk 1 stays a's until its task stops: nobody else may write it meanwhile
    assert plan.chunks[1] is ChunkState.FETCHING
    assert plan.donors_to_start() == ["b"]
    assert plan.claim("b") == 0
    assert plan.claim("b") == 2
    plan.stopped("a", None)
    assert plan.chunks[1] is ChunkState.PENDING
    assert plan.claim("b") == 1
    stats = plan.statistics()
    assert stats.rejected == {"a": 1}
    assert "hash check" in stats.dropped["a"]


def test_a_failed_donor_hands_back_what_it_fetched_but_not_what_it_is_checking():
    plan = DownloadPlan("a", manifest(digests(3)), parallel=2)
    plan.add_donor("b", manifest(digests(3)))
    plan.donors_to_start()
    assert [plan.claim("a"), plan.claim("a")] == [0, 1]
    plan.received("a", 0)
    plan.stopped("a", "connection reset")
    assert plan.chunks[0] is ChunkState.CHECKING  # its hash decides, whoever sent it
    assert plan.chunks[1] is ChunkState.PENDING
    plan.verified("a", 0)
    assert plan.statistics().dropped == {"a": "connection reset"}
    assert plan.unservable() == []
    plan.stopped("b", "gone")
    assert plan.unservable() == [1, 2]
    assert not plan.complete


def test_an_idle_donor_is_restarted_when_chunks_come_back():
    plan = DownloadPlan("a", manifest(digests(2)), parallel=2)
    plan.add_donor("b", manifest(digests(2)))
    assert plan.donors_to_start() == ["a", "b"]
    assert plan.claim("a") == 0
    assert plan.claim("b") == 1
    assert plan.claim("b") is None
    plan.received("b", 1)
    plan.verified("b", 1)
    plan.stopped("b", None)
    assert plan.donors["b"] is DonorState.IDLE
    assert plan.donors_to_start() == []  # nothing pending
    plan.stopped("a", "timeout")
    assert plan.donors_to_start() == ["b"]
    assert plan.claim("b") == 0


def test_parallel_bounds_the_active_donors_and_events_must_follow_the_table():
    plan = DownloadPlan("a", manifest(digests(8)), parallel=2)
    for donor in "bcd":
        plan.add_donor(donor, manifest(digests(8)))
    assert plan.donors_to_start() == ["a", "b"]
    assert plan.donors_to_start() == []
    assert plan.live_donors() == 4
    with pytest.raises(AssertionError):
        plan.received("a", 5)  # never claimed
    with pytest.raises(ValueError, match="parallel=0"):
        DownloadPlan("a", manifest(digests(1)), parallel=0)


def test_an_empty_state_is_complete_at_once():
    plan = DownloadPlan("a", manifest([], total_bytes=0), parallel=1)
    assert plan.complete


# ---------------------------------------------------------------------------- network


class Faulty(ForwardingStream):
    """A donor's data connection with a fault: `corrupt` flips a byte of every chunk slice;
    `stop_after` bytes of chunks sent, it sets `stopped` and hangs until its donor is killed."""

    def __init__(
        self,
        inner: trio.SocketStream,
        *,
        corrupt: bool = False,
        stop_after: int | None = None,
        stopped: trio.Event | None = None,
        on_send: Callable[[], None] | None = None,
    ) -> None:
        super().__init__(inner)
        self.corrupt = corrupt
        self.stop_after = stop_after
        self.stopped = stopped
        self.on_send = on_send
        self.sent = 0

    async def send_all(self, data) -> None:
        if self.on_send is not None:
            self.on_send()
        if len(data) > REPLY.size:  # a chunk slice (headers are REPLY.size bytes)
            if self.stop_after is not None and self.sent >= self.stop_after:
                assert self.stopped is not None
                self.stopped.set()
                await trio.sleep_forever()
            self.sent += len(data)
            if self.corrupt:
                data = bytearray(data)
                data[len(data) // 2] ^= 0xFF
        await self.inner.send_all(data)


@dataclass
class Running:
    node: Node
    donor: StateDonor
    scope: trio.CancelScope

    def kill(self) -> None:
        self.scope.cancel()


@asynccontextmanager
async def donors(
    snapshots: list[Snapshot | None],
    *,
    wraps: dict[int, Callable[[trio.SocketStream], trio.abc.Stream]] | None = None,
    max_downloads: int = 4,
    ticket_idle: float = 10.0,
    getters: dict[int, SnapshotSource] | None = None,
    caller_states: float = 20.0,
    chunk_bytes: int = CHUNK,
) -> AsyncIterator[list[Running]]:
    """One node + StateDonor per snapshot, each killable on its own."""
    wraps = wraps or {}
    getters = getters or {}

    async def run(i: int, task_status: trio.TaskStatus[Running]) -> None:
        with trio.CancelScope() as scope:
            async with open_node(
                new_identity(), listen=[LOOPBACK], announce=[], max_message_bytes=1 << 20
            ) as node:
                snapshot = snapshots[i]
                donor = StateDonor(
                    node,
                    getters.get(i, held(snapshot)),
                    max_downloads=max_downloads,
                    ticket_idle=ticket_idle,
                    chunk_bytes=chunk_bytes,
                    wrap_stream=wraps.get(i),
                    stall_timeout=5.0,
                    caller_states=caller_states,
                )
                async with trio.open_nursery() as nursery:
                    await nursery.start(donor.serve, "127.0.0.1", 0)
                    task_status.started(Running(node, donor, scope))
                    await trio.sleep_forever()

    async with trio.open_nursery() as nursery:
        running = [await nursery.start(run, i) for i in range(len(snapshots))]
        yield running
        nursery.cancel_scope.cancel()


async def connect(downloader: Node, running: list[Running]) -> list:
    for r in running:
        await downloader.connect(r.node.peer_id, r.node.announce, timeout=5)
    return [r.node.peer_id for r in running]


async def fetch(downloader: Node, peers: list, *, min_step: int = 7, parallel: int = 3):
    download = StateDownload(
        downloader, peers, min_step=min_step, parallel=parallel, stall_timeout=5
    )
    snapshot = await download.run(deadline=trio.current_time() + 20)
    return snapshot, download.statistics()


def blob(size: int = BLOB_BYTES) -> bytes:
    return os.urandom(size)


def with_differences(original: bytes, chunks: tuple[int, ...]) -> bytes:
    out = bytearray(original)
    for index in chunks:
        out[index * CHUNK + 5] ^= 0x55
    return bytes(out)


class Whole:
    """A sink (`statesync.inplace`) that takes chunk 0 first, then the rest into one buffer;
    `on_admit` runs between the two rounds."""

    def __init__(self, size: int, on_admit: Callable[[], None]) -> None:
        self.buffer = bytearray(size)
        self.on_admit = on_admit

    async def first(self, manifest, early):
        return [] if 0 in early else [0]

    async def admit(self, manifest, early):
        self.on_admit()
        view = memoryview(self.buffer)
        view[slice(*manifest.chunk(0))] = early.read(*manifest.chunk(0))
        return lambda index: view[slice(*manifest.chunk(index))]


async def test_a_donor_still_connecting_when_a_round_ends_serves_the_next(monkeypatch):
    """A round ends once its chunks are in, cancelling donors still connecting: they must be
    idle for the next round. Left active, the next round never started one, and with the
    other donor gone the download waited for its deadline."""
    state = Snapshot(7, blob())
    connect_for_real, slow = download_module.connect, []

    async def connecting(*args, certificate, **kwargs):
        peer = certificate_peer_id(certificate)
        if not slow and len(seen) == 1 and peer not in seen:
            slow.append(peer)
            await trio.sleep_forever()  # the second donor's first connection: cut short
        seen.add(peer)
        return await connect_for_real(*args, certificate=certificate, **kwargs)

    seen: set[str] = set()
    monkeypatch.setattr(download_module, "connect", connecting)
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state, state]) as running:
            peers = await connect(downloader, running)

            def kill_the_other() -> None:  # only the one cut short can serve the rest
                (fast,) = [r for r in running if r.node.peer_id.to_base58() not in slow]
                fast.kill()

            sink = Whole(len(state.blob), kill_the_other)
            job = StateDownload(downloader, peers, min_step=7, parallel=2, stall_timeout=5)
            assert await job.run_into(sink, deadline=trio.current_time() + 10) == 7
    assert slow and bytes(sink.buffer) == state.blob


async def test_three_donors_give_the_exact_bytes_and_step_in_parallel():
    state = Snapshot(7, blob(), members=("a", "b"))
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state] * 3) as running:
            peers = await connect(downloader, running)
            snapshot, stats = await fetch(downloader, peers)
            assert snapshot.step == 7
            assert snapshot.blob == state.blob
            assert isinstance(snapshot.blob, bytes)
            assert snapshot.members == ("a", "b")  # the electorate's, as the donor claims
            served = [r.donor.statistics().chunks_served for r in running]
            assert sum(served) == len(fixed_ends(BLOB_BYTES, CHUNK))
            assert sum(1 for n in served if n) >= 2, served
            assert len(stats.chunks_from) >= 2
            assert stats.rejected == {} and stats.dropped == {}
            # every ticket was released at the end
            assert [r.donor.statistics().downloads for r in running] == [0, 0, 0]


async def test_a_donor_hashes_only_what_its_snapshot_does_not_know(monkeypatch):
    """A trainer's snapshot names its layout and the hashes its step's digest took: the donor
    cuts chunks along the layout, hashes only the rest, and a download hands on the hashes
    its checks verified (a joiner's digest takes them: `state.BlobLayout.known`)."""
    data = blob()
    parts = (1000, 1000 + 3 * CHUNK + 77, BLOB_BYTES)  # a header, a large tensor, the rest
    big = [(1000 + i * CHUNK, min(1000 + (i + 1) * CHUNK, parts[1])) for i in range(4)]
    known = {span: blake3(data[span[0] : span[1]]).digest() for span in big}
    hashed: list[int] = []

    def counted(view):
        hashed.append(len(view))
        return blake3(view).digest()

    monkeypatch.setattr(donor_module, "chunk_hash", counted)
    state = Snapshot(7, data, parts=parts, hashes=known)
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state]) as running:
            snapshot, _ = await fetch(downloader, await connect(downloader, running))
    assert snapshot.blob == data
    assert sum(hashed) == BLOB_BYTES - (parts[1] - parts[0])
    assert set(big) <= set(snapshot.hashes)
    assert sorted(snapshot.hashes) == [
        chunk_span(ends, i)
        for ends in [chunk_ends(BLOB_BYTES, parts, CHUNK)]
        for i in range(len(ends))
    ]
    for (start, end), digest in snapshot.hashes.items():
        assert digest == blake3(data[start:end]).digest()


async def test_donors_whose_bytes_partly_differ_give_the_followed_manifest_exactly():
    common = blob()
    odd = with_differences(common, (3, 7))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(1) as (downloader,),
            donors([Snapshot(7, odd), Snapshot(7, common), Snapshot(7, common)]) as running,
        ):
            peers = await connect(downloader, running)
            # the manifest most donors share is followed, even though `odd` comes first
            snapshot, stats = await fetch(downloader, peers)
            assert snapshot.blob == common
            # with two donors the tie goes to the first: the result is exactly its bytes
            snapshot, stats = await fetch(downloader, peers[:2], parallel=2)
            assert snapshot.blob == odd
            assert stats.rejected == {}
            assert stats.chunks_from[str(peers[0])] >= 2  # chunks 3 and 7 came from it alone


async def test_corrupted_chunks_are_rejected_and_fetched_from_others():
    state = Snapshot(7, blob())
    wraps = {0: lambda stream: Faulty(stream, corrupt=True)}
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state] * 3, wraps=wraps) as running:
            peers = await connect(downloader, running)
            snapshot, stats = await fetch(downloader, peers)
            assert snapshot.blob == state.blob
            assert stats.rejected.get(str(peers[0]), 0) >= 1
            assert "hash check" in stats.dropped[str(peers[0])]
            assert str(peers[0]) not in stats.chunks_from
            assert running[0].donor.statistics().chunks_served >= 1


async def test_a_donor_that_dies_mid_download_is_replaced():
    state = Snapshot(7, blob())
    stopped = trio.Event()
    wraps = {0: lambda stream: Faulty(stream, stop_after=2 * CHUNK, stopped=stopped)}
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state] * 3, wraps=wraps) as running:
            peers = await connect(downloader, running)
            result = {}

            async def download() -> None:
                result["snapshot"], result["stats"] = await fetch(downloader, peers)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(download)
                await stopped.wait()
                assert running[0].donor.statistics().chunks_served == 2
                running[0].kill()
            assert result["snapshot"].blob == state.blob
            stats = result["stats"]
            assert stats.chunks_from.get(str(peers[0])) == 2
            assert str(peers[0]) in stats.dropped


@pytest.mark.parametrize("into", [False, True], ids=["run", "run_into"])
async def test_every_donor_dying_mid_download_is_one_download_failure(into):
    """The last donor gone part-way: a `StateDownloadFailed` (a RemoteError, which the trainer
    retries), not an exception group around it, which ended the joining daemon (seen on a
    GPU run where all three donors moved on to a new step at once)."""
    state = Snapshot(7, blob())
    stopped = trio.Event()
    wraps = {0: lambda stream: Faulty(stream, stop_after=2 * CHUNK, stopped=stopped)}
    failure: list[BaseException] = []
    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state], wraps=wraps) as running:
            peers = await connect(downloader, running)
            job = StateDownload(downloader, peers, min_step=7, parallel=1, stall_timeout=5)
            sink = Whole(len(state.blob), lambda: None)

            async def download() -> None:
                deadline = trio.current_time() + 20
                try:
                    await (
                        job.run_into(sink, deadline=deadline)
                        if into
                        else job.run(deadline=deadline)
                    )
                except BaseException as error:  # its type is the point
                    failure.append(error)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(download)
                await stopped.wait()
                running[0].kill()
    (error,) = failure
    assert type(error) is StateDownloadFailed, repr(error)
    assert "no donor left" in str(error)


async def test_a_sink_refusing_the_state_is_one_download_failure():
    """The trainer's sink refuses a state no quorum certified with a plain RemoteError
    (`publisher.check_certified`), inside the download's nursery: it must come out as a
    `StateDownloadFailed`, which the trainer retries, not a group that ends the daemon."""
    state = Snapshot(7, blob())

    def refuse() -> None:
        raise RemoteError("donors sent step 7 with digest ab, which fewer than 2 peers signed")

    with trio.fail_after(TIMEOUT):
        async with nodes(1) as (downloader,), donors([state]) as running:
            peers = await connect(downloader, running)
            job = StateDownload(downloader, peers, min_step=7, parallel=1, stall_timeout=5)
            with pytest.raises(StateDownloadFailed, match="fewer than 2 peers signed"):
                await job.run_into(
                    Whole(len(state.blob), refuse), deadline=trio.current_time() + 20
                )


async def test_a_busy_donor_refuses_and_the_download_uses_others_or_fails_clearly():
    state = Snapshot(7, blob(MIN_CHUNK_BYTES * 5))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(2) as (holder, downloader),
            donors([state, state], max_downloads=1) as running,
        ):
            busy, other = running
            peers = await connect(downloader, running)
            await connect(holder, running)
            # `holder` is downloading from `busy`: it holds busy's only ticket
            ticket = await holder.rpc.call(
                busy.node.peer_id, SERVICE, "manifest", ManifestRequest(0), Manifest, timeout=5
            )
            with pytest.raises(StateDownloadFailed, match="busy: serving 1 downloads") as caught:
                await fetch(downloader, peers[:1])
            assert "\n" not in str(caught.value)
            snapshot, stats = await fetch(downloader, peers)
            assert snapshot.blob == state.blob
            assert "busy" in stats.refused[str(busy.node.peer_id)]
            assert busy.donor.statistics().refused == 2
            assert busy.donor.statistics().chunks_served == 0
            # once released, the slot is free again
            await holder.rpc.call(
                busy.node.peer_id, SERVICE, "release", Release(ticket.ticket), Released, timeout=5
            )
            snapshot, _ = await fetch(downloader, peers[:1])
            assert snapshot.blob == state.blob
            assert other.donor.statistics().chunks_served == len(fixed_ends(len(state.blob), CHUNK))


async def test_an_unused_ticket_expires_and_frees_its_slot():
    state = Snapshot(7, blob(MIN_CHUNK_BYTES * 2))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(2) as (holder, downloader),
            donors([state], max_downloads=1, ticket_idle=0.3) as running,
        ):
            peers = await connect(downloader, running)
            await connect(holder, running)
            await holder.rpc.call(
                peers[0], SERVICE, "manifest", ManifestRequest(0), Manifest, timeout=5
            )
            with pytest.raises(StateDownloadFailed, match="busy"):
                await fetch(downloader, peers)
            await trio.sleep(0.4)  # the holder never connected: its ticket lapses
            snapshot, _ = await fetch(downloader, peers)
            assert snapshot == state


async def test_stale_donors_are_not_used_and_none_fresh_is_a_clear_error():
    fresh = Snapshot(7, blob(MIN_CHUNK_BYTES * 3))
    stale = Snapshot(6, blob(MIN_CHUNK_BYTES * 3))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(1) as (downloader,),
            donors([stale, None, fresh]) as running,
        ):
            peers = await connect(downloader, running)
            snapshot, stats = await fetch(downloader, peers)
            assert snapshot == fresh
            assert [r.donor.statistics().chunks_served for r in running][:2] == [0, 0]
            assert "holding step 6" in stats.refused[str(peers[0])]
            assert "holding nothing" in stats.refused[str(peers[1])]
            with pytest.raises(StateDownloadFailed, match="nothing at step >= 7") as caught:
                await fetch(downloader, peers[:2])
            assert isinstance(caught.value, RemoteError)
            with pytest.raises(StateDownloadFailed, match="none asked"):
                await fetch(downloader, [])
            # the step asked for is the floor: a fresher state is fine
            snapshot, _ = await fetch(downloader, peers, min_step=3)
            assert snapshot.step == 7


async def test_the_donor_serves_the_snapshot_its_manifest_described():
    old, new = Snapshot(7, blob()), Snapshot(8, blob())
    current = [old]

    def advance() -> None:
        current[0] = new  # the donor's state moves on while it serves the download

    async def source() -> Snapshot:
        return current[0]

    wraps = {0: lambda stream: Faulty(stream, on_send=advance)}
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(1) as (downloader,),
            donors([None], wraps=wraps, getters={0: source}) as running,
        ):
            peers = await connect(downloader, running)
            snapshot, _ = await fetch(downloader, peers)
            assert snapshot == old
            assert current[0] is new
            snapshot, _ = await fetch(downloader, peers)
            assert snapshot == new


async def test_a_peer_downloading_again_and_again_is_refused_and_others_are_served():
    """Resource limits (issue 7): each caller may start `caller_states` downloads per window."""
    state = Snapshot(7, blob(MIN_CHUNK_BYTES * 4))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(2) as (greedy, honest),
            donors([state], caller_states=2.0) as running,
        ):
            peers = await connect(greedy, running)
            await connect(honest, running)
            for _ in range(2):
                snapshot, _ = await fetch(greedy, peers)
                assert snapshot == state
            with pytest.raises(StateDownloadFailed, match="download budget spent") as caught:
                await fetch(greedy, peers)
            assert "\n" not in str(caught.value)
            snapshot, _ = await fetch(honest, peers)  # the others are still served
            assert snapshot == state
            assert running[0].donor.statistics().refused >= 1


async def test_asking_for_chunks_over_and_over_on_one_ticket_runs_out_of_budget():
    """A downloader cannot dodge the budget by re-requesting chunks on its data connection:
    a ticket serves at most twice the state's bytes."""
    state = Snapshot(7, blob(MIN_CHUNK_BYTES * 4))
    with trio.fail_after(TIMEOUT):
        async with (
            nodes(1) as (greedy,),
            donors([state]) as running,
        ):
            (peer,) = await connect(greedy, running)
            manifest = await greedy.rpc.call(
                peer, SERVICE, "manifest", ManifestRequest(0), Manifest, timeout=5
            )
            raw = await trio.open_tcp_stream(manifest.data_host, manifest.data_port)
            stream = TlsStream(raw, pinned_client_context([manifest.data_cert]), server_side=False)
            async with stream:
                await stream.handshake()
                await stream.send_all(MAGIC + manifest.ticket)
                received, served = bytearray(), 0
                for _ in range(4 * len(manifest.hashes)):  # four states' worth of requests
                    await stream.send_all(REQUEST.pack(0))
                    while len(received) < REPLY.size:
                        received += await stream.receive_some(1 << 16)
                    kind, _, length = REPLY.unpack(received[: REPLY.size])
                    while len(received) < REPLY.size + length:
                        received += await stream.receive_some(1 << 16)
                    body = bytes(received[REPLY.size : REPLY.size + length])
                    del received[: REPLY.size + length]
                    if kind == KIND_ERROR:
                        assert b"ticket is used up" in body
                        break
                    served += 1
            chunk = len(state.blob) / len(manifest.hashes)
            assert served * chunk <= 2.0 * len(state.blob) + chunk  # about two states, not four
            assert served >= len(manifest.hashes)  # the first state was given in full


async def test_a_chunk_arriving_faster_than_it_is_read_lets_other_tasks_run():
    """A read returns at once while bytes wait in the socket: fast donors kept a 100 M
    joiner's event loop in one 4 MiB chunk for up to 327 ms. Other tasks run between reads."""

    class Full:
        """A stream whose every read finds a TLS record's worth waiting (no checkpoint)."""

        async def receive_into(self, view: memoryview) -> int:
            count = min(len(view), 16 * KIB)
            view[:count] = bytes(count)
            return count

    turns = 0

    async def other_task() -> None:
        nonlocal turns
        while True:
            turns += 1
            await trio.sleep(0)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(other_task)
        await trio.sleep(0)
        before = turns
        await receive_into(Full(), memoryview(bytearray(4 << 20)), 5.0)
        assert turns - before >= (4 << 20) // YIELD_BYTES - 1
        nursery.cancel_scope.cancel()
