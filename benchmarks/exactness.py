"""Exactness at the sizes users run: N trainers (real DHT, matchmaking, data plane and state
download on loopback, in one process) train the tiny task with DeDLOC in groups of 4; their
micro-batches are recorded, and one process replays the same global batches. Per N: how far
every peer's parameters and Adam moments are from the replay, whether the peers are
bit-identical, the applied global batch against the target, and the work lost (failed
averagings, downloads).

    .venv/bin/python -m benchmarks.exactness [--sizes 2 3 5 8 16] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trio

from benchmarks.common import quiet_logs
from peer.training import state as states
from peer.training.task import TinyTask
from tests.test_training_collab import Recorder, collaboration, make_config

TARGET = 64  # tests/test_training_collab.py: tiny task, micro-batch 8


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def moments(optimizer: torch.optim.Optimizer, params) -> tuple[torch.Tensor, torch.Tensor]:
    return (
        flat(optimizer.state[p]["exp_avg"] for p in params),
        flat(optimizer.state[p]["exp_avg_sq"] for p in params),
    )


async def run(count: int, steps: int, workdir: Path) -> dict:
    config = make_config(workdir, max_steps=steps, gather_window=max(0.6, 0.25 * count))
    recorder = Recorder(TinyTask())  # the task as users get it: AdamW eps 1e-8
    started = time.perf_counter()
    with trio.fail_after(120 + 30 * count):
        async with collaboration(count, config, recorder=recorder) as (s, trainers):
            async with trio.open_nursery() as nursery:
                for trainer in trainers:
                    nursery.start_soon(trainer.run)
            s.nursery.cancel_scope.cancel()
    seconds = time.perf_counter() - started
    replay = recorder.replay(steps, range(count))
    replay_optimizer = replay_state(recorder, steps, count)
    worst_params = worst_m = worst_v = 0.0
    for trainer in trainers:
        params = list(trainer.worker.model.parameters())
        worst_params = max(worst_params, relative(flat(params), flat(replay.parameters())))
        m, v = moments(trainer.worker.strategy.optimizers()["optimizer"], params)
        rm, rv = replay_optimizer
        worst_m, worst_v = max(worst_m, relative(m, rm)), max(worst_v, relative(v, rv))
    batches = [b for t in trainers for b in t.status().global_batches]
    return {
        "count": count,
        "seconds": seconds,
        "steps": sorted({t.step for t in trainers}),
        "digests": len({states.parameters_digest(t.model) for t in trainers}),
        "params": worst_params,
        "exp_avg": worst_m,
        "exp_avg_sq": worst_v,
        "downloads": sum(t.status().downloads for t in trainers),
        "failed": sum(t.status().failures["averaging_incomplete"] for t in trainers),
        "batches": batches,
        "computed": [
            sum(len(recorder.used[(i, step)]) * 8 for i in range(count)) for step in range(steps)
        ],
    }


def replay_state(recorder: Recorder, steps: int, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The replay's Adam moments (the replay again, keeping its optimizer)."""
    task = recorder.task
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())
    for step in range(steps):
        batches = [b for i in range(count) for b in recorder.used[(i, step)]]
        x = torch.cat([x for x, _ in batches])
        y = torch.cat([y for _, y in batches])
        optimizer.zero_grad()
        task.loss(model, (x, y)).backward()
        optimizer.step()
    return moments(optimizer, list(model.parameters()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 3, 5, 8, 16])
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    quiet_logs()
    torch.set_num_threads(1)
    print(f"tiny task, target batch {TARGET}, micro-batch 8, groups of 4, {args.steps} steps")
    for count in args.sizes:
        workdir = Path(tempfile.mkdtemp(prefix=f"peertrain-exact-{count}-"))
        r = trio.run(run, count, args.steps, workdir)
        batches = r["batches"]
        print(
            f"N={count:2d}: steps {r['steps']}, {r['digests']} digest(s); max relative error "
            f"against one process: parameters {r['params']:.1e}, exp_avg {r['exp_avg']:.1e}, "
            f"exp_avg_sq {r['exp_avg_sq']:.1e}; failed averagings {r['failed']}, downloads "
            f"{r['downloads']}; global batch min/mean/max {min(batches):.0f}/"
            f"{statistics.fmean(batches):.1f}/{max(batches):.0f} (computed per step "
            f"{r['computed']}); {r['seconds']:.0f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
