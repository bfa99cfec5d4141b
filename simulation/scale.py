"""Regenerate docs/scale.md's figures from the code as it is, with one command:

    .venv/bin/python -m simulation.scale [--peers 100 300 1000] [--minutes 10] [--jobs 2]
        [--seed 0] [--seeds 1]

`--minutes` is one length for every column, or one per `--peers` value in its order
(`--peers 100 300 1000 --minutes 8 8 2`: 1,000 peers took 40 s of wall time a virtual
second, 300 peers 4.6 s).

It runs the scale matrix of issue 46 (`MATRIX`: 100 and 300 peers at 50 %/hour churn, 1,000
at 10 %/hour; a 4 MB and DeDLOC's 70.8 MB gradient; half the peers behind NAT, a third of
those symmetric; DeDLOC's volunteer links, the simulator's defaults), each run in a process of
its own, and writes a table for each number of peers between that number's markers in
docs/scale.md (`markers`), headed by the commit it ran at (with "+changes" where the simulated
code differs from it), the date, the command and each run's wall time; a command for some
sizes leaves the others' tables as they are (1,000 peers run for hours, 100 for minutes). With
`--seeds N`, rows of N seeds' steps, rounds and safety violations side by side (the columns
are the first seed's). A run that breaks safety
(two states of one step) is printed and makes the command exit non-zero; the table is written
all the same.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from simulation.collaboration import Scenario, run_collaboration
from simulation.report import Summary, rows, summarize

DOC = Path(__file__).resolve().parent.parent / "docs" / "scale.md"


def markers(peers: int) -> tuple[str, str]:
    """The lines around the table of `peers` peers in docs/scale.md."""
    return (
        f"<!-- simulation.scale, {peers} peers: begin (generated, do not edit) -->",
        f"<!-- simulation.scale, {peers} peers: end -->",
    )


ALBERT_MB = 4 * 17.7
"""ALBERT-large's gradient in float32, what DeDLOC's volunteers averaged."""


@dataclass(frozen=True)
class Column:
    peers: int
    churn_per_hour: float
    model_mb: float

    @property
    def title(self) -> str:
        return f"{self.peers:,} peers, {self.churn_per_hour:.0%}/h, {self.model_mb:g} MB"


MATRIX = [
    Column(peers, churn, mb)
    for mb in (4.0, ALBERT_MB)
    for peers, churn in ((100, 0.5), (300, 0.5), (1000, 0.1))
]
NAT_SHARE = 0.5
SYMMETRIC_SHARE = 1 / 3


def scenario(column: Column, *, minutes: float, warmup: float, seed: int) -> Scenario:
    return Scenario(
        peers=column.peers,
        minutes=minutes,
        warmup_minutes=warmup,
        churn_per_hour=column.churn_per_hour,
        model_bytes=column.model_mb * 1e6,
        seed=seed,
        nat_share=NAT_SHARE,
        symmetric_share=SYMMETRIC_SHARE,
    )


def _run(job: Scenario) -> tuple[Summary, list[str]]:
    report = run_collaboration(job, progress=sys.stderr)
    return summarize(report), [str(v) for v in report.violations[:5]]


def minutes_by_peers(peers: list[int], minutes: list[float]) -> dict[int, float]:
    """`--minutes`: one length for every column, or one per `--peers` value (in its order)."""
    if len(minutes) == 1:
        return dict.fromkeys(peers, minutes[0])
    if len(minutes) != len(peers):
        raise ValueError(
            f"--minutes {' '.join(f'{m:g}' for m in minutes)}: give one length for every "
            f"column, or one per --peers value ({len(peers)})"
        )
    return dict(zip(peers, minutes, strict=True))


def lengths(minutes: dict[int, float]) -> str:
    """The header's words for `minutes_by_peers`."""
    if len(set(minutes.values())) == 1:
        return f"{next(iter(minutes.values())):g} virtual minutes"
    return ", ".join(f"{m:g} virtual minutes at {p:,} peers" for p, m in minutes.items())


def commit() -> str:
    """The commit the run is at; "+changes" where the code it simulates is not committed."""
    root = DOC.parent.parent
    head = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "peer", "simulation"],
        cwd=root,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return f"{head or 'unknown'}{'+changes' if dirty else ''}"


def table(
    columns: list[Column], summaries: list[Summary], seeds: list[list[Summary]] | None = None
) -> list[str]:
    """A column per run (`summaries`); with `seeds` (each column's runs at every seed, the
    first the column's own), rows of their figures side by side: one seed's dynamics are
    chaotic (a change moves every later event), several show what a figure's spread is."""
    names = [name for name, _ in rows(summaries[0])]
    lines = [
        "| | " + " | ".join(c.title for c in columns) + " |",
        "| --- |" + " --- |" * len(columns),
    ]
    by_column = [dict(rows(s)) for s in summaries]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(v.get(name, "") for v in by_column) + " |")
    if seeds and len(seeds[0]) > 1:
        for name, cell in SEED_ROWS:
            cells = [" / ".join(cell(s) for s in runs) for runs in seeds]
            lines.append(f"| {name}, seed by seed | " + " | ".join(cells) + " |")
        pooled = [_pooled_rounds(runs) for runs in seeds]
        lines.append("| rounds that yield a step, all seeds | " + " | ".join(pooled) + " |")
    return lines


SEED_ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("steps", lambda s: str(s.steps)),
    ("rounds that yield a step", lambda s: f"{s.agreed_rounds:.0%} of {s.rounds}"),
    ("safety violations", lambda s: str(s.safety_violations)),
]


def _pooled_rounds(runs: list[Summary]) -> str:
    rounds = sum(s.rounds for s in runs)
    yielded = sum(round(s.agreed_rounds * s.rounds) for s in runs)
    return f"{yielded / rounds:.1%} of {rounds}" if rounds else "-"


def write(doc: Path, section: list[str], peers: int) -> None:
    """`section` between the markers of `peers` in `doc` (appended, with the markers, if it has
    none)."""
    text = doc.read_text() if doc.exists() else ""
    begin, end = markers(peers)
    block = "\n".join([begin, *section, end])
    if begin in text and end in text:
        before, rest = text.split(begin, 1)
        _, after = rest.split(end, 1)
        text = before + block + after
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    doc.write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m simulation.scale", description=__doc__)
    parser.add_argument("--peers", type=int, nargs="+", default=[100, 300, 1000])
    parser.add_argument("--models", type=float, nargs="+", default=[4.0, ALBERT_MB])
    parser.add_argument(
        "--minutes", type=float, nargs="+", default=[10.0],
        help="virtual minutes: one for every column, or one per --peers value",
    )  # fmt: skip
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--seeds", type=int, default=1, help="runs per column, at seeds --seed, --seed + 1, ..."
    )
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 1)))
    parser.add_argument("--doc", type=Path, default=DOC)
    args = parser.parse_args()
    if os.environ.get("PYTHONHASHSEED") != "0":  # the same seed, the same run (determinism)
        os.execve(
            sys.executable,
            [sys.executable, "-m", "simulation.scale", *sys.argv[1:]],
            {**os.environ, "PYTHONHASHSEED": "0"},
        )
    try:
        minutes = minutes_by_peers(args.peers, args.minutes)
    except ValueError as error:
        sys.exit(str(error))
    columns = [c for c in MATRIX if c.peers in args.peers and c.model_mb in args.models]
    if not columns:
        sys.exit(f"no column of the matrix has --peers {args.peers} and --models {args.models}")
    at, started = commit(), datetime.datetime.now(datetime.UTC)
    if args.seeds < 1:
        sys.exit(f"--seeds {args.seeds}: give 1 or more runs per column")
    seeds = list(range(args.seed, args.seed + args.seeds))
    jobs = [
        scenario(c, minutes=minutes[c.peers], warmup=args.warmup, seed=seed)
        for c in columns
        for seed in seeds
    ]
    context = multiprocessing.get_context("fork")
    # The largest first, so that the last to start is a short one (its worker would else run
    # a 300-peer column alone while the other idles).
    order = sorted(range(len(jobs)), key=lambda i: -jobs[i].peers)
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=context) as pool:
        done = dict(zip(order, pool.map(_run, [jobs[i] for i in order]), strict=True))
    results = [done[i] for i in range(len(jobs))]
    by_column = [results[i : i + len(seeds)] for i in range(0, len(results), len(seeds))]
    summaries = [runs[0][0] for runs in by_column]
    command = "python -m simulation.scale " + " ".join(sys.argv[1:])
    seeded = f"seed {args.seed}" + (
        f"; seeds {seeds[0]}-{seeds[-1]} in the last rows" if len(seeds) > 1 else ""
    )
    for peers in dict.fromkeys(c.peers for c in columns):
        mine = [i for i, c in enumerate(columns) if c.peers == peers]
        section = [
            f"{started:%Y-%m-%d}, at {at}: `{command.strip()}` ({seeded}; "
            f"{lengths({peers: minutes[peers]})} measured after {args.warmup:g} of warm-up; "
            f"{NAT_SHARE:.0%} of the peers behind NAT, {SYMMETRIC_SHARE:.0%} of those "
            f"symmetric; {args.jobs} run{'s' if args.jobs != 1 else ''} at a time on "
            f"{os.cpu_count()} cores).",
            "",
            *table(
                [columns[i] for i in mine],
                [summaries[i] for i in mine],
                [[s for s, _ in by_column[i]] for i in mine],
            ),
        ]
        write(args.doc, section, peers)
        print("\n".join(section))
    broken = [
        (c, v)
        for c, runs in zip(columns, by_column, strict=True)
        for _, violations in runs
        for v in violations
    ]
    for column, violation in broken:
        print(f"SAFETY VIOLATION ({column.title}): {violation}")
    if broken:
        sys.exit("the simulation broke safety: two peers took one step as different states")


if __name__ == "__main__":
    main()
