"""What delayed updates cost in quality: steps to the demo's validation target with the gradient
of the current parameters (exact large-batch training) and with the gradient of the previous
step's parameters (`training.delayed_updates`: step t's average is applied while step t+1's
micro-batches are computed, so every gradient is one step stale). One process, the demo's
task and batch, the same micro-batches for both in each pair; no network, so the difference is
the algorithm's alone.

    .venv/bin/python -m benchmarks.delayed_quality [--pairs 3] [--max-steps 160]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from peer.training.task import ByteGPTTask

BATCH = 256  # configs/demo.toml: task.target_batch
MICRO_BATCH = 32
TARGET = 2.9  # configs/demo.toml: training.target_validation_loss
EVERY = 5  # configs/demo.toml: training.validation_interval


def steps_to_target(seed: int, *, delayed: bool, max_steps: int) -> int | None:
    task = ByteGPTTask()
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())
    validation = task.validation_batches(MICRO_BATCH, 4)
    data = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    stale: list[torch.Tensor] | None = None
    for step in range(1, max_steps + 1):
        grads = [torch.zeros_like(p) for p in params]
        for _ in range(BATCH // MICRO_BATCH):
            loss = task.loss(model, task.sample_batch(MICRO_BATCH, data))
            for total, grad in zip(grads, torch.autograd.grad(loss, params), strict=True):
                total.add_(grad, alpha=MICRO_BATCH / BATCH)
        if delayed:  # apply the previous step's gradient; this one waits for the next step
            grads, stale = stale, grads
            if grads is None:
                continue  # the first step only computes (as the first delayed averaging runs)
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        optimizer.step()
        if step % EVERY == 0:
            with torch.no_grad():
                value = sum(float(task.loss(model, b)) for b in validation) / len(validation)
            if value <= TARGET:
                return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=160)
    args = parser.parse_args()
    torch.set_num_threads(2)
    results: dict[bool, list[int | None]] = {False: [], True: []}
    started = time.perf_counter()
    for pair in range(args.pairs):
        seed = 100 + pair
        for delayed in (False, True):
            steps = steps_to_target(seed, delayed=delayed, max_steps=args.max_steps)
            results[delayed].append(steps)
            print(f"seed {seed}: {'delayed' if delayed else 'exact  '} -> {steps}", flush=True)
    for delayed, steps in results.items():
        reached = [s for s in steps if s is not None]
        print(
            f"{'delayed updates' if delayed else 'exact (fresh)  '}: steps to {TARGET} = {steps}; "
            f"mean {statistics.fmean(reached) if reached else float('nan'):.1f}"
        )
    ratios = [
        d / e for e, d in zip(results[False], results[True], strict=True) if e is not None and d
    ]
    if ratios:
        print(f"delayed / exact, per pair: {[round(r, 2) for r in ratios]}")
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
