"""The collaborative optimizers' local numerics, without a network: averaging what several
peers contribute (weighted by samples) and applying it equals one big machine's step."""

from __future__ import annotations

import numpy as np
import torch

from peer.training.strategies import LargeBatch, LocalSGD
from peer.training.task import TinyTask


def batches(seed: int, count: int, size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    task = TinyTask()
    generator = torch.Generator().manual_seed(seed)
    return [task.sample_batch(size, generator) for _ in range(count)]


def weighted_average(contributions: list[tuple[np.ndarray, int]]) -> np.ndarray:
    total = sum(samples for _, samples in contributions)
    return sum(vector * (samples / total) for vector, samples in contributions).astype(np.float32)


def params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_large_batch_steps_equal_one_big_batch_step():
    task = TinyTask()
    # Three peers with different amounts of work per step (2, 1 and 3 micro-batches of 8 and 5).
    work = {0: batches(1, 2, 8), 1: batches(2, 1, 5), 2: batches(3, 3, 8)}
    peers = [LargeBatch(task, task.build_model()) for _ in work]
    reference_model = task.build_model()
    reference = torch.optim.AdamW(reference_model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(3):
        contributions = []
        for peer, mine in zip(peers, work.values(), strict=True):
            for x, y in mine:
                peer.accumulate((x, y), len(x))
            contributions.append(peer.take())
        assert [samples for _, samples in contributions] == [16, 5, 24]
        average = weighted_average(contributions)
        for peer in peers:
            peer.apply(average)
        x = torch.cat([x for mine in work.values() for x, _ in mine])
        y = torch.cat([y for mine in work.values() for _, y in mine])
        reference.zero_grad()
        task.loss(reference_model, (x, y)).backward()
        reference.step()
    for peer in peers:
        assert torch.equal(params(peer.model), params(peers[0].model))
        # Float tolerance: AdamW divides by sqrt(v), which magnifies rounding in tiny gradients.
        torch.testing.assert_close(
            params(peer.model), params(reference_model), rtol=1e-4, atol=2e-5
        )


def test_large_batch_gives_back_work_of_a_failed_averaging():
    task = TinyTask()
    peer = LargeBatch(task, task.build_model())
    x, y = batches(4, 1, 8)[0]
    peer.accumulate((x, y), 8)
    vector, samples = peer.take()
    assert peer.samples == 0
    peer.give_back(vector, samples)
    again, samples_again = peer.take()
    assert samples_again == 8
    np.testing.assert_allclose(again, vector, rtol=1e-6)
    assert np.abs(vector).sum() > 0


def test_local_sgd_outer_step_is_nesterov_on_the_averaged_pseudo_gradient():
    task = TinyTask()
    peers = [
        LocalSGD(task, task.build_model(), outer_lr=0.7, momentum=0.9, inner_steps=1)
        for _ in range(2)
    ]
    start = params(peers[0].model).clone()
    for seed, peer in enumerate(peers):
        for x, y in batches(seed, 3, 8):
            peer.accumulate((x, y), 8)
    contributions = [peer.take() for peer in peers]
    pseudo = [torch.from_numpy(v) for v, _ in contributions]
    assert torch.allclose(pseudo[0], start - params(peers[0].model))
    average = weighted_average(contributions)
    for peer in peers:
        peer.apply(average)
    # First Nesterov step from zero momentum: buf = g, update = g + 0.9 * buf = 1.9 g.
    expected = start - 0.7 * 1.9 * torch.from_numpy(average)
    for peer in peers:
        torch.testing.assert_close(params(peer.model), expected)
        assert peer.samples == 0
    assert torch.equal(params(peers[0].model), params(peers[1].model))


def test_local_sgd_drop_local_work_returns_to_the_shared_parameters():
    task = TinyTask()
    peer = LocalSGD(task, task.build_model(), outer_lr=0.7, momentum=0.9, inner_steps=1)
    for x, y in batches(5, 2, 8):
        peer.accumulate((x, y), 8)
    with torch.no_grad():
        for p in peer.model.parameters():
            p.fill_(0.5)  # as a state download would set them
    peer.drop_local_work()
    vector, samples = peer.take()
    assert samples == 0 and not np.any(vector)


def test_local_sgd_without_outer_momentum_at_lr_1_averages_the_parameters():
    task = TinyTask()
    peers = [
        LocalSGD(task, task.build_model(), outer_lr=1.0, momentum=0.0, inner_steps=1)
        for _ in range(3)
    ]
    for seed, peer in enumerate(peers):
        for x, y in batches(seed, 2, 8):
            peer.accumulate((x, y), 8)
    local = [params(peer.model).clone() for peer in peers]
    average = weighted_average([peer.take() for peer in peers])
    for peer in peers:
        peer.apply(average)
    torch.testing.assert_close(params(peers[0].model), sum(local) / 3)
