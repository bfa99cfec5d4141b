"""DiLoCo's validation loss next to single-process AdamW on the same tokens, for a choice of outer
optimizer, H and micro-batch: the algorithm alone (4 `LocalSGD` workers in one process, exact
averaging, no network), on the default task.

The baseline takes one AdamW step per inner step on the 4 workers' micro-batches together, so
both have seen the same number of samples at every outer step.

    .venv/bin/python -m benchmarks.diloco_quality --inner-steps 20 --outer-steps 10 \
        --micro-batch 32 --outer-lr 1.0 --outer-momentum 0
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from peer.training.strategies import LocalSGD
from peer.training.task import ByteGPTTask

WORKERS = 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--inner-steps", type=int, default=20)
    parser.add_argument("--outer-steps", type=int, default=10)
    parser.add_argument("--micro-batch", type=int, default=32)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--outer-momentum", type=float, default=0.9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    task = ByteGPTTask()
    validation = task.validation_batches(32, 8)

    def validation_loss(model: torch.nn.Module) -> float:
        with torch.no_grad():
            return sum(float(task.loss(model, b)) for b in validation) / len(validation)

    baseline = task.build_model()
    optimizer = task.make_optimizer(baseline.parameters())
    baseline_data = torch.Generator().manual_seed(5)
    workers = [
        LocalSGD(
            task,
            task.build_model(),
            outer_lr=args.outer_lr,
            momentum=args.outer_momentum,
            inner_steps=args.inner_steps,
        )
        for _ in range(WORKERS)
    ]
    data = [torch.Generator().manual_seed(1000 + i) for i in range(WORKERS)]
    started = time.perf_counter()
    for outer in range(1, args.outer_steps + 1):
        for worker, generator in zip(workers, data, strict=True):
            for _ in range(args.inner_steps):
                worker.accumulate(task.sample_batch(args.micro_batch, generator), args.micro_batch)
        average = np.mean([worker.take()[0] for worker in workers], axis=0)
        for worker in workers:
            worker.apply(average)
        for _ in range(args.inner_steps):
            batch = task.sample_batch(WORKERS * args.micro_batch, baseline_data)
            loss = task.loss(baseline, batch)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        ours, theirs = validation_loss(workers[0].model), validation_loss(baseline)
        print(
            f"outer step {outer}: DiLoCo {ours:.4f}, AdamW {theirs:.4f}, ratio {ours / theirs:.4f}",
            flush=True,
        )
    print(
        f"H={args.inner_steps}, micro-batch {args.micro_batch}, outer lr {args.outer_lr}, "
        f"momentum {args.outer_momentum}: {time.perf_counter() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
