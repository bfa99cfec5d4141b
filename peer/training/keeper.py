"""The state keeper (`backbone start --keep-state`): a backbone that follows the collaboration's
progress, downloads each newer consensus state, keeps it on disk and serves it to joiners.

It trains nothing, so joiners can download the state even when few trainers are online (or
none: after a restart it serves what it last saved). It publishes a progress record with role
"keeper" and the digest of the trainers it copied, and is asked last by downloaders.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import trio
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.files import state_folder, write_atomically
from peer.net.host import Node, data_plane_hosts, parse_addrs
from peer.training.progress import (
    CollaborationView,
    ProgressRecord,
    decode_progress,
    encode_progress,
    progress_key,
)
from peer.training.statesync import Snapshot, StateDonor, download_state

log = logging.getLogger("peertrain.keeper")

Fetch = Callable[[list[ID], int], Awaitable[Snapshot]]


class StateKeeper:
    def __init__(
        self,
        dht: DHT,
        config: PeerConfig,
        *,
        fetch: Fetch,
        directory: Path,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.dht = dht
        self.config = config
        self.fetch = fetch
        self.directory = directory
        self.clock = clock
        self.me = dht.node.peer_id.to_base58()
        self.held: Snapshot | None = None
        self.digest = ""

    def snapshot(self) -> Snapshot | None:
        return self.held

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self._load()
        task_status.started()
        key = progress_key(self.config.collaboration.name)
        interval = max(self.config.training.progress_interval, 1.0)
        exchange = max(interval, self.config.net.rpc_timeout)
        while True:
            try:
                view = None
                with trio.move_on_after(exchange):
                    view = CollaborationView(decode_progress(await self.dht.get(key)))
                # Outside the exchange's deadline: a large state takes longer to download
                # than one exchange (under it, every round would cancel and restart the
                # download); `fetch` has a deadline of its own (state.download_timeout).
                if view is not None:
                    await self._follow(view)
                if self.held is not None:
                    record = self._record()
                    with trio.move_on_after(exchange):
                        await self.dht.store(
                            key,
                            self.me,
                            encode_progress(record),
                            expiration=record.updated_at + 3 * interval,
                        )
            except RemoteError as error:
                log.debug("keeper progress exchange failed: %s", error)
            await trio.sleep(interval)

    async def _follow(self, view: CollaborationView) -> None:
        held_step = self.held.step if self.held else -1
        step = view.global_step
        donors = [r for r in view.donors(step) if r.role == "trainer"]
        if step <= held_step or not donors:
            return
        for record in donors:
            self.dht.node.remember_addrs(ID.from_base58(record.peer_id), parse_addrs(record.addrs))
        try:
            snapshot = await self.fetch([ID.from_base58(r.peer_id) for r in donors], step)
        except RemoteError as error:
            log.warning("keeper could not download step %d: %s", step, error)
            return
        if snapshot.step != step:
            # The donors stepped since our read, and the digest we know is step's: a record
            # naming their state by it would send joiners back for the state again and again
            # (their digest never matches). The next read names the newer step and its digest.
            log.info("got step %d when asking for step %d; next round", snapshot.step, step)
            return
        self.held = snapshot
        self.digest = donors[0].digest
        await trio.to_thread.run_sync(self._save, snapshot, self.digest)
        log.info("keeping the state of step %d (%d bytes)", snapshot.step, len(snapshot.blob))

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
        )

    # The blob goes to a file named by its hash (never one kept.json names), then kept.json is
    # replaced atomically (the commit), then the older blobs go: a kill at any point leaves the
    # old state or the new one whole (the chaos suite caught a kill between two in-place writes
    # losing the state of the old design).
    def _save(self, snapshot: Snapshot, digest: str) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        sha = hashlib.sha256(snapshot.blob).hexdigest()
        name = f"kept-{sha[:16]}.state"
        write_atomically(self.directory, name, snapshot.blob)
        meta = {"step": snapshot.step, "digest": digest, "sha256": sha, "file": name}
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
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        if hashlib.sha256(blob).hexdigest() != sha:
            log.warning("ignoring the kept state in %s: its hash does not match", self.directory)
            return
        self.held = Snapshot(step, blob)
        self.digest = digest
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

    async def fetch(donors: list[ID], step: int) -> Snapshot:
        return await download_state(
            node,
            donors,
            min_step=step,
            parallel=config.state.parallel_donors,
            deadline=trio.current_time() + config.state.download_timeout,
        )

    keeper = StateKeeper(
        dht,
        config,
        fetch=fetch,
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
