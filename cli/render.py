"""Rich renderings of status data. Pure: data in, renderables out."""

from __future__ import annotations

from rich.table import Table

from peer.status import StatusReport


def short_id(peer_id: str) -> str:
    return f"{peer_id[:8]}…{peer_id[-6:]}" if len(peer_id) > 16 else peer_id


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def status_table(report: StatusReport) -> Table:
    c = report.collaboration
    table = Table(
        title=f"collaboration {c.name!r}: {c.peers_online} peers, {c.backbones_online} backbones online",
        title_justify="left",
    )
    for column in ("peer id", "role", "address", "version", "uptime", "last seen"):
        if column == "address":
            table.add_column(column, overflow="fold")
        else:
            table.add_column(column, no_wrap=True)
    for row in report.peers:
        # The /p2p/<id> suffix repeats the id column; `--json` keeps full addresses.
        addrs = [addr.split("/p2p/")[0] for addr in row.addrs]
        table.add_row(
            short_id(row.peer_id),
            row.role,
            "\n".join(addrs[:2]) + (f"\n(+{len(addrs) - 2} more)" if len(addrs) > 2 else ""),
            row.version,
            duration(row.uptime_s),
            f"{duration(row.last_seen_s)} ago",
        )
    return table
