"""`peer config`: the effective configuration with where each value came from, and a check of
one file on its own."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cli import common
from peer.config import FIELDS, LoadedConfig, load_config
from peer.errors import UserError

app = typer.Typer(
    help="Show the effective configuration, or check a config file.",
    no_args_is_help=True,
    add_completion=False,
)


def effective(loaded: LoadedConfig) -> dict[str, dict[str, Any]]:
    """{"section.key": {"value": ..., "source": ...}} in the order of configs/default.toml."""
    out = {}
    for section, keys in FIELDS.items():
        values = getattr(loaded.config, section)
        for key in keys:
            dotted = f"{section}.{key}"
            out[dotted] = {"value": getattr(values, key), "source": loaded.sources[dotted]}
    return out


def effective_table(loaded: LoadedConfig) -> Table:
    table = Table("key", "value", "from", title="effective configuration", box=None)
    for dotted, entry in effective(loaded).items():
        value = entry["value"]
        shown = ", ".join(value) if isinstance(value, list) else json.dumps(value)
        source = entry["source"]
        table.add_row(dotted, shown, source, style="dim" if source == "default" else None)
    return table


@app.command()
def show(
    config: common.ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON for scripts.")] = False,
) -> None:
    """Print every setting's effective value and its source: default, file, env or flag."""
    try:
        loaded = load_config(file=config, env=os.environ)
    except UserError as error:
        common.fail(str(error))
    if as_json:
        common.echo(json.dumps(effective(loaded), indent=2))
    else:
        Console().print(effective_table(loaded))


@app.command()
def check(
    file: Annotated[Path, typer.Argument(help="The TOML config file to validate.")],
) -> None:
    """Validate FILE alone (no environment, no flags); exit 2 naming the first problem."""
    try:
        loaded = load_config(file=file, env={})
    except UserError as error:
        common.fail(str(error))
    origin = f"file {file}"
    keys = [dotted for dotted, source in loaded.sources.items() if source == origin]
    common.echo(f"{file}: valid; sets {len(keys)} of {len(loaded.sources)} keys")
