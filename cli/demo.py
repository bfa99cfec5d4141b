"""`peer demo`: a whole local collaboration on loopback, as separate processes.

One backbone and N peers are started with the real CLI and `configs/demo.toml`; they train the
default task while a live view follows the collaboration. Once a peer reports a validation loss
at or below the config's target (or after `timeout` seconds), every process gets SIGINT; the
summary reports the training and how each process stopped. Exit 0 only when the target was met.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.render import duration, status_table
from peer.config import load_config
from peer.errors import RemoteError, find_error
from peer.status import collect_status
from peer.training.progress import CollaborationView

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DEMO_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
DEMO_ENV = {
    "PEERTRAIN_CONFIG": str(DEMO_CONFIG),
    # Several peers share this machine's cores: one torch thread each.
    "OMP_NUM_THREADS": "1",
}
STOP_GRACE = 5.0


@dataclass
class Child:
    name: str
    process: trio.Process
    stopped_in: float | None = None


async def start(
    name: str,
    args: list[str],
    extra_env: dict[str, str] | None = None,
    *,
    read: bool = False,
    log_dir: Path | None = None,
) -> Child:
    """Start a process; only a `read` one gets a stdout pipe (an unread pipe fills up and
    blocks the child's progress output, and with it the child)."""
    env = {**os.environ, **DEMO_ENV, **(extra_env or {})}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", *args],
        stdout=subprocess.PIPE if read else subprocess.DEVNULL,
        stderr=(log_dir / f"{name.replace(' ', '')}.log").open("ab")
        if log_dir
        else subprocess.DEVNULL,
        env=env,
    )
    return Child(name, process)


async def read_backbone_addr(child: Child, *, timeout: float) -> str:
    buffer = b""
    with trio.fail_after(timeout):
        while b"peer join --backbone " not in buffer or not buffer.endswith(b"\n"):
            chunk = await child.process.stdout.receive_some(4096)  # type: ignore[union-attr]
            if not chunk:
                raise RuntimeError("the demo backbone exited before printing its address")
            buffer += chunk
    for line in buffer.decode().splitlines():
        if "peer join --backbone /ip4/127.0.0.1/" in line:
            return line.split("--backbone ", 1)[1].strip()
    raise RuntimeError(f"the demo backbone printed no loopback address: {buffer.decode()!r}")


async def stop(children: list[Child]) -> None:
    started = time.monotonic()
    for child in children:
        if child.process.returncode is None:
            child.process.send_signal(signal.SIGINT)

    async def wait(child: Child) -> None:
        with trio.move_on_after(STOP_GRACE):
            await child.process.wait()
            child.stopped_in = time.monotonic() - started
        if child.process.returncode is None:
            child.process.kill()
            await child.process.wait()

    async with trio.open_nursery() as nursery:
        for child in children:
            nursery.start_soon(wait, child)


@dataclass
class Outcome:
    target: float
    reached: tuple[int, float] | None = None
    """(step, validation loss) that met the target."""
    seconds: float = 0.0
    global_step: int = 0
    validation: tuple[int, float] | None = None
    peers_seen: set[str] = field(default_factory=set)


def summary(children: list[Child], outcome: Outcome, peers: int) -> Group:
    training = Table(title="training", title_justify="left", show_header=False)
    training.add_column("what", style="bold")
    training.add_column("value")
    training.add_row("task", "gpt (byte-level, Python's standard library)")
    training.add_row("global step", str(outcome.global_step))
    last = outcome.validation
    training.add_row(
        "validation loss",
        f"{last[1]:.4f} at step {last[0]} (target {outcome.target})" if last else "-",
    )
    training.add_row(
        "target reached",
        f"yes, at step {outcome.reached[0]} after {duration(outcome.seconds)}"
        if outcome.reached
        else f"no (stopped after {duration(outcome.seconds)})",
    )
    training.add_row("peers seen training", f"{len(outcome.peers_seen)} of {peers}")
    processes = Table(title="processes", title_justify="left")
    for column in ("process", "exit code", "stopped in"):
        processes.add_column(column)
    for child in children:
        stopped = (
            f"{child.stopped_in:.2f}s"
            if child.stopped_in is not None
            else f"killed after {STOP_GRACE:.0f}s"
        )
        processes.add_row(child.name, str(child.process.returncode), stopped)
    return Group(training, processes)


async def run_demo(peers: int, timeout: float, dashboard_port: int = 0) -> None:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="peertrain-demo-"))
    children: list[Child] = []
    loaded = load_config(file=DEMO_CONFIG)
    outcome = Outcome(target=loaded.config.training.target_validation_loss)
    started = time.monotonic()
    try:
        backbone = await start(
            "backbone",
            [
                "cli.backbone_cli",
                "start",
                "--identity",
                str(workdir / "backbone.key"),
                "--listen",
                LOOPBACK,
                "--dashboard-port",
                str(dashboard_port),
            ],
            # Its genesis registry with the rest of the demo, not in the user's home.
            {"PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(workdir / "backbone-state")},
            read=True,
        )
        children.append(backbone)
        address = await read_backbone_addr(backbone, timeout=30)
        console.print(f"backbone up at {address}")
        if dashboard_port:
            console.print(f"dashboard at http://127.0.0.1:{dashboard_port}/")
        for index in range(peers):
            args = [
                "cli.peer_cli",
                "join",
                "--backbone",
                address,
                "--listen",
                LOOPBACK,
                "--identity",
                str(workdir / f"peer{index}.key"),
            ]
            env = {
                "PEERTRAIN_TRAINING_CHECKPOINT_DIR": str(workdir / f"checkpoints{index}"),
                # The demo watches the target and stops everyone; a peer that stopped itself
                # would withdraw its record before the demo could read the winning loss.
                "PEERTRAIN_TRAINING_TARGET_VALIDATION_LOSS": "0",
            }
            children.append(await start(f"peer {index}", args, env, log_dir=workdir))
        config = load_config(
            file=DEMO_CONFIG, overrides={"collaboration.backbones": [address]}
        ).config
        started = time.monotonic()
        deadline = started + timeout
        with Live(console=console, refresh_per_second=2) as live:
            while time.monotonic() < deadline and outcome.reached is None:
                try:
                    report = await collect_status(config)
                except Exception as error:  # a group, when raised inside the node's nursery
                    ours = find_error(error)
                    if not isinstance(ours, RemoteError):
                        raise
                    live.update(Text(f"status: {ours}"))
                    await trio.sleep(1.0)
                    continue
                view = report.training
                outcome.global_step = max(outcome.global_step, view.global_step)
                outcome.peers_seen.update(r.peer_id for r in view.records if r.role == "trainer")
                outcome.validation = view.validation_loss() or outcome.validation
                outcome.seconds = time.monotonic() - started
                if outcome.validation and outcome.validation[1] <= outcome.target:
                    outcome.reached = outcome.validation
                live.update(
                    Group(
                        status_table(report),
                        Text(progress_line(view, config.task.target_batch, outcome)),
                    )
                )
                await trio.sleep(1.0)
    finally:
        with trio.CancelScope(shield=True):
            await stop(children)
        console.print()
        console.print(summary(children, outcome, peers))
    if outcome.reached is None or any(c.process.returncode != 0 for c in children):
        raise SystemExit(1)


def progress_line(view: CollaborationView, target_batch: int, outcome: Outcome) -> str:
    step = view.global_step
    validation = (
        f"{outcome.validation[1]:.3f} at step {outcome.validation[0]}"
        if outcome.validation
        else "-"
    )
    return (
        f"step {step} | batch {view.samples(step)}/{target_batch} | "
        f"{view.throughput(step):.0f} samples/s | validation loss {validation} "
        f"(target {outcome.target}) | {duration(outcome.seconds)} (Ctrl+C to stop)"
    )
