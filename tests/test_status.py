"""What `peer status` derives from presence records: the role assignment, pure."""

from __future__ import annotations

import msgspec
import pytest

from peer.config import load_config
from peer.measure.capabilities import Capabilities
from peer.presence import PresenceRecord
from peer.status import _report, assign_group, mean_tail, summarise_training
from tests.test_progress import rec


def record(i: int, role: str, caps: Capabilities | None, **fields) -> PresenceRecord:
    return PresenceRecord(f"peer-{i}", role, [], "0.1.0", 0.0, 0.0, caps, **fields)  # type: ignore[arg-type]


def caps(speed: float, bw: float, *, reachable=True, task="tiny", p=1_000_000, b=1024):
    return Capabilities(
        samples_per_s=speed,
        upload_bps=bw,
        download_bps=bw,
        rtt_s=0.01,
        reachable=reachable,
        device="cpu",
        free_memory_bytes=1,
        measured_at=0.0,
        task=task if speed > 0 else "",
        gradient_bytes=p if speed > 0 else 0,
        target_batch=b if speed > 0 else 0,
    )


def test_assignment_covers_peers_and_backbones_of_the_main_task():
    records = [
        record(0, "backbone", caps(0, 1e8), aggregator=True),
        record(8, "backbone", caps(0, 1e9)),  # does not aggregate: no share for it
        record(1, "peer", caps(100, 1e7)),
        record(2, "peer", caps(100, 1e7, reachable=False)),
        record(5, "peer", caps(100, 1e7)),
        record(3, "peer", caps(100, 1e7, task="other")),  # outvoted: stays out
        record(6, "peer", caps(100, 1e7, p=2_000_000)),  # same name, another model: stays out
        record(7, "peer", caps(100, 1e7, b=0)),  # no target batch: cannot be the main task
        record(4, "peer", None),  # not measured yet
    ]
    assignment, note = assign_group(records)
    assert note is None and assignment is not None
    assert (assignment.task, assignment.gradient_bytes, assignment.target_batch) == (
        "tiny",
        1_000_000,
        1024,
    )
    assert set(assignment.work) == {"peer-0", "peer-1", "peer-2", "peer-5"}
    # Three compute (a step: 3.4 s instead of 10.2 s alone); the fast backbone takes it all.
    assert assignment.work["peer-0"] == ("aggregate", pytest.approx(1.0))
    assert assignment.work["peer-2"] == ("compute", 0.0)  # client-only: never a share
    assert sum(share for _, share in assignment.work.values()) == pytest.approx(1.0)
    assert assignment.samples_per_s > 0


def test_no_assignment_says_why():
    assert assign_group([record(1, "peer", None)]) == (None, "no peer has measured its compute yet")
    nobody_reachable = [
        record(1, "peer", caps(10, 1e6, reachable=False)),
        record(2, "peer", caps(10, 1e6, reachable=False)),
    ]
    assignment, note = assign_group(nobody_reachable)
    assert assignment is None and "publicly reachable peer or backbone" in note


def test_impossible_figures_never_reach_the_solver():
    huge = msgspec.msgpack.encode(caps(1.0, 1e6))
    fields = msgspec.msgpack.decode(huge)
    for key, value in (("samples_per_s", 1e308), ("upload_bps", -1.0), ("rtt_s", float("inf"))):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(
                msgspec.msgpack.encode({**fields, key: value}), type=Capabilities
            )


def test_training_summary_reads_the_global_step_batch_loss_trend_and_bytes():
    records = [
        rec(
            0,
            step=5,
            samples=300,
            samples_per_second=100.0,
            loss=2.0,
            step_bytes=1000,
            recent_losses=[3.0, 2.5, 2.0],
        ),
        rec(
            1,
            step=5,
            samples=100,
            samples_per_second=50.0,
            loss=3.0,
            step_bytes=3000,
            recent_losses=[3.5, 3.0],
            validation_loss=2.8,
            validation_step=4,
            recent_validation=[3.1, 2.8],
        ),
        rec(2, step=4, samples=999, samples_per_second=999.0, loss=9.0, step_bytes=99),  # behind
        rec(3, role="keeper", step=5),
    ]
    t = summarise_training(records, target_batch=1000)
    assert t is not None
    assert (t.global_step, t.trainers, t.trainers_behind, t.keepers) == (5, 2, 1, 1)
    assert (t.samples, t.samples_per_s, t.eta_s) == (400, 150.0, 4.0)  # 600 missing at 150/s
    assert t.loss == 2.5 and t.loss_trend == [3.0, 3.0, 2.5]
    assert t.validation == (4, 2.8) and t.validation_trend == [3.1, 2.8]
    assert t.bytes_per_step == 4000


def test_status_counts_steps_by_the_rule_the_trainers_state_not_by_its_own_config():
    """A viewer whose config says min_group_size 1 called step 6, which only one peer signed,
    the global step; the trainers play with 2 (`ProgressRecord.min_votes`): step 5 is. One
    trainer stating another rule does not change it."""
    records = [
        rec(0, step=5, cosigners=(1,), min_votes=2),
        rec(1, step=5, cosigners=(0,), min_votes=2),
        rec(2, step=6, min_votes=1),  # signed by itself alone
    ]
    config = load_config(overrides={"averaging.min_group_size": 1}).config
    report = _report(config, {}, records, [], assign=False)
    assert report.quorum == 2 and report.training.global_step == 5
    training = report.collaboration.training
    assert training is not None and training.global_step == 5
    # Records that state nothing (older peers): the viewer's own config.
    silent = [msgspec.structs.replace(r, min_votes=0) for r in records]
    assert _report(config, {}, silent, [], assign=False).training.global_step == 6


def test_training_summary_without_records_or_speed():
    assert summarise_training([], target_batch=1000) is None
    t = summarise_training([rec(0, samples=10)], target_batch=None)
    assert t is not None and t.eta_s is None and t.loss is None and t.loss_trend == []


def test_mean_tail_aligns_series_at_their_ends():
    assert mean_tail([[1.0, 2.0, 3.0], [4.0, 5.0]]) == [1.0, 3.0, 4.0]
    assert mean_tail([]) == [] and mean_tail([[], [2.0]]) == [2.0]


def test_links_not_measured_yet_show_as_unknown_not_as_client_only():
    from peer.status import _row

    def row(role: str, capabilities: Capabilities):
        presence = record(0, role, capabilities)
        return _row(presence, now=1.0, expires_at=9.0, progress=None)

    compute_only = msgspec.structs.replace(caps(100.0, 0.0, reachable=False), rtt_s=0.0)
    early = row("peer", compute_only)
    assert early.samples_per_s == 100.0
    assert (early.upload_bps, early.rtt_s, early.reachable, early.client_only) == (None,) * 4
    probed = row("peer", caps(100.0, 5e6, reachable=False))
    assert (probed.upload_bps, probed.client_only) == (5e6, True)
    backbone = row("backbone", msgspec.structs.replace(caps(0.0, 0.0), rtt_s=0.0))
    assert (backbone.reachable, backbone.client_only) == (True, False)
    punch = msgspec.structs.replace(caps(100.0, 5e6, reachable=False), punchable=True)
    assert (row("peer", punch).reachable, row("peer", punch).client_only) == (False, False)


def test_peers_reachable_by_hole_punching_aggregate_where_everyone_reaches_them():
    punch = msgspec.structs.replace(caps(10, 1e6, reachable=False), punchable=True)
    behind_nat = [record(1, "peer", punch), record(2, "peer", punch)]
    assignment, note = assign_group(behind_nat)
    assert note is None and assignment is not None
    assert all(share > 0 for _, share in assignment.work.values()), assignment.work
    # A peer behind a symmetric NAT reaches neither: nobody can aggregate for all three.
    symmetric = record(3, "peer", caps(10, 1e6, reachable=False))
    assignment, note = assign_group([*behind_nat, symmetric])
    assert assignment is None and "publicly reachable peer or backbone" in note


def test_status_shows_the_roles_played_not_the_solvers_advice():
    """work and share come from what each node did in its last averaging: a trainer computes
    (unless downloading) and aggregates if it reduced a part; a backbone aggregates only if it
    is an aggregator that reduced a part; the solver's answer does not enter a row."""
    from peer.status import _row

    def row(presence: PresenceRecord, progress=None):
        return _row(presence, now=10.0, expires_at=100.0, progress=progress)

    trainer = record(1, "peer", caps(100, 1e7))
    computing = row(trainer, rec(1, reduced=0.25))
    assert (computing.work, computing.share) == ("compute+aggregate", 0.25)
    client = row(trainer, rec(1))
    assert (client.work, client.share) == ("compute", 0.0)
    fetching = row(trainer, rec(1, downloading=True))
    assert fetching.work == "idle"
    assert row(trainer).work is None  # no progress record: takes no part yet
    aggregator = row(record(0, "backbone", caps(0, 1e8), aggregator=True, reduced=0.4))
    assert (aggregator.work, aggregator.share) == ("aggregate", 0.4)
    waiting = row(record(0, "backbone", caps(0, 1e8), aggregator=True))
    assert waiting.work == "idle"
    plain = row(record(0, "backbone", caps(0, 1e8)))
    assert (plain.work, plain.share) == (None, None)
