"""`peer`: join a collaboration, look at it, or run a local demo of one."""

from __future__ import annotations

import json
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated

import trio
import typer
from rich.console import Console
from rich.live import Live

from cli import common, config_cli, doctor_cli
from cli.render import status_table, training_line, training_table
from peer.daemon import run_daemon
from peer.dashboard.service import run_dashboard
from peer.errors import RemoteError
from peer.net.host import Node
from peer.status import StatusReport, collect_status, status_client

if TYPE_CHECKING:
    from peer.training.trainer import Trainer

app = typer.Typer(
    help="Donate compute to a peertrain collaboration.", no_args_is_help=True, add_completion=False
)
app.add_typer(config_cli.app, name="config")


@app.command()
def join(
    backbone: common.BackboneOpt = None,
    identity: common.IdentityOpt = None,
    config: common.ConfigOpt = None,
    listen: common.ListenOpt = None,
    announce: common.AnnounceOpt = None,
    port: common.PortOpt = None,
    collaboration: common.CollabOpt = None,
    network_key: common.NetworkKeyOpt = None,
    task: Annotated[
        str | None,
        typer.Option("--task", help="Task to train: tiny, or package.module:factory."),
    ] = None,
    log_level: common.LogLevelOpt = None,
    log_format: common.LogFormatOpt = None,
    metrics_port: common.MetricsPortOpt = None,
) -> None:
    """Join a collaboration through its backbones and stay until Ctrl+C."""
    loaded = common.build_config(
        config,
        {
            "collaboration.backbones": backbone or None,
            "identity.path": str(identity) if identity else None,
            "net.listen": listen or None,
            "net.announce": announce or None,
            "collaboration.name": collaboration,
            "collaboration.network_key": str(network_key) if network_key else None,
            "task.name": task,
            "log.level": log_level,
            "log.format": log_format,
            "metrics.port": metrics_port,
        },
        port=port,
    )

    def on_ready(node: Node) -> None:
        common.echo(
            f"peer {node.peer_id} joined collaboration {loaded.config.collaboration.name!r}; reachable at:"
        )
        for addr in node.public_addrs():
            common.echo(f"  {addr}")

    trainers: list[Trainer] = []

    async def main(stop: trio.Event) -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(show_progress, trainers, loaded.config.task.target_batch)
            await run_daemon(
                loaded.config, stop, role="peer", on_ready=on_ready, on_trainer=trainers.append
            )
            nursery.cancel_scope.cancel()

    common.run_until_signal(main)


async def show_progress(trainers: list[Trainer], target_batch: int) -> None:
    """Live training progress: a table refreshed in place on a terminal, else a line per step."""
    while not trainers:
        await trio.sleep(0.2)
    trainer = trainers[0]
    if sys.stdout.isatty():
        with Live(console=Console(), refresh_per_second=2) as live:
            while True:
                live.update(training_table(trainer.status(), target_batch=target_batch))
                await trio.sleep(0.5)
    last = None
    while True:
        status = trainer.status()
        if (status.step, status.validation) != last:
            last = (status.step, status.validation)
            common.echo(training_line(status, target_batch=target_batch))
        await trio.sleep(0.5)


@app.command()
def status(
    backbone: common.BackboneOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
    watch: Annotated[
        bool, typer.Option("--watch", "-w", help="Refresh until Ctrl+C (in place on a terminal).")
    ] = False,
    interval: Annotated[
        float, typer.Option(help="Seconds between refreshes with --watch.", min=0.2)
    ] = 2.0,
    serve: Annotated[
        int | None,
        typer.Option(
            "--serve",
            help="Serve the web dashboard on this port until Ctrl+C (http://127.0.0.1:PORT/; "
            "0: any free port).",
            min=0,
            max=65535,
        ),
    ] = None,
    config: common.ConfigOpt = None,
    collaboration: common.CollabOpt = None,
    network_key: common.NetworkKeyOpt = None,
    log_level: common.LogLevelOpt = None,
) -> None:
    """Show the live peers of a collaboration (works from any machine that reaches a backbone)."""
    loaded = common.build_config(
        config,
        {
            "collaboration.backbones": backbone or None,
            "collaboration.name": collaboration,
            "collaboration.network_key": str(network_key) if network_key else None,
            "log.level": log_level or "warning",
            "dashboard.port": serve,
            "dashboard.interval": interval if serve is not None else None,
        },
    )

    def render(report: StatusReport) -> None:
        if as_json:
            common.echo(json.dumps(report.to_json(), indent=2))
        else:
            Console().print(status_table(report))

    async def show(stop: trio.Event) -> None:
        if serve is not None:
            async with status_client(loaded.config) as poll, trio.open_nursery() as nursery:
                port = await nursery.start(run_dashboard, loaded.config, poll)
                host = loaded.config.dashboard.host
                common.echo(f"dashboard at http://{host}:{port}/ (Ctrl+C to stop)")
                await stop.wait()
                nursery.cancel_scope.cancel()
            return
        if not watch:
            render(await collect_status(loaded.config))
            return
        async with status_client(loaded.config) as poll:
            if as_json or not sys.stdout.isatty():
                await refresh(stop, poll, render)  # one report after another, for logs and pipes
                return
            console = Console()
            with Live(console=console, refresh_per_second=4) as live:
                await refresh(stop, poll, lambda report: live.update(status_table(report)))

    async def refresh(
        stop: trio.Event,
        poll: Callable[[], Awaitable[StatusReport]],
        show_one: Callable[[StatusReport], None],
    ) -> None:
        while not stop.is_set():
            try:
                show_one(await poll())
            except RemoteError as error:  # a backbone restarting: say so, keep watching
                print(f"status: {error}; retrying in {interval:g} s", file=sys.stderr, flush=True)
            with trio.move_on_after(interval):
                await stop.wait()

    common.run_until_signal(show, grace=0)


@app.command()
def demo(
    peers: Annotated[int, typer.Option(help="Number of peers to start.", min=1, max=16)] = 3,
    timeout: Annotated[
        float, typer.Option(help="Seconds to train at most before giving up.", min=1)
    ] = 900.0,
    dashboard_port: Annotated[
        int,
        typer.Option(
            "--dashboard-port",
            help="The backbone serves the web dashboard on this port (0: none).",
            min=0,
            max=65535,
        ),
    ] = 0,
) -> None:
    """Train the default task with a local collaboration (a backbone and N peer processes on
    loopback) until the validation-loss target in configs/demo.toml; exit 0 when reached."""
    from cli.demo import DEMO_CONFIG, run_demo

    if not DEMO_CONFIG.is_file():  # an installed copy has no configs/ beside its sources
        common.fail(
            f"peer demo needs {DEMO_CONFIG}: run it from a peertrain checkout installed with "
            "`pip install -e .` (README quick start)"
        )
    trio.run(run_demo, peers, timeout, dashboard_port)


app.command(name="doctor")(doctor_cli.doctor)

if __name__ == "__main__":
    app()
