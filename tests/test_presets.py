"""The LAN and internet presets run a collaboration as shipped (slow: real processes).

Only what one machine cannot share is overridden: loopback addresses and free ports instead
of the presets' fixed ones, the tiny task, and a step limit."""

from __future__ import annotations

import pytest

from tests.test_cli_e2e import LOOPBACK, ROOT, IsolatedProc

pytestmark = pytest.mark.slow


class PresetProc(IsolatedProc):
    preset = ""

    def environment(self) -> dict[str, str]:
        return {
            **super().environment(),
            "PEERTRAIN_CONFIG": str(ROOT / "configs" / f"{self.preset}.toml"),
            "PEERTRAIN_NET_LISTEN": LOOPBACK,
            "PEERTRAIN_AVERAGING_DATA_PORT": "0",
            "PEERTRAIN_TASK_NAME": "tiny",
            "PEERTRAIN_TRAINING_INNER_STEPS": "10",
            "PEERTRAIN_TRAINING_MAX_STEPS": "2",
        }


@pytest.mark.parametrize("preset", ["lan", "internet"])
def test_a_preset_trains_two_peers_to_their_step_limit(preset, tmp_path, monkeypatch):
    monkeypatch.setattr(PresetProc, "preset", preset)
    started: list[PresetProc] = []

    def start(*args: str) -> PresetProc:
        proc = PresetProc(list(args), tmp_path / f"checkpoints{len(started)}")
        started.append(proc)
        return proc

    try:
        backbone = start("cli.backbone_cli", "start", "--identity", str(tmp_path / "bb.key"))
        line = backbone.wait_line("peer join --backbone /ip4/127.0.0.1/", timeout=30)
        addr = line.split("--backbone ", 1)[1].strip()
        join = ["cli.peer_cli", "join", "--backbone", addr, "--identity"]
        peers = [start(*join, str(tmp_path / f"p{i}.key")) for i in range(2)]
        for proc in peers:
            assert proc.popen.wait(timeout=240) == 0, proc.stderr_if_done()
            proc.wait_line("step 2 |", timeout=5)  # printed before it stopped at max_steps
    finally:
        for proc in started:
            if proc.popen.poll() is None:
                proc.popen.kill()
            proc.popen.wait(timeout=10)
