"""Status rendering: pure data in, rich tables out, 80 columns wide."""

from __future__ import annotations

import dataclasses

from rich.console import Console

from cli.render import duration, rate, status_table
from peer.status import CollaborationSummary, GroupAssignment, PeerRow, StatusReport

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
    upload_bps=2.5e6,
    download_bps=1.25e8,
    rtt_s=0.0412,
    reachable=False,
    device="cpu",
    free_memory_bytes=1 << 30,
    measured_at=0.0,
    work="compute",
    share=0.0,
)
SUMMARY = CollaborationSummary("demo", 1, 0, [], 0.0, None, "no peer has measured its compute yet")


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
    expected = "…ALLTe1aw 22.2k 2.5 MB/s 125 MB/s 41.2 ms no compute 0.0%"
    assert measured.split() == expected.split()
    assert "roles: no peer has measured its compute yet" in text
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
    assert "predicted 5.853e+04 samples/s" in text and "P = 0.0415 MB, B = 4096" in text


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
