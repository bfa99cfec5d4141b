"""examples/plain_loop.py: two plain PyTorch loops, each with a DataLoader over its own shard
of a dataset, train one model together through `peertrain.Optimizer` (loopback)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from tests.collab_processes import BASE_ENV, ROOT, Collaboration

STEPS = 6


def test_two_shards_of_a_dataloader_train_one_model_together(tmp_path):
    collab = Collaboration(tmp_path, {"PEERTRAIN_LOG_LEVEL": "warning"})
    loops: list[subprocess.Popen[str]] = []
    try:
        collab.start_backbone()
        env = {**os.environ, **BASE_ENV, "PEERTRAIN_LOG_LEVEL": "warning"}
        env.pop("PEERTRAIN_CONFIG")  # the example's own settings, with debug.toml's loopback
        env["PEERTRAIN_NET_LISTEN"] = "/ip4/127.0.0.1/tcp/0"
        env["PEERTRAIN_TRAINING_GATHER_WINDOW"] = "1.0"
        env["PEERTRAIN_TRAINING_PROGRESS_INTERVAL"] = "0.5"
        for shard in range(2):
            loops.append(
                subprocess.Popen(
                    [sys.executable, "examples/plain_loop.py", "--backbone", collab.backbone_addr,
                     "--shard", str(shard), "--shards", "2", "--steps", str(STEPS),
                     "--identity", str(tmp_path / f"loop{shard}.key"),
                     "--checkpoints", str(tmp_path / f"checkpoints{shard}")],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                )
            )  # fmt: skip
        outputs = [loop.communicate(timeout=240)[0] for loop in loops]
    finally:
        for loop in loops:  # by PID, whatever happened
            if loop.poll() is None:
                loop.kill()
                loop.wait(10)
        collab.close()
    results = []
    for loop, output in zip(loops, outputs, strict=True):
        assert loop.returncode == 0, output[-3000:]
        found = re.search(
            r"step (\d+) after \d+ epochs of shard \d: loss ([\d.]+) -> ([\d.]+)", output
        )
        assert found, output[-3000:]
        results.append((int(found[1]), float(found[2]), float(found[3])))
    for step, before, after in results:
        assert step >= STEPS, results
        assert after < before, results  # the steps applied are steps down the loss
    (step_a, _, after_a), (step_b, _, after_b) = results
    if step_a == step_b:  # the same step: the same parameters, the same loss on all the data
        assert after_a == after_b, results
