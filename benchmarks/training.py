"""Training utilisation and bytes per token: 4 `peer join` processes and a backbone on loopback,
DiLoCo (H inner steps) and DeDLOC with delayed updates, on the default task.

Utilisation = time spent computing micro-batches / wall time, per peer, from the start of
training to its end (each peer logs its figures when it reaches max_steps). The baseline, measured
in the same run, is one process training alone with the same settings: its samples/s is the
throughput the collaboration's 4 processes share the machine's cores with.

    .venv/bin/python -m benchmarks.training [--steps-diloco 6] [--steps-dedloc 12]
        [--modes diloco dedloc]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from peer.training.task import ByteGPTTask
from tests.collab_processes import Collaboration, wait_all

PEERS = 4
MICRO_BATCH = 16


def single_process_rate(seconds: float = 8.0) -> float:
    """Samples/s of plain local training on one thread (the same micro-batches)."""
    torch.set_num_threads(1)
    task = ByteGPTTask()
    model = task.build_model()
    optimizer = task.make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(0)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        loss = task.loss(model, task.sample_batch(MICRO_BATCH, generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        done += MICRO_BATCH
    return done / (time.perf_counter() - started)


def run(name: str, env: dict[str, str], timeout: float) -> list[dict]:
    workdir = Path(tempfile.mkdtemp(prefix=f"peertrain-bench-{name}-"))
    collab = Collaboration(
        workdir,
        {
            "PEERTRAIN_CONFIG": str(
                Path(__file__).resolve().parent.parent / "configs" / "demo.toml"
            ),
            "PEERTRAIN_LOG_FORMAT": "json",
            "PEERTRAIN_LOG_LEVEL": "info",
            "PEERTRAIN_TASK_MICRO_BATCH": str(MICRO_BATCH),
            "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "0",
            "PEERTRAIN_TRAINING_TARGET_VALIDATION_LOSS": "0",
            **env,
        },
    )
    try:
        collab.start_backbone()
        peers = [collab.start_peer(i) for i in range(PEERS)]
        wait_all(peers, timeout=timeout)
        figures = [p.finished() for p in peers]
        missing = [p.name for p, f in zip(peers, figures, strict=True) if f is None]
        if missing:
            raise SystemExit(f"{name}: {missing} logged no final figures; see {workdir}")
        return figures  # type: ignore[return-value]
    finally:
        collab.close()


def report(name: str, figures: list[dict], baseline: float) -> None:
    utilisation = [f["utilisation"] for f in figures]
    steady = [f["utilisation_after_first_step"] for f in figures]
    samples = sum(f["samples"] for f in figures)
    wall = max(f["wall_s"] for f in figures)
    block = ByteGPTTask().shape.block
    averaged = statistics.mean(f["averaged_bytes"] for f in figures)
    per_token = averaged / (statistics.mean(f["samples"] for f in figures) * block)
    print(
        f"{name:>21}: utilisation per peer {', '.join(f'{u:.1%}' for u in utilisation)} "
        f"(mean {statistics.mean(utilisation):.1%}); after the first step "
        f"{', '.join(f'{u:.1%}' for u in steady)} (mean {statistics.mean(steady):.1%}); "
        f"{samples / wall:.0f} samples/s together "
        f"= {samples / wall / baseline:.2f}x one process alone; "
        f"steps {figures[0]['step']}; {per_token:.1f} bytes averaged per token per peer"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-diloco", type=int, default=6)
    parser.add_argument("--steps-dedloc", type=int, default=12)
    parser.add_argument("--inner-steps", type=int, default=50)
    parser.add_argument(
        "--modes", nargs="+", choices=["diloco", "dedloc"], default=["diloco", "dedloc"]
    )
    args = parser.parse_args()
    baseline = single_process_rate()
    print(f"baseline: one process, one thread: {baseline:.0f} samples/s")
    for codec in ("none", "fp16") if "diloco" in args.modes else ():
        diloco = run(
            "diloco",
            {
                "PEERTRAIN_TRAINING_MODE": "diloco",
                "PEERTRAIN_TRAINING_INNER_STEPS": str(args.inner_steps),
                "PEERTRAIN_TRAINING_MAX_STEPS": str(args.steps_diloco),
                "PEERTRAIN_AVERAGING_CODEC": codec,
            },
            timeout=900,
        )
        report(f"diloco H={args.inner_steps} {codec}", diloco, baseline)
    if "dedloc" not in args.modes:
        return
    dedloc = run(
        "dedloc",
        {
            "PEERTRAIN_TRAINING_MODE": "dedloc",
            "PEERTRAIN_TRAINING_DELAYED_UPDATES": "true",
            "PEERTRAIN_TASK_TARGET_BATCH": "512",
            "PEERTRAIN_TRAINING_MAX_STEPS": str(args.steps_dedloc),
        },
        timeout=900,
    )
    report("dedloc delayed none", dedloc, baseline)


if __name__ == "__main__":
    main()
