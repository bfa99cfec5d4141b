"""`peer config show` and `peer config check`: what they print and their exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.peer_cli import app
from peer.config import config_to_dict, load_config

runner = CliRunner()
CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def test_show_reports_each_value_with_its_source(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text('[presence]\nttl = 30.0\n[task]\nname = "tiny"\n')
    result = runner.invoke(
        app,
        ["config", "show", "--config", str(file), "--json"],
        env={"PEERTRAIN_TASK_NAME": "gpt", "PEERTRAIN_CONFIG": ""},
    )
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["presence.ttl"] == {"value": 30.0, "source": f"file {file}"}
    assert shown["task.name"] == {"value": "gpt", "source": "env PEERTRAIN_TASK_NAME"}
    assert shown["dht.alpha"] == {"value": 3, "source": "default"}
    assert next(iter(shown)) == "identity.path"  # sections in the order of configs/default.toml


def test_show_as_a_table_names_the_sources(tmp_path):
    file = tmp_path / "c.toml"
    file.write_text("[presence]\nttl = 30.0\n")
    result = runner.invoke(app, ["config", "show", "--config", str(file)], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    line = next(row for row in result.output.splitlines() if "presence.ttl" in row)
    assert "30.0" in line and f"file {file}" in line


def test_check_accepts_the_shipped_presets(tmp_path):
    presets = sorted(CONFIGS.glob("*.toml"))
    assert {p.stem for p in presets} >= {"default", "demo", "debug", "lan", "internet"}
    for preset in presets:
        result = runner.invoke(app, ["config", "check", str(preset)])
        assert result.exit_code == 0, result.output
        assert "valid" in result.output


@pytest.mark.parametrize("name", ["lan", "internet"])
def test_a_deployment_preset_sets_only_what_differs_from_the_defaults(name):
    # Their header says so; a key equal to its default would only hide later default changes.
    loaded = load_config(file=CONFIGS / f"{name}.toml", env={})
    defaults = config_to_dict(load_config(env={}).config)
    ours = config_to_dict(loaded.config)
    from_file = [key for key, source in loaded.sources.items() if source.startswith("file")]
    assert from_file
    for key in from_file:
        section, field = key.split(".")
        assert ours[section][field] != defaults[section][field], key


def test_check_rejects_a_bad_file_in_one_line_and_ignores_the_environment(tmp_path):
    bad = tmp_path / "bad.toml"
    cases = {
        '[presence]\nttl = "soon"\n': "presence.ttl = 'soon'",
        "[presence]\nttl = 2.0\nrefresh = 5.0\n": "expected less than presence.ttl",
        "[training]\nmystery = 1\n": "unknown key 'training.mystery'",
        "[presence\n": "not valid TOML",
    }
    for text, message in cases.items():
        bad.write_text(text)
        result = runner.invoke(app, ["config", "check", str(bad)])
        assert result.exit_code == 2, (text, result.output)
        assert message in result.output and len(result.output.strip().splitlines()) == 1
    good = tmp_path / "good.toml"
    good.write_text("[presence]\nttl = 30.0\n")
    result = runner.invoke(
        app, ["config", "check", str(good)], env={"PEERTRAIN_PRESENCE_TTL": "oops"}
    )
    assert result.exit_code == 0, result.output
    assert "sets 1 of" in result.output
    missing = runner.invoke(app, ["config", "check", str(tmp_path / "none.toml")])
    assert missing.exit_code == 2 and "does not exist" in missing.output


def test_demo_without_its_config_is_a_one_line_error(tmp_path, monkeypatch):
    import cli.demo

    monkeypatch.setattr(cli.demo, "DEMO_CONFIG", tmp_path / "configs" / "demo.toml")
    result = runner.invoke(app, ["demo"])
    assert result.exit_code == 2
    assert "peer demo needs" in result.output and "pip install -e" in result.output
    assert len(result.output.strip().splitlines()) == 1
