"""The default task: the stdlib corpus, the byte-level GPT, batches and validation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peer.training.corpus import load_corpus
from peer.training.gpt import GPT, GPTShape
from peer.training.task import ByteGPTTask, load_task

SMALL = GPTShape(block=16, layers=2, heads=2, width=32)


def write_tree(root):
    for i in range(60):
        path = root / f"pkg{i % 3}" / f"mod{i}.py"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"# module {i}\n" + "x = 1\n" * (i + 5))
    (root / "tests").mkdir()
    (root / "tests" / "test_skip.py").write_text("SKIPPED = True\n" * 100)


def test_corpus_is_deterministic_split_and_skips_tests(tmp_path):
    write_tree(tmp_path)
    first, second = load_corpus(tmp_path), load_corpus(tmp_path)
    assert first.fingerprint == second.fingerprint
    assert np.array_equal(first.train, second.train)
    train, validation = bytes(first.train), bytes(first.validation)
    assert validation and train and b"SKIPPED" not in train + validation
    modules = lambda text: {line for line in text.split(b"\n") if line.startswith(b"# module")}  # noqa: E731
    assert not modules(train) & modules(validation)  # no file in both splits
    assert len(modules(train)) + len(modules(validation)) == 60


def test_corpus_of_an_empty_folder_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no usable text"):
        load_corpus(tmp_path)


def test_gpt_is_causal_tied_and_starts_near_uniform():
    torch.manual_seed(0)
    model = GPT(SMALL).eval()
    tokens = torch.randint(0, 256, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, 256)
    changed = tokens.clone()
    changed[:, 10:] = (changed[:, 10:] + 1) % 256
    assert torch.allclose(model(changed)[:, :10], logits[:, :10], atol=1e-6)  # no peeking ahead
    assert not torch.allclose(model(changed)[:, 10:], logits[:, 10:])
    assert model.head.weight is model.tokens.weight
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens.reshape(-1))
    assert abs(loss.item() - math.log(256)) < 0.6  # near uniform over 256 bytes


def test_the_default_task_samples_reproducibly_and_learns(tmp_path):
    write_tree(tmp_path)
    task = ByteGPTTask(SMALL, corpus=load_corpus(tmp_path))
    one = task.sample_batch(4, torch.Generator().manual_seed(3))
    two = task.sample_batch(4, torch.Generator().manual_seed(3))
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))
    x, y = one
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # next byte
    validation = task.validation_batches(4, 3)
    assert all(
        torch.equal(a[0], b[0])
        for a, b in zip(validation, task.validation_batches(4, 3), strict=True)
    )
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())

    def validation_loss() -> float:
        with torch.no_grad():
            return sum(task.loss(model, b).item() for b in validation) / len(validation)

    before = validation_loss()
    generator = torch.Generator().manual_seed(0)
    for _ in range(40):
        optimizer.zero_grad()
        task.loss(model, task.sample_batch(16, generator)).backward()
        optimizer.step()
    assert validation_loss() < before - 1.0  # the repetitive toy corpus is easy to learn


def test_gpt_is_the_default_and_builds_the_same_model_everywhere():
    task = load_task("gpt")
    a, b = task.build_model(), task.build_model()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
