"""A catch-up into the peer's own tensors (`peer.training.catchup`, `statesync.inplace`): which
chunks come first, the certificate checked before anything of ours changes, the rest received
where our tensors lie, and a download that fails part-way."""

from __future__ import annotations

import functools

import pytest
import torch
import trio

from peer.errors import RemoteError
from peer.training import checkpoint as checkpoints
from peer.training import state as states
from peer.training import worker as worker_module
from peer.training.chunks import (
    PIECE_BYTES,
    Manifest,
    chunk_ends,
    chunk_hash,
    chunk_span,
    fixed_ends,
)
from peer.training.statesync import Snapshot, StateDownload, StateDownloadFailed
from peer.training.statesync.inplace import EarlyChunks, KnownPieces, place
from peer.training.statesync.wire import sliceable
from peer.training.task import TinyTask
from tests.test_statesync import connect, donors, nodes
from tests.test_trainer_steps import (
    INNER_STEPS,
    FakeMonotonic,
    behind,
    make_trainer,
    read,
    signed_record,
    take_steps,
)
from tests.test_training_strategies import NormTask

TIMEOUT = 30


class WideTask(TinyTask):
    """The tiny task with a first layer of 5.3 MB: two digest pieces (4 MiB and the rest), so
    a donor's chunks of it go straight into our tensors; the rest are small and share chunks."""

    name = "wide"
    inputs, hidden = 1024, 1300


def manifest_of(
    blob: bytes | memoryview, step: int, ends: list[int], members: tuple[str, ...] = ()
) -> Manifest:
    hashes = [chunk_hash(blob[slice(*chunk_span(ends, i))]) for i in range(len(ends))]
    return Manifest(step, len(blob), ends, hashes, "127.0.0.1", 1, bytes(32), b"", list(members))


class Feed:
    """A download into a sink from a snapshot in hand, as `StateDownload.run_into` drives it
    (each chunk's bytes are the snapshot's, so they pass their checks): the chunks it fetched,
    those before the check (`early`), and how many chunks go into our tensors before the
    download breaks off (`fail_after`; -1: never)."""

    def __init__(self, *snapshots: Snapshot, cut: int = PIECE_BYTES, fail_after: int = -1):
        self.snapshots = list(snapshots)
        self.cut = cut
        self.fail_after = fail_after
        self.fetched: list[int] = []
        self.early: list[int] = []

    async def __call__(self, donors, step, sink) -> int:
        snapshot = self.snapshots.pop(0)
        blob = sliceable(snapshot.blob)
        ends = chunk_ends(len(blob), snapshot.parts, self.cut)
        manifest = manifest_of(bytes(blob[0 : len(blob)]), snapshot.step, ends, snapshot.members)
        early = EarlyChunks(manifest)
        self.fetched = []
        while wanted := [i for i in await sink.first(manifest, early) if i not in early]:
            for index in wanted:
                early.view(index)[:] = blob[slice(*manifest.chunk(index))]
                self.fetched.append(index)
        self.early = list(self.fetched)
        where = await sink.admit(manifest, early)
        for index in range(len(ends)):
            view = None if index in early else where(index)
            if view is not None:
                if len(self.fetched) - len(self.early) == self.fail_after:
                    raise StateDownloadFailed("the last donor left")
                view[:] = blob[slice(*manifest.chunk(index))]
                self.fetched.append(index)
        return manifest.step


def own_tensors(trainer) -> list[torch.Tensor]:
    """The parameters and AdamW moments a catch-up in place writes into."""
    optimizer = trainer.worker.strategy.optimizers()["optimizer"]
    moments = [t for s in optimizer.state.values() for t in s.values() if t.dim() > 0]
    return [*trainer.worker.model.parameters(), *moments]


def same_state(a, b) -> bool:
    return all(torch.equal(x, y) for x, y in zip(own_tensors(a), own_tensors(b), strict=True))


async def ahead(tmp_path, task=WideTask, steps: int = 2, **kwargs):
    donor = await make_trainer(tmp_path / "a", task=task(), **kwargs)
    partner = await make_trainer(tmp_path / "b", task=task(), **kwargs)
    await take_steps(donor, steps)
    await take_steps(partner, steps)
    return donor, partner


async def fallen_behind(tmp_path, task=WideTask, *, trained: bool = True, **kwargs):
    """A trainer (with a step of its own, if `trained`) that has read the records of two peers
    at step 2, and one of those two."""
    trainer = await make_trainer(tmp_path / "me", task=task(), **kwargs)
    if trained:
        await take_steps(trainer, 1)
    donor, partner = await ahead(tmp_path, task, **kwargs)
    read(trainer, signed_record(donor, partner))
    return trainer, donor


# ---------------------------------------------------------------------------- pure: placement


def layout_of(sizes: dict[str, int]) -> states.BlobLayout:
    start, spans = 100, {}
    for name, size in sizes.items():
        spans[name] = (start, start + size)
        start += size
    return states.BlobLayout(spans, (100, *(end for _, end in spans.values())))


def test_large_tensors_go_late_piece_by_piece_and_small_ones_come_first():
    big = 2 * PIECE_BYTES + 1000
    layout = layout_of({"a": 10, "b": big, "c": 20, "d": PIECE_BYTES, "x": big, "e": 30})
    total = layout.parts[-1]
    ends = chunk_ends(total, layout.parts, PIECE_BYTES)
    manifest = manifest_of(bytes(total), 1, ends)
    wanted = {"a", "b", "c", "d", "e"}
    placement = place(manifest, layout, loaded=wanted, certified=wanted - {"d"})
    spans = layout.spans
    late = {manifest.chunk(i): where for i, where in placement.late.items()}
    b, x = spans["b"][0], spans["x"][0]
    assert late == {
        (b, b + PIECE_BYTES): ("b", 0),
        (b + PIECE_BYTES, b + 2 * PIECE_BYTES): ("b", PIECE_BYTES),
        (b + 2 * PIECE_BYTES, spans["b"][1]): ("b", 2 * PIECE_BYTES),
        spans["c"]: ("c", 0),  # small, but a chunk of its own: its one piece
        spans["d"]: ("d", 0),
        spans["e"]: ("e", 0),
    }
    # The header and "a" share a chunk: its bytes are needed to check the state.
    assert [manifest.chunk(i) for i in placement.early] == [(0, spans["b"][0])]
    assert sorted(manifest.chunk(i) for i in placement.skipped) == [
        (x, x + PIECE_BYTES),
        (x + PIECE_BYTES, x + 2 * PIECE_BYTES),
        (x + 2 * PIECE_BYTES, spans["x"][1]),
    ]


def test_a_certified_tensor_cut_otherwise_than_its_pieces_comes_first():
    """Only a chunk that is exactly a piece of the digest has the digest's hash: the rest of
    a certified tensor is needed before the check. An uncertified one goes late any way."""
    layout = layout_of({"p": 2 * PIECE_BYTES, "q": 2 * PIECE_BYTES})
    total = layout.parts[-1]
    ends = fixed_ends(total, PIECE_BYTES)  # cut from the blob's start, not each tensor's
    manifest = manifest_of(bytes(total), 1, ends)
    placement = place(manifest, layout, loaded={"p", "q"}, certified={"p"})
    # [0, P): the header and p; [P, 2P) inside p but not one of its pieces; [2P, 3P) p's
    # tail and q's head; then two chunks inside q.
    assert placement.early == {0, 1, 2}
    assert placement.late == {3: ("q", PIECE_BYTES - 100), 4: ("q", 2 * PIECE_BYTES - 100)}
    assert not placement.skipped


def test_a_piece_that_is_no_chunk_is_hashed_from_the_early_bytes():
    data = bytes(range(256)) * 64
    ends = [4096, 8192, 16384]
    manifest = manifest_of(data, 1, ends)
    early = EarlyChunks(manifest)
    for index in (0, 1):
        early.view(index)[:] = data[slice(*manifest.chunk(index))]
    known = KnownPieces(manifest, early)
    assert known.get((8192, 16384)) == manifest.hashes[2]  # a whole chunk: the manifest's
    assert known.get((100, 5000)) == chunk_hash(data[100:5000])  # across two early chunks
    with pytest.raises(RemoteError, match="not fetched"):
        known.get((8000, 9000))


# ---------------------------------------------------------------------------- the trainer


@pytest.mark.parametrize("trained", [True, False])
async def test_a_peer_behind_downloads_into_its_own_tensors(tmp_path, autojump_clock, trained):
    """A trained peer that fell behind held its state beside the whole download (2.5x the state
    at 100 M): now the large tensors' chunks land in its own parameters and moments, and only
    the header and the small tensors come aside first. A fresh joiner's moments are made."""
    trainer, donor = await fallen_behind(tmp_path, trained=trained)
    before = [t.data_ptr() for t in own_tensors(trainer)]
    feed = trainer.download_into = Feed(await donor.snapshot())
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == donor.digest and not trainer.worker.torn
    assert same_state(trainer, donor)
    after = [t.data_ptr() for t in own_tensors(trainer)]
    if trained:
        assert after == before  # received where they lie
    else:
        assert after[: len(before)] == before and len(after) > len(before)
    snapshot = await donor.snapshot()
    assert snapshot is not None
    ends = chunk_ends(len(snapshot.blob), snapshot.parts, PIECE_BYTES)
    early_bytes = sum(
        end - start for start, end in map(functools.partial(chunk_span, ends), feed.early)
    )
    assert early_bytes < len(snapshot.blob) / 10
    assert sorted(feed.fetched) == list(range(len(ends)))  # each chunk once
    await take_steps(trainer, 1)
    await take_steps(donor, 1)
    assert same_state(trainer, donor)


class WideNormTask(NormTask):
    """The wide task with a BatchNorm layer: float running statistics, an int64 counter."""

    name = "wide-norm"
    inputs, hidden = WideTask.inputs, WideTask.hidden


async def test_buffers_come_in_place_with_the_parameters(tmp_path, autojump_clock):
    trainer, donor = await fallen_behind(tmp_path, WideNormTask)
    norm = trainer.worker.model[1]
    with torch.no_grad():
        norm.running_mean.fill_(7.0)
        norm.num_batches_tracked.fill_(99)
    trainer.download_into = Feed(await donor.snapshot())
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == donor.digest
    theirs = donor.worker.model.state_dict()
    assert all(torch.equal(t, theirs[n]) for n, t in trainer.worker.model.state_dict().items())


async def test_a_diloco_peer_behind_downloads_into_its_parameters_and_outer_momentum(
    tmp_path, autojump_clock
):
    """DiLoCo serves its anchor and outer optimizer: they land in our parameters (then our
    anchor) and our outer momentum where they lie; our inner optimizer stays our own."""
    trainer, donor = await fallen_behind(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    strategy = trainer.worker.strategy
    outer = strategy.optimizers()["outer"]
    inner = strategy.optimizers()["inner"]
    momenta = [s["momentum_buffer"] for s in outer.state.values()]
    inner_moments = [s["exp_avg"].clone() for s in inner.state.values()]
    before = [t.data_ptr() for t in [*trainer.worker.model.parameters(), *momenta]]
    trainer.download_into = Feed(await donor.snapshot())
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == donor.digest
    momenta = [s["momentum_buffer"] for s in outer.state.values()]
    assert [t.data_ptr() for t in [*trainer.worker.model.parameters(), *momenta]] == before
    theirs = donor.worker.strategy.optimizers()["outer"]
    assert all(
        torch.equal(a["momentum_buffer"], b["momentum_buffer"])
        for a, b in zip(outer.state.values(), theirs.state.values(), strict=True)
    )
    ours = [s["exp_avg"] for s in inner.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(inner_moments, ours, strict=True))
    await take_steps(trainer, 1)
    await take_steps(donor, 1)
    assert states.parameters_digest(trainer.worker.model) == states.parameters_digest(
        donor.worker.model
    )


@pytest.mark.parametrize("mode", ["dedloc", "diloco"])
async def test_a_donor_cut_otherwise_and_a_small_model_come_whole_and_load_alike(
    tmp_path, autojump_clock, mode
):
    """Chunks of 64 KiB (a donor's `chunk_bytes`) are no digest piece, so a large tensor's
    come first (each hashed into its pieces), and the tiny task's state is one small chunk:
    both load as a download beside us did."""
    for task, cut in ((WideTask, 64 << 10), (TinyTask, PIECE_BYTES)):
        where = tmp_path / f"{task.name}-{cut}"
        trainer = await make_trainer(where / "me", task=task(), mode=mode, inner_steps=INNER_STEPS)
        donor, partner = await ahead(where, task, mode=mode, inner_steps=INNER_STEPS)
        read(trainer, signed_record(donor, partner))
        feed = trainer.download_into = Feed(await donor.snapshot(), cut=cut)
        await trainer._catch_up(*behind(trainer))
        assert trainer.step == 2 and trainer.digest == donor.digest
        if task is TinyTask:  # one chunk, the whole state
            assert feed.early == feed.fetched == [0]
        await take_steps(trainer, 1)
        await take_steps(donor, 1)
        assert states.parameters_digest(trainer.worker.model) == states.parameters_digest(
            donor.worker.model
        )


async def test_an_uncertified_state_is_refused_before_any_byte_of_ours_changes(
    tmp_path, autojump_clock
):
    trainer, _ = await fallen_behind(tmp_path)
    poisoned = await make_trainer(tmp_path / "p", task=WideTask())
    await take_steps(poisoned, 2)
    with torch.no_grad():
        next(poisoned.worker.model.parameters()).fill_(0.25)
    await poisoned._hold(2)
    kept = [t.clone() for t in own_tensors(trainer)]
    feed = trainer.download_into = Feed(await poisoned.snapshot())
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 1 and trainer.status().failures["state_download"] == 1
    assert not trainer.worker.torn and feed.fetched == feed.early
    assert all(torch.equal(a, b) for a, b in zip(kept, own_tensors(trainer), strict=True))
    assert await trainer.snapshot() is not None  # still served


async def test_a_state_whose_header_names_another_step_is_refused(tmp_path, autojump_clock):
    """The certificate is of the manifest's step: a state saying it is of a later one would be
    held (and signed) as that step. Refused by both ways of downloading."""
    donor, partner = await ahead(tmp_path, TinyTask)
    snapshot = await donor.snapshot()
    assert snapshot is not None
    later = states.from_bytes(bytes(snapshot.blob))
    later.step = 7
    lying = Snapshot(2, states.to_bytes(later))
    for in_place in (False, True):
        trainer = await make_trainer(tmp_path / f"me-{in_place}")
        read(trainer, signed_record(donor, partner))
        if in_place:
            trainer.download_into = Feed(lying)
        else:

            async def download(donors, step):
                return lying

            trainer.download = download
        await trainer._catch_up(*behind(trainer))
        assert trainer.step == 0 and trainer.status().failures["state_download"] == 1


async def test_a_download_that_breaks_off_part_way_leaves_nothing_trained_served_or_saved(
    tmp_path, autojump_clock
):
    """Once our tensors began to take the new state, a failed download leaves them torn. With
    no checkpoint to go back to: no micro-batch, call or declaration (a wait instead), no state
    to serve, no checkpoint written; the next download that completes mends it."""
    trainer, donor = await fallen_behind(tmp_path)
    snapshot = await donor.snapshot()
    assert snapshot is not None
    feed = trainer.download_into = Feed(snapshot, fail_after=1)
    await trainer._catch_up(*behind(trainer))
    assert trainer.worker.torn and trainer.step == 1 and len(feed.fetched) > len(feed.early)
    assert trainer.status().failures["state_download"] == 1
    assert trainer.local().torn  # the policy computes, calls and declares no more
    assert await trainer.snapshot() is None
    await trainer._checkpoint(force=True)
    assert checkpoints.load_latest(trainer.checkpoint_dir) is None
    trainer.download_into = Feed(snapshot)
    await trainer._catch_up(*behind(trainer))
    assert not trainer.worker.torn and trainer.step == 2 and same_state(trainer, donor)
    assert not trainer.local().torn


async def test_a_torn_state_goes_back_to_the_last_checkpoint(tmp_path, autojump_clock):
    """A peer whose only donor left mid-download would wait for ever: with a checkpoint, it
    takes that state back at once, and serves and trains again."""
    trainer, donor = await fallen_behind(tmp_path)
    await trainer._save()  # no deadline (the virtual clock would pass any while it writes)
    kept = [t.clone() for t in own_tensors(trainer)]
    digest = trainer.digest
    trainer.download_into = Feed(await donor.snapshot(), fail_after=1)
    await trainer._catch_up(*behind(trainer))
    assert not trainer.worker.torn and trainer.step == 1 and trainer.digest == digest
    assert all(torch.equal(a, b) for a, b in zip(kept, own_tensors(trainer), strict=True))
    assert await trainer.snapshot() is not None
    assert not trainer.local().torn


async def test_where_our_tensors_cannot_take_the_bytes_a_failure_leaves_our_state_whole(
    tmp_path, autojump_clock, monkeypatch
):
    """On a GPU the bytes arrive in new CPU tensors (here: every receiver a new one): nothing
    of ours is overwritten, so a failed download leaves the state we hold served and whole."""
    receivers = worker_module.states.receivers

    def new_ones(*args, **kwargs):
        return {name: torch.empty_like(t) for name, t in receivers(*args, **kwargs).items()}

    monkeypatch.setattr(worker_module.states, "receivers", new_ones)
    trainer, donor = await fallen_behind(tmp_path)
    kept = [t.clone() for t in own_tensors(trainer)]
    snapshot = await donor.snapshot()
    trainer.download_into = Feed(snapshot, fail_after=1)
    await trainer._catch_up(*behind(trainer))
    assert not trainer.worker.torn and trainer.step == 1
    assert all(torch.equal(a, b) for a, b in zip(kept, own_tensors(trainer), strict=True))
    assert await trainer.snapshot() is not None
    trainer.download_into = Feed(snapshot)
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and same_state(trainer, donor)


async def test_a_header_claimed_too_long_is_refused_before_it_is_fetched(tmp_path, autojump_clock):
    trainer, donor = await fallen_behind(tmp_path, TinyTask, trained=False)
    snapshot = await donor.snapshot()
    assert snapshot is not None
    blob = bytearray(bytes(snapshot.blob))
    blob[:8] = (states.MAX_HEADER_BYTES + 1).to_bytes(8, "little")
    big = Snapshot(2, bytes(blob) + bytes(states.MAX_HEADER_BYTES), parts=())
    feed = trainer.download_into = Feed(big)
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 0 and trainer.status().failures["state_download"] == 1
    assert feed.fetched == [0]


async def test_a_periodic_save_gives_way_to_a_catch_up(tmp_path, autojump_clock, monkeypatch):
    """It held the tensors a download into them waits for (past the donors' tickets), and the
    state it writes is behind the collaboration's."""
    monotonic = FakeMonotonic()
    trainer, _ = await fallen_behind(
        tmp_path, TinyTask, checkpoint_interval=1.0, monotonic=monotonic
    )
    given: list = []

    async def save_checkpoint(directory, *, within, gives_way):
        given.append(gives_way)

    monkeypatch.setattr(trainer.worker, "save_checkpoint", save_checkpoint)
    monotonic.advance(2.0)  # a periodic checkpoint is due
    async with trio.open_nursery() as nursery:
        await trainer._checkpoint(nursery)
    (gives_way,) = given
    during = []

    async def download_into(donors, step, sink):
        during.append(gives_way())
        raise RemoteError("busy")

    trainer.download_into = download_into
    assert not gives_way()
    await trainer._catch_up(*behind(trainer))
    assert during == [True] and not gives_way()


# ---------------------------------------------------------------------------- over the network


async def test_a_download_into_our_tensors_over_loopback_survives_a_corrupt_chunk(tmp_path):
    """`StateDownload.run_into` with three donors, one of which flips a byte of every chunk it
    sends past the header: each such chunk fails its check, is fetched from the others, and
    our tensors end bit for bit the donors'."""
    trainer, donor = await fallen_behind(tmp_path)
    snapshot = await donor.snapshot()
    assert snapshot is not None

    class Flip(trio.abc.Stream):
        def __init__(self, inner) -> None:
            self.inner = inner

        async def send_all(self, data) -> None:
            data = bytearray(data)
            if len(data) > 1024:
                data[len(data) // 2] ^= 0x55
            await self.inner.send_all(data)

        async def wait_send_all_might_not_block(self) -> None:
            await self.inner.wait_send_all_might_not_block()

        async def receive_some(self, max_bytes=None):
            return await self.inner.receive_some(max_bytes)

        async def aclose(self) -> None:
            await self.inner.aclose()

    with trio.fail_after(TIMEOUT):
        async with (
            nodes(1) as (downloader,),
            donors([snapshot] * 3, wraps={0: Flip}, chunk_bytes=PIECE_BYTES) as running,
        ):
            peers = await connect(downloader, running)
            job = StateDownload(downloader, peers, min_step=2, parallel=3, stall_timeout=5)

            async def download_into(donors, step, sink):
                return await job.run_into(sink, deadline=trio.current_time() + 20)

            trainer.download_into = download_into
            before = [t.data_ptr() for t in own_tensors(trainer)]
            await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == donor.digest and same_state(trainer, donor)
    assert [t.data_ptr() for t in own_tensors(trainer)] == before
    stats = job.statistics()
    assert sum(stats.rejected.values()) >= 1 and str(running[0].node.peer_id) in stats.dropped
