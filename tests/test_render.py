"""Status rendering: pure data in, a rich table out."""

from __future__ import annotations

from rich.console import Console

from cli.render import duration, status_table
from peer.status import CollaborationSummary, PeerRow, StatusReport

PEER = "12D3KooWQUC1A3WpFs5jn2Ee29CfVYzRVxDaAtjMK7pGALLTe1aw"


def render(report: StatusReport) -> str:
    console = Console(record=True, width=160)
    console.print(status_table(report))
    return console.export_text()


def test_table_shows_short_ids_addresses_without_the_id_and_durations():
    row = PeerRow(
        peer_id=PEER,
        role="peer",
        addrs=[f"/ip4/10.0.0.{i}/tcp/4001/p2p/{PEER}" for i in range(1, 4)],
        version="0.1.0",
        started_at=0.0,
        uptime_s=3725.0,
        last_seen_s=2.4,
        expires_in_s=20.0,
    )
    summary = CollaborationSummary("demo", 1, 0, [], 0.0)
    text = render(StatusReport(summary, [row]))
    assert "collaboration 'demo': 1 peers, 0 backbones online" in text
    assert "12D3KooW…LTe1aw" in text and PEER not in text
    assert "/ip4/10.0.0.1/tcp/4001" in text and "/p2p/" not in text
    assert "(+1 more)" in text and "10.0.0.3" not in text
    assert "1h02m" in text and "2s ago" in text


def test_durations():
    assert [duration(s) for s in (0, 59.9, 60, 3599, 3600, 90061)] == [
        "0s",
        "59s",
        "1m00s",
        "59m59s",
        "1h00m",
        "25h01m",
    ]
