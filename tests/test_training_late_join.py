"""A late joiner, in one process on loopback: it starts mid-run, downloads a state of dozens of
chunks from several donors, one of which is killed mid-download, and holds bit-identical
parameters to the others after its first step.

The state is made large by a wider tiny task (chunks are at least 64 KiB: `MIN_CHUNK_BYTES`).
The kill is scripted on the donors' data connections (`StateDonor.wrap_stream`), so it lands
mid-download every time: see `KillOne`.
"""

from __future__ import annotations

import types
from collections import defaultdict

import pytest
import trio

import tests.test_training_collab as collab
from cli.common import find_error
from peer.errors import ConfigError
from peer.training import state as states
from peer.training.chunks import MIN_CHUNK_BYTES
from peer.training.statesync import REPLY, StateDonor
from peer.training.task import TinyTask
from peer.training.trainer import Trainer
from tests.helpers import ForwardingStream, Swarm, load_factor, swarm
from tests.test_training_collab import DHT_CONFIG, Joinable, make_config

VICTIM_CHUNKS = 2  # chunks the killed donor serves before it hangs
JOINER = 3  # the joiner's index among the trainers (and the donors)


class WideTask(TinyTask):
    """The tiny task with a wide hidden layer: ~0.66 MB of parameters, ~2 MB of state with
    AdamW's moments, so ~31 chunks of 64 KiB."""

    hidden = 2048


class KillOne:
    """A script for every donor's data connections, from `arm()` on: the first donor to send
    a chunk becomes the victim; it sends VICTIM_CHUNKS chunks, then hangs (and sets `hung`)
    until the test kills it. The other donors hold their chunks until then, so the victim
    has served chunks and still holds claimed ones when it dies: the download cannot finish
    without dropping it and requeueing those."""

    def __init__(self) -> None:
        self.armed = False
        self.victim: int | None = None
        self.sent = 0
        self.hung = trio.Event()

    def arm(self) -> None:
        self.armed = True

    def wrap(self, donor: int):
        return lambda stream: Scripted(stream, self, donor)

    async def before_send(self, donor: int, size: int) -> None:
        if not self.armed or self.hung.is_set() or size <= REPLY.size:
            return  # reply headers are REPLY.size bytes: only chunks' bytes are scripted
        if self.victim is None:
            self.victim = donor
        if donor != self.victim:
            await self.hung.wait()
        elif self.sent == VICTIM_CHUNKS:
            self.hung.set()
            await trio.sleep_forever()
        else:
            self.sent += 1


class Scripted(ForwardingStream):
    def __init__(self, inner: trio.SocketStream, script: KillOne, donor: int) -> None:
        super().__init__(inner)
        self.script = script
        self.donor = donor

    async def send_all(self, data) -> None:
        await self.script.before_send(self.donor, len(data))
        await self.inner.send_all(data)


class DonorSeam:
    """What a `Joinable` starts its servers through (it calls `s.nursery.start`): every
    `StateDonor` gets the script around its data connections and a cancel scope of its own,
    so the test can kill one donor and nothing else of its peer."""

    def __init__(self, s: Swarm, script: KillOne) -> None:
        self.s = s
        self.script = script
        self.scopes: list[trio.CancelScope] = []

    async def start(self, fn, *args):
        donor = getattr(fn, "__self__", None)
        if not isinstance(donor, StateDonor):
            return await self.s.nursery.start(fn, *args)
        donor.wrap_stream = self.script.wrap(len(self.scopes))
        scope = trio.CancelScope()
        self.scopes.append(scope)

        async def serve(task_status: trio.TaskStatus[int]) -> None:
            with scope:
                await fn(*args, task_status=task_status)

        return await self.s.nursery.start(serve)

    def kill(self, donor: int) -> None:
        self.scopes[donor].cancel()


async def record_digests(trainers: list[Trainer], history: dict[int, dict[int, str]]) -> None:
    """history[peer][step] = its parameters digest at that step (a trainer changes its step
    and its digest with no await between; steps are a gathering window apart)."""
    while True:
        for index, trainer in enumerate(trainers):
            history[index][trainer.step] = trainer.digest
        await trio.sleep(0.02)


async def test_a_late_joiner_downloads_many_chunks_survives_a_killed_donor_and_steps_in_lockstep(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(collab, "TinyTask", WideTask)  # what Joinable's trainers train
    # Steps at least 1.5 s apart (stretched by load): a joiner whose download of ~2 MB takes
    # longer than a step finds the others a step ahead each time and only ever downloads
    # (5 downloads, no step of its own, under two CPU burners). 8 steps: a joiner votes and
    # counts from the step after the first whose plan it was in (the step rule counts only
    # members' votes), so it may download twice before its first step.
    config = make_config(tmp_path, max_steps=8, gather_window=1.5)
    script = KillOne()
    history: dict[int, dict[int, str]] = defaultdict(dict)
    with trio.fail_after(120 * load_factor()):
        async with swarm(JOINER, DHT_CONFIG) as s:
            seam = DonorSeam(s, script)
            group = Joinable(types.SimpleNamespace(nursery=seam), config, None)
            for dht in s.dhts:
                await group.add(dht)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(record_digests, group.trainers, history)
                async with trio.open_nursery() as training:
                    for trainer in group.trainers:
                        training.start_soon(trainer.run)
                    while min(t.step for t in group.trainers) < 2:
                        await trio.sleep(0.05)
                    joiner = await group.add(await s.add())
                    script.arm()
                    training.start_soon(joiner.run)
                    await script.hung.wait()
                    # Mid-download: the victim has served its chunks, the rest are pending.
                    (first, *_) = [d for d in group.downloads if d.node is joiner.dht.node]
                    during = first.statistics()
                    assert during.chunks > during.done
                    assert script.victim in range(JOINER)
                    seam.kill(script.victim)
                nursery.cancel_scope.cancel()
            s.nursery.cancel_scope.cancel()

    # Everyone (the victim's trainer too: only its donor died) finished with equal parameters.
    assert [t.step for t in group.trainers] == [8] * (JOINER + 1)
    assert len({states.parameters_digest(t.worker.model) for t in group.trainers}) == 1
    # (The others may download too if a late ticket split a step's group under load.)

    # The first download: dozens of chunks, from several donors, the victim dropped midway.
    downloads = [d.statistics() for d in group.downloads if d.node is joiner.dht.node]
    stats = downloads[0]
    assert stats.total_bytes >= 24 * MIN_CHUNK_BYTES
    assert stats.done == stats.chunks >= 24
    victim = str(group.trainers[script.victim].dht.node.peer_id)
    assert stats.chunks_from[victim] == VICTIM_CHUNKS
    assert victim in stats.dropped
    assert sum(stats.chunks_from.values()) == stats.chunks
    # In parallel: every donor whose offer matched the followed one served part of it (one
    # at a time, a donor would have waited in reserve, unused).
    donors = {str(t.dht.node.peer_id) for t in group.trainers[:JOINER]}
    assert set(stats.chunks_from) == donors - set(stats.refused)
    assert len(stats.chunks_from) >= 2

    # After its first step, and every one after it, the joiner holds the others' parameters.
    assert joiner.status().steps_applied >= 1
    downloaded = {d.step for d in downloads}
    joined = history[JOINER]
    stepped = sorted(set(joined) - downloaded - {0})
    assert stepped, (joined, downloaded)
    for step in stepped:
        others = {history[i][step] for i in range(JOINER) if step in history[i]}
        assert others == {joined[step]}, step


async def test_a_joiner_started_with_another_task_refuses_to_join_in_one_line(
    tmp_path, monkeypatch
):
    """The collaboration trains the tiny task; a peer started with a wider model under the same
    task name refuses with one line naming both (before, it retried state downloads forever,
    "scheduler state extra", or trained alone)."""
    config = make_config(tmp_path, max_steps=50)
    with trio.fail_after(90 * load_factor()):
        async with swarm(2, DHT_CONFIG) as s:
            group = Joinable(s, config, None)
            for dht in s.dhts:
                await group.add(dht)
            async with trio.open_nursery() as training:
                for trainer in group.trainers:
                    training.start_soon(trainer.run)
                while min(t.step for t in group.trainers) < 1:  # a certified step
                    await trio.sleep(0.05)
                monkeypatch.setattr(collab, "TinyTask", WideTask)
                stranger = await group.add(await s.add())
                with pytest.raises(BaseExceptionGroup) as refused:  # from the trainer's nursery
                    await stranger.run()
                training.cancel_scope.cancel()
            s.nursery.cancel_scope.cancel()
    error = find_error(refused.value)  # what the CLI prints (one line, exit 2)
    assert isinstance(error, ConfigError)
    message = str(error)
    assert "\n" not in message
    assert "trains task 'tiny' (dedloc, AdamW, 10,384 parameters" in message
    assert "this peer task 'tiny' (dedloc, AdamW, 0.166 M parameters" in message
    assert stranger.status().downloads == 0
