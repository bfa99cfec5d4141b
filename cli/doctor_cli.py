"""`peer doctor`: check what would stop this machine from joining, and say how to fix it.

Exit status: 0 when no check failed (warnings allowed), 1 when one did, 2 for a bad flag or
config value (one line on stderr, as everywhere).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Sequence
from typing import Annotated

import trio
import typer
from rich.console import Console
from rich.text import Text

from cli import common
from peer.daemon import parse_backbones
from peer.doctor import Finding
from peer.doctor_run import run_doctor
from peer.errors import UserError

EXIT_FAILED = 1
LABELS = {"ok": ("OK  ", "green"), "warn": ("WARN", "yellow"), "fail": ("FAIL", "bold red")}


def doctor(
    backbone: common.BackboneOpt = None,
    config: common.ConfigOpt = None,
    listen: common.ListenOpt = None,
    announce: common.AnnounceOpt = None,
    port: common.PortOpt = None,
    identity: common.IdentityOpt = None,
    collaboration: common.CollabOpt = None,
    network_key: common.NetworkKeyOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the findings as JSON.")] = False,
    log_level: common.LogLevelOpt = None,
) -> None:
    """Check what would stop `peer join` with these flags: backbones, reachability, addresses,
    clock, device, bandwidth, disk, identity key. Exit 0 if no check fails (warnings allowed),
    1 if one does, 2 for a bad flag or config value; 30 s at most."""
    loaded = common.build_config(
        config,
        {
            "collaboration.backbones": backbone or None,
            "identity.path": str(identity) if identity else None,
            "net.listen": listen or None,
            "net.announce": announce or None,
            "collaboration.name": collaboration,
            "collaboration.network_key": str(network_key) if network_key else None,
            "log.level": log_level or "warning",
        },
        port=port,
    )
    try:
        parse_backbones(loaded.config.collaboration.backbones)  # bad addresses: exit 2 first
        findings = trio.run(run_doctor, loaded.config)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except BaseException as error:
        ours = common.find_error(error)
        if not isinstance(ours, UserError):
            raise
        common.fail(str(ours))
    if as_json:
        common.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    else:
        show(findings, Console(highlight=False, soft_wrap=True))
    if any(f.level == "fail" for f in findings):
        raise typer.Exit(EXIT_FAILED)


def show(findings: Sequence[Finding], console: Console) -> None:
    """`OK   name  message`, and under a warning or failure `     fix: advice`."""
    for finding in findings:
        label, style = LABELS[finding.level]
        console.print(Text.assemble((label, style), f" {finding.name:<12} {finding.message}"))
        if finding.advice and finding.level != "ok":
            console.print(f"     fix: {finding.advice}", markup=False)
    counts = Counter(f.level for f in findings)
    console.print(
        f"{counts['ok']} ok, {counts['warn']} warning(s), {counts['fail']} failure(s)",
        markup=False,
    )
