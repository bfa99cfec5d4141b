"""examples/huggingface_gpt2.py (slow suite): two HuggingFace `Trainer` processes train a tiny
GPT-2 together through `peertrain.Optimizer` on loopback. Skipped without `transformers` and
`accelerate`."""

from __future__ import annotations

import re

import pytest

from tests.collab_processes import run_example_shards

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow
STEPS = 4


def test_two_huggingface_trainers_train_a_tiny_gpt2_together(tmp_path):
    outputs = run_example_shards(tmp_path, "huggingface_gpt2.py", STEPS)
    results = []
    for output in outputs:
        found = re.search(r"step (\d+) of shard \d: held-out loss ([\d.]+) -> ([\d.]+)", output)
        assert found, output[-3000:]
        results.append((int(found[1]), float(found[2]), float(found[3])))
    for step, before, after in results:
        assert step >= STEPS and after < before, results
    (step_a, _, after_a), (step_b, _, after_b) = results
    if step_a == step_b:  # the same step: the same model, the same loss
        assert after_a == after_b, results
