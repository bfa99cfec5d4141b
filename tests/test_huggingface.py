"""examples/huggingface_gpt2.py (slow suite): two HuggingFace `Trainer` processes train a tiny
GPT-2 together through `peertrain.Optimizer` on loopback. Skipped without `transformers` and
`accelerate`."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.collab_processes import BASE_ENV, ROOT, Collaboration

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow
STEPS = 4


def test_two_huggingface_trainers_train_a_tiny_gpt2_together(tmp_path):
    collab = Collaboration(tmp_path, {"PEERTRAIN_LOG_LEVEL": "warning"})
    runs: list[subprocess.Popen[str]] = []
    try:
        collab.start_backbone()
        env = {**os.environ, **BASE_ENV, "PEERTRAIN_LOG_LEVEL": "warning"}
        env.pop("PEERTRAIN_CONFIG")
        env["PEERTRAIN_NET_LISTEN"] = "/ip4/127.0.0.1/tcp/0"
        for shard in range(2):
            runs.append(
                subprocess.Popen(
                    [sys.executable, "examples/huggingface_gpt2.py", "--backbone",
                     collab.backbone_addr, "--shard", str(shard), "--shards", "2",
                     "--steps", str(STEPS), "--identity", str(tmp_path / f"hf{shard}.key"),
                     "--checkpoints", str(tmp_path / f"checkpoints{shard}")],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
            )  # fmt: skip
        outputs = [run.communicate(timeout=400)[0] for run in runs]
    finally:
        for run in runs:  # by PID, whatever happened
            if run.poll() is None:
                run.kill()
                run.wait(10)
        collab.close()
    results = []
    for run, output in zip(runs, outputs, strict=True):
        assert run.returncode == 0, output[-3000:]
        found = re.search(r"step (\d+) of shard \d: held-out loss ([\d.]+) -> ([\d.]+)", output)
        assert found, output[-3000:]
        results.append((int(found[1]), float(found[2]), float(found[3])))
    for step, before, after in results:
        assert step >= STEPS and after < before, results
    (step_a, _, after_a), (step_b, _, after_b) = results
    if step_a == step_b:  # the same step: the same model, the same loss
        assert after_a == after_b, results
