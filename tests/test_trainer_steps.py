"""When an averaging result becomes an optimizer step (no network: the trainer's decision on
a result it is handed)."""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from types import SimpleNamespace

import msgspec
import numpy as np
import pytest
import torch
import trio
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.averaging.allreduce import RoundReport
from peer.averaging.averager import AveragingResult
from peer.averaging.reduce import ChunkResult
from peer.config import AveragingConfig, PeerConfig, TaskConfig, TrainingConfig
from peer.dht.records import Entry
from peer.errors import RemoteError
from peer.training import state as states
from peer.training.progress import CollaborationView, ProgressRecord, encode_progress
from peer.training.state import StateMismatch
from peer.training.task import TinyTask
from peer.training.timing import STORES_PER_WINDOW
from peer.training.trainer import (
    MAX_DOWNLOAD_BACKOFF,
    MAX_WAIT_FOR_OTHERS,
    Trainer,
    data_seed,
)
from tests.test_progress import rec


def make_trainer(
    tmp_path,
    task=None,
    mode: str = "dedloc",
    max_steps: int = 0,
    min_group_size: int = 2,
    clock=time.time,
    **training,
) -> Trainer:
    key_pair = create_new_key_pair()
    peer_id = ID.from_pubkey(key_pair.public_key)
    return Trainer(
        dht=SimpleNamespace(  # type: ignore[arg-type]
            node=SimpleNamespace(
                peer_id=peer_id,
                public_addrs=lambda: [],
                identity=SimpleNamespace(key_pair=key_pair),
            )
        ),
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
        clock=clock,
    )


def test_a_peer_that_read_no_other_ticket_steps_alone_only_once_nobody_is_left(tmp_path):
    """A step of our samples alone parts from everyone at our step or beyond; a peer cut off
    from the others (or one that missed their gathering) accumulates instead, until nobody at
    our step or beyond has been in view for `solo_after` seconds; and only where
    `averaging.min_group_size` = 1 lets one peer make a step (`peer.training.certificate`)."""
    trainer = make_trainer(tmp_path, min_group_size=1)
    size = sum(p.numel() for p in trainer.model.parameters())
    alone = AveragingResult(peers_seen=1)
    other = rec(0, step=0, digest="x", samples=8, samples_per_second=1.0)  # another trainer

    def try_alone(gather_until: float) -> None:
        trainer._finish_step(np.full(size, 0.5, dtype=np.float32), 8, alone, gather_until)

    trainer._note_view(CollaborationView([other]))  # at our step
    try_alone(1.0)
    assert trainer.step == 0 and trainer.strategy.samples == 8  # kept for the next try
    trainer._note_view(CollaborationView([msgspec.structs.replace(other, step=5)]))  # ahead
    try_alone(2.0)
    assert trainer.step == 0 and trainer.strategy.samples == 16
    # Its record gone (left, or cut off from us): not yet, it was in view a moment ago.
    trainer._note_view(CollaborationView([]))
    try_alone(3.0)
    assert trainer.step == 0 and trainer.strategy.samples == 24
    # solo_after seconds later nobody came back: the accumulated samples make our step.
    assert trainer._company_at is not None
    trainer._company_at -= trainer.training.solo_after
    try_alone(4.0)
    assert trainer.step == 1
    # With the default min_group_size = 2, never: a step of one certifies nothing.
    pair = make_trainer(tmp_path / "pair")
    pair._note_view(CollaborationView([]))
    for _ in range(3):
        pair._finish_step(np.full(size, 0.5, dtype=np.float32), 8, alone, 5.0)
    assert pair._on_our_own() and pair.step == 0 and pair.strategy.samples == 24


def test_a_peer_ahead_waits_for_those_catching_up_but_not_for_one_stuck_behind(tmp_path):
    """The partition testbed run: a peer that had stepped alone during a 35 s cut was ahead
    after the heal, and stepped alone 19 more times while the others, behind, downloaded its
    state after each of its steps (8 downloads each) and never averaged with it."""
    trainer = make_trainer(tmp_path, min_group_size=1)
    size = sum(p.numel() for p in trainer.model.parameters())
    alone = AveragingResult(peers_seen=1)

    def try_alone(gather_until: float) -> None:
        trainer._finish_step(np.full(size, 0.5, dtype=np.float32), 8, alone, gather_until)

    try_alone(1.0)  # nobody seen yet: a lone first peer trains
    try_alone(2.0)
    assert trainer.step == 2
    behind = rec(0, step=0, digest="x")
    trainer._note_view(CollaborationView([behind]))  # appeared: it is about to download
    try_alone(3.0)
    assert trainer.step == 2
    # It catches up by download to step 1 (we moved on meanwhile): still catching up.
    for moved in trainer._moves.since:
        trainer._moves.since[moved] = (0, trainer._moves.since[moved][1] - 100)
    trainer._note_view(CollaborationView([msgspec.structs.replace(behind, step=1)]))
    try_alone(4.0)
    assert trainer.step == 2
    # Stuck at step 1 for solo_after seconds (its downloads keep failing): it holds us back
    # no longer, once nobody else has been there for solo_after either.
    for moved in trainer._moves.since:
        trainer._moves.since[moved] = (1, trainer._moves.since[moved][1] - 100)
    trainer._note_view(CollaborationView([msgspec.structs.replace(behind, step=1)]))
    assert trainer._company_at is not None
    trainer._company_at -= trainer.training.solo_after
    try_alone(5.0)
    assert trainer.step == 3


def test_a_peer_left_behind_when_the_collaboration_finished_stops_instead_of_stepping_alone(
    tmp_path,
):
    """The 5 Mbit testbed run: the others reached max_steps and left while a laggard was still
    downloading; it then stepped alone to the last step and ended on parameters nobody held."""
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer._note_view(CollaborationView([rec(0, step=3, digest="x")]))
    assert not trainer._done()  # it downloads from them
    trainer._note_view(CollaborationView([]))  # they left
    assert not trainer._done()  # (or a read missed them: wait solo_after)
    assert trainer._company_at is not None
    trainer._company_at -= trainer.training.solo_after
    assert trainer._done() and trainer.step == 0
    # Without max_steps, or once we reached it ourselves, nothing changes.
    free = make_trainer(tmp_path)
    free._note_view(CollaborationView([rec(0, step=3, digest="x")]))
    free._note_view(CollaborationView([]))
    free._company_at = -math.inf
    assert not free._done()


async def test_a_finished_peer_waits_for_one_behind_it_up_to_a_download_deadline(
    tmp_path, autojump_clock
):
    """Finished peers used to leave after 2 gather_window + 4 progress_interval + 5 s (13 s)
    whatever the others did: a laggard mid-way through a 20 s download lost its donors."""
    trainer = make_trainer(tmp_path, max_steps=3)
    take_steps(trainer, 3)
    laggard = rec(0, step=1, digest="x")
    trainer._note_view(CollaborationView([laggard]))

    async def catches_up_at(seconds: float) -> None:
        await trio.sleep(seconds)
        trainer._note_view(
            CollaborationView([msgspec.structs.replace(laggard, step=3, digest=trainer.digest)])
        )

    started = trio.current_time()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(catches_up_at, 40.0)
        await trainer._settle()
    assert trio.current_time() - started == pytest.approx(40.0, abs=1.0)
    # One that never catches up (its record alive, e.g. a dead peer's not yet expired) is
    # waited for no longer than a download's deadline after the usual bound.
    trainer._note_view(CollaborationView([laggard]))
    started = trio.current_time()
    await trainer._settle()
    bound = trainer.timing.settle_patience(trainer._store_seconds)
    assert trio.current_time() - started == pytest.approx(
        bound + trainer.config.state.download_timeout, abs=1.0
    )
    # One at our step and digest, but downloading (two groups swapping digests at the end):
    # we wait until it holds what it fetched, and would download it if that is the consensus.
    fetching = rec(0, step=3, digest=trainer.digest, downloading=True)
    trainer._note_view(CollaborationView([fetching]))
    started = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def fetched_at(seconds: float) -> None:
            await trio.sleep(seconds)
            done = msgspec.structs.replace(fetching, downloading=False)
            trainer._note_view(CollaborationView([done]))

        nursery.start_soon(fetched_at, 50.0)
        await trainer._settle()
    assert trio.current_time() - started == pytest.approx(50.0, abs=1.0)
    # Nobody behind: the usual bound (a peer at our step on another digest downloads from us).
    trainer._note_view(CollaborationView([rec(0, step=3, digest="x")]))
    started = trio.current_time()
    await trainer._settle()
    assert trio.current_time() - started == pytest.approx(bound, abs=1.0)


def group_result(size: int, weight: float, *, complete: bool = True) -> AveragingResult:
    """What the averager returns: the exact average of `weight` samples, or nothing."""
    report = RoundReport(chunks=[ChunkResult(0, size, 3)])
    if not complete:
        report.dropped_senders["someone"] = "timed out"
        return AveragingResult(peers_seen=3, rounds=[report], skipped=["round 0: incomplete"])
    average = np.full(size, 0.25, dtype=np.float32)
    return AveragingResult(peers_seen=3, rounds=[report], average=average, weight=weight, members=3)


def test_failed_averagings_warn_only_once_they_persist(tmp_path, caplog):
    trainer = make_trainer(tmp_path)
    size = sum(p.numel() for p in trainer.model.parameters())
    vector = np.full(size, 0.5, dtype=np.float32)
    outcomes = [False] * 4 + [True] + [False] * 14  # 4 failures, a step, 14 failures
    with caplog.at_level("INFO", logger="peertrain.trainer"):
        for gather_until, complete in enumerate(outcomes, start=1):
            trainer._finish_step(vector, 8, group_result(size, 3, complete=complete), gather_until)
    failures = [r for r in caplog.records if "did not complete" in r.getMessage()]
    warned = [i + 1 for i, r in enumerate(failures) if r.levelname == "WARNING"]
    # The 3rd failure in a row warns, then the 13th, 23rd...; a step starts the count over.
    assert len(failures) == 18 and warned == [3, 7, 17]
    assert trainer.status.failures["averaging_incomplete"] == 18


@pytest.mark.parametrize(
    ("samples", "weight", "complete", "steps"),
    [
        (8, 24, True, True),  # an ordinary step
        (0, 16, True, True),  # we had nothing, others did: the group's average still applies
        (0, 0, True, False),  # nobody had samples: nothing was averaged
        (8, 24, False, False),  # a member failed: our work waits for the next try
    ],
)
def test_a_group_result_is_a_step_only_if_exact_and_someone_contributed(
    tmp_path, samples, weight, complete, steps
):
    trainer = make_trainer(tmp_path)
    before = states.parameters_digest(trainer.model)
    size = sum(p.numel() for p in trainer.model.parameters())
    ours = np.full(size, 0.5, dtype=np.float32)
    result = group_result(size, weight, complete=complete)
    trainer._finish_step(ours, samples, result, 1.0)
    assert trainer.step == (1 if steps else 0)
    assert (states.parameters_digest(trainer.model) != before) == steps
    if steps:  # the step took the average, not our own contribution
        expected = TinyTask().build_model()
        optimizer = TinyTask().make_optimizer(expected.parameters())
        for p in expected.parameters():
            p.grad = torch.full_like(p, 0.25)
        optimizer.step()
        assert states.parameters_digest(trainer.model) == states.parameters_digest(expected)
    else:  # our own work, exactly, is kept for the next try
        assert trainer.strategy.samples == samples
        kept = torch.cat([t.reshape(-1) for t in trainer.strategy.sums]) / max(samples, 1)
        assert torch.equal(kept, torch.from_numpy(ours)) or samples == 0


class ScheduledTiny(TinyTask):
    """The tiny task with a learning rate that halves every global step."""

    def make_scheduler(self, optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


INNER_STEPS = 2


def make_scheduled(tmp_path, mode: str = "dedloc") -> Trainer:
    return make_trainer(tmp_path, task=ScheduledTiny(), mode=mode, inner_steps=INNER_STEPS)


def take_steps(trainer: Trainer, count: int) -> None:
    """`count` global steps, each with the local work of the mode (diloco: H inner steps)."""
    size = sum(p.numel() for p in trainer.model.parameters())
    for step in range(count):
        if trainer.training.mode == "diloco":
            generator = torch.Generator().manual_seed(step)
            for _ in range(INNER_STEPS):
                trainer.strategy.accumulate(TinyTask().sample_batch(8, generator), 8)
        average = np.full(size, 0.5, dtype=np.float32)
        trainer._finish_step(average, 8, group_result(size, 3), 1.0)


def learning_rate(trainer: Trainer) -> float:
    optimizers = trainer.strategy.optimizers()
    optimizer = optimizers.get("optimizer") or optimizers["inner"]
    return optimizer.param_groups[0]["lr"]


@pytest.mark.parametrize(("mode", "per_step"), [("dedloc", 1), ("diloco", INNER_STEPS)])
def test_the_scheduler_steps_with_its_optimizer_and_travels_with_the_state(
    tmp_path, mode, per_step
):
    """dedloc: once per global step; diloco: once per inner step (the paper's schedule; it
    stepped once per outer step before), H per outer step on every peer."""
    donor = make_scheduled(tmp_path / "a", mode)
    take_steps(donor, 3)
    assert learning_rate(donor) == pytest.approx(1e-2 * 0.5 ** (3 * per_step))
    blob = states.to_bytes(donor._captured)

    joiner = make_scheduled(tmp_path / "b", mode)
    joiner._restore(states.from_bytes(blob))
    assert joiner.step == 3 and learning_rate(joiner) == learning_rate(donor)
    take_steps(donor, 1)
    take_steps(joiner, 1)
    assert learning_rate(joiner) == learning_rate(donor)
    assert learning_rate(donor) == pytest.approx(1e-2 * 0.5 ** (4 * per_step))
    assert states.parameters_digest(joiner.model) == states.parameters_digest(donor.model)


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
def test_a_scheduler_state_unlike_ours_is_refused_and_changes_nothing(tmp_path, tamper):
    donor = make_scheduled(tmp_path / "a")
    take_steps(donor, 2)
    captured = donor._captured
    tamper(captured.metadata["scheduler"])
    state = states.from_bytes(states.to_bytes(captured))
    joiner = make_scheduled(tmp_path / "b")
    before = states.parameters_digest(joiner.model)
    with pytest.raises(StateMismatch, match="scheduler"):
        joiner._restore(state)
    assert joiner.step == 0 and states.parameters_digest(joiner.model) == before
    assert learning_rate(joiner) == 1e-2


def test_a_state_without_the_scheduler_this_task_has_is_refused(tmp_path):
    plain = make_trainer(tmp_path / "a")
    take_steps(plain, 1)
    with pytest.raises(StateMismatch, match="scheduler state missing"):
        make_scheduled(tmp_path / "b")._restore(states.from_bytes(states.to_bytes(plain._captured)))


def test_slow_dht_stores_widen_the_gathering_window_and_the_declare_margin(tmp_path):
    """Over high-latency links a 2 s window closed before tickets landed (issue 7 testbed)."""
    trainer = make_trainer(tmp_path)
    timing = trainer.timing
    configured = trainer.training.gather_window
    assert timing.window(trainer._store_seconds) == configured
    assert timing.declare_margin(trainer._store_seconds) == min(configured / 4, 1.0)
    trainer.note_store_time(0.01)  # a loopback store changes nothing
    assert timing.window(trainer._store_seconds) == configured
    for _ in range(10):
        trainer.note_store_time(1.5)  # a store over a 160 ms RTT path: several round trips
    assert trainer._store_seconds == pytest.approx(1.5, rel=0.05)
    window = timing.window(trainer._store_seconds)
    margin = timing.declare_margin(trainer._store_seconds)
    assert window >= 4 * 1.4 and margin >= 2 * 1.4
    assert window > margin + 1.0  # time left to compute
    # However slow: no wider than the furthest ahead anyone believes a call.
    assert timing.window(1e6) == timing.max_window < timing.latest_call(0.0)


async def test_failed_state_downloads_back_off_and_a_success_resets_the_wait(
    tmp_path, autojump_clock
):
    trainer = make_trainer(tmp_path)
    trainer.dht.node.remember_addrs = lambda *args: None
    outcomes = [False] * 8 + [True, False]
    waits = []

    async def download(donors, step):
        if outcomes.pop(0):
            trainer._capture()
            return trainer.snapshot()
        raise RemoteError("busy: serving 4 downloads")

    trainer.download = download
    donor = rec(1, step=0, digest="x")
    view = CollaborationView([donor])
    for _ in range(10):
        started = trio.current_time()
        await trainer._catch_up([donor], view)
        waits.append(round(trio.current_time() - started, 3))
    interval = trainer.training.progress_interval
    doubling = [min(interval * 2**i, MAX_DOWNLOAD_BACKOFF) for i in range(8)]
    assert waits[:8] == doubling and doubling[-1] == MAX_DOWNLOAD_BACKOFF
    assert waits[8] == 0  # the success
    assert waits[9] == interval  # and the next failure starts over


async def test_a_peer_downloading_says_so_in_its_record(tmp_path, autojump_clock):
    trainer = make_trainer(tmp_path)
    trainer.dht.node.remember_addrs = lambda *args: None
    during = []

    async def download(donors, step):
        during.append(trainer.record().downloading)
        await trio.sleep(5)
        trainer._capture()
        return trainer.snapshot()

    trainer.download = download
    donor = rec(1, step=0, digest="x")
    assert not trainer.record().downloading
    await trainer._catch_up([donor], CollaborationView([donor]))
    assert during == [True] and not trainer.record().downloading
    assert trainer._publish_now.is_set()  # others learn both at once


async def test_a_store_cut_short_by_its_deadline_still_widens_the_window(tmp_path, autojump_clock):
    """Stores slower than the progress exchange's deadline never finished, so they were never
    counted: a peer in the namespace testbed kept calling 3 s windows while its tickets landed
    4 s late."""
    trainer = make_trainer(tmp_path)

    async def slow_store(*args, **kwargs):
        await trio.sleep(60)  # past any deadline

    async def withdraw(*args, **kwargs):
        return 0

    trainer.dht.store, trainer.dht.withdraw = slow_store, withdraw
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trainer._keep_progress)
        await trio.sleep(30)
        nursery.cancel_scope.cancel()
    deadline = max(trainer.training.progress_interval, trainer.config.net.rpc_timeout)
    assert trainer._store_seconds >= deadline
    assert trainer.timing.window(trainer._store_seconds) >= STORES_PER_WINDOW * deadline


def test_every_peer_draws_its_own_micro_batches_for_any_seed(tmp_path):
    """A non-zero `training.seed` gave every peer the same data (10 of 10 micro-batches
    compared were identical)."""
    assert data_seed(7, "peer-a") != data_seed(7, "peer-b")
    assert data_seed(7, "peer-a") == data_seed(7, "peer-a")  # reproducible
    assert data_seed(0, "peer-a") != data_seed(7, "peer-a")
    first = [make_trainer(tmp_path / str(i), seed=7).next_batch()[0][0] for i in range(3)]
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])


def other(peer_id: str, **fields) -> ProgressRecord:
    """Another trainer's record at step 0 (peer ids sort: "0" < "12D3KooW..." < "z")."""
    return msgspec.structs.replace(rec(0, step=0), peer_id=peer_id, **fields)


def dedloc_trainer(tmp_path, *others: ProgressRecord, rate: float = 10.0) -> Trainer:
    trainer = make_trainer(tmp_path)  # target batch 64, micro-batch 8
    trainer._rate_ema = rate
    trainer.clock = lambda: 1.0  # the records' updated_at: nothing to project yet
    trainer._note_view(CollaborationView(list(others)))
    return trainer


def work(trainer: Trainer, micro_batches: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for _ in range(micro_batches):
        trainer.strategy.accumulate(TinyTask().sample_batch(8, generator), 8)


def test_a_dedloc_peer_stops_at_its_quota_of_the_target_batch(tmp_path):
    """Each peer computes its quota (by speed) of the target's micro-batches and holds: the
    global batch is the target, give or take a micro-batch per peer, however stale the
    records are (target 256 gave 160-704 before)."""
    trainer = dedloc_trainer(tmp_path, *(other(f"z{i}", samples_per_second=10.0) for i in range(3)))
    assert trainer._quota(trainer.view()) == 2  # 8 micro-batches among four equally fast peers
    work(trainer, 1)
    assert not trainer._batch_is_full(trainer.view())
    work(trainer, 1)
    assert trainer._batch_is_full(trainer.view())
    # Three times faster than the others: 8 x 30/60 = 4 micro-batches.
    fast = dedloc_trainer(
        tmp_path / "fast", *(other(f"z{i}", samples_per_second=10.0) for i in range(3)), rate=30
    )
    assert fast._quota(fast.view()) == 4
    # A peer at another step, or downloading, takes no part in this step.
    apart = dedloc_trainer(
        tmp_path / "apart",
        other("z1", samples_per_second=10.0, step=5),
        other("z2", samples_per_second=10.0, downloading=True),
    )
    assert apart._quota(apart.view()) == 8


def test_the_quotas_of_every_peer_add_up_to_the_target(tmp_path):
    """16 peers and a target of 8 micro-batches: half of them compute one, the others none
    and only receive the average (a share of half a micro-batch each, rounded, made every peer
    hold with nothing: 16 peers averaged zero samples again and again)."""
    peers = [f"p{i:02d}" for i in range(16)]
    rates = {peer: 10.0 + i for i, peer in enumerate(peers)}
    quotas = []
    for me in peers:
        records = [other(p, samples_per_second=rates[p]) for p in peers if p != me]
        trainer = dedloc_trainer(tmp_path / me, *records, rate=rates[me])
        trainer.me = me
        quotas.append(trainer._quota(trainer.view()))
    assert sum(quotas) == 8 and set(quotas) == {0, 1}
    assert quotas[-1] == 1  # the fastest gets one


def test_warming_up_peers_deal_quotas_from_the_rates_they_published(tmp_path):
    """Each peer deals from the records everyone reads, its own included: two peers whose
    first (slow) micro-batches were published at 10/s and who run at 30/s now each took
    themselves for the faster one (6 + 6 of 8 micro-batches: a global batch of 96)."""
    quotas = []
    for me, peer in (("a", "b"), ("b", "a")):
        trainer = dedloc_trainer(
            tmp_path / me,
            other(me, samples_per_second=10.0),
            other(peer, samples_per_second=10.0),
            rate=30.0,
        )
        trainer.me = me
        quotas.append(trainer._quota(trainer.view()))
    assert quotas == [4, 4]


def test_a_dedloc_peer_stops_when_the_others_already_hold_the_batch(tmp_path):
    trainer = dedloc_trainer(
        tmp_path, other("z1", samples=40, holding=True), other("z2", samples=20, holding=True)
    )
    assert trainer._batch_is_full(trainer.view())  # 60 >= 64 - 4: one more would overshoot
    # Their counts move on at their speed until they hold (projected at most 2 intervals on).
    moving = dedloc_trainer(tmp_path / "m", other("z1", samples=40, samples_per_second=10.0))
    assert not moving._batch_is_full(moving.view())  # 40, and our share is 32
    moving.clock = lambda: 1.0 + 2 * moving.training.progress_interval
    assert moving._batch_is_full(moving.view())  # 40 + 10/s x 2 s
    stale = CollaborationView([other("z1", samples=40, samples_per_second=10.0)])
    assert stale.projected_samples(0, now=100.0, horizon=2.0) == 60  # not 1030


def test_only_the_lowest_trainer_calls_a_step_unless_it_stays_silent(tmp_path):
    """Two calls of a step made at nearly the same moment split it (8 peers in one process
    split 5-3): one caller, with a fallback in case it is gone."""
    low = dedloc_trainer(tmp_path / "low", other("z1", samples=40, holding=True))
    high = dedloc_trainer(tmp_path / "high", other("0", samples=40, holding=True))
    for trainer in (low, high):
        work(trainer, 3)
        assert trainer._ready(trainer.view())
        trainer._ready_since = time.monotonic()
    assert low._may_call(low.view()) and not high._may_call(high.view())
    high._ready_since -= 10.0  # the lowest stayed silent
    assert high._may_call(high.view())


def test_after_a_failed_averaging_nobody_calls_while_others_are_still_in_it(tmp_path):
    trainer = dedloc_trainer(tmp_path, other("z1", call_step=0, gather_until=0.5))
    work(trainer, 8)
    trainer._ready_since = time.monotonic()
    assert trainer._may_call(trainer.view())  # nothing failed for us: their call is theirs
    trainer._failed_before = 0.5  # we failed (or missed) that gathering; they are still in it
    assert not trainer._may_call(trainer.view())
    trainer._note_view(CollaborationView([other("z1")]))  # done with it
    assert trainer._may_call(trainer.view())


def test_how_long_others_may_still_be_averaging_grows_with_the_vector(tmp_path):
    """The wait for peers still in a failed averaging covers its rounds' transfers of the
    vector at the measured bandwidth: a fixed 30 s was shorter than one round of a 400 MB
    vector at 50 MB/s, and a peer called the step while the others were still in it. Here
    the tiny model's vector takes 40 s to send at the bandwidth we measured."""
    trainer = dedloc_trainer(tmp_path, other("z1"))
    # The tiny vector is slow to send only at a few kB/s: below the default floor on claims.
    averaging = dataclasses.replace(trainer.config.averaging, min_bandwidth=1.0)
    trainer.config = dataclasses.replace(trainer.config, averaging=averaging)
    fixed = 4 * averaging.join_timeout + 2 * averaging.timeout_floor
    assert trainer._longest_averaging(trainer.view()) == fixed  # unmeasured: the old bound
    size = sum(p.numel() for p in trainer.model.parameters())
    rate = 4 * size / 40.0  # bytes/s: float32, 40 s
    trainer.capabilities = lambda: SimpleNamespace(upload_bps=rate, download_bps=rate)
    longest = trainer._longest_averaging(trainer.view())
    assert longest > 2 * 40.0 * averaging.timeout_multiplier > fixed
    # Our averaging of the gathering that closed at 0.5 failed; a peer still in it holds our
    # call until then, no longer.
    trainer._finish_step(np.zeros(size, np.float32), 8, group_result(size, 0, complete=False), 0.5)
    trainer._note_view(CollaborationView([other("z1", call_step=0, gather_until=0.5)]))
    trainer.clock = lambda: 0.5 + (fixed + longest) / 2
    assert trainer._others_still_averaging(trainer.view())
    trainer.clock = lambda: 0.5 + longest + 1.0
    assert not trainer._others_still_averaging(trainer.view())
    # A record that goes on claiming to be in the averaging holds calls 10 minutes at most,
    # however large the model and slow our link (here: 11 hours a transfer).
    trainer.capabilities = lambda: SimpleNamespace(upload_bps=1.0, download_bps=1.0)
    assert trainer._longest_averaging(trainer.view()) == MAX_WAIT_FOR_OTHERS == 600.0


def test_a_group_of_a_minority_of_the_trainers_does_not_step(tmp_path):
    """Two groups that averaged one step apart cannot both step: before, both did, and the
    smaller one downloaded the other's state and lost its samples."""
    trainer = dedloc_trainer(tmp_path, *(other(f"z{i}") for i in range(4)))  # 5 trainers
    size = sum(p.numel() for p in trainer.model.parameters())
    ours = np.full(size, 0.5, dtype=np.float32)
    minority = group_result(size, 16)
    minority.members = 2
    trainer._finish_step(ours, 8, minority, 1.0)
    assert trainer.step == 0 and trainer.strategy.samples == 8
    assert "not a majority" in " ".join(minority.skipped)
    majority = group_result(size, 24)  # 3 of 5
    trainer._finish_step(ours, 8, majority, 2.0)
    assert trainer.step == 1 and trainer.status.global_batches[-1] == 24


def test_a_diloco_peer_takes_exactly_its_inner_steps_and_calls_once_everyone_did(tmp_path):
    """H was a minimum: peers kept taking inner steps until the gathering (29-31 with H = 10)."""
    trainer = make_trainer(tmp_path, mode="diloco", inner_steps=3)
    trainer._note_view(CollaborationView([other("z1", samples=8)]))
    work(trainer, 2)
    assert not trainer._batch_is_full(trainer.view())
    work(trainer, 1)
    assert trainer._batch_is_full(trainer.view())  # exactly H: no more inner steps
    assert not trainer._ready(trainer.view())  # the other is not done yet
    trainer._note_view(CollaborationView([other("z1", samples=24, holding=True)]))
    assert trainer._ready(trainer.view())


@pytest.mark.parametrize(("weighting", "expected"), [("samples", 24.0), ("uniform", 1.0)])
async def test_diloco_pseudo_gradients_are_weighted_by_samples_or_uniformly(
    tmp_path, weighting, expected
):
    weights = []

    class Averager:
        async def average(self, vector, *, weight, **_):
            weights.append(weight)
            return AveragingResult(peers_seen=1)

    trainer = make_trainer(tmp_path, mode="diloco", outer_weighting=weighting)
    trainer.averager = Averager()  # type: ignore[assignment]
    vector, samples = np.zeros(4, np.float32), 24
    await trainer._run_averaging(vector, samples, 0, 1.0)
    await trainer._run_averaging(vector, 0, 0, 1.0)
    assert weights == [expected, 0.0]


@pytest.mark.parametrize(("weighting", "recorded"), [("samples", [3.0]), ("uniform", [])])
def test_a_uniformly_weighted_step_records_no_global_batch(tmp_path, caplog, weighting, recorded):
    """With peers weighted equally the average's weight counts peers: it was logged and kept as
    the step's global batch ("8 local samples of 3")."""
    trainer = make_trainer(tmp_path, mode="diloco", outer_weighting=weighting)
    trainer._note_view(CollaborationView([other("z1"), other("z2")]))
    size = sum(p.numel() for p in trainer.model.parameters())
    with caplog.at_level(logging.INFO, logger="peertrain.trainer"):
        trainer._finish_step(np.zeros(size, np.float32), 8, group_result(size, 3.0), 1.0)
    assert trainer.step == 1
    assert list(trainer.status.global_batches) == recorded
    applied = [r.applied for r in caplog.records if hasattr(r, "applied")]
    assert applied[-1]["global_batch"] == (recorded[0] if recorded else None)
    assert ("of 3" in caplog.text) == bool(recorded)


def test_a_caller_done_with_its_own_quota_waits_for_the_collaboration(tmp_path):
    """Being done with one's own quota is not the batch being full: a step called then made
    the others declare half-way through theirs. Nor does a peer with nothing to do take over
    the call from a lowest peer that is still computing."""
    trainer = dedloc_trainer(tmp_path, other("z1", samples=8, samples_per_second=10.0))
    work(trainer, 4)  # our quota: 4 of 8 micro-batches
    assert trainer._batch_is_full(trainer.view())
    trainer._holding = True  # (as its loop sets it)
    assert not trainer._ready(trainer.view())  # 40 of 64, and 20 more in the 2 s window
    trainer._note_view(CollaborationView([other("z1", samples=32, holding=True)]))
    assert trainer._ready(trainer.view())  # everyone holds
    # One that computes nothing (its micro-batches count no samples) never holds: it must not
    # keep the step from being called (3 peers, one of them idle, waited forever).
    trainer._note_view(CollaborationView([other("z1", samples=0, samples_per_second=0.0)]))
    assert trainer._ready(trainer.view())
    # A peer whose quota is nothing, while the lowest computes and publishes: no call of its
    # own, until a long wait says the lowest will not call.
    idle = dedloc_trainer(
        tmp_path / "idle", other("0", samples=40, samples_per_second=10.0, updated_at=1.0)
    )
    idle.clock = lambda: 1.0 + 0.5  # the lowest's record is fresh
    idle._ready_since = time.monotonic() - 5.0  # past the fallback wait (2 s), not the long one
    assert idle._ready(idle.view())  # 40 + 10/s over the window: the batch will be full
    assert not idle._may_call(idle.view())
    idle._ready_since = time.monotonic() - 100.0
    assert idle._may_call(idle.view())


# ---------------------------------------------------------------------------- the hijack


def signed_record(trainer: Trainer, *others: Trainer, **fields) -> ProgressRecord:
    """`trainer`'s own record, carrying the signatures of `others` at its (step, digest) as
    their records would have (others must hold the same state)."""
    record = trainer.record()
    signatures = [*record.signatures, *(o.record().signatures[0] for o in others)]
    return msgspec.structs.replace(record, signatures=signatures, **fields)


def test_a_state_downloads_only_for_a_certified_step(tmp_path):
    """One peer's record at a higher step used to send everyone to download its state."""
    trainer = make_trainer(tmp_path / "me")
    liar = make_trainer(tmp_path / "liar")
    take_steps(liar, 2)

    def read(*records: ProgressRecord) -> None:  # as the progress loop reads the DHT
        entries = {r.peer_id: Entry(encode_progress(r), 2e9) for r in records}
        trainer._note_view(trainer._read(entries))

    read(signed_record(liar))
    assert trainer.view().global_step == 0 and trainer._should_download(trainer.view()) == []
    # Two members of the round that made it signed: then it is the collaboration's step.
    partner = make_trainer(tmp_path / "partner")
    take_steps(partner, 2)
    assert partner.digest == liar.digest
    read(signed_record(liar, partner))
    assert [r.peer_id for r in trainer._should_download(trainer.view())] == [liar.me]


async def test_a_donor_cannot_hand_over_a_state_other_than_the_certified_one(
    tmp_path, autojump_clock
):
    """The hijack as shown: the donor's state had every parameter at 0.25 and AdamW's lr at
    1e-9, and every peer (and the keeper) took it."""
    trainer = make_trainer(tmp_path / "me")
    trainer.dht.node.remember_addrs = lambda *args: None
    honest, partner = make_trainer(tmp_path / "a"), make_trainer(tmp_path / "b")
    take_steps(honest, 2)
    take_steps(partner, 2)
    record = signed_record(honest, partner)
    view = CollaborationView([record], trainer.quorum)
    trainer._note_view(view)

    poisoned = make_trainer(tmp_path / "poison")
    take_steps(poisoned, 2)
    with torch.no_grad():
        for parameter in poisoned.model.parameters():
            parameter.fill_(0.25)
    for group in poisoned.strategy.optimizer.param_groups:
        group["lr"] = 1e-9
    poisoned._capture()
    served = [poisoned.snapshot()]

    async def download(donors, step):
        return served[0]

    trainer.download = download
    await trainer._catch_up([record], view)
    assert trainer.step == 0 and trainer.status.failures["state_download"] == 1
    assert all(float(p.detach().abs().max()) != 0.25 for p in trainer.model.parameters())

    # The certified state, with the donor's learning rate changed (not in the digest): taken,
    # with our own task's learning rate.
    for group in honest.strategy.optimizer.param_groups:
        group["lr"] = 1e-9
    honest._capture()
    assert honest.digest == record.digest
    served[0] = honest.snapshot()
    await trainer._catch_up([record], view)
    assert trainer.step == 2 and trainer.digest == record.digest
    assert learning_rate(trainer) == learning_rate(partner) != 1e-9


def test_a_donor_state_with_a_non_finite_value_is_refused_and_changes_nothing(tmp_path):
    trainer = make_trainer(tmp_path / "me")
    donor = make_trainer(tmp_path / "donor")
    take_steps(donor, 1)
    state = states.from_bytes(donor.snapshot().blob)
    name = next(n for n in state.tensors if n.startswith("optimizer.") and "exp_avg" in n)
    state.tensors[name].view(-1)[0] = math.inf
    before = states.parameters_digest(trainer.model)
    with pytest.raises(StateMismatch, match="NaN or Inf"):
        trainer._restore(state, from_donor=True)
    assert trainer.step == 0 and states.parameters_digest(trainer.model) == before


@pytest.mark.parametrize(("mode", "per_step"), [("dedloc", 1), ("diloco", INNER_STEPS)])
def test_a_donors_schedule_is_never_loaded_ours_is_replayed(tmp_path, mode, per_step):
    """A scheduler state is JSON a donor writes (base_lrs 1e-9 slows every peer to a halt):
    after a download the schedule is our own task's, stepped as many times as the step says."""
    donor = make_scheduled(tmp_path / "a", mode)
    take_steps(donor, 3)
    donor._captured.metadata["scheduler"]["base_lrs"] = [1e-9]
    state = states.from_bytes(states.to_bytes(donor._captured))
    joiner = make_scheduled(tmp_path / "b", mode)
    joiner._restore(state, from_donor=True)
    assert joiner.step == 3
    assert learning_rate(joiner) == pytest.approx(1e-2 * 0.5 ** (3 * per_step))
    take_steps(joiner, 1)
    assert learning_rate(joiner) == pytest.approx(1e-2 * 0.5 ** (4 * per_step))


async def test_training_stops_at_the_target_on_our_own_validation_or_a_quorum(tmp_path):
    """One peer reporting a validation loss under the target used to end everyone's training."""
    trainer = make_trainer(tmp_path, target_validation_loss=2.9)
    liar = msgspec.structs.replace(rec(0), validation_loss=0.01, validation_step=99)
    trainer._note_view(CollaborationView([liar], trainer.quorum))
    assert not trainer._done()
    trainer.status.validation = (0, 2.5)  # our own
    assert trainer._done()
    trainer.status.validation = (0, 3.5)
    second = msgspec.structs.replace(rec(1), validation_loss=2.0, validation_step=99)
    trainer._note_view(CollaborationView([liar, second], trainer.quorum))
    assert trainer._done()


def test_a_call_far_ahead_holds_nobody(tmp_path):
    """One peer's call of the next step 11 days ahead used to be the earliest call forever."""
    trainer = make_trainer(tmp_path)
    now = trainer.clock()
    far = msgspec.structs.replace(rec(0, step=0), call_step=0, gather_until=now + 11 * 86400)
    trainer._note_view(CollaborationView([far], trainer.quorum))
    assert trainer._current_call(trainer.view()) is None
    near = msgspec.structs.replace(rec(1, step=0), call_step=0, gather_until=now + 2)
    trainer._note_view(CollaborationView([far, near], trainer.quorum))
    assert trainer._current_call(trainer.view()) == now + 2


async def test_a_step_nobody_else_applied_is_given_up_for_the_certified_one(
    tmp_path, autojump_clock
):
    """Two peers under load: one's averaging completed, the other's did not. The first held a
    step only it signed, the second could neither download it nor average a step apart: both
    called their own steps for ever. The one stranded ahead goes back to the certified step."""
    now = [1000.0]
    trainer = make_trainer(tmp_path / "ahead", clock=lambda: now[0])
    trainer.dht.node.remember_addrs = lambda *args: None
    partner = make_trainer(tmp_path / "behind")
    start = partner.snapshot()
    take_steps(trainer, 1)  # our averaging completed; the partner's did not
    behind = signed_record(partner)  # still at step 0
    view = CollaborationView([behind], trainer.quorum)
    trainer._note_view(view)
    assert trainer.view().global_step == 0 and trainer._should_download(trainer.view()) == []
    # Its signature never comes: after the patience, we fetch the step it holds.
    now[0] += trainer.timing.settle_patience(trainer._store_seconds)
    trainer._note_view(view)
    assert [r.peer_id for r in trainer._should_download(trainer.view())] == [partner.me]

    async def download(donors, step):
        return start

    trainer.download = download
    await trainer._catch_up([behind], trainer.view())
    assert trainer.step == 0 and trainer.digest == partner.digest
    # A step the partner signed too is never given up.
    take_steps(trainer, 1)
    take_steps(partner, 1)
    trainer._note_view(CollaborationView([signed_record(partner)], trainer.quorum))
    now[0] += 10 * trainer.timing.settle_patience(trainer._store_seconds)
    trainer._note_view(CollaborationView([signed_record(partner)], trainer.quorum))
    assert trainer._should_download(trainer.view()) == []
