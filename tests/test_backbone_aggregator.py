"""A backbone that aggregates (`averaging.backbone_aggregates`): the calls it joins (pure), and a
collaboration in which it reduces a share of every step while the trainers' steps stay those of
one process."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch
import trio

from peer.averaging.allreduce import DataServer, retry_spec
from peer.averaging.averager import Averager, planned_view
from peer.averaging.group import MAX_AGGREGATE_ELEMENTS, Ticket, stated_size
from peer.roles import share_cap
from peer.training import state as states
from peer.training.aggregator import BackboneAggregator, next_call
from peer.training.progress import CollaborationView
from peer.training.timing import Timing
from tests.helpers import data_identity, load_factor, swarm
from tests.test_group import joined, spec_of
from tests.test_progress import rec
from tests.test_training_collab import (
    DHT_CONFIG,
    Joinable,
    Recorder,
    make_config,
    parameters,
)

CHUNK = 1024  # the tiny task's 10 k parameters in 11 chunks: shares cut it finely enough
TIMING = Timing(
    gather_window=1.0, progress_interval=0.5, solo_after=10.0, presence_ttl=30.0,
    download_timeout=20.0, rpc_timeout=5.0,
)  # fmt: skip


def view_of(*records, quorum: int = 2) -> CollaborationView:
    return CollaborationView(sorted(records, key=lambda r: r.peer_id), quorum)


def test_it_joins_the_earliest_call_of_the_certified_step_of_the_trainers_model():
    called = dict(call_step=3, fingerprint="f")
    view = view_of(
        rec(0, cosigners=(1,), gather_until=20.0, **called),
        rec(1, cosigners=(0,), gather_until=15.0, **called),
        rec(2, cosigners=(0,), fingerprint="g"),  # outvoted: another model's fingerprint
        # Records not holding the certified state say nothing, however many.
        *[rec(i, digest="x", fingerprint="g") for i in (3, 4, 5)],
    )
    call = next_call(view, after=0.0, now=10.0, timing=TIMING)
    assert call is not None and (call.gather_until, call.fingerprint) == (15.0, "f")
    assert call.contributors == {rec(i).peer_id for i in (0, 1, 2)}  # whose tickets size it
    # Joined already (or closed): the next one, then none.
    assert next_call(view, after=15.0, now=10.0, timing=TIMING).gather_until == 20.0
    assert next_call(view, after=20.0, now=10.0, timing=TIMING) is None
    assert next_call(view, after=0.0, now=16.0, timing=TIMING).gather_until == 20.0


def test_a_lone_record_moves_it_nowhere():
    # A call of an uncertified step (one liar at step 9), and a call days ahead: both ignored.
    liar = rec(3, step=9, call_step=9, gather_until=11.0, fingerprint="f")
    honest = [rec(i, cosigners=(1 - i,), fingerprint="f") for i in (0, 1)]
    assert next_call(view_of(liar, *honest), after=0.0, now=10.0, timing=TIMING) is None
    ahead = rec(2, cosigners=(0,), call_step=3, gather_until=1e6, fingerprint="f")
    assert next_call(view_of(ahead, *honest), after=0.0, now=10.0, timing=TIMING) is None
    # No trainer states a fingerprint (older peers): nothing to join.
    quiet = [rec(i, cosigners=(1 - i,), call_step=3, gather_until=12.0) for i in (0, 1)]
    assert next_call(view_of(*quiet), after=0.0, now=10.0, timing=TIMING) is None


def test_the_size_is_what_enough_computing_tickets_state():
    def view(*sizes: int, computes: bool = True) -> list[Ticket]:
        return [
            msgspec.structs.replace(joined().ticket, size=size, computes=computes) for size in sizes
        ]

    assert stated_size(view(100, 100, 7), quorum=2) == 100
    assert stated_size(view(100, 7), quorum=2) is None  # nobody's size has a quorum
    assert stated_size(view(0, 0), quorum=1) is None  # older tickets state none
    assert stated_size(view(*[MAX_AGGREGATE_ELEMENTS + 1] * 3), quorum=2) is None  # too big
    assert stated_size(view(5, 5, 9, 9), quorum=2) == 5  # a tie: the smaller
    assert stated_size(view(5, 5, computes=False), quorum=2) is None  # aggregators' say nothing


def test_aggregators_sit_out_plans_of_several_rounds_and_every_retry():
    aggregator = joined(weight=0.0)  # weight 0: it computes nothing
    assert not aggregator.ticket.computes
    trainers = [joined(weight=1.0) for _ in range(5)]

    def view(members):
        return sorted([j.ticket for j in members], key=lambda t: t.peer_id)

    single = view([aggregator, *trainers[:3]])
    assert planned_view(single, 4) == single  # one group of 4: it reduces a part
    many = view([aggregator, *trainers])
    assert planned_view(many, 4) == view(trainers)  # 6 > 4: a plan of rounds, without it
    spec = spec_of([aggregator, *trainers[:3]], size=1000)
    assert any(m.share > 0 and not m.computes for m in spec.members)
    retry = retry_spec(spec, set())
    assert [m.peer_id for m in retry.members] == sorted(j.ticket.peer_id for j in trainers[:3])
    assert sum(m.share for m in retry.members) == pytest.approx(1.0)


async def test_a_backbone_reduces_a_share_of_every_step_and_the_steps_stay_exact(tmp_path):
    """3 trainers and an aggregating backbone: the backbone is in every step's group and
    reduces a part of it, the trainers' parameters are bit-identical and equal to one
    process training on the union of their micro-batches."""
    steps, count = 3, 3
    config = make_config(tmp_path, max_steps=steps, gather_window=1.0)
    averaging = dataclasses.replace(
        config.averaging, backbone_aggregates=True, chunk_elements=CHUNK
    )
    config = dataclasses.replace(config, averaging=averaging)
    recorder = Recorder()
    with trio.fail_after(120 * load_factor()):
        async with swarm(count + 1, DHT_CONFIG) as s:
            group = Joinable(s, config, recorder)
            for dht in s.dhts[:count]:
                await group.add(dht)
            backbone = s.dhts[count]
            server = DataServer(data_identity(backbone.node.identity))
            port = await s.nursery.start(server.serve, "127.0.0.1", 0)
            averager = Averager(
                backbone, config.averaging, collaboration="test", data_server=server,
                data_host="127.0.0.1", data_port=port,
            )  # fmt: skip
            aggregator = BackboneAggregator(backbone, averager, config, capabilities=lambda: None)
            await s.nursery.start(aggregator.run)
            async with trio.open_nursery() as nursery:
                for trainer in group.trainers:
                    nursery.start_soon(trainer.run)
            s.nursery.cancel_scope.cancel()
    trainers = group.trainers
    assert [t.step for t in trainers] == [steps] * count
    assert aggregator.tally.completed >= 1 and aggregator.tally.reduced > 0
    # Its share is capped like anyone's: at most 1.5 / 4 of the vector, give or take a chunk
    # (shares cut the vector in whole chunks); the trainers reduce the rest.
    size = trainers[0].worker.vector_size
    assert aggregator.tally.reduced <= share_cap(4) + CHUNK / size
    assert any(t.record().reduced > 0 for t in trainers)
    assert len({states.parameters_digest(t.worker.model) for t in trainers}) == 1
    model = recorder.replay(steps, range(count))
    torch.testing.assert_close(
        parameters(trainers[0].worker.model), parameters(model), rtol=1e-4, atol=2e-5
    )
