"""What cannot run here (systemd) is checked statically: the units parse, start our commands
with options those commands have, set only real config keys, stop cleanly and restart."""

from __future__ import annotations

import configparser
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.backbone_cli import app as backbone_app
from cli.peer_cli import app as peer_app
from peer.config import load_config

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))
COMMANDS = {("backbone", "start"): backbone_app, ("peer", "join"): peer_app}


def parse_unit(path: Path) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # keys are case-sensitive in systemd
    parser.read_string(path.read_text())
    return parser


def test_there_are_units_for_a_backbone_and_a_peer():
    assert {u.name for u in UNITS} == {"peertrain-backbone.service", "peertrain-peer.service"}


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_a_unit_runs_our_command_with_options_it_has(unit):
    service = parse_unit(unit)["Service"]
    argv = shlex.split(service["ExecStart"])
    program, subcommand, options = Path(argv[0]).name, argv[1], argv[2:]
    app = COMMANDS[(program, subcommand)]
    help_text = CliRunner().invoke(app, [subcommand, "--help"], env={"COLUMNS": "200"}).output
    for option in (o for o in options if o.startswith("--")):
        assert option in help_text, (unit.name, option)
    # Clean stop: SIGINT withdraws the node's records; systemd waits longer than our 3 s.
    assert service["KillSignal"] == "SIGINT"
    assert float(service["TimeoutStopSec"]) > 3
    assert service["Restart"] in ("on-failure", "always")
    assert service["User"] != "root" and service["NoNewPrivileges"] == "yes"


@pytest.mark.parametrize("unit", UNITS, ids=lambda u: u.name)
def test_a_unit_sets_only_real_config_keys_and_keeps_state_in_its_state_directory(unit):
    service = parse_unit(unit)["Service"]
    env = dict(line.split("=", 1) for line in service.get("Environment", "").split())
    loaded = load_config(env=env)  # a wrong key or value raises ConfigError
    # The home directory is protected: checkpoints must go under StateDirectory.
    assert service["ProtectHome"] == "yes"
    state = f"/var/lib/{service['StateDirectory']}"
    assert loaded.config.training.checkpoint_dir.startswith(state)
    assert f"--identity {state}/" in service["ExecStart"]
