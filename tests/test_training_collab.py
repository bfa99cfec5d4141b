"""Collaborative training end to end in one process: real DHT, matchmaking, data plane and
state download on loopback, several trainers on the tiny task."""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Iterable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
import torch
import trio
from libp2p.peer.id import ID

from peer.averaging.allreduce import DataServer
from peer.averaging.averager import Averager
from peer.config import AveragingConfig, DhtConfig, PeerConfig, TaskConfig, TrainingConfig
from peer.training import state as states
from peer.training.statesync import StateDonor, StateDownload
from peer.training.task import TinyTask
from peer.training.trainer import Trainer
from tests.helpers import CuttingRelay, data_identity, load_factor, swarm

DHT_CONFIG = dataclasses.replace(DhtConfig(), replicas=5, alpha=3, purge_interval=3600.0)


def make_config(tmp_path: Path, **training) -> PeerConfig:
    """The tiny task among in-process trainers; the gathering window (0.6 s, or the one given)
    stretched by the machine's load (`load_factor`): under load, stores land late and a peer
    that misses a gathering downloads instead of averaging."""
    window = training.pop("gather_window", 0.6) * load_factor()
    return PeerConfig(
        dht=DHT_CONFIG,
        task=TaskConfig(name="tiny", micro_batch=8, target_batch=64),
        averaging=AveragingConfig(timeout_floor=2.0, join_timeout=2.0),
        training=TrainingConfig(
            **{
                "gather_window": window,
                "progress_interval": 0.1,
                "validation_interval": 0,
                "checkpoint_dir": str(tmp_path / "checkpoints"),
                "checkpoint_interval": 3600.0,
                **training,
            }
        ),
    )


class OracleTask(TinyTask):
    """The tiny task with AdamW's eps at 1e-4 instead of 1e-8, for the tests that compare a
    collaboration with one process element by element. Both add the same gradients in a
    different float order (rounding near 1e-9); where an element's gradient cancels to about
    1e-8, Adam's g / (|g| + eps) turns that rounding into a step a few % different (2 of
    10,384 parameters 3e-4 off, in 1 of 4 runs of 8 peers). With eps 1e-4 the same rounding
    moves no parameter by more than 7 % of the tolerance (400 one-step trials); a wrong
    weighting of the peers' gradients still moves thousands."""

    def make_optimizer(self, parameters: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        optimizer = super().make_optimizer(parameters)
        for group in optimizer.param_groups:
            group["eps"] = 1e-4
        return optimizer


class Recorder:
    """Deterministic micro-batches per peer, remembered with the peer and the step they
    counted toward."""

    def __init__(self, task: TinyTask | None = None) -> None:
        self.task = task or OracleTask()  # every trainer of the collaboration uses its kind
        self.used: dict[tuple[int, int], list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(
            list
        )

    def source(self, index: int, trainer_ref: list[Trainer]):
        generator = torch.Generator().manual_seed(1000 + index)

        def next_batch():
            batch = self.task.sample_batch(8, generator)
            self.used[(index, trainer_ref[0].step)].append(batch)
            return batch, 8

        return next_batch

    def dropped(self, index: int, step: int) -> None:
        """Peer `index` adopted a downloaded state while at `step`: the micro-batches it drew
        toward that step entered no step (adopting a state drops local work)."""
        self.used.pop((index, step), None)

    def replay(self, steps: int, peers: Iterable[int]) -> torch.nn.Module:
        """One process taking the same global batches: at each step, the union of what the
        given peers computed toward it."""
        peers = list(peers)
        model = self.task.build_model()
        optimizer = self.task.make_optimizer(model.parameters())
        for step in range(steps):
            batches = [b for i in peers for b in self.used[(i, step)]]
            x = torch.cat([x for x, _ in batches])
            y = torch.cat([y for _, y in batches])
            optimizer.zero_grad()
            self.task.loss(model, (x, y)).backward()
            optimizer.step()
        return model


class Joinable:
    """In-process trainers on one swarm, each with a state donor; more can join later."""

    def __init__(self, s, config: PeerConfig, recorder: Recorder | None) -> None:
        self.s = s
        self.config = config
        self.recorder = recorder
        self.trainers: list[Trainer] = []
        self.downloads: list[StateDownload] = []
        #: (trainer index, the step it held, the step it fetched) of each state download
        self.catch_ups: list[tuple[int, int, int]] = []
        #: Catch-ups download into the trainers' own tensors (the daemon's way), or beside.
        self.in_place = True

    async def add(
        self, dht, *, relay: int | None = None, relays: dict[int, CuttingRelay] | None = None
    ) -> Trainer:
        """A trainer on `dht`; `relay`: its data port is a CuttingRelay that cuts after that
        many bytes back (kept in `relays` by the trainer's index)."""
        index = len(self.trainers)
        server = DataServer(data_identity(dht.node.identity))
        port = await self.s.nursery.start(server.serve, "127.0.0.1", 0)
        if relay is not None and relays is not None:
            relays[index] = CuttingRelay(port, limit=relay)
            port = await self.s.nursery.start(relays[index].serve)
        averager = Averager(
            dht,
            self.config.averaging,
            collaboration="test",
            data_server=server,
            data_host="127.0.0.1",
            data_port=port,
        )

        async def download(donors, step, sink=None):
            job = StateDownload(
                dht.node, [ID.from_base58(r.peer_id) for r in donors], min_step=step, parallel=3
            )
            self.downloads.append(job)
            at = ref[0].step
            self.catch_ups.append((index, at, step))
            deadline = trio.current_time() + 20 * load_factor()
            if sink is None:
                result = await job.run(deadline=deadline)
            else:  # as the daemon does: into the trainer's own tensors
                result = await job.run_into(sink, deadline=deadline)
            if self.recorder:  # (on a loaded machine a peer that missed a gathering downloads)
                self.recorder.dropped(index, at)
            return result

        ref: list[Trainer] = []
        training = self.config.training
        trainer = Trainer(
            dht=dht,
            averager=averager,
            config=dataclasses.replace(
                self.config,
                training=dataclasses.replace(
                    training, checkpoint_dir=f"{training.checkpoint_dir}/{index}"
                ),
            ),
            task=type(self.recorder.task)() if self.recorder else TinyTask(),
            device=torch.device("cpu"),
            download=download,
            download_into=download if self.in_place else None,
            batches=self.recorder.source(index, ref) if self.recorder else None,
        )
        ref.append(trainer)
        donor = StateDonor(dht.node, trainer.snapshot, chunk_bytes=64 * 1024)
        await self.s.nursery.start(donor.serve, "127.0.0.1", 0)
        self.trainers.append(trainer)
        return trainer


@asynccontextmanager
async def collaboration(count: int, config: PeerConfig, *, recorder: Recorder | None = None):
    async with swarm(count, DHT_CONFIG) as s:
        group = Joinable(s, config, recorder)
        for dht in s.dhts:
            await group.add(dht)
        yield s, group


def parameters(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize(
    "count",
    # 5 or more peers plan rounds of several groups; on CI's 2 cores 5 took 111 s (14 s on an
    # idle machine) and once failed (a member banned its round-1 leader: "its spec misstates
    # the peers our value stands for"), 8 and 16 take minutes: they run with -m slow.
    [
        3,
        pytest.param(5, marks=pytest.mark.slow),
        pytest.param(8, marks=pytest.mark.slow),
        pytest.param(16, marks=pytest.mark.slow),
    ],
    ids=["3-peers-1-group", "5-peers-groups-of-4", "8-peers-groups-of-4", "16-peers-groups-of-4"],
)
async def test_dedloc_steps_equal_single_process_big_batch_training(tmp_path, count):
    """The oracle: every peer's parameters after each step are those of one process training
    on the union of the peers' micro-batches. With more peers than `group_size` (4) the
    averaging takes two Moshpit rounds; before, 5 peers in groups of 4 applied two different
    averages every step (12-40 % off), and the minority downloaded state."""
    steps = 3
    # Many trainers in one process on a small machine: stores and reads are slow, so the
    # gathering window is long enough for every one of them to see a call.
    config = make_config(tmp_path, max_steps=steps, gather_window=max(0.6, 0.25 * count))
    assert config.averaging.group_size == 4
    recorder = Recorder()
    with trio.fail_after((60 + 10 * count) * load_factor()):
        async with collaboration(count, config, recorder=recorder) as (s, group):
            trainers = group.trainers
            async with trio.open_nursery() as nursery:
                for trainer in trainers:
                    nursery.start_soon(trainer.run)
            s.nursery.cancel_scope.cancel()
    assert [t.step for t in trainers] == [steps] * count
    assert all(t.status().downloads == 0 for t in trainers)  # nobody ended apart
    digests = {states.parameters_digest(t.worker.model) for t in trainers}
    assert len(digests) == 1  # bit-identical on every peer
    for step in range(steps):  # the global batch: 64 samples, give or take a micro-batch each
        batch = sum(len(recorder.used[(i, step)]) * 8 for i in range(count))
        assert batch >= 64 - 8 * count
        # The first step may overshoot: a peer that starts before the others' records are
        # readable counts on itself alone (seen once on CI: 64 + 7 x 8 samples for step 1).
        assert step == 0 or batch <= 64 + 8 * count, (step, batch)
    model = recorder.replay(steps, range(count))
    torch.testing.assert_close(
        parameters(trainers[0].worker.model), parameters(model), rtol=1e-4, atol=2e-5
    )


async def test_a_member_killed_mid_averaging_leaves_the_others_their_own_gradients(tmp_path):
    """5 peers in groups of 4; the first group's lowest peer dies in the middle of the first
    all-reduce, after it returned some averages (a relay in front of its data port cuts every
    connection, then its trainer is cancelled). Nobody applies that averaging; each survivor
    keeps exactly its own gradient, and their next steps are those of one process on the
    survivors' micro-batches. Before, the survivors gave back their half-averaged vectors as
    their own contribution (0.41-0.47 relative error in 110,603 of 165,904 elements) and it
    entered the next step."""
    steps = 2
    config = make_config(tmp_path, max_steps=steps)
    config = dataclasses.replace(
        config, averaging=dataclasses.replace(config.averaging, chunk_elements=256)
    )
    recorder = Recorder()
    with trio.fail_after(120 * load_factor()):
        async with swarm(5, DHT_CONFIG) as s:
            group = Joinable(s, config, recorder)
            victim = min(range(5), key=lambda i: s.dhts[i].node.peer_id.to_base58())
            relays: dict[int, CuttingRelay] = {}
            for i, dht in enumerate(s.dhts):
                await group.add(dht, relay=4000 if i == victim else None, relays=relays)
            trainers = group.trainers
            async with trio.open_nursery() as nursery:
                for i, trainer in enumerate(trainers):
                    if i != victim:
                        nursery.start_soon(trainer.run)
                async with trio.open_nursery() as doomed:
                    doomed.start_soon(trainers[victim].run)
                    await relays[victim].cut.wait()
                    doomed.cancel_scope.cancel()
            s.nursery.cancel_scope.cancel()
    survivors = [i for i in range(5) if i != victim]
    assert relays[victim].returned == 4000  # it returned some averages before it died
    assert trainers[victim].step == 0
    assert trainers[victim]._stop_began is not None  # its final save's clock started there
    assert [trainers[i].step for i in survivors] == [steps] * 4
    # The victim's group saw the averaging fail (on a loaded machine a survivor may instead
    # have missed that gathering: then it never took part in the cut round).
    assert any(trainers[i].status().failures["averaging_incomplete"] >= 1 for i in survivors)
    assert len({states.parameters_digest(trainers[i].worker.model) for i in survivors}) == 1
    model = recorder.replay(steps, survivors)
    torch.testing.assert_close(
        parameters(trainers[survivors[0]].worker.model), parameters(model), rtol=1e-4, atol=2e-5
    )


@pytest.mark.parametrize(
    "training",
    [
        {"mode": "dedloc", "delayed_updates": True},
        {"mode": "diloco", "inner_steps": 4},
    ],
    ids=["dedloc-delayed", "diloco"],
)
async def test_every_peer_holds_the_same_parameters_after_each_step(tmp_path, training):
    config = make_config(tmp_path, max_steps=3, gather_window=1.2, **training)
    with trio.fail_after(60 * load_factor()):
        async with collaboration(3, config) as (s, group):
            trainers = group.trainers
            start = parameters(trainers[0].worker.model).clone()
            async with trio.open_nursery() as nursery:
                for trainer in trainers:
                    nursery.start_soon(trainer.run)
            s.nursery.cancel_scope.cancel()
    assert [t.step for t in trainers] == [3] * 3
    assert len({states.parameters_digest(t.worker.model) for t in trainers}) == 1
    assert not torch.equal(parameters(trainers[0].worker.model), start)
    # After any step: a peer that diverged holds a digest the others do not (or a step nobody
    # signed) and downloads a step no higher than its own. A peer that missed a gathering
    # (under two CPU burners, even 3.4 s windows) downloads the step it missed: allowed.
    assert all(fetched > held for _, held, fetched in group.catch_ups), group.catch_ups
    if training["mode"] == "dedloc":  # the target batch, give or take a micro-batch a peer,
        # twice that after a failed or missed gathering (its samples are kept for the next);
        # before, delayed updates computed on through every averaging: 3,280 for 64.
        assert all(b <= 2 * 64 + 8 * 3 for t in trainers for b in t.status().global_batches)


async def test_a_late_joiner_downloads_the_state_and_then_steps_in_lockstep(tmp_path):
    # Steps at least 1.5 s apart (stretched by load), as a download takes: with steps faster
    # than a download, a joiner finds the others a step ahead each time it finishes and only
    # ever downloads (seen under two CPU burners).
    config = make_config(tmp_path, max_steps=5, gather_window=1.5)
    with trio.fail_after(90 * load_factor()):
        async with swarm(3, DHT_CONFIG) as s:
            group = Joinable(s, config, None)
            for dht in s.dhts:
                await group.add(dht)
            async with trio.open_nursery() as nursery:
                for trainer in group.trainers:
                    nursery.start_soon(trainer.run)
                while min(t.step for t in group.trainers) < 2:
                    await trio.sleep(0.05)
                joiner = await group.add(await s.add())
                nursery.start_soon(joiner.run)
            s.nursery.cancel_scope.cancel()
    assert [t.step for t in group.trainers] == [5] * 4
    assert joiner.status().downloads >= 1
    assert joiner.status().steps_applied >= 1  # it stepped with the others after downloading
    assert len({states.parameters_digest(t.worker.model) for t in group.trainers}) == 1
    first = group.downloads[0].statistics()
    assert first.done == first.chunks >= 2 and first.step >= 2
    # (Fetching from several donors at once, and switching donors, is shown on larger states
    # in tests/test_statesync.py: this state is only two chunks.)
    # (The first three may download too: on a loaded machine a late ticket can split a step's
    # group in two, and the minority then fetches the consensus state; the digests above
    # show that it healed.)


async def test_a_peer_without_samples_takes_the_same_steps_without_downloading(tmp_path):
    """A member with nothing to add (here: its batches never count) still receives the
    average and applies the identical step, instead of falling behind and downloading."""
    config = make_config(tmp_path, max_steps=3)

    class Idle(Recorder):
        def source(self, index, trainer_ref):
            batches = super().source(index, trainer_ref)
            if index != 2:
                return batches
            return lambda: (batches()[0], 0)

    with trio.fail_after(60 * load_factor()):
        async with collaboration(3, config, recorder=Idle()) as (s, group):
            trainers = group.trainers
            async with trio.open_nursery() as nursery:
                for trainer in trainers:
                    nursery.start_soon(trainer.run)
            s.nursery.cancel_scope.cancel()
    assert [t.step for t in trainers] == [3] * 3
    assert trainers[2].status().samples_computed == 0
    # It applies the steps itself (before, it fell behind and downloaded every one). Anyone
    # may download once on a loaded machine, where a late ticket splits a step's group (as
    # above; CI saw trainer 1 read no other ticket at step 1 and fetch step 2).
    assert trainers[2].status().steps_applied >= 2
    assert sum(t.status().downloads for t in trainers) <= 1
    assert len({states.parameters_digest(t.worker.model) for t in trainers}) == 1
