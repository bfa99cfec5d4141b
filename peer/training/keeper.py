"""The state keeper (`backbone start --keep-state`): a backbone that follows the collaboration's
progress, downloads each newer consensus state, keeps it on disk and serves it to joiners.

It trains nothing, so joiners can download the state even when few trainers are online (or
none: after a restart it serves what it last saved). It takes only a certified (step, digest)
(`peer.training.certificate`) and checks the bytes it got against the digest. It publishes a
progress record with role "keeper", that digest and the trainers' signatures of it (so that
its record certifies the state after they leave), and is asked last by downloaders.

It saves what it keeps as a checkpoint (`peer.training.checkpoint.save_blob`: atomic, the blob
as received, the digest and signatures in the checkpoint's record) in its own folder, and
loads the newest intact one at start. A folder of a version before that (`kept.json` naming a
`kept-<sha>.state` blob) is served until the first save, which removes it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.files import state_folder
from peer.net.host import Node, data_plane_hosts
from peer.training import state as states
from peer.training.certificate import MAX_SIGNATURES, StepSignature, valid_signatures
from peer.training.checkpoint import Checkpoint, load_latest_blob, save_blob
from peer.training.layout import Fingerprint, layout, task_fingerprint
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
)
from peer.training.publisher import ProgressPublisher, fetch_certified
from peer.training.statesync import Snapshot, StateDonor, download_state
from peer.training.strategies import SHARED_OPTIMIZERS
from peer.training.task import load_task
from peer.training.timing import Timing

log = logging.getLogger("peertrain.keeper")

#: Fetches the state of `step` (or newer) from the given holders.
Fetch = Callable[[list[ProgressRecord], int], Awaitable[Snapshot]]
#: The digest of a state (`state.state_digest`), and where its blob's layout parts end;
#: StateMismatch if it is no state.
Digest = Callable[[Snapshot], tuple[str, tuple[int, ...]]]
#: What is kept: the state, its certified digest and the signatures of (step, digest).
Kept = tuple[Snapshot, str, list[StepSignature]]

#: Checkpoints kept on disk: the newest, and one to fall back to if it rots (twice the disk).
KEEP = 2
#: The files of the format before checkpoints (kept.json naming a kept-<sha>.state blob).
_OLD_META = "kept.json"


class StateKeeper:
    def __init__(
        self,
        dht: DHT,
        config: PeerConfig,
        *,
        fetch: Fetch,
        digest: Digest,
        directory: Path,
        fingerprint: str,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht = dht
        self.config = config
        self.fetch = fetch
        self.digest_of = digest
        #: The task's fingerprint (`layout.py`): we keep only the states of its trainers.
        self.fingerprint = fingerprint
        self.directory = directory
        self.clock = clock
        self.timing = Timing.of(config)
        self.me = dht.node.peer_id.to_base58()
        self.held: Snapshot | None = None
        self.digest = ""
        self.signatures: list[StepSignature] = []

    async def snapshot(self) -> Snapshot | None:
        return self.held

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        # Off the loop: reading and hashing a large state takes seconds.
        await trio.to_thread.run_sync(self._load)
        read = trio.Event()
        views: list[CollaborationView] = []

        def on_read(view: CollaborationView) -> None:
            views[:] = [view.training(self.fingerprint)]
            read.set()

        progress = ProgressPublisher(
            self.dht,
            self.config,
            record=lambda: self._record() if self.held is not None else None,
            on_read=on_read,
            interval=self.timing.keeper_interval,
            longest_read_interval=self.timing.longest_read_interval,
            ttl=self.timing.keeper_ttl,
            clock=self.clock,
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(progress.run)
            task_status.started()
            while True:
                await read.wait()
                read = trio.Event()
                # Outside the exchange's deadline: a large state takes longer to download
                # than one exchange; `fetch` has a deadline of its own
                # (state.download_timeout).
                if await self._follow(views[0]):
                    progress.publish_now()

    async def _follow(self, view: CollaborationView) -> bool:
        """Download the certified global step if it is newer than ours; whether we did."""
        held_step = self.held.step if self.held else -1
        step = view.global_step  # certified
        donors = [r for r in view.donors(step) if r.role == "trainer"]
        if step <= held_step or not donors:
            return False

        async def parse(snapshot: Snapshot) -> tuple[tuple[int, ...], str]:
            digest, parts = await trio.to_thread.run_sync(self.digest_of, snapshot)
            return parts, digest

        try:
            snapshot, parts, digest = await fetch_certified(
                self.dht, self.fetch, donors, step, view=lambda: view, parse=parse, lowest=step
            )
        except RemoteError as error:
            log.warning("keeper could not take step %d: %s", step, error)
            return False
        if snapshot.step != step:
            # The donors stepped since our read, and the signatures we know are step's: a
            # record naming their newer state with them would certify nothing. The next read
            # names the newer step and its signatures.
            log.info("got step %d when asking for step %d; next round", snapshot.step, step)
            return False
        # Served along its layout (`Snapshot.parts`) with the hashes its download checked.
        # Served from now on: no longer a buffer anyone may give back.
        held = dataclasses.replace(snapshot, parts=parts, disposable=False)
        self.held, self.digest = held, digest
        signed = [
            s for r in view.records if r.step == step and r.digest == digest for s in r.signatures
        ]
        self.signatures = valid_signatures(signed, self.config.collaboration.name, step, digest)
        await trio.to_thread.run_sync(self._save, snapshot, self.digest, self.signatures)
        log.info("keeping the state of step %d (%d bytes)", snapshot.step, len(snapshot.blob))
        return True

    def _record(self) -> ProgressRecord:
        assert self.held is not None
        return ProgressRecord(
            peer_id=self.me,
            role="keeper",
            addrs=self.dht.node.public_addrs(),
            step=self.held.step,
            digest=self.digest,
            samples=0,
            samples_per_second=0.0,
            updated_at=self.clock(),
            signatures=self.signatures[:MAX_SIGNATURES],  # few keepers: as many as any reader takes
            fingerprint=self.fingerprint,
        )

    def _save(self, snapshot: Snapshot, digest: str, signatures: list[StepSignature]) -> None:
        """Save a checkpoint of `snapshot` (blocking: call it in a thread), then remove the files
        of the old format, if any (the metadata first: it must never name a missing blob)."""
        extra = {
            "digest": digest,
            "signatures": [[s.signer, s.signature.hex()] for s in signatures],
        }
        save_blob(self.directory, snapshot.step, snapshot.blob, extra=extra, keep=KEEP)
        (self.directory / _OLD_META).unlink(missing_ok=True)
        for path in self.directory.glob("kept*.state"):
            path.unlink(missing_ok=True)

    def _load(self) -> None:
        """Hold the newest intact checkpoint, or else the old format's state, if any (blocking:
        call it in a thread before anything reads what is held)."""
        kept = load_latest_blob(self.directory, parse=self._parse)
        if kept is None:
            kept = self._load_old_format()
        if kept is None:
            return
        self.held, self.digest, self.signatures = kept
        log.info("serving the kept state of step %d", self.held.step)

    def _parse(self, checkpoint: Checkpoint) -> Kept:
        """What a checkpoint keeps; ValueError if its `extra` is not what `_save` writes."""
        extra = checkpoint.extra or {}
        digest, signed = extra.get("digest"), extra.get("signatures")
        if not isinstance(digest, str) or not isinstance(signed, list):
            raise ValueError(
                f"extra = {checkpoint.extra!r}, expected a digest and a list of signatures"
            )
        return self._kept(checkpoint.step, checkpoint.blob, digest, _signatures(signed))

    def _kept(self, step: int, blob: bytes, digest: str, signed: list[StepSignature]) -> Kept:
        """The signatures loaded back are checked again: a hand-edited file certifies nothing."""
        name = self.config.collaboration.name
        try:  # served along its layout, as trainers serve theirs (`Snapshot.parts`)
            parts = states.parse_blob(blob)[1].parts
        except states.StateMismatch:
            parts = ()
        signatures = valid_signatures(signed, name, step, digest)
        return Snapshot(step, blob, parts=parts), digest, signatures

    def _load_old_format(self) -> Kept | None:
        """kept.json and the blob it names, if they are intact, else None."""
        try:
            meta = json.loads((self.directory / _OLD_META).read_text())
            name = str(meta.get("file", "kept.state"))  # kept.state: saved before blobs had names
            if "/" in name or not name.endswith(".state"):
                return None
            blob = (self.directory / name).read_bytes()
            step, digest, sha = int(meta["step"]), str(meta["digest"]), str(meta["sha256"])
            signed = _signatures(meta.get("signatures", []))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
        if hashlib.sha256(blob).hexdigest() != sha:
            log.warning("ignoring the kept state in %s: its hash does not match", self.directory)
            return None
        return self._kept(step, blob, digest, signed)


def _signatures(pairs: Any) -> list[StepSignature]:
    """[[signer, signature hex], ...] as `_save` writes them; ValueError if they are not."""
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(x, str) for x in p) for p in pairs
    ):
        raise ValueError(f"signatures = {pairs!r}, expected [[signer, signature hex], ...]")
    return [StepSignature(signer, bytes.fromhex(signature)) for signer, signature in pairs]


async def run_keeper(
    node: Node,
    dht: DHT,
    config: PeerConfig,
    *,
    task_status: trio.TaskStatus[StateKeeper] = trio.TASK_STATUS_IGNORED,
) -> None:
    """The keeper and the donor that serves what it keeps."""
    bind, advertised = data_plane_hosts(node, config.net.listen)

    async def fetch(donors: list[ProgressRecord], step: int) -> Snapshot:
        return await download_state(
            node,
            [ID.from_base58(r.peer_id) for r in donors],
            min_step=step,
            parallel=config.state.parallel_donors,
            deadline=trio.current_time() + config.state.download_timeout,
        )

    digest, fingerprint = state_digester(config)
    keeper = StateKeeper(
        dht,
        config,
        fetch=fetch,
        digest=digest,
        fingerprint=fingerprint.digest,
        directory=state_folder(
            config.training.checkpoint_dir, config.collaboration.name, "kept-state"
        ),
    )
    donor = StateDonor(
        node,
        keeper.snapshot,
        max_downloads=config.state.max_uploads,
        chunk_bytes=config.state.chunk_bytes,
        advertised_host=advertised,
        caller_states=config.state.caller_states,
        caller_window=config.state.caller_window,
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(donor.serve, bind, 0)
        await nursery.start(keeper.run)
        task_status.started(keeper)


def state_digester(config: PeerConfig) -> tuple[Digest, Fingerprint]:
    """What `StateKeeper` checks a state's bytes with: the digest a trainer of the task
    computes (`TorchWorker.digest`), from the model's certified tensor names; and the task's
    fingerprint. The model is built on torch's meta device: names and shapes, no memory."""
    task = load_task(config.task.name, config.task.args)
    training = config.training
    with torch.device("meta"):
        model = task.build_model()
        fingerprint = task_fingerprint(
            task, model, mode=training.mode, average_buffers=training.average_buffers
        )
    names = layout(model, average_buffers=training.average_buffers).certified
    shared = SHARED_OPTIMIZERS[config.training.mode]

    def digest(snapshot: Snapshot) -> tuple[str, tuple[int, ...]]:
        state, layout = states.parse_blob(bytes(snapshot.blob))
        certified = states.state_digest(state, names, shared, known=layout.known(snapshot.hashes))
        return certified.digest, layout.parts

    return digest, fingerprint
