"""Status rendering: pure data in, rich tables out, 80 columns wide."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from cli.render import duration, rate, sparkline, status_table
from peer.status import (
    CollaborationSummary,
    GroupAssignment,
    PeerRow,
    StatusReport,
    TrainingSummary,
)

PEER = "12D3KooWQUC1A3WpFs5jn2Ee29CfVYzRVxDaAtjMK7pGALLTe1aw"
ROW = PeerRow(
    peer_id=PEER,
    role="peer",
    addrs=[f"/ip4/10.0.0.{i}/tcp/4001/p2p/{PEER}" for i in range(1, 4)],
    version="0.1.0",
    started_at=0.0,
    uptime_s=3725.0,
    last_seen_s=2.4,
    expires_in_s=20.0,
    samples_per_s=22222.2,
    upload_bps=41.3e6,  # the widest figures: 4 digits and a unit
    download_bps=1.25e8,
    rtt_s=0.0412,
    reachable=False,
    device="cpu",
    free_memory_bytes=1 << 30,
    measured_at=0.0,
    work="aggregate",
    share=0.5,
    client_only=True,
    progress_role=None,
    step=None,
    contribution=None,
    training_samples_per_s=None,
    loss=None,
)
SUMMARY = CollaborationSummary(
    "demo", 1, 0, [], 0.0, None, "no peer has measured its compute yet", None
)


def render(report: StatusReport) -> str:
    console = Console(record=True, width=80)
    console.print(status_table(report))
    return console.export_text()


def test_tables_show_ids_addresses_measurements_and_roles_in_80_columns():
    text = render(StatusReport(SUMMARY, [ROW]))
    assert "collaboration 'demo': 1 peers, 0 backbones online" in text
    assert "…ALLTe1aw" in text and PEER not in text
    assert "/ip4/10.0.0.1/tcp/4001" in text and "/p2p/" not in text
    assert "(+1 more)" in text and "10.0.0.3" not in text
    assert "1h02m" in text and "2s ago" in text
    measured = next(line for line in text.splitlines() if line.startswith("…ALLTe1aw  22.2k"))
    expected = "…ALLTe1aw 22.2k 41.3 MB/s 125 MB/s 41.2 ms yes aggregate 50.0%"
    assert measured.split() == expected.split()
    assert "roles: no peer has measured its compute yet" in text
    assert "1 peer (1 aggregate, 1 client-only), 0 backbones" in text
    assert "no progress published yet" in text
    assert "this step" not in text  # no training table without progress
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text.replace("…ALLTe1aw", "")  # nothing truncated


def test_unmeasured_peers_show_dashes_and_the_prediction_is_summarised():
    row = dataclasses.replace(
        ROW, samples_per_s=None, upload_bps=None, download_bps=None, rtt_s=None, reachable=None
    )
    row = dataclasses.replace(row, work=None, share=None)
    assignment = GroupAssignment(
        task="tiny",
        gradient_bytes=41_500,
        target_batch=4096,
        samples_per_s=58530.0,
        step_time_s=0.07,
        compute_time_s=0.069,
        comm_time_s=0.001,
        exact=True,
        work={},
    )
    summary = dataclasses.replace(SUMMARY, assignment=assignment, assignment_note=None)
    text = render(StatusReport(summary, [row]))
    assert "…ALLTe1aw  -" in text
    flat = " ".join(text.split())  # the footer wraps at 80 columns
    assert "predicts 5.853e+04 samples/s" in flat and "P = 0.0415 MB, B = 4096" in flat


def test_training_summary_and_rows_show_step_batch_loss_trend_and_contributions():
    other = "12D3KooWBvL3hGdVz1ZPgGJm2mT4xUH6Kq2fN9aSwE7cR5yXoPzQ"
    trainer = dataclasses.replace(
        ROW,
        progress_role="trainer",
        step=42,
        contribution=1536,
        training_samples_per_s=812.5,
        loss=3.21049,
    )
    behind = dataclasses.replace(
        trainer, peer_id=other, step=41, contribution=64, loss=None, client_only=False
    )
    training = TrainingSummary(
        global_step=42,
        trainers=1,
        trainers_behind=1,
        keepers=1,
        samples=2048,
        target_batch=4096,
        samples_per_s=1625.0,
        eta_s=1.3,
        loss=3.21049,
        loss_trend=[3.9, 3.6, 3.4, 3.21],
        validation=(40, 3.3),
        validation_trend=[3.8, 3.3],
        bytes_per_step=1_250_000,
    )
    summary = dataclasses.replace(SUMMARY, peers_online=2, training=training)
    text = render(StatusReport(summary, [trainer, behind]))
    assert "step       42: 1 trainer, 1 behind, 1 state keeper" in text
    assert "batch 2048/4096 (50%), 1.62k samples/s, ETA 1s" in text
    assert "3.2105 █▅▃▁   validation 3.3000 at step 40 █▁" in text
    assert "1.25 MB sent and received per step" in text
    rows = [
        line.split() for line in text.splitlines() if line.startswith("…") and "trainer" in line
    ]
    assert rows == [
        ["…ALLTe1aw", "trainer", "42", "812", "1536", "(75%)", "3.2105"],
        ["…" + other[-8:], "trainer", "41", "812", "64", "-"],
    ]
    assert max(len(line) for line in text.splitlines()) <= 80


def test_sparkline_spans_lowest_to_highest():
    assert sparkline([]) == "" and sparkline([1.0]) == ""
    assert sparkline([2.0, 2.0]) == "▁▁"
    assert sparkline([4.0, 1.0, 2.5]) == "█▁▅"


def test_units():
    assert [duration(s) for s in (0, 59.9, 60, 3599, 3600, 90061)] == [
        "0s",
        "59s",
        "1m00s",
        "59m59s",
        "1h00m",
        "25h01m",
    ]
    assert [rate(r) for r in (None, 12, 2.5e3, 1.25e8, 3e9)] == [
        "-",
        "12 B/s",
        "2.5 kB/s",
        "125 MB/s",
        "3 GB/s",
    ]
