"""`backbone`: run a stable node that peers join through."""

from __future__ import annotations

from typing import Annotated

import typer

from cli import common
from peer.daemon import run_daemon
from peer.net.host import Node

app = typer.Typer(
    help="Run a peertrain backbone (DHT bootstrap node).",
    no_args_is_help=True,
    add_completion=False,
)

DEFAULT_IDENTITY = "~/.peertrain/backbone.key"


@app.callback()
def main() -> None:
    """Backbones are always-on DHT servers; peers join a collaboration through any of them."""


@app.command()
def start(
    identity: common.IdentityOpt = None,
    port: common.PortOpt = None,
    bootstrap: Annotated[
        list[str] | None,
        typer.Option(
            "--bootstrap", help="Multiaddr of another backbone to connect to (repeatable)."
        ),
    ] = None,
    config: common.ConfigOpt = None,
    listen: common.ListenOpt = None,
    announce: common.AnnounceOpt = None,
    collaboration: common.CollabOpt = None,
    keep_state: Annotated[
        bool,
        typer.Option(
            "--keep-state",
            help="Keep the newest training state on disk and serve it to joining peers.",
        ),
    ] = False,
    log_level: common.LogLevelOpt = None,
    log_format: common.LogFormatOpt = None,
    metrics_port: common.MetricsPortOpt = None,
) -> None:
    """Start a backbone and print the addresses peers should pass to `peer join --backbone`."""
    overrides = {
        "identity.path": str(identity) if identity else None,
        "collaboration.backbones": bootstrap or None,
        "net.listen": listen or None,
        "net.announce": announce or None,
        "collaboration.name": collaboration,
        "state.keep": True if keep_state else None,
        "log.level": log_level,
        "log.format": log_format,
        "metrics.port": metrics_port,
    }
    loaded = common.build_config(config, overrides, port=port)
    if loaded.sources["identity.path"] == "default":  # a backbone's key lives apart from a peer's
        loaded = common.build_config(
            config, {**overrides, "identity.path": DEFAULT_IDENTITY}, port=port
        )

    def on_ready(node: Node) -> None:
        common.echo(
            f"backbone {node.peer_id} serving collaboration {loaded.config.collaboration.name!r}; peers join with:"
        )
        for addr in node.public_addrs():
            common.echo(f"  peer join --backbone {addr}")

    common.run_until_signal(
        lambda stop: run_daemon(loaded.config, stop, role="backbone", on_ready=on_ready)
    )


if __name__ == "__main__":
    app()
