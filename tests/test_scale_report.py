"""`python -m simulation.scale`: the figures of docs/scale.md written from runs of the code as
it is, between their markers, under the commit they ran at."""

from __future__ import annotations

import concurrent.futures
import dataclasses
from pathlib import Path

import pytest

from simulation import scale
from simulation.scale import MATRIX, Column, markers, table, write
from tests.test_simulation import small


def test_the_matrix_is_the_issues_100_300_and_1000_peers_at_their_churn_for_both_models():
    assert {(c.peers, c.churn_per_hour) for c in MATRIX} == {(100, 0.5), (300, 0.5), (1000, 0.1)}
    assert {c.model_mb for c in MATRIX} == {4.0, scale.ALBERT_MB}
    job = scale.scenario(MATRIX[0], minutes=10, warmup=3, seed=0)
    assert (job.nat_share, job.symmetric_share) == (0.5, 1 / 3)


def test_minutes_are_one_length_for_every_column_or_one_per_peer_count():
    assert scale.minutes_by_peers([100, 300], [8.0]) == {100: 8.0, 300: 8.0}
    per_size = scale.minutes_by_peers([100, 300, 1000], [8.0, 8.0, 2.0])
    assert per_size == {100: 8.0, 300: 8.0, 1000: 2.0}
    assert scale.lengths(per_size) == (
        "8 virtual minutes at 100 peers, 8 virtual minutes at 300 peers, "
        "2 virtual minutes at 1,000 peers"
    )
    assert scale.lengths({100: 8.0, 300: 8.0}) == "8 virtual minutes"
    with pytest.raises(ValueError, match="one per --peers value"):
        scale.minutes_by_peers([100, 300, 1000], [8.0, 2.0])


def test_the_table_replaces_only_what_is_between_its_markers(tmp_path: Path):
    doc = tmp_path / "scale.md"
    doc.write_text("# Scale\n\nprose before\n")
    write(doc, ["first"], 100)
    begin, end = markers(100)
    assert doc.read_text() == f"# Scale\n\nprose before\n\n{begin}\nfirst\n{end}\n"
    doc.write_text(doc.read_text() + "\nprose after\n")
    write(doc, ["second", "| a |"], 100)
    assert doc.read_text() == (
        f"# Scale\n\nprose before\n\n{begin}\nsecond\n| a |\n{end}\n\nprose after\n"
    )
    write(doc, ["thousand"], 1000)  # another size's table: after, this one untouched
    other, other_end = markers(1000)
    assert doc.read_text().endswith(f"prose after\n\n{other}\nthousand\n{other_end}\n")
    assert f"{begin}\nsecond\n| a |\n{end}" in doc.read_text()


def test_a_runs_figures_become_a_column_of_the_table():
    summary, violations = scale._run(small(peers=3, minutes=0.5, churn_per_hour=0, seed=2))
    assert violations == []
    column = Column(3, 0.0, 4.0)
    lines = table([column, column], [summary, summary])
    assert lines[0] == f"| | {column.title} | {column.title} |"
    steps = next(line for line in lines if line.startswith("| steps (per hour / ideal)"))
    assert steps.count(f"{summary.steps} (") == 2
    assert any(line.startswith("| safety violations") and "| 0 | 0 |" in line for line in lines)


def test_runs_at_several_seeds_show_their_figures_side_by_side_and_pooled():
    summary, _ = scale._run(small(peers=3, minutes=0.5, churn_per_hour=0, seed=2))
    column = Column(3, 0.0, 4.0)
    failing = dataclasses.replace(summary, rounds=3, agreed_rounds=1 / 3, safety_violations=1)
    lines = table([column], [summary], [[summary, failing]])
    single = table([column], [summary], [[summary]])
    assert lines[: len(single)] == single  # the columns are the first seed's
    by_name = dict(line.strip("| ").split(" | ") for line in lines[len(single) :])
    assert by_name["steps, seed by seed"] == f"{summary.steps} / {summary.steps}"
    assert by_name["safety violations, seed by seed"] == "0 / 1"
    assert by_name["rounds that yield a step, seed by seed"].endswith(" / 33% of 3")
    yielded = round(summary.agreed_rounds * summary.rounds) + 1
    pooled = f"{yielded / (summary.rounds + 3):.1%} of {summary.rounds + 3}"
    assert by_name["rounds that yield a step, all seeds"] == pooled


def test_the_command_runs_each_column_at_each_seed(monkeypatch, tmp_path):
    """`--seeds 2` runs every column at two seeds; the columns are the first seed's."""
    summary, _ = scale._run(small(peers=3, minutes=0.5, churn_per_hour=0, seed=2))

    def run(job):  # a run's steps name its column and seed
        return dataclasses.replace(summary, steps=job.peers + job.seed), []

    class Inline(concurrent.futures.ThreadPoolExecutor):
        def __init__(self, jobs: int, mp_context: object) -> None:
            super().__init__(jobs)

    monkeypatch.setattr(scale, "_run", run)
    monkeypatch.setattr(scale.concurrent.futures, "ProcessPoolExecutor", Inline)
    monkeypatch.setattr(scale, "commit", lambda: "abc1234")
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    doc = tmp_path / "scale.md"
    argv = ["scale", "--peers", "100", "300", "--models", "4", "--seed", "5", "--seeds", "2"]
    monkeypatch.setattr(scale.sys, "argv", [*argv, "--doc", str(doc)])
    scale.main()
    text = doc.read_text()
    assert "(seed 5; seeds 5-6 in the last rows;" in text
    hundred = text.split(markers(100)[0])[1].split(markers(100)[1])[0]
    three = text.split(markers(300)[0])[1].split(markers(300)[1])[0]
    assert "| steps (per hour / ideal) | 105 (" in hundred and "| 305 (" in three
    assert "| steps, seed by seed | 105 / 106 |" in hundred
    assert "| steps, seed by seed | 305 / 306 |" in three
    # One size again: its table is rewritten, the other's stays.
    monkeypatch.setattr(scale, "commit", lambda: "def5678")
    monkeypatch.setattr(scale.sys, "argv", ["scale", "--peers", "300", "--doc", str(doc)])
    scale.main()
    again = doc.read_text()
    assert hundred in again and three not in again
    assert "at def5678: `python -m simulation.scale --peers 300" in again


def test_the_commit_names_uncommitted_changes_to_the_simulated_code(monkeypatch, tmp_path):
    calls: list[list[str]] = []

    def run(args, **kwargs):
        calls.append(args)
        out = "abc1234\n" if "rev-parse" in args else " M peer/training/policy.py\n"
        return type("Done", (), {"stdout": out})()

    monkeypatch.setattr(scale.subprocess, "run", run)
    assert scale.commit() == "abc1234+changes"
    assert calls[1][-2:] == ["peer", "simulation"]
