"""The state keeper (`backbone start --keep-state`) in one process: real DHT, trainers, state
download and data plane on loopback, the tiny task.

The trainers are held still (their batches stop counting samples once they reach HOLD_AT), so
"the keeper holds the trainers' step" is a fact to check, not a race to win.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.files import state_folder
from peer.net.host import Node
from peer.training import checkpoint as checkpoint_module
from peer.training import state as states
from peer.training.certificate import StepSignature, sign_step
from peer.training.checkpoint import Checkpoint, load_latest_blob
from peer.training.chunks import MIN_CHUNK_BYTES, fixed_ends
from peer.training.keeper import KEEP, StateKeeper, run_keeper, state_digester
from peer.training.progress import (
    ProgressRecord,
    decode_progress,
    encode_progress,
    progress_key,
    should_call,
)
from peer.training.statesync import (
    REPLY,
    DownloadStatistics,
    Snapshot,
    StateDonor,
    StateDownload,
    StateDownloadFailed,
    held,
)
from peer.training.strategies import LargeBatch
from peer.training.task import TinyTask
from peer.training.trainer import Trainer
from tests.helpers import LOOPBACK, ForwardingStream, Swarm, new_identity, swarm
from tests.test_training_collab import DHT_CONFIG, Joinable, Recorder, make_config

HOLD_AT = 2  # the trainers stop counting samples here (and stop a step or two later)


class HoldAt(Recorder):
    """The recorder's batches until a trainer reaches `step`; then batches that count no
    samples. The trainers still publish their records (a trainer that stops withdraws its
    record), and stop stepping once their throughput has decayed (`held_step`)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step

    def source(self, index: int, trainer_ref: list[Trainer]):
        inner = super().source(index, trainer_ref)

        def next_batch():
            batch, size = inner()
            return batch, size if trainer_ref[0].step < self.step else 0

        return next_batch


def keeper_config(tmp_path: Path) -> PeerConfig:
    """A backbone's config: the trainers' collaboration, its own folder, loopback only."""
    config = make_config(tmp_path)
    return dataclasses.replace(config, net=dataclasses.replace(config.net, listen=[LOOPBACK]))


def kept_folder(config: PeerConfig) -> Path:
    return state_folder(config.training.checkpoint_dir, config.collaboration.name, "kept-state")


def kept(config: PeerConfig) -> Checkpoint | None:
    """The keeper's newest checkpoint, as saved."""
    return load_latest_blob(kept_folder(config))


def kept_step(config: PeerConfig) -> int | None:
    return None if (checkpoint := kept(config)) is None else checkpoint.step


def blob_digest(blob: bytes) -> str:
    """The digest of a state blob, as a trainer holding it would report it."""
    names = [name for name, _ in TinyTask().build_model().named_parameters()]
    return states.state_digest(states.from_bytes(blob), names, LargeBatch.shared).digest


def held_step(trainers: list[Trainer], config: PeerConfig) -> int | None:
    """The step every trainer is at once none of them would call another, else None.

    A trainer calls a step on the samples projected from its throughput, so a step or two
    with no samples may follow HOLD_AT; once no one's view projects enough, and every new
    batch counts none, no one calls again."""
    steps = {t.step for t in trainers}
    if len(steps) != 1:
        return None
    (step,) = steps
    for trainer in trainers:
        view = trainer.view()
        if view.call(step) is not None or should_call(
            view,
            step,
            target_batch=config.task.target_batch,
            window=config.training.gather_window,
            now=trainer.clock(),
            horizon=2 * config.training.progress_interval,
        ):
            return None
    return step


async def wait_until(condition: Callable[[], bool]) -> None:
    while not condition():
        await trio.sleep(0.05)


async def progress(dht: DHT, config: PeerConfig) -> list[ProgressRecord]:
    """The records of the peers still here (a peer that left leaves a `leaving` one)."""
    name = config.collaboration.name
    records = decode_progress(await dht.get(progress_key(name)), collaboration=name)
    return [r for r in records if not r.leaving]


async def start_stoppable(nursery: trio.Nursery, fn, *args) -> tuple[Any, trio.CancelScope]:
    """`nursery.start(fn, *args)` in a cancel scope of its own: (what it started, the scope)."""
    scope = trio.CancelScope()

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        with scope:
            await fn(*args, task_status=task_status)

    return await nursery.start(run), scope


async def start_keeper(s: Swarm, config: PeerConfig) -> tuple[StateKeeper, trio.CancelScope]:
    """`run_keeper` on a node of its own, stoppable on its own."""
    dht = await s.add()
    return await start_stoppable(s.nursery, run_keeper, dht.node, dht, config)


async def download_from(
    node: Node, keeper: StateKeeper, *, min_step: int
) -> tuple[Snapshot, DownloadStatistics]:
    """A download that may only ask `keeper`: (the snapshot, the download's statistics)."""
    donor = keeper.dht.node
    node.remember_addrs(donor.peer_id, donor.announce)
    job = StateDownload(node, [donor.peer_id], min_step=min_step, parallel=3)
    snapshot = await job.run(deadline=trio.current_time() + 20)
    return snapshot, job.statistics()


@dataclass
class Followed:
    s: Swarm
    trainers: list[Trainer]
    keeper: StateKeeper
    config: PeerConfig
    """The keeper's."""
    training: trio.CancelScope
    """Cancel to stop every trainer."""
    step: int
    """The step the trainers are held at."""


@asynccontextmanager
async def followed(tmp_path: Path, *, trainers: int) -> AsyncIterator[Followed]:
    """Trainers held still, and a keeper (started before them) that holds their state."""
    config = make_config(tmp_path / "trainers")
    kept = keeper_config(tmp_path / "keeper")
    async with swarm(trainers, DHT_CONFIG) as s:
        group = Joinable(s, config, HoldAt(HOLD_AT))
        for dht in s.dhts:
            await group.add(dht)
        keeper, _ = await start_keeper(s, kept)

        async def train(task_status: trio.TaskStatus[None]) -> None:
            async with trio.open_nursery() as nursery:
                for trainer in group.trainers:
                    nursery.start_soon(trainer.run)
                task_status.started()

        _, training = await start_stoppable(s.nursery, train)
        await wait_until(
            lambda: (
                (step := held_step(group.trainers, config)) is not None and kept_step(kept) == step
            )
        )
        yield Followed(s, group.trainers, keeper, kept, training, group.trainers[0].step)


async def test_the_keeper_follows_the_trainers_and_saves_their_state(tmp_path):
    with trio.fail_after(60):
        async with followed(tmp_path, trainers=2) as f:
            digests = {t.digest for t in f.trainers}
            trainer_blob = bytes((await f.trainers[0].snapshot()).blob)
            held = await f.keeper.snapshot()
    assert f.step >= HOLD_AT
    assert len(digests) == 1
    (digest,) = digests
    assert held is not None and held.step == f.step
    assert held.blob == trainer_blob  # the consensus state, bit for bit
    assert not held.disposable  # served: nobody may give its pages back
    assert f.keeper.digest == digest
    # On disk: a checkpoint of the blob, its record naming the digest and signatures.
    saved = kept(f.config)
    assert saved is not None and saved.step == f.step
    assert saved.blob == held.blob
    assert saved.extra == {
        "digest": digest,
        # The trainers' signatures of (step, digest): the keeper's record certifies the state
        # after they leave.
        "signatures": [[s.signer, s.signature.hex()] for s in f.keeper.signatures],
    }
    assert sorted(s.signer for s in f.keeper.signatures) == sorted(t.me for t in f.trainers)
    assert 1 <= len(list(kept_folder(f.config).glob("step-*.json"))) <= KEEP
    assert states.from_bytes(saved.blob).step == f.step
    assert blob_digest(saved.blob) == digest


async def test_a_joiner_downloads_from_the_keeper_alone_when_no_trainer_is_online(tmp_path):
    with trio.fail_after(60):
        async with followed(tmp_path, trainers=2) as f:
            (digest,) = {t.digest for t in f.trainers}
            f.training.cancel()  # every trainer stops and withdraws its record
            while [r.role for r in await progress(f.keeper.dht, f.config)] != ["keeper"]:
                await trio.sleep(0.1)
            # A joiner of its own (its own checkpoint folder: nothing to resume from) that
            # stops once it holds the trainers' step: it can only get there by downloading.
            joining = make_config(tmp_path / "joiner", max_steps=f.step)
            joiners = Joinable(f.s, joining, None)
            dht = await f.s.add()
            # Its DHT finds the keeper's record first: a joiner whose first reads miss every
            # record (a lookup cut short on a loaded machine) trains alone from step 0, and
            # the tiny task reaches max_steps in a second (once seen: downloads == 0).
            while [r.role for r in await progress(dht, f.config)] != ["keeper"]:
                await trio.sleep(0.1)
            joiner = await joiners.add(dht)
            await joiner.run()
    assert joiner.step == f.step
    assert joiner.status().downloads == 1
    assert joiner.status().steps_applied == 0
    assert joiner.digest == digest
    assert states.parameters_digest(joiner.worker.model) == states.parameters_digest(
        f.trainers[0].worker.model
    )
    (download,) = joiners.downloads
    stats = download.statistics()
    assert stats.done == stats.chunks >= 1
    assert set(stats.chunks_from) == {str(f.keeper.dht.node.peer_id)}


async def publish(dht: DHT, config: PeerConfig, record: ProgressRecord | None) -> None:
    key, me = progress_key(config.collaboration.name), dht.node.peer_id.to_base58()
    if record is None:
        await dht.withdraw(key, me, expiration=time.time() + 120)
    else:
        await dht.store(key, me, encode_progress(record), expiration=time.time() + 60)


COSIGNER = new_identity()


def trainer_record(
    dht: DHT, config: PeerConfig, *, step: int, digest: str, cosigned: bool = True
) -> ProgressRecord:
    """What a trainer at `step` would publish (no samples, no call), its state signed by
    itself and (`cosigned`) one other member of the round that made it."""
    me, name = dht.node.peer_id.to_base58(), config.collaboration.name
    signers = [(dht.node.identity, me)]
    if cosigned:
        signers.append((COSIGNER, COSIGNER.peer_id.to_base58()))
    return ProgressRecord(
        peer_id=dht.node.peer_id.to_base58(),
        role="trainer",
        addrs=dht.node.public_addrs(),
        step=step,
        digest=digest,
        samples=0,
        samples_per_second=0.0,
        updated_at=time.time(),
        signatures=[
            sign_step(identity.key_pair.private_key, peer_id, name, step, digest)
            for identity, peer_id in signers
        ],
        fingerprint=state_digester(config)[1].digest,  # a trainer of the keeper's task
    )


def a_state(step: int, *, padding: int = 0) -> tuple[Snapshot, str]:
    """A state of the tiny task at `step` (parameters moved off their initial values, by an
    amount that depends on the step)."""
    task = TinyTask()
    model = task.build_model()
    for parameter in model.parameters():
        parameter.data.add_(0.1 * step)
    optimizers = LargeBatch(task, model).optimizers()
    state = states.capture(step, model, optimizers)
    if padding:  # a buffer (not in the digest) that makes the blob `padding` bytes bigger
        state.tensors["model.padding"] = torch.zeros(padding, dtype=torch.uint8)
    names = [name for name, _ in model.named_parameters()]
    digest = states.state_digest(state, names, LargeBatch.shared).digest
    return Snapshot(step, states.to_bytes(state)), digest


async def test_a_restarted_keeper_serves_what_it_saved_unless_the_blob_does_not_match(tmp_path):
    config = keeper_config(tmp_path)
    state, digest = a_state(3)
    with trio.fail_after(60):
        async with swarm(1, DHT_CONFIG) as s:
            # A "trainer" at step 3: a donor and its progress record, nothing else.
            holder = s.dhts[0]
            donor = StateDonor(holder.node, held(state), chunk_bytes=MIN_CHUNK_BYTES)
            _, holding = await start_stoppable(s.nursery, donor.serve, "127.0.0.1", 0)
            await publish(holder, config, trainer_record(holder, config, step=3, digest=digest))
            _, stop_first = await start_keeper(s, config)
            await wait_until(lambda: kept_step(config) == 3)
            stop_first.cancel()
            # The trainer goes away: from now on only what the keeper saved can be served.
            holding.cancel()
            await publish(holder, config, None)
            assert kept(config).extra["digest"] == digest

            restarted, stop_restarted = await start_keeper(s, config)
            assert await restarted.snapshot() == state  # loaded before it read any record
            assert restarted.digest == digest
            snapshot, stats = await download_from(holder.node, restarted, min_step=3)
            assert snapshot == state
            assert set(stats.chunks_from) == {str(restarted.dht.node.peer_id)}
            # ... and tells joiners so: its record names the step it loaded.
            me = restarted.dht.node.peer_id.to_base58()
            while not (mine := [r for r in await progress(holder, config) if r.peer_id == me]):
                await trio.sleep(0.1)
            assert [(r.role, r.step, r.digest) for r in mine] == [("keeper", 3, digest)]
            stop_restarted.cancel()

            # A blob that does not match its recorded hash (a damaged disk) is not served.
            (payload,) = kept_folder(config).glob("step-3-*.safetensors")
            damaged = bytearray(payload.read_bytes())
            damaged[len(damaged) // 2] ^= 0xFF
            payload.write_bytes(bytes(damaged))
            ignoring, _ = await start_keeper(s, config)
            assert await ignoring.snapshot() is None
            with pytest.raises(StateDownloadFailed, match="holding nothing"):
                await download_from(holder.node, ignoring, min_step=3)


class SlowChunks(ForwardingStream):
    """A donor's data connection that waits `delay` seconds before each chunk's bytes."""

    def __init__(self, inner: trio.SocketStream, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    async def send_all(self, data) -> None:
        if len(data) > REPLY.size:  # a chunk's bytes (a reply header is REPLY.size bytes)
            await trio.sleep(self.delay)
        await self.inner.send_all(data)


async def test_a_state_slower_to_download_than_one_progress_exchange_is_still_kept(tmp_path):
    # The keeper reads and publishes progress under a deadline of max(1 s, rpc_timeout), here
    # 1 s; the download has its own (state.download_timeout): 30 chunks at 0.1 s, ~3 s.
    config = keeper_config(tmp_path)
    config = dataclasses.replace(config, net=dataclasses.replace(config.net, rpc_timeout=0.5))
    state, digest = a_state(3, padding=30 * MIN_CHUNK_BYTES)
    with trio.fail_after(30):
        async with swarm(1, DHT_CONFIG) as s:
            holder = s.dhts[0]
            donor = StateDonor(
                holder.node,
                held(state),
                chunk_bytes=MIN_CHUNK_BYTES,
                wrap_stream=lambda stream: SlowChunks(stream, 0.1),
            )
            await s.nursery.start(donor.serve, "127.0.0.1", 0)
            await publish(holder, config, trainer_record(holder, config, step=3, digest=digest))
            keeper, _ = await start_keeper(s, config)
            await wait_until(lambda: kept_step(config) == 3)
    assert await keeper.snapshot() == state
    assert kept(config).blob == state.blob


async def test_a_state_newer_than_its_donors_records_is_kept_only_under_its_own_digest(tmp_path):
    config = keeper_config(tmp_path)
    _, old_digest = a_state(3)
    new_state, new_digest = a_state(4)
    with trio.fail_after(30):
        async with swarm(1, DHT_CONFIG) as s:
            holder = s.dhts[0]
            # The trainer has stepped to 4; its record (published every interval) says 3.
            donor = StateDonor(holder.node, held(new_state), chunk_bytes=MIN_CHUNK_BYTES)
            await s.nursery.start(donor.serve, "127.0.0.1", 0)
            await publish(holder, config, trainer_record(holder, config, step=3, digest=old_digest))
            keeper, _ = await start_keeper(s, config)
            # Asking for 3, the keeper gets 4, whose digest no record names: it keeps nothing
            # (and asks again next round), rather than name 4's parameters by 3's digest.
            chunks = len(fixed_ends(len(new_state.blob), MIN_CHUNK_BYTES))
            await wait_until(lambda: donor.statistics().chunks_served >= 2 * chunks)
            assert await keeper.snapshot() is None
            assert kept(config) is None
            # The record catches up: step 4 is kept, under its own digest.
            await publish(holder, config, trainer_record(holder, config, step=4, digest=new_digest))
            await wait_until(lambda: kept_step(config) == 4)
    assert kept(config).extra["digest"] == new_digest
    assert await keeper.snapshot() == new_state
    assert keeper.digest == new_digest


def a_keeper(directory: Path) -> StateKeeper:
    """A keeper on `directory` that only saves and loads (no DHT, nothing to fetch)."""
    node = SimpleNamespace(peer_id=ID.from_pubkey(create_new_key_pair().public_key))
    return StateKeeper(
        SimpleNamespace(node=node),  # type: ignore[arg-type]
        PeerConfig(),
        fetch=None,  # type: ignore[arg-type]
        digest=None,  # type: ignore[arg-type]
        directory=directory,
        fingerprint="",
    )


def signed(step: int, digest: str) -> StepSignature:
    """COSIGNER's signature of (step, digest) in the default config's collaboration."""
    name = PeerConfig().collaboration.name
    return sign_step(
        COSIGNER.key_pair.private_key, COSIGNER.peer_id.to_base58(), name, step, digest
    )


def loaded(directory: Path) -> tuple[Snapshot | None, str, list[StepSignature]]:
    """What a keeper started on `directory` holds."""
    keeper = a_keeper(directory)
    keeper._load()
    return keeper.held, keeper.digest, keeper.signatures


def test_what_the_keeper_saves_loads_back_with_its_signatures_checked_again(tmp_path):
    keeper = a_keeper(tmp_path)
    good = signed(3, "d3")
    forged = StepSignature(new_identity().peer_id.to_base58(), good.signature)
    keeper._save(Snapshot(3, b"state of step 3"), "d3", [good, forged])
    assert loaded(tmp_path) == (Snapshot(3, b"state of step 3"), "d3", [good])
    # The checkpoint's record holds what was given (a hand edit could add a forged one).
    assert kept_signers(tmp_path) == sorted([good.signer, forged.signer])


def kept_signers(directory: Path) -> list[str]:
    checkpoint = load_latest_blob(directory)
    assert checkpoint is not None and checkpoint.extra is not None
    return sorted(signer for signer, _ in checkpoint.extra["signatures"])


def test_a_kill_while_the_keeper_saves_keeps_the_old_state(tmp_path, monkeypatch):
    """The keeper's first design wrote kept.state in place, then kept.json: a kill between them
    left a blob whose hash did not match, and the keeper restarted with nothing to serve."""
    keeper = a_keeper(tmp_path)
    keeper._save(Snapshot(3, b"state of step 3"), "d3", [])
    real = checkpoint_module.write_atomically

    def dies_at_the_record(directory: Path, name: str, data: bytes) -> None:
        if name.endswith(".json"):
            raise KeyboardInterrupt("killed")
        real(directory, name, data)

    monkeypatch.setattr(checkpoint_module, "write_atomically", dies_at_the_record)
    with pytest.raises(KeyboardInterrupt):
        keeper._save(Snapshot(4, b"state of step 4"), "d4", [])
    monkeypatch.setattr(checkpoint_module, "write_atomically", real)
    assert loaded(tmp_path) == (Snapshot(3, b"state of step 3"), "d3", [])
    keeper._save(Snapshot(4, b"state of step 4"), "d4", [])  # the next save tidies up
    assert len(list(tmp_path.glob("*.safetensors"))) == KEEP
    assert loaded(tmp_path) == (Snapshot(4, b"state of step 4"), "d4", [])


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _edit_the_digest(path: Path) -> None:
    record = json.loads(path.read_text())
    record["extra"]["digest"] = 5
    path.write_text(json.dumps(record))


def _edit_the_signatures(path: Path) -> None:
    record = json.loads(path.read_text())
    record["extra"]["signatures"] = [["signer", "not hex"]]
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (_flip_a_byte, "step-4-*.safetensors", "crc32"),
        (_edit_the_digest, "step-4.json", "expected a digest"),
        (_edit_the_signatures, "step-4.json", "non-hexadecimal"),
    ],
)
def test_a_damaged_newest_kept_state_falls_back_to_the_older(
    tmp_path, caplog, damage, file, message
):
    keeper = a_keeper(tmp_path)
    keeper._save(Snapshot(3, b"state of step 3"), "d3", [signed(3, "d3")])
    keeper._save(Snapshot(4, b"state of step 4"), "d4", [signed(4, "d4")])
    (path,) = tmp_path.glob(file)
    damage(path)
    with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
        assert loaded(tmp_path) == (Snapshot(3, b"state of step 3"), "d3", [signed(3, "d3")])
    assert any(message in r.getMessage() for r in caplog.records), caplog.records


def write_old_format(directory: Path, snapshot: Snapshot, digest: str, signatures: list) -> None:
    """kept.json and its blob, as the keeper wrote them before it saved checkpoints."""
    directory.mkdir(parents=True, exist_ok=True)
    sha = hashlib.sha256(snapshot.blob).hexdigest()
    (directory / f"kept-{sha[:16]}.state").write_bytes(snapshot.blob)
    meta = {
        "step": snapshot.step,
        "digest": digest,
        "sha256": sha,
        "file": f"kept-{sha[:16]}.state",
        "signatures": [[s.signer, s.signature.hex()] for s in signatures],
    }
    (directory / "kept.json").write_text(json.dumps(meta))


def test_the_state_kept_by_a_previous_version_is_served_until_the_next_save(tmp_path):
    good = signed(3, "d3")
    forged = StepSignature(COSIGNER.peer_id.to_base58(), bytes(64))
    write_old_format(tmp_path, Snapshot(3, b"state of step 3"), "d3", [good, forged])
    assert loaded(tmp_path) == (Snapshot(3, b"state of step 3"), "d3", [good])

    a_keeper(tmp_path)._save(Snapshot(4, b"state of step 4"), "d4", [])
    assert not list(tmp_path.glob("kept*")), "the old format's files are gone"
    assert loaded(tmp_path) == (Snapshot(4, b"state of step 4"), "d4", [])


def test_a_damaged_old_kept_state_is_not_served(tmp_path):
    write_old_format(tmp_path, Snapshot(3, b"state of step 3"), "d3", [])
    (blob,) = tmp_path.glob("kept-*.state")
    _flip_a_byte(blob)
    assert loaded(tmp_path) == (None, "", [])
    (tmp_path / "kept.json").write_text('{"step": "three"}')  # a hand edit: never raises
    assert loaded(tmp_path) == (None, "", [])
