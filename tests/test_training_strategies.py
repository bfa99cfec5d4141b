"""The collaborative optimizers' local numerics, without a network: averaging what several
peers contribute (weighted by samples) and applying it equals one big machine's step."""

from __future__ import annotations

import numpy as np
import torch

from peer.training.layout import averaged_buffers
from peer.training.precision import Precision
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


# ------------------------------------------------------------------ buffers, dtypes, AMP, clipping


class NormTask(TinyTask):
    """The tiny task with a BatchNorm layer: running statistics (float) and a batch counter
    (int64) that every micro-batch's forward pass moves."""

    name = "tiny-norm"

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(
            torch.nn.Linear(self.inputs, self.hidden),
            torch.nn.BatchNorm1d(self.hidden),
            torch.nn.GELU(),
            torch.nn.Linear(self.hidden, self.outputs),
        )


def with_buffers(task: TinyTask, **options) -> LargeBatch:
    model = task.build_model()
    return LargeBatch(task, model, buffers=[b for _, b in averaged_buffers(model)], **options)


def test_buffers_are_averaged_with_the_gradient_so_every_peer_holds_the_same():
    task = NormTask()
    peers = [with_buffers(task) for _ in range(2)]
    # Different data and amounts of work: the running statistics and counters drift apart.
    for seed, (peer, count) in enumerate(zip(peers, (2, 3), strict=True)):
        for x, y in batches(seed, count, 8):
            peer.accumulate((x, y), len(x))
    norms = [peer.model[1] for peer in peers]
    assert not torch.equal(norms[0].running_mean, norms[1].running_mean)
    expected_mean = (norms[0].running_mean * 16 + norms[1].running_mean * 24) / 40
    contributions = [peer.take() for peer in peers]
    assert len(contributions[0][0]) == peers[0].vector_size == peers[0].gradient_size + 2 * 128 + 1
    average = weighted_average(contributions)
    for peer in peers:
        peer.apply(average)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        assert torch.equal(getattr(norms[0], name), getattr(norms[1], name)), name
    torch.testing.assert_close(norms[0].running_mean, expected_mean)
    assert norms[0].num_batches_tracked.dtype == torch.int64
    assert int(norms[0].num_batches_tracked) == 3  # (2 * 16 + 3 * 24) / 40 = 2.6, rounded


def test_a_failed_averaging_gives_back_the_gradient_and_leaves_the_buffers_as_they_are():
    task = NormTask()
    peer = with_buffers(task)
    x, y = batches(4, 1, 8)[0]
    peer.accumulate((x, y), 8)
    mean = peer.model[1].running_mean.clone()
    vector, samples = peer.take()
    peer.give_back(vector, samples)
    again, _ = peer.take()
    np.testing.assert_allclose(again, vector, rtol=1e-6)
    assert torch.equal(peer.model[1].running_mean, mean)


def test_gradients_accumulate_in_float32_for_bf16_parameters():
    task = TinyTask()
    model = task.build_model().to(torch.bfloat16)
    peer = LargeBatch(task, model)
    work = [(x.bfloat16(), y.bfloat16()) for x, y in batches(5, 64, 4)]
    exact = [torch.zeros(p.shape, dtype=torch.float64) for p in model.parameters()]
    for x, y in work:
        loss = task.loss(model, (x, y)) * len(x)
        for total, grad in zip(
            exact, torch.autograd.grad(loss, list(model.parameters())), strict=True
        ):
            total += grad.double()
        peer.accumulate((x, y), len(x))
    vector, samples = peer.take()
    expected = torch.cat([t.reshape(-1) for t in exact]) / samples
    # bf16 sums of 64 micro-batches are off by ~1e-2 relative; float32 ones by ~1e-7.
    torch.testing.assert_close(torch.from_numpy(vector).double(), expected, rtol=1e-5, atol=1e-7)


def test_the_averaged_gradient_is_clipped_by_its_norm_as_clip_grad_norm_does():
    task = TinyTask()
    peers = [LargeBatch(task, task.build_model(), clip_grad_norm=0.05) for _ in range(2)]
    for seed, peer in enumerate(peers):
        for x, y in batches(seed, 2, 8):
            peer.accumulate((x, y), len(x))
    average = weighted_average([peer.take() for peer in peers])
    assert np.linalg.norm(average) > 0.05  # the clipping does something
    reference_model = task.build_model()
    reference = task.make_optimizer(reference_model.parameters())
    offset = 0
    for p in reference_model.parameters():
        p.grad = torch.from_numpy(average[offset : offset + p.numel()].copy()).view_as(p)
        offset += p.numel()
    torch.nn.utils.clip_grad_norm_(reference_model.parameters(), 0.05)
    reference.step()
    for peer in peers:
        peer.apply(average)
    assert torch.equal(params(peers[0].model), params(peers[1].model))
    torch.testing.assert_close(params(peers[0].model), params(reference_model))
    assert not np.shares_memory(average, peers[0].gradient(average))  # the average is intact


class DtypeSpy(TinyTask):
    """The tiny task, noting the dtype its first layer computes in."""

    def loss(self, model, batch):
        x, y = batch
        hidden = model[0](x)
        self.seen = hidden.dtype
        return torch.nn.functional.mse_loss(model[2](model[1](hidden)).float(), y)


def test_bf16_autocast_computes_in_bf16_and_contributes_a_float32_gradient_close_to_fp32():
    task = DtypeSpy()
    fp32 = LargeBatch(task, task.build_model())
    bf16 = LargeBatch(task, task.build_model(), precision=Precision("bf16", torch.device("cpu")))
    ((x, y),) = batches(6, 1, 16)
    fp32.accumulate((x, y), 16)
    assert task.seen == torch.float32
    bf16.accumulate((x, y), 16)
    assert task.seen == torch.bfloat16
    reference, ours = fp32.take()[0], bf16.take()[0]
    assert ours.dtype == np.float32
    assert np.linalg.norm(ours - reference) < 0.05 * np.linalg.norm(reference)


def test_fp16_contributions_are_unscaled_whatever_each_peers_scale():
    task = DtypeSpy()
    cpu = torch.device("cpu")
    fp32 = LargeBatch(task, task.build_model())
    peers = [LargeBatch(task, task.build_model(), precision=Precision("fp16", cpu)) for _ in "ab"]
    # One peer has backed off after overflows; the other starts at torch's 2^16.
    peers[1].precision.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ((x, y),) = batches(7, 1, 16)
    fp32.accumulate((x, y), 16)
    reference = fp32.take()[0]
    for peer in peers:
        peer.accumulate((x, y), 16)
    assert task.seen == torch.float16
    vectors = [peer.take()[0] for peer in peers]
    for vector in vectors:
        assert np.linalg.norm(vector - reference) < 0.02 * np.linalg.norm(reference)
    assert np.linalg.norm(vectors[0] - vectors[1]) < 0.02 * np.linalg.norm(reference)


def test_fp16_skips_a_micro_batch_whose_gradients_overflow_and_backs_off_the_scale():
    task = TinyTask()
    peer = LargeBatch(task, task.build_model(), precision=Precision("fp16", torch.device("cpu")))
    scaler = peer.precision.scaler
    ((x, y),) = batches(8, 1, 8)
    peer.accumulate((x, y), 8)
    kept = [s.clone() for s in peer.sums]
    scale = scaler.get_scale()
    peer.accumulate((x * 1e4, y), 8)  # overflows fp16 once scaled
    assert peer.samples == 8
    assert all(torch.equal(a, b) for a, b in zip(peer.sums, kept, strict=True))
    assert scaler.get_scale() == scale / 2
    assert all(p.grad is None for p in peer.params)  # apply() owns .grad


def test_fp16_inner_steps_that_overflow_do_not_count_toward_diloco_s_inner_steps():
    task = TinyTask()
    peer = LocalSGD(
        task,
        task.build_model(),
        outer_lr=0.7,
        momentum=0.9,
        inner_steps=2,
        precision=Precision("fp16", torch.device("cpu")),
    )
    ((x, y),) = batches(9, 1, 8)
    before = params(peer.model).clone()
    peer.accumulate((x * 1e4, y), 8)
    assert peer.samples == 0 and torch.equal(params(peer.model), before)
    peer.accumulate((x, y), 8)
    assert peer.samples == 8 and not torch.equal(params(peer.model), before)


def test_gradients_sum_in_grad_and_are_freed_once_taken_unless_a_delayed_step_needs_grad():
    """The default keeps no accumulators beside .grad (a model's worth of memory, plus
    autograd.grad's outputs); a delayed step, which uses .grad while the next step's
    micro-batches accumulate, keeps its own. Both sum the same bits."""
    task = TinyTask()
    work = batches(11, 3, 8)
    plain = LargeBatch(task, task.build_model())
    delayed = LargeBatch(task, task.build_model(), delayed=True)
    assert plain.in_grad and plain.sums == []
    assert not delayed.in_grad and len(delayed.sums) == len(delayed.params)
    for x, y in work:
        plain.accumulate((x, y), 8)
        delayed.accumulate((x, y), 8)
    assert all(p.grad is not None for p in plain.params)
    assert all(p.grad is None for p in delayed.params)
    (vector, samples), (same, _) = plain.take(), delayed.take()
    assert np.array_equal(vector, same) and samples == 24
    assert all(p.grad is None for p in plain.params)  # the vector holds it now
    plain.give_back(vector, samples)
    again, _ = plain.take()
    np.testing.assert_allclose(again, vector, rtol=1e-6)
