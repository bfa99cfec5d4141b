"""Training inside the daemon: the data plane, the averager, the state donor and the trainer,
composed and owned by one nursery.

    DataServer (all-reduce TCP) -> Averager -> Trainer <- state download from donors
                                               Trainer -> StateDonor (serves our state)
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable

import torch
import trio
from libp2p.peer.id import ID

from peer.averaging.averager import start_averager
from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.measure.compute import gradient_bytes
from peer.measure.service import Measurements
from peer.net.host import Node, data_plane_hosts
from peer.training.progress import ProgressRecord
from peer.training.statesync import Snapshot, StateDonor, StateDownload
from peer.training.statesync.inplace import Sink
from peer.training.task import Task
from peer.training.tracking import open_tracker
from peer.training.trainer import Trainer
from peer.training.worker import TorchWorker, WorkerFactory


async def run_training(
    node: Node,
    dht: DHT,
    config: PeerConfig,
    task: Task,
    device: torch.device,
    measurements: Measurements,
    *,
    on_trainer: Callable[[Trainer], None] = lambda trainer: None,
    make_worker: WorkerFactory = TorchWorker,
    task_status: trio.TaskStatus[Trainer] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Train until the trainer finishes (max_steps or the validation target) or is cancelled.
    `make_worker`: the worker that owns the model (another for a training loop of the user's
    own, `peer.embed`)."""
    bind, advertised = data_plane_hosts(node, config.net.listen)  # the donor's too
    # In a thread: torch's writer imports TensorBoard and opens its file.
    tracker = await trio.to_thread.run_sync(
        open_tracker, config.log.tensorboard_dir, node.peer_id.to_base58()
    )
    # Closed once every task that writes to it has ended (the trainer's own included).
    with contextlib.closing(tracker):
        async with trio.open_nursery() as nursery:
            averager = await start_averager(nursery, node, dht, config)
            identity = averager.data_server.identity

            def job(donors: list[ProgressRecord], step: int) -> tuple[StateDownload, float]:
                """A download of `step` from `donors`, and its deadline."""
                limit = state_bytes_limit(trainer.worker.model)
                capabilities = measurements.capabilities()
                bandwidth = capabilities.download_bps if capabilities else None
                download = StateDownload(
                    node,
                    [ID.from_base58(r.peer_id) for r in donors],
                    min_step=step,
                    parallel=config.state.parallel_donors,
                    max_total_bytes=limit,
                    rpc_timeout=manifest_seconds(config, limit),
                )
                return download, trio.current_time() + download_seconds(config, limit, bandwidth)

            async def download(donors: list[ProgressRecord], step: int) -> Snapshot:
                state, deadline = job(donors, step)
                return await state.run(deadline=deadline)

            async def download_into(donors: list[ProgressRecord], step: int, sink: Sink) -> int:
                state, deadline = job(donors, step)
                return await state.run_into(sink, deadline=deadline)

            # Building a large model (its initialisation, the optimizers, the accumulators) takes
            # seconds: in a thread, or the event loop stalls (1.4 s at 10 M parameters).
            worker = await trio.to_thread.run_sync(
                functools.partial(
                    make_worker, task, config, device=device, peer_id=node.peer_id.to_base58()
                )
            )
            # The interpreter's heap is now mostly torch's and the model's bookkeeping: out of the
            # cyclic GC's reach, or each full collection scans it all on the event loop (a full
            # collection of a shared heap was the whole p99 of the DHT benchmark's stores).
            gc.freeze()
            measurements.observe_model(gradient_bytes(worker.model))
            trainer = Trainer(
                worker=worker,
                dht=dht,
                averager=averager,
                config=config,
                task=task,
                device=device,
                download=download,
                download_into=download_into,
                capabilities=measurements.capabilities,
                observe_training=measurements.observe_training,
                clock=dht.clock,
                tracker=tracker,
            )
            donor = StateDonor(
                node,
                trainer.snapshot,
                identity=identity,
                max_downloads=config.state.max_uploads,
                chunk_bytes=config.state.chunk_bytes,
                advertised_host=advertised,
                caller_states=config.state.caller_states,
                caller_window=config.state.caller_window,
            )
            await nursery.start(donor.serve, bind, 0)
            on_trainer(trainer)
            await nursery.start(trainer.run)
            task_status.started(trainer)
            await trainer.finished.wait()
            nursery.cancel_scope.cancel()


#: Bytes per second a donor serializes and hashes a state at before its manifest answers, at
#: least (~1 GB/s each on an idle core of this machine class; a tenth for a loaded one).
PREPARE_BPS = 100e6
#: The share of a link's measured download bandwidth a state download is given time for.
DOWNLOAD_SHARE = 1 / 3


def manifest_seconds(config: PeerConfig, state_bytes: int) -> float:
    """Deadline of a manifest call: the RPC timeout plus the donor's preparation of a state of
    up to `state_bytes` (a fixed 5 s timed out the first downloads of a 38 M-parameter model)."""
    return config.net.rpc_timeout + state_bytes / PREPARE_BPS


def download_seconds(config: PeerConfig, state_bytes: int, bandwidth_bps: float | None) -> float:
    """Deadline of a whole download: `state.download_timeout`, or longer where moving
    `state_bytes` at a third of our measured download bandwidth (bytes/s) takes longer."""
    transfer = state_bytes / (bandwidth_bps * DOWNLOAD_SHARE) if bandwidth_bps else 0.0
    return max(config.state.download_timeout, manifest_seconds(config, state_bytes) + transfer)


def state_bytes_limit(model: torch.nn.Module) -> int:
    """The largest state we accept from a donor for `model`: its parameters, an optimizer's
    state of up to 3 times their size (AdamW holds 2), and 64 MiB for the rest. A donor that
    offered more made every downloader set aside its figure (up to 64 GiB) for a tiny model."""
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return 4 * parameter_bytes + (64 << 20)
