"""What `peer` and `backbone` share: config loading from flags, running a daemon under trio with
signal handling, and turning user and network errors into one line and exit code 2."""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn

import trio
import typer

from peer.config import LoadedConfig, load_config
from peer.errors import UserError, find_error
from peer.logs import setup_logging

EXIT_USER_ERROR = 2

BackboneOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--backbone",
        "-b",
        help="Backbone multiaddr with /p2p/<id> (repeatable; any one that answers is enough).",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="TOML config file (see configs/default.toml).",
        envvar="PEERTRAIN_CONFIG",
    ),
]
IdentityOpt = Annotated[
    Path | None, typer.Option("--identity", help="Ed25519 key file; created on first run.")
]
ListenOpt = Annotated[
    list[str] | None, typer.Option("--listen", help="Multiaddr to listen on (repeatable).")
]
AnnounceOpt = Annotated[
    list[str] | None, typer.Option("--announce", help="Multiaddr to advertise (repeatable).")
]
PortOpt = Annotated[
    int | None,
    typer.Option("--port", help="TCP port to listen on (replaces the port of every --listen)."),
]
CollabOpt = Annotated[
    str | None,
    typer.Option("--collaboration", help="Collaboration name (namespace of all DHT keys)."),
]
NetworkKeyOpt = Annotated[
    Path | None,
    typer.Option(
        "--network-key",
        help="Key file of a private collaboration (made by `backbone network-key FILE`).",
    ),
]
LogLevelOpt = Annotated[
    str | None, typer.Option("--log-level", help="debug, info, warning or error.")
]
LogFormatOpt = Annotated[str | None, typer.Option("--log-format", help="rich or json.")]
MetricsPortOpt = Annotated[
    int | None,
    typer.Option(
        "--metrics-port", help="Serve Prometheus metrics on this port (GET /metrics; 0: off)."
    ),
]


def fail(message: str) -> NoReturn:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(EXIT_USER_ERROR)


def with_port(listen: list[str], port: int) -> list[str]:
    """Replace the TCP port of each listen multiaddr."""
    out = []
    for addr in listen:
        parts = addr.split("/")
        if "tcp" not in parts:
            fail(f"--port given but listen address {addr!r} has no /tcp/ part")
        parts[parts.index("tcp") + 1] = str(port)
        out.append("/".join(parts))
    return out


def build_config(
    config_file: Path | None, overrides: dict[str, Any], *, port: int | None = None
) -> LoadedConfig:
    """Load defaults < file < PEERTRAIN_* env < flags, or exit 2 with the config error."""
    try:
        loaded = load_config(file=config_file, env=os.environ, overrides=overrides)
        if port is not None:
            loaded = load_config(
                file=config_file,
                env=os.environ,
                overrides={
                    **overrides,
                    "net.listen": with_port(list(loaded.config.net.listen), port),
                },
            )
    except UserError as error:
        fail(str(error))
    setup_logging(level=loaded.config.log.level, fmt=loaded.config.log.format)
    return loaded


def run_until_signal(main: Callable[[trio.Event], Awaitable[None]], *, grace: float = 2.5) -> None:
    """Run `main(stop)` under trio until it returns or a signal arrives.

    The first SIGINT/SIGTERM sets `stop`, so a daemon can withdraw its records while its host
    still runs; whatever is left after `grace` seconds is cancelled; a second signal exits at
    once. User errors and unreachable peers end in one line on stderr and exit code 2.
    """

    async def supervised() -> None:
        stop = trio.Event()
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:

                async def watch() -> None:
                    async for _ in signals:
                        if stop.is_set():
                            os._exit(130)  # second Ctrl+C: the user wants out now
                        stop.set()
                        nursery.cancel_scope.deadline = trio.current_time() + grace
                        if grace > 0:  # a daemon: say what the wait is for, and the way out
                            echo(f"stopping within {grace:g} s (Ctrl+C again to quit at once)")

                nursery.start_soon(watch)
                await main(stop)
                nursery.cancel_scope.cancel()

    try:
        trio.run(supervised)
    except BaseException as error:
        ours = find_error(error)
        if ours is None:
            raise
        fail(str(ours))
    exit_at_once(0)


def exit_at_once(code: int) -> NoReturn:
    """End a daemon that has shut down cleanly without the interpreter's teardown: its final
    garbage collection (the model, optimizer state, the network stack) took ~3 s of a peer's
    stop (measured with py-spy: gc_collect_main after atexit). Everything is saved by now."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def echo(line: str) -> None:
    print(line, flush=True)
    sys.stdout.flush()
