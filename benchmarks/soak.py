"""Soak: a local collaboration trains the default task for a long time with churn, while the
memory (RSS) and open file descriptors of every daemon are sampled each minute.

A backbone and 4 peers (`configs/demo.toml`, training on, no stop target). Peers 0 and 1 and the
backbone run the whole time; every `--churn-every` seconds one of peers 2 and 3 (in turn) is
SIGKILLed and restarted 5 s later with its identity and checkpoint folder, so the long-lived
daemons keep seeing peers leave and join, averaging groups fail and re-form, and states get
downloaded. A restarted peer that exits on its own is reported, started again, and fails the
run. The verdict looks at each long-lived daemon's samples after the warm-up (`--warmup`): the
peak RSS of the last third may exceed that of the first third by at most `--rss-bound` MiB,
and likewise open descriptors by `--fd-bound`; it prints the least-squares trend too. (A peer's
RSS is a sawtooth of a few hundred MiB, so first-against-last measures the phase, not a leak;
hivemind's averager was reported to leak 16 GB in 3 hours.)

    .venv/bin/python -m benchmarks.soak [--minutes 30] [--churn-every 300] [--out soak.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import psutil

from tests.collab_processes import Collaboration, Proc, kill

ROOT = Path(__file__).resolve().parent.parent
PEERS = 4
STABLE = ("backbone", "peer0", "peer1")


def sample(proc: Proc) -> dict[str, float] | None:
    """RSS (MiB) and open descriptors of a running daemon; None if it is gone."""
    try:
        process = psutil.Process(proc.popen.pid)
        return {"rss_mib": process.memory_info().rss / 2**20, "fds": process.num_fds()}
    except psutil.Error:
        return None


def growth(series: list[float]) -> tuple[float, float]:
    """(the last third's peak minus the first third's, the least-squares slope per sample). A
    training peer's RSS is a sawtooth (buffers of each step, the allocator's caching): its
    first and last samples differ by the phase they caught; a leak lifts the peaks."""
    third = max(1, len(series) // 3)
    rise = max(series[-third:]) - max(series[:third])
    n = len(series)
    mean_x, mean_y = (n - 1) / 2, sum(series) / n
    spread = sum((x - mean_x) ** 2 for x in range(n)) or 1.0
    slope = sum((x - mean_x) * (y - mean_y) for x, y in enumerate(series)) / spread
    return rise, slope


def judge(samples: list[dict], warmup: float, rss_bound: float, fd_bound: int) -> dict[str, str]:
    """Print and return each long-lived daemon's verdict after the warm-up (samples a minute
    apart): RSS peaks may rise by `rss_bound` MiB, descriptors by `fd_bound`."""
    warm = [s for s in samples if s["minute"] >= warmup]
    verdicts = {}
    for name in STABLE:
        if any(s[name] is None for s in warm):
            verdicts[name] = "died"
            continue
        rss = [s[name]["rss_mib"] for s in warm]
        fds = [s[name]["fds"] for s in warm]
        rise, slope = growth(rss)
        fd_rise, _ = growth(fds)
        ok = rise <= rss_bound and fd_rise <= fd_bound
        verdicts[name] = "ok" if ok else "GREW"
        print(
            f"{name:9s} RSS {min(rss):.0f}-{max(rss):.0f} MiB, first to last {rss[0]:.0f} -> "
            f"{rss[-1]:.0f}, peaks of the first and last thirds {rise:+.1f} MiB, trend "
            f"{slope:+.2f} MiB/min; fds {min(fds)}-{max(fds)} ({fd_rise:+.0f}): {verdicts[name]}"
        )
    return verdicts


def global_step(collab: Collaboration) -> int:
    return max(collab.global_steps, default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--churn-every", type=float, default=300.0)
    parser.add_argument("--warmup", type=float, default=5.0, help="minutes before the baseline")
    parser.add_argument("--rss-bound", type=float, default=64.0, help="MiB of growth allowed")
    parser.add_argument("--fd-bound", type=int, default=16)
    parser.add_argument("--out", type=Path, default=None, help="write the samples as JSON")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="peertrain-soak-"))
    collab = Collaboration(
        workdir,
        {
            "PEERTRAIN_CONFIG": str(ROOT / "configs" / "demo.toml"),
            "PEERTRAIN_LOG_FORMAT": "json",
            "PEERTRAIN_LOG_LEVEL": "warning",
            "PEERTRAIN_TRAINING_TARGET_VALIDATION_LOSS": "0",
            "PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": "60",
        },
    )
    samples: list[dict] = []
    kills = 0
    exits: list[str] = []  # churned peers that exited on their own after a restart
    try:
        collab.start_backbone()
        peers = {f"peer{i}": collab.start_peer(i) for i in range(PEERS)}
        collab.watch_global_step()
        started = time.monotonic()
        next_sample, next_churn, victim = 0.0, args.churn_every, 2
        print(f"soak: {args.minutes:g} min, churn every {args.churn_every:g} s, logs in {workdir}")
        while (elapsed := time.monotonic() - started) < args.minutes * 60:
            if elapsed >= next_churn:
                name = f"peer{victim}"
                kill(peers[name])
                kills += 1
                time.sleep(5.0)
                peers[name] = collab.start_peer(victim)  # same identity, same checkpoints
                victim = 5 - victim  # 2, 3, 2, ...
                next_churn += args.churn_every
            for index in (2, 3):  # a restarted peer that gave up is noted and started again
                name = f"peer{index}"
                if peers[name].popen.poll() is not None:
                    lines = peers[name].log.read_text(errors="replace").strip().splitlines()
                    exits.append(
                        f"{elapsed / 60:.1f} min {name}: {lines[-1][:200] if lines else ''}"
                    )
                    print(f"{name} exited ({exits[-1]}); starting it again")
                    peers[name] = collab.start_peer(index)
            if elapsed >= next_sample:
                # The step as a status client last read it (it may miss reads under load).
                row = {"minute": round(elapsed / 60, 1), "global_step": global_step(collab)}
                for name, proc in [("backbone", collab.procs[0]), *peers.items()]:
                    row[name] = sample(proc)
                samples.append(row)
                cells = [
                    f"{n} {r['rss_mib']:.0f} MiB/{r['fds']} fd" if r else f"{n} -"
                    for n, r in row.items()
                    if isinstance(r, dict) or r is None
                ]
                print(
                    f"{row['minute']:5.1f} min  step {row['global_step']:5d}  " + "  ".join(cells)
                )
                next_sample += 60.0
            time.sleep(1.0)
        exited = {name: collab_proc.popen.poll() for name, collab_proc in peers.items()}
    finally:
        collab.close()

    verdicts = judge(samples, args.warmup, args.rss_bound, args.fd_bound)
    steps = [s["global_step"] for s in samples]
    print(
        f"global step {steps[0]} -> {steps[-1]} over {samples[-1]['minute']:.1f} min, "
        f"{kills} SIGKILLs; peers still running at the end: "
        f"{sum(code is None for code in exited.values())}/{PEERS}; restarted peers that exited "
        f"on their own: {len(exits)}"
    )
    for line in exits:
        print(f"  {line}")
    if args.out:
        args.out.write_text(
            json.dumps({"samples": samples, "verdicts": verdicts, "exits": exits}, indent=1)
        )
    stable_alive = all(exited[name] is None for name in STABLE if name in exited)
    ok = all(v == "ok" for v in verdicts.values()) and stable_alive and not exits
    print("PASS" if ok else "FAIL")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
