"""The state keeper (`backbone start --keep-state`): a backbone that follows the collaboration's
progress, downloads each newer consensus state, keeps it on disk and serves it to joiners.

It trains nothing, so joiners can download the state even when few trainers are online (or
none: after a restart it serves what it last saved). It takes only a certified (step, digest)
(`peer.training.certificate`) and checks the bytes it got against the digest. It publishes a
progress record with role "keeper", that digest and the trainers' signatures of it (so that
its record certifies the state after they leave), and is asked last by downloaders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import torch
import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.files import state_folder, write_atomically
from peer.net.host import Node, data_plane_hosts
from peer.training import state as states
from peer.training.certificate import MAX_SIGNATURES, StepSignature, valid_signatures
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
#: The digest of a state's bytes (`state.state_digest`); StateMismatch if they are no state.
Digest = Callable[[bytes], str]


class StateKeeper:
    def __init__(
        self,
        dht: DHT,
        config: PeerConfig,
        *,
        fetch: Fetch,
        digest: Digest,
        directory: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht = dht
        self.config = config
        self.fetch = fetch
        self.digest_of = digest
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
        self._load()
        read = trio.Event()
        views: list[CollaborationView] = []

        def on_read(view: CollaborationView) -> None:
            views[:] = [view]
            read.set()

        progress = ProgressPublisher(
            self.dht,
            self.config,
            record=lambda: self._record() if self.held is not None else None,
            on_read=on_read,
            interval=self.timing.keeper_interval,
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

        async def parse(blob: bytes) -> tuple[None, str]:
            return None, await trio.to_thread.run_sync(self.digest_of, blob)

        try:
            snapshot, _, digest = await fetch_certified(
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
        self.held, self.digest = snapshot, digest
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
            signatures=self.signatures[:MAX_SIGNATURES],
        )

    # The blob goes to a file named by its hash (never one kept.json names), then kept.json is
    # replaced atomically (the commit), then the older blobs go: a kill at any point leaves the
    # old state or the new one whole (the chaos suite caught a kill between two in-place writes
    # losing the state of the old design).
    def _save(self, snapshot: Snapshot, digest: str, signatures: list[StepSignature]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sha = hashlib.sha256(snapshot.blob).hexdigest()
        name = f"kept-{sha[:16]}.state"
        write_atomically(self.directory, name, snapshot.blob)
        meta = {
            "step": snapshot.step,
            "digest": digest,
            "sha256": sha,
            "file": name,
            "signatures": [[s.signer, s.signature.hex()] for s in signatures],
        }
        write_atomically(self.directory, "kept.json", json.dumps(meta).encode())
        for path in self.directory.glob("kept*.state"):
            if path.name != name:
                path.unlink(missing_ok=True)

    def _load(self) -> None:
        try:
            meta = json.loads((self.directory / "kept.json").read_text())
            name = str(meta.get("file", "kept.state"))  # kept.state: saved before blobs had names
            if "/" in name or not name.endswith(".state"):
                return
            blob = (self.directory / name).read_bytes()
            step, digest, sha = int(meta["step"]), str(meta["digest"]), str(meta["sha256"])
            signed = [
                StepSignature(str(a), bytes.fromhex(b)) for a, b in meta.get("signatures", [])
            ]
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if hashlib.sha256(blob).hexdigest() != sha:
            log.warning("ignoring the kept state in %s: its hash does not match", self.directory)
            return
        self.held = Snapshot(step, blob)
        self.digest = digest
        self.signatures = valid_signatures(signed, self.config.collaboration.name, step, digest)
        log.info("serving the kept state of step %d", step)


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

    keeper = StateKeeper(
        dht,
        config,
        fetch=fetch,
        digest=state_digester(config),
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


def state_digester(config: PeerConfig) -> Digest:
    """What `StateKeeper` checks a state's bytes with: the digest a trainer of the task
    computes (`TorchWorker.digest`), from the model's parameter names. The model is built on
    torch's meta device: names and shapes, no memory."""
    task = load_task(config.task.name)
    with torch.device("meta"):
        names = [name for name, _ in task.build_model().named_parameters()]
    shared = SHARED_OPTIMIZERS[config.training.mode]

    def digest(blob: bytes) -> str:
        return states.state_digest(states.from_bytes(blob), names, shared)

    return digest
