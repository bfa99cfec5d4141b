"""The figures of a simulated collaboration (`collaboration.Report`), as rows to print."""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from simulation.collaboration import Report


@dataclass(frozen=True)
class Summary:
    peers: int
    minutes: float
    wall_seconds: float
    steps: int
    """Steps the collaboration took while measured."""
    steps_per_hour: float
    ideal_steps_per_hour: float
    attempts: int
    exact_share: float
    """Averaging calls that ended with the exact average (a step)."""
    complete_gatherings: float
    """Gatherings in which every peer that took part got the exact average."""
    peers_in_complete_groups: float
    """Per gathering, the share of its peers whose every round completed; the mean."""
    dht_ops_per_step: float
    """DHT stores and gets per trainer per collaboration step."""
    store_p50: float
    store_p99: float
    get_p50: float
    get_p99: float
    dht_bytes_per_peer: float
    """Bytes/s of DHT traffic (requests and replies) per trainer."""
    hottest_node_bytes: float
    """Bytes/s of replies the busiest node sent."""
    view_coverage: float
    """The mean share of the live trainers whose progress records a read saw."""
    min_view_coverage: float
    departures: int
    arrivals: int
    downloads: int
    digests_agree: bool
    failure_reasons: list[tuple[str, int]]


def summarize(report: Report) -> Summary:
    scenario = report.scenario
    seconds = scenario.minutes * 60
    hours = seconds / 3600
    by_epoch: dict[int, list[bool]] = defaultdict(list)
    for attempt in report.attempts:
        if attempt.peers_seen > 0:  # called too late to be in the gathering: not a member
            by_epoch[attempt.epoch].append(attempt.exact)
    gatherings = list(by_epoch.values())
    ops = sum(len(times) for times in report.dht_seconds.values())
    coverage = [seen / alive for seen, alive in report.views if alive]
    reasons: dict[str, int] = defaultdict(int)
    for attempt in report.attempts:
        if not attempt.exact and attempt.why:
            reasons[_reason(attempt.why)] += 1
    return Summary(
        peers=scenario.peers,
        minutes=scenario.minutes,
        wall_seconds=report.wall_seconds,
        steps=report.steps,
        steps_per_hour=report.steps / hours,
        ideal_steps_per_hour=3600 / report.ideal_step_seconds,
        attempts=len(report.attempts),
        exact_share=_share(a.exact for a in report.attempts),
        complete_gatherings=_share(all(g) for g in gatherings),
        peers_in_complete_groups=statistics.fmean(sum(g) / len(g) for g in gatherings)
        if gatherings
        else 0.0,
        dht_ops_per_step=ops / scenario.peers / max(1, report.steps),
        store_p50=_quantile(report.dht_seconds["store"], 0.5),
        store_p99=_quantile(report.dht_seconds["store"], 0.99),
        get_p50=_quantile(report.dht_seconds["get"], 0.5),
        get_p99=_quantile(report.dht_seconds["get"], 0.99),
        dht_bytes_per_peer=sum(report.traffic.bytes.values()) / seconds / scenario.peers,
        hottest_node_bytes=max(report.traffic.served.values(), default=0) / seconds,
        view_coverage=statistics.fmean(coverage) if coverage else 0.0,
        min_view_coverage=min(coverage, default=0.0),
        departures=report.departures,
        arrivals=report.arrivals,
        downloads=report.downloads,
        digests_agree=report.digests_agree,
        failure_reasons=sorted(reasons.items(), key=lambda kv: -kv[1])[:5],
    )


def _reason(why: str) -> str:
    """A failure's kind, without the peer ids that make each one unique."""
    words = [w for w in why.split() if not w.startswith("12D3KooW")]
    return " ".join(words)[:70]


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rows(summary: Summary) -> list[tuple[str, str]]:
    s = summary
    return [
        ("peers, minutes simulated", f"{s.peers}, {s.minutes:g} (wall {s.wall_seconds:.0f} s)"),
        ("churn: left / joined / downloads", f"{s.departures} / {s.arrivals} / {s.downloads}"),
        (
            "steps (per hour / ideal)",
            f"{s.steps} ({s.steps_per_hour:.0f} / {s.ideal_steps_per_hour:.0f} = {s.steps_per_hour / s.ideal_steps_per_hour:.2f}x)",
        ),
        ("averaging calls exact", f"{s.exact_share:.1%} of {s.attempts}"),
        ("gatherings complete for all their peers", f"{s.complete_gatherings:.1%}"),
        ("peers in a complete group (mean per gathering)", f"{s.peers_in_complete_groups:.1%}"),
        ("DHT stores+gets per trainer per step", f"{s.dht_ops_per_step:.0f}"),
        ("DHT store p50 / p99", f"{s.store_p50 * 1000:.0f} / {s.store_p99 * 1000:.0f} ms"),
        ("DHT get p50 / p99", f"{s.get_p50 * 1000:.0f} / {s.get_p99 * 1000:.0f} ms"),
        ("DHT traffic per trainer", f"{s.dht_bytes_per_peer * 8 / 1e6:.2f} Mbit/s"),
        ("busiest node's DHT replies", f"{s.hottest_node_bytes * 8 / 1e6:.1f} Mbit/s"),
        (
            "progress read coverage (mean / min)",
            f"{s.view_coverage:.1%} / {s.min_view_coverage:.1%}",
        ),
        ("digests of the newest step agree", "yes" if s.digests_agree else "NO"),
        *((f"  failed: {why}", str(n)) for why, n in s.failure_reasons),
    ]
