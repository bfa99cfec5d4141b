"""What delayed updates cost in quality: steps to the demo's validation target with the gradient
of the current parameters (exact large-batch training) and with delayed updates, where step t's
average is applied while step t+1's micro-batches are computed: the first `stale` fraction of
each step's micro-batches see the parameters before the previous step's update, the rest the
parameters after it (in the trainer that fraction is the averaging's share of a step's time;
the issue measured 11-88 %). One process, the demo's task and batch, the same micro-batches for
every variant of a pair; no network, so the difference is the algorithm's alone.

    .venv/bin/python -m benchmarks.delayed_quality [--pairs 3] [--stale 0.25 0.5 1.0]
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


def steps_to_target(seed: int, *, stale: float | None, max_steps: int) -> int | None:
    """Steps (batches of BATCH) until the validation loss reaches TARGET; `stale` None: exact."""
    task = ByteGPTTask()
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())
    validation = task.validation_batches(MICRO_BATCH, 4)
    data = torch.Generator().manual_seed(seed)
    params = list(model.parameters())
    micro_batches = BATCH // MICRO_BATCH
    pending: list[torch.Tensor] | None = None  # delayed: the last step's gradient, not applied

    def apply(grads: list[torch.Tensor]) -> None:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        optimizer.step()

    for step in range(1, max_steps + 1):
        grads = [torch.zeros_like(p) for p in params]
        for index in range(micro_batches):
            if stale is not None and pending is not None and index == round(stale * micro_batches):
                apply(pending)  # the previous step's average arrives mid-way through this one
                pending = None
            loss = task.loss(model, task.sample_batch(MICRO_BATCH, data))
            for total, grad in zip(grads, torch.autograd.grad(loss, params), strict=True):
                total.add_(grad, alpha=MICRO_BATCH / BATCH)
        if stale is None:
            apply(grads)
        else:
            if pending is not None:  # stale = 1: it arrives after this step's micro-batches
                apply(pending)
            pending = grads
        if step % EVERY == 0:
            with torch.no_grad():
                value = sum(float(task.loss(model, b)) for b in validation) / len(validation)
            if value <= TARGET:
                return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--stale", type=float, nargs="+", default=[0.25, 0.5, 1.0])
    parser.add_argument("--max-steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    variants: list[float | None] = [None, *args.stale]
    results: dict[float | None, list[int | None]] = {v: [] for v in variants}
    started = time.perf_counter()
    for pair in range(args.pairs):
        seed = 100 + pair
        for stale in variants:
            steps = steps_to_target(seed, stale=stale, max_steps=args.max_steps)
            results[stale].append(steps)
            name = "exact" if stale is None else f"delayed, {stale:.0%} stale"
            print(f"seed {seed}: {name} -> {steps}", flush=True)
    for stale, steps in results.items():
        reached = [s for s in steps if s is not None]
        name = "exact" if stale is None else f"delayed, {stale:.0%} of micro-batches stale"
        mean = statistics.fmean(reached) if reached else float("nan")
        print(f"{name}: steps to {TARGET} = {steps}; mean {mean:.1f}")
    print(f"{time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
