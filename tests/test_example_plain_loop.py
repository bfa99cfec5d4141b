"""examples/plain_loop.py: two plain PyTorch loops, each with a DataLoader over its own shard
of a dataset, train one model together through `peertrain.Optimizer` (loopback)."""

from __future__ import annotations

import re

from tests.collab_processes import run_example_shards

STEPS = 6


def test_two_shards_of_a_dataloader_train_one_model_together(tmp_path):
    outputs = run_example_shards(tmp_path, "plain_loop.py", STEPS, timeout=240)
    results = []
    for output in outputs:
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
