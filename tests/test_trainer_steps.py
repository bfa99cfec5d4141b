"""The trainer as executor (no network): what it does with an averaging's result, a downloaded
state, a checkpoint and its progress records. Its decisions are `tests/test_policy.py`'s."""

from __future__ import annotations

import functools
import gc
import logging
import math
import os
import random
import subprocess
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import wait
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer import heap
from peer.averaging.allreduce import RoundReport
from peer.averaging.averager import AveragingResult
from peer.averaging.reduce import ChunkResult
from peer.config import AveragingConfig, PeerConfig, TaskConfig, TrainingConfig
from peer.errors import RemoteError
from peer.priority import NICENESS
from peer.training import checkpoint as checkpoints
from peer.training import state as states
from peer.training import trainer as trainer_module
from peer.training import worker as worker_module
from peer.training.policy import CatchUp, Compute, Outcome
from peer.training.progress import CollaborationView, ProgressRecord, VoteRecord
from peer.training.state import StateMismatch
from peer.training.statesync import Snapshot
from peer.training.steprule import Candidate, Vote, average_digest, plan_of
from peer.training.task import TinyTask
from peer.training.timing import STORES_PER_WINDOW
from peer.training.trainer import Trainer
from peer.training.worker import data_seed
from tests.test_publisher import get_each

INNER_STEPS = 2


class FakeMonotonic:
    """A monotonic clock for `Trainer(monotonic=...)` that moves only when a test says."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0  # monotonic
        self.now += seconds


async def no_records(key: str, *, hot: bool = False, strict: bool = False) -> dict:
    """A progress read of a DHT nobody else is in."""
    return {}


async def make_trainer(
    tmp_path,
    task=None,
    mode: str = "dedloc",
    max_steps: int = 0,
    min_group_size: int = 2,
    clock=None,
    monotonic: Callable[[], float] | None = None,
    **training,
) -> Trainer:
    key_pair = create_new_key_pair()
    peer_id = ID.from_pubkey(key_pair.public_key)
    dht = SimpleNamespace(
        node=SimpleNamespace(
            peer_id=peer_id,
            public_addrs=lambda: [],
            identity=SimpleNamespace(key_pair=key_pair),
            remember_addrs=lambda *args: None,
        ),
        looks_up=lambda key: True,
        lookup_seconds=0.0,
        get=no_records,
        rng=random.Random(0),
        clock=time.time,
    )
    dht.get_many = functools.partial(get_each, dht)  # through its `get`, which a test may swap
    trainer = Trainer(
        dht=dht,  # type: ignore[arg-type]
        averager=None,  # type: ignore[arg-type]
        config=PeerConfig(
            averaging=AveragingConfig(min_group_size=min_group_size),
            task=TaskConfig(name="tiny", micro_batch=8, target_batch=64),
            training=TrainingConfig(
                checkpoint_dir=str(tmp_path), mode=mode, max_steps=max_steps, **training
            ),
        ),
        task=task or TinyTask(),
        device=torch.device("cpu"),
        download=None,  # type: ignore[arg-type]
        **({"clock": clock} if clock else {}),
        **({"monotonic": monotonic} if monotonic else {}),
    )
    await trainer.prepare()
    trainer.policy.started()
    return trainer


def size_of(trainer: Trainer) -> int:
    return trainer.worker.vector_size


OTHERS = ("a-member", "b-member")  # the other members of a `group_result`'s group


def group_result(size: int, weight: float, *, complete: bool = True) -> AveragingResult:
    """What the averager returns: the exact average of `weight` samples over our group of
    three (us and OTHERS), or nothing."""
    report = RoundReport(chunks=[ChunkResult(0, size, 3)], seconds=1.25, bytes_sent=10)
    if not complete:
        report.dropped_senders["someone"] = "timed out"
        return AveragingResult(peers_seen=3, rounds=[report], skipped=["round 0: incomplete"])
    average = np.full(size, 0.25, dtype=np.float32)
    result = AveragingResult(peers_seen=3, rounds=[report], average=average, weight=weight)
    result.members, result.plan = 3, ("", *OTHERS)  # "": ours, set by `finish`
    return result


def others_vote_for(trainer: Trainer, result: AveragingResult) -> None:
    """The other members of the group, and of the step's electorate, hold our step and vote
    for the average we all got (the step rule certifies it: `Trainer._elect`)."""
    plan = plan_of(result.plan)
    assert result.average is not None
    choice = Candidate(trainer.step + 1, average_digest(result.average, result.weight), plan)
    electorate, _ = trainer.policy.electorate_for(choice)
    # Every other member of the step's electorate votes (from the second step a candidate
    # needs more than two thirds of it): OTHERS, and a donor we downloaded from, say.
    members = trainer.policy._plans.get(electorate, frozenset()) - {trainer.me}
    records = [
        ProgressRecord(
            peer_id=peer,
            role="trainer",
            addrs=[],
            step=trainer.step,
            digest=trainer.digest,
            samples=0,
            samples_per_second=0.0,
            updated_at=trainer.clock(),
            vote=VoteRecord.of(Vote(peer, choice, electorate)),
        )
        for peer in sorted(members | set(OTHERS))
    ]
    trainer.policy.observe(CollaborationView(records, trainer.policy.quorum), trainer.clock())


async def finish(trainer: Trainer, vector: np.ndarray, samples: int, result) -> None:
    """The end of an averaging we declared in (`policy.declare` leaves it AVERAGING); the
    others vote for its average."""
    assert trainer.policy.declare(1.0, trainer.clock(), in_background=False)
    if result.plan:
        result.plan = (trainer.me, *result.plan[1:])
        others_vote_for(trainer, result)
    await trainer._finish(vector, samples, result, 1.0)


async def take_steps(trainer: Trainer, count: int) -> None:
    """`count` global steps, each with the local work of the mode (diloco: H inner steps)."""
    size = size_of(trainer)
    for _ in range(count):
        if trainer.training.mode == "diloco":
            for _ in range(INNER_STEPS):
                await trainer.worker.compute()
        await finish(trainer, np.full(size, 0.5, dtype=np.float32), 8, group_result(size, 3))


async def adopt(trainer: Trainer, state: states.TrainingState, **kwargs) -> None:
    await trainer.worker.restore(state, **kwargs)
    await trainer._hold(state.step)


async def state_of(trainer: Trainer) -> states.TrainingState:
    snapshot = await trainer.snapshot()
    assert snapshot is not None
    return states.from_bytes(snapshot.blob)


async def saved_state(trainer: Trainer) -> states.TrainingState:
    """The held state as its checkpoint has it (a DiLoCo peer serves no inner optimizer)."""
    await trainer._checkpoint(force=True)
    saved = checkpoints.load_latest(trainer.checkpoint_dir)
    assert saved is not None and saved.step == trainer.step
    return saved


def parameters(trainer: Trainer) -> str:
    return states.parameters_digest(trainer.worker.model)


# ---------------------------------------------------------------------------- results


@pytest.mark.parametrize(
    ("samples", "weight", "complete", "steps"),
    [
        (8, 24, True, True),  # an ordinary step
        (0, 0, True, False),  # nobody had samples: nothing was averaged
        (8, 24, False, False),  # a member failed: our work waits for the next try
    ],
)
async def test_a_step_applies_the_average_and_a_failure_gives_our_work_back(
    tmp_path, samples, weight, complete, steps
):
    trainer = await make_trainer(tmp_path)
    before = parameters(trainer)
    size = size_of(trainer)
    await trainer.worker.compute()
    vector, samples_taken = await trainer.worker.take()
    assert samples_taken == 8
    await finish(trainer, vector, samples, group_result(size, weight, complete=complete))
    assert trainer.step == (1 if steps else 0)
    assert (parameters(trainer) != before) == steps
    if steps:  # the step took the average, not our own contribution
        expected = TinyTask().build_model()
        optimizer = TinyTask().make_optimizer(expected.parameters())
        for p in expected.parameters():
            p.grad = torch.full_like(p, 0.25)
        optimizer.step()
        assert parameters(trainer) == states.parameters_digest(expected)
        assert trainer.status().steps_applied == 1 and trainer.status().step == 1
    else:  # our own work, exactly, is kept for the next try
        assert trainer.worker.samples == samples
        sums = trainer.worker.strategy.gradient_sums()  # type: ignore[attr-defined]
        kept = torch.cat([t.reshape(-1) for t in sums]) / max(samples, 1)
        assert torch.equal(kept, torch.from_numpy(vector)) or samples == 0


async def test_a_candidate_whose_election_stalled_is_applied_if_a_retry_certifies_it(
    tmp_path, monkeypatch
):
    """Review: a step's rounds carry on across its tries, so a retry's election can certify
    the candidate of a try whose election had stalled; its holders had dropped it, and every
    peer tried to download a state nobody held. We keep it, and apply it then."""
    trainer = await make_trainer(tmp_path)
    size = size_of(trainer)
    first = group_result(size, 24)
    stalled_average = first.average
    assert stalled_average is not None
    first.plan = (trainer.me, *OTHERS)
    kept = Candidate(1, average_digest(stalled_average, 24), plan_of(first.plan))
    outcomes = iter([(Outcome.STALLED, None), (Outcome.LOST, kept)])

    async def elect(*_args, **_kwargs):
        return next(outcomes)

    monkeypatch.setattr(trainer, "_elect", elect)
    await trainer._finish(np.full(size, 0.5, dtype=np.float32), 8, first, 1.0)
    assert trainer.step == 0 and trainer.worker.samples == 8  # our work back for the retry
    retry = group_result(size, 30)
    retry.average = np.full(size, 0.75, dtype=np.float32)
    retry.plan = (trainer.me, *OTHERS)
    vector, samples = await trainer.worker.take()
    await trainer._finish(vector, samples, retry, 2.0)
    assert trainer.step == 1  # applied the kept average: nothing to download
    expected = TinyTask().build_model()
    optimizer = TinyTask().make_optimizer(expected.parameters())
    for p in expected.parameters():
        p.grad = torch.full_like(p, 0.25)  # the stalled try's average, not the retry's
    optimizer.step()
    assert parameters(trainer) == states.parameters_digest(expected)
    assert trainer._stalled is None and trainer.status().steps_applied == 1


async def test_failed_averagings_are_counted_and_warn_only_once_they_persist(tmp_path, caplog):
    trainer = await make_trainer(tmp_path)
    size = size_of(trainer)
    vector = np.full(size, 0.5, dtype=np.float32)
    with caplog.at_level("INFO", logger="peertrain.trainer"):
        for _ in range(4):
            await finish(trainer, vector, 8, group_result(size, 3, complete=False))
    failures = [r for r in caplog.records if "did not complete" in r.getMessage()]
    assert [r.levelname for r in failures] == ["INFO", "INFO", "WARNING", "INFO"]
    assert trainer.status().failures["averaging_incomplete"] == 4


async def test_the_first_micro_batch_s_warm_up_is_not_taken_for_our_speed(tmp_path, monkeypatch):
    """Torch's first micro-batch is slow (8.7 ms against 0.2 ms for the tiny task). Published
    as our rate, it dealt a restarted peer no quota of the target batch."""
    trainer = await make_trainer(tmp_path)
    timings = iter([1.0, 0.01, 0.01])

    async def compute() -> worker_module.Computed:
        return worker_module.Computed(8, 1.0, next(timings))

    monkeypatch.setattr(trainer.worker, "compute", compute)
    await trainer._compute()
    assert trainer.local().samples_per_second == 0.0  # unknown: the quotas deal equally
    assert trainer.local().batch_seconds == 1.0  # meanwhile, a micro-batch's time at most
    await trainer._compute()
    await trainer._compute()
    assert trainer.local().samples_per_second == pytest.approx(800.0)
    assert trainer.local().batch_seconds == pytest.approx(0.01)
    assert trainer.tally.samples_computed == 24  # its samples count all the same


async def test_a_step_declares_before_its_gradients_are_taken(tmp_path, monkeypatch):
    """The ticket goes out while the torch thread copies the gradients out (at 100 M that took
    longer than the margin before the close, and the first try of every step failed): the
    averager is called with the take still queued, and gets the vector from it."""
    trainer = await make_trainer(tmp_path)
    for _ in range(2):
        await trainer.worker.compute()
    samples = trainer.worker.samples
    expected = torch.cat([p.grad.reshape(-1) for p in trainer.worker.strategy.params]) / samples  # type: ignore[attr-defined]
    gate = threading.Event()
    # The torch thread is busy until the averager runs (or 5 s, for a trainer that waits on
    # the take first: then the averager finds it done).
    trainer.worker._thread.submit(gate.wait, 5.0)
    seen = {}

    class Averager:
        async def average(self, vector, *, size, weight, **_):
            seen["untaken"] = trainer.worker.samples
            seen["weight"] = weight
            gate.set()
            seen["vector"] = await vector()
            assert len(seen["vector"]) == size
            return AveragingResult(peers_seen=1)

    trainer.averager = Averager()  # type: ignore[assignment]

    async def no_read() -> None:
        pass

    monkeypatch.setattr(trainer.progress, "read", no_read)
    with trio.fail_after(20):
        async with trio.open_nursery() as nursery:
            await trainer._declare(trainer.clock() + 10, 0.0, nursery)
    assert seen["untaken"] == samples and seen["weight"] == samples
    torch.testing.assert_close(torch.from_numpy(seen["vector"][: len(expected)]), expected)
    assert trainer.worker.samples == samples  # a failed averaging gives the work back


@pytest.mark.parametrize(("weighting", "expected"), [("samples", 24.0), ("uniform", 1.0)])
async def test_diloco_pseudo_gradients_are_weighted_by_samples_or_uniformly(
    tmp_path, weighting, expected
):
    weights = []

    class Averager:
        async def average(self, vector, *, weight, **_):
            weights.append(weight)
            return AveragingResult(peers_seen=1)

    trainer = await make_trainer(tmp_path, mode="diloco", outer_weighting=weighting)
    trainer.averager = Averager()  # type: ignore[assignment]
    vector, samples = np.zeros(4, np.float32), 24
    await trainer._run_averaging(vector, samples, 0, 1.0)
    await trainer._run_averaging(vector, 0, 0, 1.0)
    assert weights == [expected, 0.0]


@pytest.mark.parametrize(("weighting", "recorded"), [("samples", (3.0,)), ("uniform", ())])
async def test_a_uniformly_weighted_step_records_no_global_batch(
    tmp_path, caplog, weighting, recorded
):
    """With peers weighted equally the average's weight counts peers: it was logged and kept as
    the step's global batch ("8 local samples of 3")."""
    trainer = await make_trainer(tmp_path, mode="diloco", outer_weighting=weighting)
    size = size_of(trainer)
    with caplog.at_level(logging.INFO, logger="peertrain.trainer"):
        await finish(trainer, np.zeros(size, np.float32), 8, group_result(size, 3.0))
    assert trainer.step == 1
    assert trainer.status().global_batches == recorded
    applied = [r.applied for r in caplog.records if hasattr(r, "applied")]
    assert applied[-1]["global_batch"] == (recorded[0] if recorded else None)
    assert applied[-1]["allreduce_s"] == 1.25  # the rounds' time, for benchmarks and operators
    assert ("of 3" in caplog.text) == bool(recorded)


# ---------------------------------------------------------------------------- schedules, states


class ScheduledTiny(TinyTask):
    """The tiny task with a learning rate that halves every global step."""

    def make_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


async def make_scheduled(tmp_path, mode: str = "dedloc") -> Trainer:
    return await make_trainer(tmp_path, task=ScheduledTiny(), mode=mode, inner_steps=INNER_STEPS)


def learning_rate(trainer: Trainer) -> float:
    optimizers = trainer.worker.strategy.optimizers()
    optimizer = optimizers.get("optimizer") or optimizers["inner"]
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(("mode", "per_step"), [("dedloc", 1), ("diloco", INNER_STEPS)])
async def test_the_scheduler_steps_with_its_optimizer_and_travels_with_the_state(
    tmp_path, mode, per_step
):
    """dedloc: once per global step; diloco: once per inner step (the paper's schedule; it
    stepped once per outer step before), H per outer step on every peer."""
    donor = await make_scheduled(tmp_path / "a", mode)
    await take_steps(donor, 3)
    assert learning_rate(donor) == pytest.approx(1e-2 * 0.5 ** (3 * per_step))
    joiner = await make_scheduled(tmp_path / "b", mode)
    await adopt(joiner, await saved_state(donor))
    assert joiner.step == 3 and learning_rate(joiner) == learning_rate(donor)
    await take_steps(donor, 1)
    await take_steps(joiner, 1)
    assert learning_rate(joiner) == learning_rate(donor)
    assert learning_rate(donor) == pytest.approx(1e-2 * 0.5 ** (4 * per_step))
    assert parameters(joiner) == parameters(donor)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda s: s.update(optimizer="x"),  # an attribute of ours to overwrite
        lambda s: s.update(base_lrs=[1.0, 2.0]),  # wrong length
        lambda s: s.update(last_epoch="3"),  # wrong kind
        lambda s: s.update(lr_lambdas=[{"__class__": 1}]),  # written into our lambdas
    ],
    ids=["extra-key", "length", "kind", "lambda-dict"],
)
async def test_a_scheduler_state_unlike_ours_is_refused_and_changes_nothing(tmp_path, tamper):
    donor = await make_scheduled(tmp_path / "a")
    await take_steps(donor, 2)
    state = await state_of(donor)
    tamper(state.metadata["scheduler"])
    state = states.from_bytes(states.to_bytes(state))
    joiner = await make_scheduled(tmp_path / "b")
    before = parameters(joiner)
    with pytest.raises(StateMismatch, match="scheduler"):
        await joiner.worker.restore(state)
    assert joiner.step == 0 and parameters(joiner) == before
    assert learning_rate(joiner) == 1e-2


async def test_a_state_without_the_scheduler_this_task_has_is_refused(tmp_path):
    plain = await make_trainer(tmp_path / "a")
    await take_steps(plain, 1)
    scheduled = await make_scheduled(tmp_path / "b")
    with pytest.raises(StateMismatch, match="scheduler state missing"):
        await scheduled.worker.restore(await state_of(plain))


async def test_a_resumed_peer_shows_the_step_of_its_checkpoint(tmp_path):
    """After a resume `trainer.step` was 3 and `status.step` 0: `peer status`, the metrics and
    the live view showed step 0 (status mirrored the trainer's fields by hand)."""
    trainer = await make_trainer(tmp_path)
    await take_steps(trainer, 3)
    await trainer._checkpoint(force=True)
    assert checkpoints.load_latest(trainer.checkpoint_dir).step == 3
    resumed = await make_trainer(tmp_path)
    assert resumed.step == 3 and resumed.status().step == 3
    assert parameters(resumed) == parameters(trainer) and resumed.digest == trainer.digest
    assert resumed.record().step == 3


@pytest.mark.parametrize("mode", ["dedloc", "diloco"])
async def test_a_restored_donor_state_holds_the_digest_it_was_checked_with(tmp_path, mode):
    """A joiner holds a downloaded state under the digest computed when it was parsed (no
    second pass over the state): restoring must copy every certified tensor exactly."""
    donor = await make_trainer(tmp_path / "donor", mode=mode, inner_steps=INNER_STEPS)
    await take_steps(donor, 2)
    snapshot = await donor.snapshot()
    assert snapshot is not None
    joiner = await make_trainer(tmp_path / "joiner", mode=mode, inner_steps=INNER_STEPS)
    state, digest = await joiner.worker.parse(snapshot)
    assert digest == donor.digest
    await joiner.worker.restore(state, from_donor=True)
    assert await joiner.worker.hold(state.step) == digest  # computed afresh from our tensors


async def test_a_download_frees_the_optimizer_state_it_replaces(tmp_path):
    """A restore replaces the optimizer's tensors; the checkpoint writer's note of the last
    state it wrote and our cached snapshot (both of the live state: the optimizer's own
    tensors) kept the old ones alive, 0.8 GB at 100 M beside the download's bytes. With the
    collector off, they are gone after it."""
    trainer = await make_trainer(tmp_path / "me")
    await take_steps(trainer, 1)
    await trainer._checkpoint(force=True)  # written from the live state
    assert await trainer.snapshot() is not None  # served to others, cached
    held = trainer.worker.held
    assert held is not None and held.live
    name = next(n for n in held.state.tensors if n.startswith("optimizer.") and "exp_avg" in n)
    old = weakref.ref(held.state.tensors[name])  # a view of the optimizer's tensor
    del held
    donor = await two_ahead(tmp_path, trainer)
    serving(trainer, await donor.snapshot())
    restore, cached = trainer.worker.restore, []

    async def restoring(state, **kwargs) -> None:
        cached.append(trainer._snapshot)  # dropped before: it holds the tensors replaced
        await restore(state, **kwargs)

    trainer.worker.restore = restoring  # type: ignore[method-assign]
    gc.collect()
    gc.disable()
    try:
        await trainer._catch_up(*behind(trainer))
        assert old() is None
    finally:
        gc.enable()
    assert cached == [None]
    assert trainer.step == 2 and trainer.digest == donor.digest
    await trainer._checkpoint(force=True)  # the new state is written: not taken for the old
    assert checkpoints.load_latest(trainer.checkpoint_dir).step == 2


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_DONTNEED) is Linux's")
@pytest.mark.parametrize("disposable", [True, False])
async def test_a_download_s_buffer_goes_back_as_it_is_loaded_and_no_other_blob_does(
    tmp_path, disposable
):
    """A fresh 100 M joiner peaked with AdamW's moments cloned beside the whole download
    (0.8 GB): the pages of a download's own buffer (`Snapshot.disposable`) go back to the
    system as its tensors are loaded; they read as zeros after. A blob that is not the
    download's alone is left as it was."""
    trainer = await make_trainer(tmp_path / "me")
    donor = await two_ahead(tmp_path, trainer)
    served = await donor.snapshot()
    assert served is not None
    blob = bytes(served.blob)
    before = bytearray(blob)  # a copy
    snapshot = Snapshot(2, blob, parts=served.parts, hashes=served.hashes, disposable=disposable)
    serving(trainer, snapshot)
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2
    ours, theirs = (await state_of(trainer)).tensors, (await state_of(donor)).tensors
    assert [n for n in theirs if n.startswith(("model.", "optimizer."))] == [
        n for n in ours if n.startswith(("model.", "optimizer."))
    ]
    assert all(torch.equal(ours[n], theirs[n]) for n in ours if n.startswith(("model.", "opt")))
    changed = [i for i in range(len(blob)) if blob[i] != before[i]]
    assert bool(changed) == disposable
    assert all(blob[i] == 0 for i in changed)
    if disposable:  # the first layer's weights (32 KiB) at least: whole pages of them
        assert len(changed) >= 4096


@pytest.mark.skipif(sys.platform != "linux", reason="per-thread nice levels are Linux's")
async def test_a_donor_serves_its_held_state_while_the_torch_thread_is_busy(tmp_path):
    """A donor's manifest waited for the torch thread's training step (seconds at 100 M beside
    three peers): the held state's bytes are views, taken without it."""
    trainer = await make_trainer(tmp_path)
    await take_steps(trainer, 1)
    gate = threading.Event()
    busy = trainer.worker._thread.submit(gate.wait, 60.0)
    try:
        with trio.fail_after(30):  # a bound, not a measure: the call returns at once or never
            snapshot = await trainer.snapshot()
        assert not busy.done()
    finally:
        gate.set()
    assert snapshot is not None and snapshot.step == trainer.step
    assert states.from_bytes(bytes(snapshot.blob)).step == trainer.step


async def test_a_restore_runs_at_the_loop_s_priority_with_the_torch_thread_held(
    tmp_path, monkeypatch
):
    """A 100 M joiner's load took 6 s on the torch thread at nice +10 beside three training
    peers: it runs at the caller's priority, one operation at a time all the same."""
    trainer, donor = await make_trainer(tmp_path / "me"), await make_trainer(tmp_path / "a")
    await take_steps(donor, 1)
    state = await state_of(donor)
    worker = trainer.worker
    torch_thread = await worker._run(threading.get_native_id)
    restore, seen = states.restore, []

    def restoring(*args, **options):
        thread = threading.get_native_id()
        seen.append((thread != torch_thread, os.getpriority(os.PRIO_PROCESS, thread)))
        later = worker._thread.submit(lambda: None)
        seen.append(not wait([later], timeout=0.5).done)  # the torch thread waits
        return restore(*args, **options)

    monkeypatch.setattr(states, "restore", restoring)
    await worker.restore(state, from_donor=True)
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [(True, ours), True]
    assert parameters(trainer) == parameters(donor)


async def test_a_catch_up_logs_the_seconds_of_its_phases(tmp_path, caplog):
    """Where a late joiner's wait goes: the download and its check, the load, the whole (and
    the step it caught up to)."""
    trainer = await make_trainer(tmp_path / "me")
    donor = await two_ahead(tmp_path, trainer)
    serving(trainer, await donor.snapshot())
    with caplog.at_level("INFO", logger="peertrain.trainer"):
        await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2
    done = [r for r in caplog.records if r.getMessage().startswith("downloaded the state")]
    phases = done[0].catch_up  # type: ignore[attr-defined]
    assert set(phases) == {"step", "fetch_and_check_s", "load_s", "total_s"}
    assert phases["step"] == 2
    # Each is rounded to the millisecond, so the parts may pass the whole by 1.5 ms.
    assert 0 <= phases["fetch_and_check_s"] + phases["load_s"] <= phases["total_s"] + 0.0015


async def test_a_diloco_peer_holds_its_anchor_and_outer_optimizer_not_a_copy(tmp_path):
    """DiLoCo's inner steps move the parameters and the inner optimizer, so it held a copy of
    its whole state (1.6 GB at 100 M, 3.6x the state per peer). It holds the anchor (the
    parameters as of the outer step) and the outer optimizer's own tensors, which inner steps
    leave alone: what it serves stays the step's state, byte for byte, through inner steps."""
    trainer = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    await take_steps(trainer, 1)
    held = trainer.worker.held
    assert held is not None and held.live
    strategy = trainer.worker.strategy
    held_at = {t.data_ptr() for t in held.state.tensors.values()}
    assert {a.data_ptr() for a in strategy.anchor} <= held_at
    momenta = [s["momentum_buffer"] for s in strategy.outer.state.values()]
    assert momenta and {m.data_ptr() for m in momenta} <= held_at
    assert not [name for name in held.state.tensors if name.startswith("inner.")]
    snapshot = await trainer.snapshot()
    assert snapshot is not None
    before = bytes(snapshot.blob)
    for _ in range(3):
        await trainer.worker.compute()  # inner steps
    moved = zip(strategy.params, strategy.anchor, strict=True)
    assert trainer.worker.samples > 0 and not all(torch.equal(p, a) for p, a in moved)
    assert bytes(snapshot.blob) == before  # still valid, and still the step's state
    assert trainer.worker.certify(held.state).digest == trainer.digest


@pytest.mark.parametrize("precision", ["fp32", "fp16"])
async def test_diloco_inner_steps_leave_no_gradients_behind(tmp_path, precision):
    """Gradients stayed from one inner step to the next, a model's worth of memory through
    every averaging (0.4 GB at 100 M)."""
    trainer = await make_trainer(
        tmp_path, mode="diloco", inner_steps=INNER_STEPS, precision=precision
    )
    await trainer.worker.compute()
    assert trainer.worker.samples > 0 or precision == "fp16"  # fp16 may skip a step
    assert all(p.grad is None for p in trainer.worker.model.parameters())


async def test_a_diloco_checkpoint_carries_the_inner_optimizer_it_resumes_with(tmp_path):
    """The held state has no inner optimizer (it is each peer's own, and moves with every
    inner step): the checkpoint copies it as of the save, and a resumed peer has it."""
    trainer = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    await take_steps(trainer, 1)
    await trainer.worker.compute()  # an inner step past the held one
    inner = trainer.worker.strategy.inner
    moments = [s["exp_avg"].clone() for s in inner.state.values()]
    saved = await saved_state(trainer)
    assert moments and all(
        torch.equal(saved.tensors[f"inner.{i}.exp_avg"], m) for i, m in enumerate(moments)
    )
    anchored = trainer.worker.strategy.anchored_parameters()
    assert anchored and all(  # the held step's parameters, not the inner step's
        torch.equal(saved.tensors[f"model.{name}"], a) for name, a in anchored.items()
    )
    resumed = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    assert resumed.step == 1 and resumed.digest == trainer.digest
    again = resumed.worker.strategy.inner.state.values()
    assert all(torch.equal(s["exp_avg"], m) for s, m in zip(again, moments, strict=True))


async def test_a_stop_does_not_wait_for_the_digest_of_the_step_just_taken(tmp_path, monkeypatch):
    """A stop that came while the torch thread digested the state just applied (1.2 s at
    100 M, more on a busy machine) waited for all of it: 3.96 s from SIGINT to exit. The
    digest ends at the stop; nobody signs that step, and the final checkpoint writes it."""
    trainer = await make_trainer(tmp_path)
    await take_steps(trainer, 1)
    started = threading.Event()
    digest = states.state_digest

    def digesting(state, names, shared, *, cancelled, known):
        def stop_seen() -> bool:
            if not started.is_set():
                started.set()
                trainer.worker.stopping.wait(timeout=20)  # the digest is under way when it comes
            return cancelled()

        return digest(state, names, shared, cancelled=stop_seen, known=known)

    monkeypatch.setattr(states, "state_digest", digesting)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer._note_stop)
        nursery.start_soon(trainer._hold, 2)
        await trio.to_thread.run_sync(started.wait, 20)
        nursery.cancel_scope.cancel()  # the stop
    held = trainer.worker.held
    assert held is not None and held.state.step == 2 and held.digest is None
    assert trainer.step == 1  # not signed
    assert await trainer.worker.save_checkpoint(trainer.checkpoint_dir) == 2


@pytest.mark.parametrize(
    ("mode", "training"),
    [
        ("dedloc", {}),  # sums in .grad
        ("dedloc", {"delayed_updates": True}),  # sums of their own, from autograd.grad
        ("dedloc", {"precision": "fp16"}),  # the scaler's .grad, then sums of their own
        ("diloco", {}),
    ],
    ids=["dedloc", "dedloc-delayed", "dedloc-fp16", "diloco"],
)
@pytest.mark.parametrize("where", ["forward", "backward"])
async def test_a_stop_cuts_the_micro_batch_in_hand_short(tmp_path, mode, training, where):
    """A stop waited for the micro-batch in hand (1-3 s at 100 M beside three training peers;
    one stop took 3.8 s of its 3): it now ends at the next layer or parameter gradient, adds
    nothing, and leaves no half-added gradient behind (nor moves a DiLoCo peer's parameters)."""
    trainer = await make_trainer(tmp_path, mode=mode, **training)
    worker = trainer.worker
    await worker.compute()  # local work from before the stop
    before = [p.detach().clone() for p in worker.model.parameters()]
    first, *_, last = worker.model  # Linear, GELU, Linear
    ran: list[str] = []
    hooks = [first.register_forward_hook(lambda *_: ran.append("first"))]
    hooks.append(last.register_forward_hook(lambda *_: ran.append("last")))
    if where == "forward":  # the stop comes after the first layer's forward
        hooks.append(first.register_forward_hook(lambda *_: worker.stopping.set()))
    else:  # ...or once the last layer's weight has its gradient (the first one computed)
        hooks.append(last.weight.register_hook(lambda grad: worker.stopping.set()))
    bias_grads: list[torch.Tensor] = []
    hooks.append(first.bias.register_hook(bias_grads.append))  # the last gradient computed

    done = await worker.compute()
    assert done.samples == 0 and math.isnan(done.loss)
    assert ran == (["first"] if where == "forward" else ["first", "last"])
    assert not bias_grads  # backward went no further
    assert all(p.grad is None for p in worker.model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, worker.model.parameters(), strict=True))
    if mode == "dedloc":
        assert worker.samples == 0  # its sums, partly added to, are dropped
        assert all(not t.any() for t in worker.strategy.gradient_sums())
    for hook in hooks:
        hook.remove()
    worker.stopping.clear()  # nothing else is changed: micro-batches add again
    assert (await worker.compute()).samples == 8


@pytest.mark.parametrize("stopping", [False, True])
async def test_a_diloco_checkpoint_writes_its_inner_optimizer_as_is_with_training_held(
    tmp_path, monkeypatch, stopping
):
    """A DiLoCo checkpoint copied the inner optimizer first (0.8 GB at 100 M: its peers
    peaked at 2.35-2.53x the state; and the time of a stop): the writer reads the live
    tensors with the torch thread held still until they are written; then training goes on
    while the rest is written."""
    trainer = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    await take_steps(trainer, 1)
    await trainer.worker.compute()
    worker = trainer.worker
    live = {
        t.data_ptr()
        for s in worker.strategy.inner.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim()
    }
    save, seen = checkpoints.save_checkpoint, []

    def saving(directory, state, *, written, **options):
        inner = [
            t.data_ptr() for n, t in state.tensors.items() if n.startswith("inner.") and t.dim()
        ]
        seen.append(sorted(inner) == sorted(live))
        later = worker._thread.submit(lambda: None)
        seen.append(not wait([later], timeout=0.5).done)  # held still while they are written
        others: list[str] = []

        def noted(name: str) -> None:
            written(name)
            if not name.startswith("inner.") and not others:
                others.append(name)  # the inner optimizer is written: training goes on
                seen.append(bool(wait([later], timeout=20).done))

        return save(directory, state, written=noted, **options)

    monkeypatch.setattr(checkpoints, "save_checkpoint", saving)
    if stopping:
        worker.stopping.set()
    assert await worker.save_checkpoint(trainer.checkpoint_dir) == 1
    assert seen == [True, True, True]
    saved = checkpoints.load_latest(trainer.checkpoint_dir)
    for index, entries in enumerate(worker.strategy.inner.state.values()):
        assert torch.equal(saved.tensors[f"inner.{index}.exp_avg"], entries["exp_avg"])


async def test_a_disk_too_slow_for_the_inner_optimizer_lets_training_go_on_and_later_saves_copy(
    tmp_path, monkeypatch, caplog
):
    """Writing the inner optimizer as it is holds training still: a disk slower than
    HOLD_SECONDS gives that save up (training goes on), and later saves copy it first."""
    trainer = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    await take_steps(trainer, 1)
    await trainer.worker.compute()
    worker = trainer.worker
    monkeypatch.setattr(worker_module, "HOLD_SECONDS", 0.05)
    save, calls, seen = checkpoints.save_checkpoint, [], []

    def slow_disk(directory, state, *, written, **options):
        calls.append(state)
        if len(calls) > 1:
            return save(directory, state, written=written, **options)
        later = worker._thread.submit(lambda: None)

        def slowly(name: str) -> None:
            if name.startswith("inner.") and not seen:
                seen.append(bool(wait([later], timeout=20).done))  # training went on
            written(name)

        return save(directory, state, written=slowly, **options)

    monkeypatch.setattr(checkpoints, "save_checkpoint", slow_disk)
    with caplog.at_level(logging.WARNING, logger="peertrain.trainer"):
        assert await worker.save_checkpoint(trainer.checkpoint_dir) is None
    assert seen == [True] and "later ones copy it first" in caplog.text
    assert checkpoints.load_latest(trainer.checkpoint_dir) is None
    live = {id(t) for s in worker.strategy.inner.state.values() for t in s.values()}
    assert await worker.save_checkpoint(trainer.checkpoint_dir) == 1
    copied = [t for n, t in calls[1].tensors.items() if n.startswith("inner.")]
    assert copied and not any(id(t) in live for t in copied)


async def test_a_checkpoint_gives_up_waiting_for_a_busy_torch_thread_at_its_deadline(tmp_path):
    """The inner optimizer is copied on the torch thread: a final save waited for it beyond
    its time (4.3 s from SIGINT to exit at 100 M, with nothing written)."""
    trainer = await make_trainer(tmp_path, mode="diloco", inner_steps=INNER_STEPS)
    await take_steps(trainer, 1)
    busy, finished = threading.Event(), threading.Event()

    def long_micro_batch() -> None:
        busy.wait(20)
        finished.set()

    trainer.worker._thread.submit(long_micro_batch)
    try:
        assert await trainer.worker.save_checkpoint(trainer.checkpoint_dir, within=0.05) is None
        assert not finished.is_set()  # it did not wait for the torch thread
    finally:
        busy.set()
    assert checkpoints.load_latest(trainer.checkpoint_dir) is None


async def test_a_donor_state_with_a_non_finite_value_is_refused_and_changes_nothing(tmp_path):
    trainer = await make_trainer(tmp_path / "me")
    donor = await make_trainer(tmp_path / "donor")
    await take_steps(donor, 1)
    state = await state_of(donor)
    name = next(n for n in state.tensors if n.startswith("optimizer.") and "exp_avg" in n)
    state.tensors[name].view(-1)[0] = math.inf
    before = parameters(trainer)
    with pytest.raises(StateMismatch, match="NaN or Inf"):
        await trainer.worker.restore(state, from_donor=True)
    assert trainer.step == 0 and parameters(trainer) == before


@pytest.mark.parametrize(("mode", "per_step"), [("dedloc", 1), ("diloco", INNER_STEPS)])
async def test_a_donors_schedule_is_never_loaded_ours_is_replayed(tmp_path, mode, per_step):
    """A scheduler state is JSON a donor writes (base_lrs 1e-9 slows every peer to a halt):
    after a download the schedule is our own task's, stepped as many times as the step says."""
    donor = await make_scheduled(tmp_path / "a", mode)
    await take_steps(donor, 3)
    state = await state_of(donor)
    state.metadata["scheduler"]["base_lrs"] = [1e-9]
    joiner = await make_scheduled(tmp_path / "b", mode)
    await adopt(joiner, states.from_bytes(states.to_bytes(state)), from_donor=True)
    assert joiner.step == 3
    assert learning_rate(joiner) == pytest.approx(1e-2 * 0.5 ** (3 * per_step))
    await take_steps(joiner, 1)
    assert learning_rate(joiner) == pytest.approx(1e-2 * 0.5 ** (4 * per_step))


# ---------------------------------------------------------------------------- downloads


def signed_record(trainer: Trainer, *others: Trainer, **fields) -> ProgressRecord:
    """`trainer`'s own record, carrying the signatures of `others` at its (step, digest) as
    their records would have (others must hold the same state)."""
    record = trainer.record()
    signatures = [*record.signatures, *(o.record().signatures[0] for o in others)]
    return msgspec.structs.replace(record, signatures=signatures, **fields)


def serving(trainer: Trainer, *snapshots: Snapshot | Exception):
    """A download function that hands out `snapshots` in turn (an exception: raised)."""
    queue = list(snapshots)

    async def download(donors, step):
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    trainer.download = download


def read(trainer: Trainer, *records: ProgressRecord) -> None:
    trainer.policy.observe(CollaborationView(list(records), trainer.policy.quorum), trainer.clock())


async def two_ahead(tmp_path, trainer: Trainer) -> Trainer:
    """Two peers at step 2 whose records (signed by both) `trainer` has read: one of them."""
    donor, partner = await make_trainer(tmp_path / "a"), await make_trainer(tmp_path / "b")
    await take_steps(donor, 2)
    await take_steps(partner, 2)
    read(trainer, signed_record(donor, partner))
    return donor


def behind(trainer: Trainer) -> tuple[list[ProgressRecord], int]:
    """The catch-up the policy asks for now (the test's records put us behind)."""
    action = trainer.policy.next_action(trainer.local(), trainer.clock())
    assert isinstance(action, CatchUp), action
    return action.donors, action.target


async def test_a_donor_cannot_hand_over_a_state_other_than_the_certified_one(
    tmp_path, autojump_clock
):
    """The hijack as shown: the donor's state had every parameter at 0.25 and AdamW's lr at
    1e-9, and every peer (and the keeper) took it."""
    trainer = await make_trainer(tmp_path / "me")
    honest, partner = await make_trainer(tmp_path / "a"), await make_trainer(tmp_path / "b")
    await take_steps(honest, 2)
    await take_steps(partner, 2)
    record = signed_record(honest, partner)
    read(trainer, record)

    poisoned = await make_trainer(tmp_path / "poison")
    await take_steps(poisoned, 2)
    for parameter in poisoned.worker.model.parameters():
        parameter.detach().fill_(0.25)
    for group in poisoned.worker.strategy.optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = 1e-9
    await poisoned._hold(2)
    # The certified state, with the donor's learning rate changed (not in the digest): taken,
    # with our own task's learning rate.
    for group in honest.worker.strategy.optimizer.param_groups:  # type: ignore[attr-defined]
        group["lr"] = 1e-9
    await honest._hold(2)
    assert honest.digest == record.digest
    serving(trainer, await poisoned.snapshot(), await honest.snapshot())

    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 0 and trainer.status().failures["state_download"] == 1
    assert all(float(p.detach().abs().max()) != 0.25 for p in trainer.worker.model.parameters())
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == record.digest
    assert learning_rate(trainer) == learning_rate(partner) != 1e-9
    assert trainer.status().downloads == 1


async def test_a_certified_state_is_taken_though_its_signers_stepped_on_meanwhile(
    tmp_path, autojump_clock
):
    """A step certified when the download began stays certified (signatures cannot be
    forged), though by its end the signers' records name their next step and no longer carry
    the signatures of this one."""
    trainer = await make_trainer(tmp_path / "me")
    honest = await two_ahead(tmp_path, trainer)
    snapshot = await honest.snapshot()

    async def download(donors, step):
        moved_on = msgspec.structs.replace(honest.record(), step=3, digest="f" * 32)
        read(trainer, moved_on)
        return snapshot

    trainer.download = download
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 2 and trainer.digest == honest.digest
    assert trainer.status().failures["state_download"] == 0


@pytest.mark.parametrize("mode", ["dedloc", "diloco"])
async def test_a_download_makes_room_first_and_a_diloco_peer_keeps_its_inner_steps(
    tmp_path, autojump_clock, mode
):
    """A peer behind the collaboration downloads with its state and the download's bytes at
    once: a DeDLOC peer's gradient sums (for a step already taken without it) go before the
    download, not after it (at 100 M a peer that fell behind peaked at 3.9 GB). A DiLoCo
    peer's inner steps stay while the download fails."""
    trainer = await make_trainer(tmp_path, mode=mode, inner_steps=INNER_STEPS)
    donor = await make_trainer(tmp_path / "a", mode=mode, inner_steps=INNER_STEPS)
    partner = await make_trainer(tmp_path / "b", mode=mode, inner_steps=INNER_STEPS)
    await take_steps(donor, 1)
    await take_steps(partner, 1)
    for _ in range(2):
        await trainer.worker.compute()
    before = [p.detach().clone() for p in trainer.worker.model.parameters()]
    read(trainer, signed_record(donor, partner))
    seen = []

    async def download(donors, step):
        seen.append(trainer.worker.samples)
        raise RemoteError("busy")

    trainer.download = download
    await trainer._catch_up(*behind(trainer))
    if mode == "dedloc":
        assert seen == [0]
        assert all(p.grad is None for p in trainer.worker.model.parameters())
    else:
        assert seen == [16] and trainer.worker.samples == 16
    after = list(trainer.worker.model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


async def test_failed_state_downloads_back_off_and_the_record_says_downloading(
    tmp_path, autojump_clock
):
    trainer = await make_trainer(tmp_path)
    donor, partner = await make_trainer(tmp_path / "a"), await make_trainer(tmp_path / "b")
    await take_steps(donor, 1)
    await take_steps(partner, 1)
    read(trainer, signed_record(donor, partner))
    during = []

    async def download(donors, step):
        during.append(trainer.record().downloading)
        await trio.sleep(5)
        raise RemoteError("busy: serving 4 downloads")

    trainer.download = download
    waits = []
    for _ in range(3):
        started = trio.current_time()
        await trainer._catch_up(*behind(trainer))
        waits.append(round(trio.current_time() - started - 5, 3))
    interval = trainer.training.progress_interval
    assert waits == [interval, 2 * interval, 4 * interval]
    assert during == [True] * 3 and not trainer.record().downloading
    assert trainer.progress._now.is_set()  # others learn both at once


async def test_a_step_nobody_else_applied_is_given_up_for_the_certified_one(
    tmp_path, autojump_clock
):
    """The executor's half of `tests/test_policy.py`'s stranded peer: going back to the
    certified step is a download like any other (a step below ours is accepted only then)."""
    now = [1000.0]
    trainer = await make_trainer(tmp_path / "ahead", clock=lambda: now[0])
    partner = await make_trainer(tmp_path / "behind")
    start = await partner.snapshot()
    await take_steps(trainer, 1)  # our averaging completed; the partner's did not
    read(trainer, signed_record(partner))
    now[0] += trainer.timing.settle_patience(trainer.policy.store_seconds)
    read(trainer, signed_record(partner))
    serving(trainer, start)
    await trainer._catch_up(*behind(trainer))
    assert trainer.step == 0 and trainer.digest == partner.digest


# ---------------------------------------------------------------------------- progress, data


async def test_a_store_cut_short_by_its_deadline_still_widens_the_window(tmp_path, autojump_clock):
    """Stores slower than the progress exchange's deadline never finished, so they were never
    counted: a peer in the namespace testbed kept calling 3 s windows while its tickets landed
    4 s late."""
    trainer = await make_trainer(tmp_path)

    async def slow_store(*args, **kwargs):
        await trio.sleep(60)  # past any deadline

    async def withdraw(*args, **kwargs):
        return 0

    trainer.dht.store, trainer.dht.withdraw = slow_store, withdraw
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer.progress.run)
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    deadline = max(trainer.training.progress_interval, trainer.config.net.rpc_timeout)
    assert trainer.policy.store_seconds >= deadline
    assert trainer.timing.window(trainer.policy.store_seconds) >= STORES_PER_WINDOW * deadline


async def test_every_peer_draws_its_own_micro_batches_for_any_seed(tmp_path):
    """A non-zero `training.seed` gave every peer the same data (10 of 10 micro-batches
    compared were identical)."""
    assert data_seed(7, "peer-a") != data_seed(7, "peer-b")
    assert data_seed(7, "peer-a") == data_seed(7, "peer-a")  # reproducible
    assert data_seed(0, "peer-a") != data_seed(7, "peer-a")
    trainers = [await make_trainer(tmp_path / str(i), seed=7) for i in range(3)]
    first = [t.worker.next_batch()[0][0] for t in trainers]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


def test_the_trainer_holds_no_tensor_of_its_own():
    """Torch work runs in the worker by construction: the executor reaches the model only
    through `TorchWorker`'s coroutines (a name check, so that a `self.model` does not creep
    back into the trainer)."""
    import inspect

    from peer.training import trainer as module

    source = inspect.getsource(module)
    for name in ("self.model", "self.strategy", "torch.no_grad", ".backward(", "to_thread"):
        assert name not in source, name


async def test_a_far_call_and_a_lone_liar_change_nothing_through_a_real_read(tmp_path):
    """Records decoded from DHT entries (signatures checked) reach the policy as they are."""
    from peer.dht.records import Entry
    from peer.training.progress import encode_progress

    trainer = await make_trainer(tmp_path / "me")
    liar = await make_trainer(tmp_path / "liar")
    await take_steps(liar, 2)
    record = signed_record(liar, call_step=2, gather_until=trainer.clock() + 11 * 86400)
    entries = {record.peer_id: Entry(encode_progress(record), 2e9)}

    async def get(key, **_):
        return entries

    trainer.dht.get = get
    await trainer.progress.read()
    assert trainer.view().global_step == 0
    action = trainer.policy.next_action(trainer.local(), trainer.clock())
    assert isinstance(action, Compute)


async def test_a_periodic_checkpoint_is_written_while_training_goes_on(tmp_path, monkeypatch):
    """The save runs in a thread of its own: micro-batches go on while it writes (before, it
    ran in the training thread and training waited for the disk: 6.4 s for a 38 M-parameter
    model). The held state is the live parameters (no copy): a step that completes meanwhile
    waits for the write, so the checkpoint holds the step it names. One save at a time; the
    final one writes the newest state, once."""
    monotonic = FakeMonotonic()
    trainer = await make_trainer(tmp_path, checkpoint_interval=3600.0, monotonic=monotonic)
    await take_steps(trainer, 1)
    assert trainer.worker.held.live
    step_1 = trainer.digest
    started, release = threading.Event(), threading.Event()
    real = checkpoints.save_checkpoint

    def held_up(directory, state, **options):
        started.set()
        release.wait(60)
        return real(directory, state, **options)

    monkeypatch.setattr(checkpoints, "save_checkpoint", held_up)
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            monotonic.advance(3599.0)
            await trainer._checkpoint(nursery)  # not due yet: no save started
            assert not nursery.child_tasks
            monotonic.advance(1.0)  # the interval since the trainer began: due
            await trainer._checkpoint(nursery)
            assert len(nursery.child_tasks) == 1
            await trio.to_thread.run_sync(started.wait, 30)
            await trainer.worker.compute()  # the training thread is free
            monotonic.advance(3600.0)
            await trainer._checkpoint(nursery)  # due again, but one is being written
            nursery.start_soon(take_steps, trainer, 1)  # its apply waits for the write
            await trio.sleep(0.2)
            assert trainer.step == 1
            release.set()
    assert trainer.step == 2
    saved = checkpoints.load_latest(trainer.checkpoint_dir)
    assert saved.step == 1 and trainer.worker.certify(saved).digest == step_1
    saves = len(list(trainer.checkpoint_dir.glob("*.json")))
    await trainer._checkpoint(force=True)  # on the way out: the step we hold now
    saved = checkpoints.load_latest(trainer.checkpoint_dir)
    assert saved.step == 2 and trainer.worker.certify(saved).digest == trainer.digest
    await trainer._checkpoint(force=True)  # nothing new to write
    assert len(list(trainer.checkpoint_dir.glob("*.json"))) == saves + 1


async def test_torch_work_runs_in_one_thread_below_the_event_loop_s_priority(tmp_path):
    """Where cores are short the event loop (the bytes of averagings and downloads) is
    scheduled before the torch thread (before, 0.5-1.7 s loop stalls at 40 M parameters on
    2 cores)."""
    trainer = await make_trainer(tmp_path)

    def where() -> tuple[int, int]:
        thread = threading.get_native_id()
        return thread, os.getpriority(os.PRIO_PROCESS, thread)

    first, second = await trainer.worker._run(where), await trainer.worker._run(where)
    assert first[0] == second[0] != threading.get_native_id()
    ours = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert first[1] == min(19, ours + NICENESS)


@pytest.mark.skipif(sys.platform != "linux", reason="madvise(MADV_DONTNEED) is Linux's")
def test_pages_are_given_back_only_inside_the_buffer_named():
    pattern = bytes(range(1, 256)) * 1024  # 255 KiB, no zero byte
    buffer, other = bytes(bytearray(pattern)), bytes(bytearray(pattern))
    within = heap.span_of(buffer)
    start = within[0]
    heap.drop_pages(*heap.span_of(other), within=within)  # another buffer: left alone
    heap.drop_pages(start - heap.PAGE_BYTES, 2 * heap.PAGE_BYTES, within=within)  # reaches out
    assert buffer == pattern and other == pattern
    heap.drop_pages(start + 100, 5 * heap.PAGE_BYTES, within=within)
    first = -(-(start + 100) // heap.PAGE_BYTES) * heap.PAGE_BYTES - start
    end = (start + 100 + 5 * heap.PAGE_BYTES) // heap.PAGE_BYTES * heap.PAGE_BYTES - start
    assert end - first >= 4 * heap.PAGE_BYTES  # whole pages only
    assert buffer[first:end] == bytes(end - first)
    assert buffer[:first] == pattern[:first] and buffer[end:] == pattern[end:]


FREED_BLOCKS = """
import torch
from pathlib import Path
from peer.heap import return_free_memory

def rss():
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

big = torch.empty(16 << 20, dtype=torch.uint8)  # mapped; freed, it raises the threshold
del big
blocks = [torch.ones(2 << 20, dtype=torch.uint8) for _ in range(150)]  # 300 MB in the heap
last = torch.ones(1 << 20, dtype=torch.uint8)  # above them: no trim at the heap's top
del blocks
before = rss()
return_free_memory()
print(before - rss())
"""


@pytest.mark.skipif(heap.malloc_trim() is None, reason="glibc's malloc_trim only")
def test_freed_blocks_under_the_mmap_threshold_go_back_to_the_system():
    """glibc keeps freed blocks under its mmap threshold in its heap (a 100 M model's
    gradients: about 500 MB through each averaging); `return_free_memory` gives them back.
    In a fresh interpreter: the heap of one that ran other tests is anybody's guess."""
    done = subprocess.run(
        [sys.executable, "-c", FREED_BLOCKS], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) > 200 << 20


async def test_taking_the_gradients_gives_their_memory_back(tmp_path, monkeypatch):
    trainer = await make_trainer(tmp_path)
    await trainer.worker.compute()
    returned = []
    monkeypatch.setattr(worker_module, "return_free_memory", lambda: returned.append(1))
    _, samples = await trainer.worker.take()
    assert returned == [1] and samples == 8


async def test_a_periodic_checkpoint_gives_way_to_a_stop(tmp_path, monkeypatch):
    """A periodic save has no deadline of its own: one that had waited for the torch thread,
    then wrote 1.6 GB, made a DiLoCo stop take 7-9 s. At a stop it ends between two pieces,
    and the final save writes the state we hold within the stop's budget."""
    monotonic = FakeMonotonic()
    trainer = await make_trainer(tmp_path, checkpoint_interval=60.0, monotonic=monotonic)
    await take_steps(trainer, 1)
    started = threading.Event()
    real = checkpoints.save_checkpoint

    def slow_disk(directory, state, *, cancelled, **options):
        started.set()
        for _ in range(1000):  # 10 s of pieces, unless cut short
            if cancelled():
                raise states.WriteCancelled("cut short between two pieces")
            time.sleep(0.01)
        return real(directory, state, cancelled=cancelled, **options)

    monkeypatch.setattr(checkpoints, "save_checkpoint", slow_disk)
    with trio.fail_after(5):  # the slow disk alone takes 10 s
        async with trio.open_nursery() as nursery:
            monotonic.advance(60.0)
            await trainer._checkpoint(nursery)  # due: a periodic save starts
            await trio.to_thread.run_sync(started.wait, 5)
            with trio.CancelScope() as stop:
                stop.cancel()
                await trainer._note_stop()  # told to stop: the periodic save gives way
    assert checkpoints.load_latest(trainer.checkpoint_dir) is None
    monkeypatch.setattr(checkpoints, "save_checkpoint", real)
    await trainer._checkpoint(force=True)  # the final save, within the stop's budget
    assert checkpoints.load_latest(trainer.checkpoint_dir).step == trainer.step == 1


async def test_the_checkpoint_on_the_way_out_is_given_up_when_it_takes_too_long(
    tmp_path, monkeypatch
):
    """A stop has 2.5 s of grace: the final save gets FINAL_SAVE_SECONDS, then the previous
    checkpoint stands (before, a 100 M-parameter peer took 8.8 s to stop, most of it this)."""
    trainer = await make_trainer(tmp_path)
    await take_steps(trainer, 1)
    await trainer._save()  # a periodic checkpoint: no time limit
    await take_steps(trainer, 1)
    asked: list[tuple[int, bool]] = []

    def slow_disk(directory, state, *, cancelled, **options):
        while not asked or not asked[-1][1]:
            asked.append((state.step, cancelled()))
            time.sleep(0.01)
        raise states.WriteCancelled("cut short")

    monkeypatch.setattr(checkpoints, "save_checkpoint", slow_disk)
    monkeypatch.setattr("peer.training.trainer.FINAL_SAVE_SECONDS", 0.1)
    with trio.fail_after(30):  # the disk never finishes: only the limit ends the save
        await trainer._checkpoint(force=True)
    assert asked[-1] == (2, True)
    assert checkpoints.load_latest(trainer.checkpoint_dir).step == 1  # the previous one stands


async def test_a_stop_is_noted_at_once_while_the_torch_thread_finishes_its_work(tmp_path):
    """The work in hand mutates the model: the training task waits for it even when told to
    stop; the stop's time is noted at once beside it (the wait comes out of the final save's)."""
    monotonic = FakeMonotonic()
    trainer = await make_trainer(tmp_path, monotonic=monotonic)
    done = threading.Event()

    def slow() -> None:
        time.sleep(0.3)  # real time: the stop (0.05 s) comes while this runs
        monotonic.advance(1.0)  # the trainer's clock when the work in hand ends
        done.set()

    async def training() -> None:
        await trainer.worker._run(slow)

    with trio.move_on_after(0.05) as scope:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(trainer._note_stop)
            await training()
    assert scope.cancelled_caught and done.is_set()  # the work ended before the stop did
    assert trainer._stop_began == 0.0  # noted before the work ended, not at 1.0


@pytest.mark.parametrize(
    ("waited", "saved"),
    [
        (0.4, 2),  # time is left: the state we hold is written
        (trainer_module.FINAL_SAVE_BY, 1),  # none left: the previous checkpoint stands
    ],
)
async def test_the_final_save_gets_what_is_left_after_waiting_for_the_torch_thread(
    tmp_path, waited: float, saved: int
):
    """A stop that waited for the torch thread's work in hand (a micro-batch, a digest: 1-2 s
    at 100 M on a busy machine) then gave the final save its full 1.5 s: 4.3 s to stop. The
    save must end FINAL_SAVE_BY after the stop began."""
    monotonic = FakeMonotonic()
    trainer = await make_trainer(tmp_path, monotonic=monotonic)
    await take_steps(trainer, 1)
    await trainer._save()  # a periodic checkpoint: no time limit
    await take_steps(trainer, 1)
    with trio.CancelScope() as stop:
        stop.cancel()
        await trainer._note_stop()  # told to stop now (it sets the worker stopping, as in run)
    monotonic.advance(waited)  # spent waiting for the torch thread's work in hand
    await trainer._checkpoint(force=True)
    assert checkpoints.load_latest(trainer.checkpoint_dir).step == saved


async def test_the_refusal_of_another_task_shows_no_control_characters(tmp_path):
    trainer = await make_trainer(tmp_path)
    record = msgspec.structs.replace(trainer.record(), step=7, task="task 'x'\x1b[2J\x07 (evil)")
    line = trainer._refusal(record)
    assert "\x1b" not in line and "\x07" not in line and "\n" not in line
    assert "trains task 'x'?[2J? (evil) (step 7), this peer task 'tiny'" in line


async def test_the_policy_counts_on_reads_as_far_apart_as_the_records_make_them(tmp_path):
    """A thousand trainers' records are read every ~5 s (`publisher.read_interval`): the
    policy then finds a record silent, and a call's window wide enough, by that age."""
    from tests.test_publisher import progress_entries

    trainer = await make_trainer(tmp_path / "me")
    entries = progress_entries(1000)

    async def get(key, **_):
        return entries

    trainer.dht.get = get
    await trainer.progress.read()
    assert trainer.progress.read_interval > 5
    assert trainer.policy.timing.reading == trainer.progress.read_interval
    assert trainer.policy.timing.stale_record > trainer.progress.read_interval


@given(
    st.lists(st.tuples(st.integers(0, 12), st.booleans()), max_size=30),
    st.lists(st.integers(0, 12), max_size=8, unique=True),
    st.integers(1, 6),
)
def test_remembered_contacts_are_the_newest_publishers_of_addresses(read, before, limit):
    """`remember_contacts` leaves what moving every peer of the read that publishes addresses
    to the end (its newest addresses), then keeping the last `limit`, leaves: the contacts a
    peer out of touch rejoins through (`Trainer._keep_in_touch`)."""
    names = [f"p{i:02d}" for i in range(13)]
    me = names[0]
    records = [
        SimpleNamespace(peer_id=names[i], addrs=[f"/ip4/127.0.0.{i}/tcp/{n}"] if has else [])
        for n, (i, has) in enumerate(read)
    ]
    known = OrderedDict((names[i], ["/old"]) for i in before)
    expected = OrderedDict(known)
    for r in records:  # the model: move every one
        if r.peer_id != me and r.addrs:
            expected.pop(r.peer_id, None)
            expected[r.peer_id] = list(r.addrs)
    while len(expected) > limit:
        expected.popitem(last=False)
    trainer_module.remember_contacts(known, records, me, limit)
    assert list(known.items()) == list(expected.items())
