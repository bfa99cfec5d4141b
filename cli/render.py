"""Rich renderings of status data. Pure: data in, renderables out."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from peer.status import PeerRow, StatusReport, TrainingSummary

if TYPE_CHECKING:  # the trainer imports torch; `peer status` never needs it
    from peer.training.trainer import TrainerStatus


def short_id(peer_id: str) -> str:
    # Every Ed25519 peer id starts with "12D3KooW": the end is what tells them apart.
    return f"…{peer_id[-8:]}" if len(peer_id) > 12 else peer_id


def duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def rate(bytes_per_s: float | None) -> str:
    """Link speed in bytes/s, with a decimal prefix: 12.5 MB/s."""
    return "-" if bytes_per_s is None else f"{size(bytes_per_s)}/s"


def size(n: float) -> str:
    """Bytes with a decimal prefix: 26.7 MB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def speed(samples_per_s: float | None) -> str:
    if samples_per_s is None:
        return "-"
    if samples_per_s >= 1e3:
        return f"{samples_per_s / 1e3:.3g}k"
    return f"{samples_per_s:.3g}"


SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    """A trend in one short word: the lowest value is ▁, the highest █."""
    if len(values) < 2:
        return ""
    low, high = min(values), max(values)
    span = high - low
    if span <= 0:
        return SPARKS[0] * len(values)
    return "".join(SPARKS[round((v - low) / span * (len(SPARKS) - 1))] for v in values)


def count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def training_summary(report: StatusReport) -> Table:
    """The collaboration's training at a glance: step, batch, speed, loss and its trend."""
    t = report.collaboration.training
    table = Table(box=None, show_header=False, padding=(0, 1), pad_edge=False)
    table.add_column("what", style="bold", no_wrap=True)
    table.add_column("value")
    table.add_row("peers", _peers_by_role(report))
    if t is None:
        table.add_row("training", Text("no progress published yet", style="yellow"))
        return table
    behind = f", {t.trainers_behind} behind" if t.trainers_behind else ""
    keepers = f", {count(t.keepers, 'state keeper')}" if t.keepers else ""
    table.add_row("step", f"{t.global_step}: {count(t.trainers, 'trainer')}{behind}{keepers}")
    target = t.target_batch
    batch = f"{t.samples}/{target} ({t.samples / target:.0%})" if target else f"{t.samples}"
    eta = duration(t.eta_s) if t.eta_s is not None else "-"
    table.add_row("next step", f"batch {batch}, {speed(t.samples_per_s)} samples/s, ETA {eta}")
    loss = f"{t.loss:.4f} {sparkline(t.loss_trend)}" if t.loss is not None else "-"
    if t.validation is not None:
        step, value = t.validation
        loss += f"   validation {value:.4f} at step {step} {sparkline(t.validation_trend)}"
    table.add_row("loss", loss)
    table.add_row("averaging", f"{size(t.bytes_per_step)} sent and received per step")
    return table


def _peers_by_role(report: StatusReport) -> str:
    c = report.collaboration
    work = Counter(
        WORK_LABELS.get(row.work or "", "") for row in report.peers if row.role == "peer"
    )
    parts = [f"{n} {label}" for label, n in sorted(work.items()) if label]
    client_only = sum(bool(row.client_only) for row in report.peers if row.role == "peer")
    if client_only:
        parts.append(f"{client_only} client-only")
    detail = f" ({', '.join(parts)})" if parts else ""
    return f"{count(c.peers_online, 'peer')}{detail}, {count(c.backbones_online, 'backbone')}"


def status_table(report: StatusReport) -> Group:
    """Tables that fit 80 columns: the training at a glance, who is online, what each
    measured and does, and where each is in training."""
    c = report.collaboration
    online = Table(
        **TABLE_STYLE,
        title=f"collaboration {c.name!r}: {c.peers_online} peers, {c.backbones_online} backbones online",
        title_justify="left",
    )
    for column in ("peer id", "role", "address", "version", "uptime", "last seen"):
        online.add_column(column, overflow="fold" if column == "address" else "ellipsis")
    measured = Table(
        **TABLE_STYLE, title="measured capabilities and roles played", title_justify="left"
    )
    # "client\nonly" on two lines: the widest values (e.g. 41.3 MB/s, 50.0%) must fit 80 columns.
    for column in ("peer id", "samples/s", "up", "down", "rtt", "client\nonly", "work", "share"):
        measured.add_column(column, no_wrap=True)
    training = Table(**TABLE_STYLE, title="training", title_justify="left")
    for column in ("peer id", "role", "step", "samples/s", "this step", "loss"):
        training.add_column(column, no_wrap=True)
    for row in report.peers:
        # The /p2p/<id> suffix repeats the id column; `--json` keeps full addresses.
        addrs = [addr.split("/p2p/")[0] for addr in row.addrs]
        online.add_row(
            short_id(row.peer_id),
            row.role,
            "\n".join(addrs[:2]) + (f"\n(+{len(addrs) - 2} more)" if len(addrs) > 2 else ""),
            row.version,
            duration(row.uptime_s),
            f"{duration(row.last_seen_s)} ago",
        )
        measured.add_row(
            short_id(row.peer_id),
            speed(row.samples_per_s),
            rate(row.upload_bps),
            rate(row.download_bps),
            f"{row.rtt_s * 1e3:.1f} ms" if row.rtt_s is not None else "-",
            _yes_no(row.client_only),
            WORK_LABELS.get(row.work or "", "-"),
            f"{row.share:.1%}" if row.share is not None else "-",
        )
        if row.progress_role is not None:
            training.add_row(
                short_id(row.peer_id),
                row.progress_role,
                str(row.step),
                speed(row.training_samples_per_s),
                _contribution(row, c.training),
                f"{row.loss:.4f}" if row.loss is not None else "-",
            )
    a = c.assignment
    if a is None:
        footer = Text(f"roles: {c.assignment_note}", style="yellow")
    else:
        footer = Text(
            f"task {a.task!r}, P = {a.gradient_bytes / 1e6:.3g} MB, B = {a.target_batch}: "
            f"the role solver predicts {a.samples_per_s:.4g} samples/s; a step takes "
            f"{a.step_time_s:.3g} s (compute {a.compute_time_s:.3g} s + all-reduce "
            f"{a.comm_time_s:.3g} s). work and share: what each did in its last averaging "
            "(computes gradients, reduces a share of the all-reduce, or both); a peer not "
            "reachable inbound never aggregates"
        )
    parts = [training_summary(report), online, measured, footer]
    return Group(*parts, training) if training.row_count else Group(*parts)


# Compact enough for both tables to fit 80 columns.
TABLE_STYLE: dict = {
    "box": box.SIMPLE_HEAD,
    "padding": (0, 1),
    "pad_edge": False,
    "show_edge": False,
    "collapse_padding": True,
}
WORK_LABELS = {
    "compute+aggregate": "both",
    "compute": "compute",
    "aggregate": "aggregate",
    "idle": "idle",
}


def _yes_no(flag: bool | None) -> str:
    return {None: "-", True: "yes", False: "no"}[flag]


def _contribution(row: PeerRow, training: TrainingSummary | None) -> str:
    """Samples toward the next step, and their part of the collaboration's (at its step)."""
    if row.progress_role != "trainer" or row.contribution is None:
        return "-"
    if training is None or row.step != training.global_step or not training.samples:
        return str(row.contribution)
    return f"{row.contribution} ({row.contribution / training.samples:.0%})"


def training_line(status: TrainerStatus, *, target_batch: int) -> str:
    """One line of a peer's training progress (for logs and non-terminal output)."""
    view = status.view
    step = status.step
    loss = f"{status.loss:.4f}" if status.loss is not None else "-"
    eta = view.eta(step, target_batch)
    eta_text = duration(eta) if eta != float("inf") else "-"
    validation = (
        f" | val {status.validation[1]:.4f} @ {status.validation[0]}" if status.validation else ""
    )
    return (
        f"step {step} | {status.phase} | loss {loss}{validation} | "
        f"{speed(view.throughput(step))} collab, {speed(status.samples_per_second)} here | "
        f"{len(view.trainers(step))} peers | batch {view.samples(step)}/{target_batch} "
        f"| next step in {eta_text}"
    )


def training_table(status: TrainerStatus, *, target_batch: int) -> Table:
    """A peer's live training view: the collaboration, then this peer."""
    view = status.view
    step = status.step
    table = Table(box=box.SIMPLE, show_header=False, title="training", title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    eta = view.eta(step, target_batch)
    table.add_row("step", f"{step} (global {view.global_step})  {status.phase}")
    table.add_row("loss", f"{status.loss:.4f}" if status.loss is not None else "-")
    if status.validation:
        table.add_row("validation", f"{status.validation[1]:.4f} at step {status.validation[0]}")
    table.add_row(
        "samples/s",
        f"{speed(view.throughput(step))} collaboration, {speed(status.samples_per_second)} here",
    )
    table.add_row("peers", f"{len(view.trainers(step))} training at this step")
    table.add_row(
        "next step",
        f"{view.samples(step)}/{target_batch} samples, "
        f"ETA {duration(eta) if eta != float('inf') else '-'}",
    )
    if status.last_step_seconds is not None:
        table.add_row("averaging", f"{status.last_step_seconds:.2f}s last step")
    return table
