"""Simulate collaborations of N volunteers on trio's virtual clock and print their figures.

    .venv/bin/python -m simulation --peers 100 300 [--minutes 30] [--warmup 3] [--churn 0.1]
        [--nat 0.5 --symmetric 0.33] [--gatherings]

Every peer runs the real DHT, matchmaking, Moshpit plan and step policy over a simulated
network (`simulation.network`); see `simulation/collaboration.py` for what is simulated.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from simulation.collaboration import Scenario, run_collaboration
from simulation.report import gatherings, rows, summarize


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m simulation", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[100])
    parser.add_argument("--minutes", type=float, default=30.0, help="virtual minutes measured")
    parser.add_argument("--warmup", type=float, default=3.0, help="virtual minutes first")
    parser.add_argument("--churn", type=float, default=0.10, help="share of peers leaving per hour")
    parser.add_argument("--model-mb", type=float, default=4 * 17.7, help="gradient MB on the wire")
    parser.add_argument("--target-batch", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--nat", type=float, default=0.0, help="share of volunteers behind NAT")
    parser.add_argument(
        "--symmetric", type=float, default=0.0, help="share of those behind a symmetric NAT"
    )
    parser.add_argument(
        "--partial-from",
        type=int,
        default=Scenario(peers=1).partial_from,
        help="averaging.partial_from: plans of this many peers take partial averages",
    )
    parser.add_argument(
        "--group-size",
        type=int,
        default=Scenario(peers=1).group_size,
        help="averaging.group_size: Moshpit's m (at least the peers: one group)",
    )
    parser.add_argument(
        "--gatherings",
        action="store_true",
        help="also print each gathering: its calls, the averages they ended on, its failures",
    )
    parser.add_argument("--log-level", default="error")
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":
        # Sets of peer ids iterate in hash order: the same order in every run of a seed
        # (simulation.determinism).
        os.execve(
            sys.executable,
            [sys.executable, "-m", "simulation", *sys.argv[1:]],
            {**os.environ, "PYTHONHASHSEED": "0"},
        )
    logging.basicConfig(level=args.log_level.upper(), format="%(name)s: %(message)s")
    violated = False
    for peers in args.peers:
        scenario = Scenario(
            peers=peers,
            minutes=args.minutes,
            warmup_minutes=args.warmup,
            churn_per_hour=args.churn,
            model_bytes=args.model_mb * 1e6,
            target_batch=args.target_batch,
            seed=args.seed,
            nat_share=args.nat,
            symmetric_share=args.symmetric,
            partial_from=args.partial_from,
            group_size=args.group_size,
        )
        report = run_collaboration(scenario, progress=sys.stderr)
        summary = summarize(report)
        violated = violated or bool(report.violations)
        width = max(len(name) for name, _ in rows(summary))
        print(f"\n{peers} peers")
        for name, value in rows(summary):
            print(f"  {name:<{width}}  {value}")
        if args.gatherings:
            print("  gatherings:")
            for line in gatherings(report.attempts):
                print(f"    {line}")
        for violation in report.violations[:10]:
            print(f"  SAFETY VIOLATION: {violation}")
    if violated:
        sys.exit("the simulation broke safety: two peers took one step as different states")


if __name__ == "__main__":
    main()
