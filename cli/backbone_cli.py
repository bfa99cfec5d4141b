"""`backbone`: run a stable node that peers join through."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from cli import common
from peer.config import LoadedConfig
from peer.daemon import run_daemon
from peer.errors import ConfigError, UserError
from peer.net.host import Node, parse_multiaddr
from peer.net.identity import load_or_create_identity
from peer.net.network_key import create_network_key

app = typer.Typer(
    help="Run a peertrain backbone (DHT bootstrap node).",
    no_args_is_help=True,
    add_completion=False,
)

DEFAULT_IDENTITY = "~/.peertrain/backbone.key"


@app.callback()
def main() -> None:
    """Backbones are always-on DHT servers; peers join a collaboration through any of them."""


def backbone_config(
    config: Path | None, overrides: dict[str, Any], *, port: int | None = None
) -> LoadedConfig:
    """The config a backbone runs with: a peer's, but its key lives apart from a peer's."""
    loaded = common.build_config(config, overrides, port=port)
    if loaded.sources["identity.path"] == "default":
        loaded = common.build_config(
            config, {**overrides, "identity.path": DEFAULT_IDENTITY}, port=port
        )
    return loaded


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
    network_key: common.NetworkKeyOpt = None,
    keep_state: Annotated[
        bool,
        typer.Option(
            "--keep-state",
            help="Keep the newest training state on disk and serve it to joining peers.",
        ),
    ] = False,
    aggregate: Annotated[
        bool,
        typer.Option(
            "--aggregate",
            help="Reduce a share of each step's averaging, as DeDLOC's backbones do "
            "(averaging.backbone_aggregates).",
        ),
    ] = False,
    log_level: common.LogLevelOpt = None,
    log_format: common.LogFormatOpt = None,
    metrics_port: common.MetricsPortOpt = None,
    dashboard_port: Annotated[
        int | None,
        typer.Option(
            "--dashboard-port",
            help="Serve the web dashboard on this port (http://127.0.0.1:PORT/; 0: off).",
        ),
    ] = None,
) -> None:
    """Start a backbone and print the addresses peers should pass to `peer join --backbone`."""
    overrides = {
        "identity.path": str(identity) if identity else None,
        "collaboration.backbones": bootstrap or None,
        "net.listen": listen or None,
        "net.announce": announce or None,
        "collaboration.name": collaboration,
        "collaboration.network_key": str(network_key) if network_key else None,
        "state.keep": True if keep_state else None,
        "averaging.backbone_aggregates": True if aggregate else None,
        "log.level": log_level,
        "log.format": log_format,
        "metrics.port": metrics_port,
        "dashboard.port": dashboard_port,
    }
    loaded = backbone_config(config, overrides, port=port)

    def on_ready(node: Node) -> None:
        common.echo(
            f"backbone {node.peer_id} serving collaboration {loaded.config.collaboration.name!r}; peers join with:"
        )
        for addr in node.public_addrs():
            common.echo(f"  peer join --backbone {addr}")

    common.run_until_signal(
        lambda stop: run_daemon(loaded.config, stop, role="backbone", on_ready=on_ready)
    )


@app.command("id")
def id_(
    identity: common.IdentityOpt = None,
    address: Annotated[
        str | None,
        typer.Option(
            "--address",
            help="Transport multiaddr peers dial (e.g. /dns4/backbone/tcp/31337); print it "
            "with /p2p/<peer id> appended, ready for `peer join --backbone`.",
        ),
    ] = None,
    config: common.ConfigOpt = None,
) -> None:
    """Print the backbone's peer id (or full address), creating its key on first use."""
    # Peers need the id as well as an address; printing it without starting the backbone lets
    # a deployment hand out the full address up front (deploy/compose.yaml does).
    loaded = backbone_config(config, {"identity.path": str(identity) if identity else None})
    try:
        transport = None if address is None else parse_multiaddr(address, what="--address")
        if transport is not None and "p2p" in (p.name for p in transport.protocols()):
            raise ConfigError(f"--address {address!r} already ends in /p2p/<id>; drop that part")
        # No IdentityLock: reading the public half is safe while `start` runs on the key.
        found = load_or_create_identity(Path(loaded.config.identity.path).expanduser())
    except UserError as error:
        common.fail(str(error))
    common.echo(str(found.peer_id) if transport is None else f"{transport}/p2p/{found.peer_id}")


@app.command("network-key")
def network_key_(
    path: Annotated[Path, typer.Argument(help="Where to write the new key (mode 0600).")],
) -> None:
    """Make the key of a private collaboration: pass it to every backbone and peer with
    --network-key (or collaboration.network_key); machines without it cannot connect."""
    try:
        create_network_key(path.expanduser())
    except UserError as error:
        common.fail(str(error))
    common.echo(f"wrote {path}; copy it (mode 0600) to every machine you admit")


if __name__ == "__main__":
    app()
