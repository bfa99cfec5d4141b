"""`peer demo`: a whole local collaboration on loopback, as separate processes.

One backbone and N peers are started with the real CLI, a live status table follows them, and
after `duration` seconds every process gets SIGINT; the summary reports how each one stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import trio
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from cli.render import status_table
from peer.config import load_config
from peer.errors import RemoteError
from peer.status import StatusReport, collect_status

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
# Short presence so the view follows joins and leaves within seconds.
DEMO_ENV = {
    "PEERTRAIN_PRESENCE_TTL": "6",
    "PEERTRAIN_PRESENCE_REFRESH": "2",
    "PEERTRAIN_LOG_LEVEL": "warning",
}
STOP_GRACE = 5.0


@dataclass
class Child:
    name: str
    process: trio.Process
    stopped_in: float | None = None


async def start(name: str, args: list[str], nursery: trio.Nursery) -> Child:
    env = {**os.environ, **DEMO_ENV}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", *args], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env
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


def summary(children: list[Child], seen: set[str], peers: int) -> Table:
    table = Table(title="demo summary", title_justify="left")
    for column in ("process", "exit code", "stopped in"):
        table.add_column(column)
    for child in children:
        stopped = (
            f"{child.stopped_in:.2f}s"
            if child.stopped_in is not None
            else f"killed after {STOP_GRACE:.0f}s"
        )
        table.add_row(child.name, str(child.process.returncode), stopped)
    table.caption = f"peers seen online: {len(seen)} of {peers}"
    return table


async def run_demo(peers: int, duration: float) -> None:
    console = Console()
    workdir = Path(tempfile.mkdtemp(prefix="peertrain-demo-"))
    children: list[Child] = []
    seen: set[str] = set()
    try:
        async with trio.open_nursery() as nursery:
            backbone = await start(
                "backbone",
                [
                    "cli.backbone_cli",
                    "start",
                    "--identity",
                    str(workdir / "backbone.key"),
                    "--listen",
                    LOOPBACK,
                ],
                nursery,
            )
            children.append(backbone)
            address = await read_backbone_addr(backbone, timeout=30)
            console.print(f"backbone up at {address}")
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
                children.append(await start(f"peer {index}", args, nursery))
            config = load_config(
                overrides={"collaboration.backbones": [address], "log.level": "warning"}
            ).config
            deadline = time.monotonic() + duration
            report: StatusReport | None = None
            with Live(console=console, refresh_per_second=4) as live:
                while time.monotonic() < deadline:
                    try:
                        report = await collect_status(config)
                        seen.update(row.peer_id for row in report.peers if row.role == "peer")
                    except RemoteError as error:
                        live.update(Text(f"status: {error}"))
                    if report is not None:
                        left = Text(
                            f"stopping in {deadline - time.monotonic():.0f}s (Ctrl+C to stop now)"
                        )
                        live.update(Group(status_table(report), left))
                    await trio.sleep(1.0)
            nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await stop(children)
        console.print()
        console.print(summary(children, seen, peers))
    if len(seen) < peers:
        raise SystemExit(1)
