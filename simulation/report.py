"""The figures of a simulated collaboration (`collaboration.Report`), as rows to print."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from simulation.collaboration import BACKBONES, EPOCH, Attempt, Report, RoundTime
from simulation.nat import Nat, Path
from simulation.windows import Window

_PEER_ID = re.compile(r"12D3KooW[1-9A-HJ-NP-Za-km-z]+")
"""A peer id (ed25519, base58) in a failure's words."""


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
    averaged_share: float
    """Averaging calls that ended with an exact average over some peers (`AveragingResult`)."""
    complete_share: float
    """Averaging calls whose average holds every contribution of their view."""
    rounds: int
    """The collaboration's tries at a step that ended (`rounds_of`)."""
    cut_rounds: int
    """Rounds still averaging when the run ended: not counted as either."""
    agreed_rounds: float
    """Rounds that yielded their step: the try whose call gave the step's first holder the
    step (the step rule certified one of its candidates; the others download it)."""
    complete_rounds: float
    """Rounds in which every peer that took part got the average over its whole view."""
    late_gatherings: int
    """Gatherings of a step opened after the round that took it (`Round.late_gatherings`)."""
    peers_on_the_step: float
    """Per round, the share of its peers on its most common average; the mean."""
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
    mean_node_reply_bytes: float
    """Bytes/s of replies the mean node sent: all replies over the peers and backbones (a
    peer that left and the one that took its place count as one)."""
    mean_server_reply_bytes: float
    """The same over the DHT servers alone: the backbones and the volunteers not behind NAT.
    A NATed peer is a DHT client (nobody adds it to a routing table: `DHT.announcing`), so it
    holds no records and answers no lookup; with half the peers behind NAT the busiest node
    is about 2x the mean node's even where every server carries the same load."""
    view_coverage: float
    """The mean share of the live trainers whose progress records a read saw."""
    min_view_coverage: float
    departures: int
    arrivals: int
    backbone_failures: int
    downloads: int
    digests_agree: bool
    safety_violations: int
    """Peers that took a step as another state than the first peer that took it."""
    failure_reasons: list[tuple[str, int]]
    elections: dict[str, int]
    election_seconds: float
    step_phases: tuple[float, float, float]
    """A step's median seconds: to its call, its averaging, its election (`step_phases`)."""
    volunteers: int
    """Volunteers that took part (the first ones and those that joined later)."""
    behind_nat: int
    symmetric: int
    connections: dict[Path, int]
    """libp2p connections made in the whole run, by path (`simulation.nat`)."""
    relayed_bytes: float
    """Bytes the backbones relayed in the whole run (control traffic: relays carry no tensors)."""
    reducer_paths: dict[Path, int]
    """All-reduce pairs of a sender and a NATed reducer, by path (none: relayed or failed)."""
    rounds_cut: int
    """All-reduce rounds that failed for a pair with no direct connection (the whole run)."""
    donor_paths: dict[Path, int]
    """State downloads' pairs of a joiner and a NATed donor, by path."""
    busiest_window: Window | None = None
    """The measured window whose busiest node sent the most (`simulation.windows`)."""


def summarize(report: Report) -> Summary:
    scenario = report.scenario
    seconds = scenario.minutes * 60
    hours = seconds / 3600
    everyone = rounds_of(report.attempts, report.taken_at, report.taken_by)
    rounds = [r for r in everyone if not report.cut & r.epochs]
    on_the_step = [r.on_the_step for r in rounds]
    ops = sum(len(times) for times in report.dht_seconds.values())
    coverage = [seen / alive for seen, alive in report.views if alive]
    phases = step_phases(rounds, report.taken_at)
    replies = sum(report.traffic.served.values()) / seconds
    public = _share(v.nat is Nat.PUBLIC for v in report.volunteers)
    servers = max(1.0, BACKBONES + scenario.peers * public)  # a replacement counts as one
    reasons: dict[str, int] = defaultdict(int)
    for attempt in report.attempts:
        if not attempt.complete and attempt.why:
            reasons[_reason(attempt.why)] += 1
    return Summary(
        peers=scenario.peers,
        minutes=scenario.minutes,
        wall_seconds=report.wall_seconds,
        steps=report.steps,
        steps_per_hour=report.steps / hours,
        ideal_steps_per_hour=3600 / report.ideal_step_seconds,
        attempts=len(report.attempts),
        averaged_share=_share(a.members > 0 for a in report.attempts),
        complete_share=_share(a.complete for a in report.attempts),
        rounds=len(rounds),
        cut_rounds=len(everyone) - len(rounds),
        agreed_rounds=_share(r.yielded for r in rounds),
        complete_rounds=_share(all(a.complete for a in r.calls) for r in rounds),
        late_gatherings=sum(r.late_gatherings for r in rounds),
        peers_on_the_step=statistics.fmean(on_the_step) if on_the_step else 0.0,
        dht_ops_per_step=ops / scenario.peers / max(1, report.steps),
        store_p50=_quantile(report.dht_seconds["store"], 0.5),
        store_p99=_quantile(report.dht_seconds["store"], 0.99),
        get_p50=_quantile(report.dht_seconds["get"], 0.5),
        get_p99=_quantile(report.dht_seconds["get"], 0.99),
        dht_bytes_per_peer=sum(report.traffic.bytes.values()) / seconds / scenario.peers,
        hottest_node_bytes=max(report.traffic.served.values(), default=0) / seconds,
        mean_node_reply_bytes=replies / (scenario.peers + BACKBONES),
        mean_server_reply_bytes=replies / servers,
        view_coverage=statistics.fmean(coverage) if coverage else 0.0,
        min_view_coverage=min(coverage, default=0.0),
        departures=report.departures,
        backbone_failures=report.backbone_failures,
        arrivals=report.arrivals,
        downloads=report.downloads,
        digests_agree=report.digests_agree,
        safety_violations=len(report.violations),
        failure_reasons=sorted(reasons.items(), key=lambda kv: -kv[1])[:5],
        elections=dict(report.elections),
        election_seconds=report.election_seconds,
        step_phases=phases,
        volunteers=len(report.volunteers),
        behind_nat=sum(v.nat is not Nat.PUBLIC for v in report.volunteers),
        symmetric=sum(v.nat is Nat.SYMMETRIC for v in report.volunteers),
        connections={path: report.nat.connections[path] for path in Path},
        relayed_bytes=report.nat.relayed_bytes,
        reducer_paths={path: report.nat.reducer_paths[path] for path in Path},
        rounds_cut=report.nat.rounds_cut,
        donor_paths={path: report.nat.donor_paths[path] for path in Path},
        busiest_window=report.busiest_window,
    )


@dataclass
class Round:
    """The collaboration's try at one step (`rounds_of`)."""

    step: int
    calls: list[Attempt]
    opened: float
    """Virtual seconds: its first call."""
    late_gatherings: int = 0
    """Gatherings of the step opened after this round took it (during its election, or once
    a peer held the step): peers that missed it, averaging apart (they are not on the step,
    and download it)."""
    yielded: bool = False
    """The step was taken from this try (`rounds_of`)."""

    @property
    def epochs(self) -> set[int]:
        return {a.epoch for a in self.calls}

    @property
    def on_the_step(self) -> float:
        """The share of its calls on its most common average."""
        return _most_common_average(self.calls) / len(self.calls)


def step_phases(rounds: list[Round], taken_at: dict[int, float]) -> tuple[float, float, float]:
    """Where a step's time goes, the median over the steps taken after another (virtual
    seconds): from the step before to its yielding round's first call (computing, the call's
    window, waits for others), that round's calls (the median call: gathering, averaging),
    and from then to the step (the election, and its reads)."""
    to_call, averaging, to_step = [], [], []
    for r in rounds:
        before, taken = taken_at.get(r.step - 1), taken_at.get(r.step)
        if not r.yielded or before is None or taken is None:
            continue
        ended = statistics.median(a.ended for a in r.calls)
        to_call.append(r.opened - before)
        averaging.append(statistics.median(a.ended - a.started for a in r.calls))
        to_step.append(taken - ended)
    if not to_call:
        return (math.nan, math.nan, math.nan)
    return (statistics.median(to_call), statistics.median(averaging), statistics.median(to_step))


def rounds_of(
    attempts: Iterable[Attempt],
    taken_at: dict[int, float],
    taken_by: dict[int, str] | None = None,
) -> list[Round]:
    """The averaging calls by round: the collaboration's try at one step, i.e. the calls of
    that step in one gathering (one epoch), or in several gatherings open at once (calls of
    the step made at nearly the same moment split its peers: one round). A gathering that
    opened after the last one closed (its calls started later) is the next try, unless a peer
    had taken the step by then (`taken_at`, virtual seconds: the safety check's first holder):
    then its peers missed the step and count in the last round, off the step.

    The round that yields a step is the one whose call gave its first holder the step
    (`taken_by`: that peer's last call of the step before it took it; the step rule certified
    one of the round's candidates, whatever the split of their averages); a gathering opened
    after it while its election ran missed the step as well (at 100 simulated peers, 7 peers
    and then 1 called step 4 again in the 41 s between a round of 83 opening and the step,
    and the last of them was counted as the try that yielded it). Without the holder's call, the last
    round opened before the step was taken. Calls made too late for their gathering (an
    empty view) are in none."""
    by_step: dict[int, dict[int, list[Attempt]]] = defaultdict(lambda: defaultdict(list))
    for attempt in attempts:
        if attempt.peers_seen > 0:
            by_step[attempt.step][attempt.epoch].append(attempt)
    rounds: list[Round] = []
    for step in sorted(by_step):
        closes = -math.inf  # the current round's latest close, virtual seconds
        taken = taken_at.get(step, math.inf)
        ours: list[Round] = []
        for epoch, calls in sorted(by_step[step].items()):
            opened = min(a.started for a in calls)
            if opened >= taken and ours:
                ours[-1].late_gatherings += 1
            elif opened >= closes or not ours:  # the last one closed before: a new try
                ours.append(Round(step, [], opened))
            ours[-1].calls.extend(calls)
            closes = max(closes, epoch / 1000 - EPOCH)
        tries = [r for r in ours if r.opened < taken]
        if tries and taken < math.inf:
            yielding = _yielding(tries, taken, (taken_by or {}).get(step))
            for missed in tries[tries.index(yielding) + 1 :]:  # opened during its election
                yielding.calls.extend(missed.calls)
                yielding.late_gatherings += len(missed.epochs)  # its own and its late ones
                ours.remove(missed)
            yielding.yielded = True
        rounds.extend(ours)
    return rounds


def gatherings(attempts: Iterable[Attempt], *, reasons: int = 3) -> list[str]:
    """Each gathering (a step's calls that share an epoch), in the order they closed: its
    calls and how many of them averaged over their whole view, how many distinct averages
    they ended on and the largest number of calls on one (the candidates its election chose
    among), when its calls ended (median and last, virtual seconds), its `reasons` most common
    failures, and its Moshpit rounds (`round_lines`). How a round of many peers splits: at
    300 simulated peers a first step's 290 calls ended on 82 averages, none over the whole
    view."""
    by_gathering: dict[tuple[int, int], list[Attempt]] = defaultdict(list)
    for attempt in attempts:
        if attempt.peers_seen > 0:
            by_gathering[(attempt.epoch, attempt.step)].append(attempt)
    lines = []
    for (epoch, step), calls in sorted(by_gathering.items()):
        averages = Counter(a.average for a in calls if a.average)
        ends = [a.ended for a in calls]
        why = Counter(_reason(a.why) for a in calls if a.why)
        lines.append(
            f"step {step}, gathering closed at {epoch / 1000 - EPOCH:.1f} s: {len(calls)} "
            f"calls, {sum(a.complete for a in calls)} over their whole view; "
            f"{len(averages)} averages, the largest on {max(averages.values(), default=0)}; "
            f"ended {statistics.median(ends):.1f} s (median), {max(ends):.1f} s (last)"
            + "".join(f"\n    {n} x {reason}" for reason, n in why.most_common(reasons))
            + "".join(f"\n    {line}" for line in round_lines(calls))
        )
    return lines


def round_lines(calls: Iterable[Attempt]) -> list[str]:
    """Each Moshpit round of `calls` (one gathering's): the calls that met a group in it and
    those it gave a new basis, and the median / 90th percentile of when they started it, how
    long their group took to form (waiting for members still in earlier rounds) and the
    all-reduce's seconds (the rounds that averaged), virtual seconds; where calls were left
    alone, how many, and how many of those had a planned member of their group forming its
    group of that round meanwhile (`_met_nobody`: before session 48's fix, two such members
    each led and waited for the other)."""
    by_round: dict[int, list[RoundTime]] = defaultdict(list)
    forming: dict[tuple[int, str], list[RoundTime]] = defaultdict(list)
    alone: dict[int, list[tuple[str, RoundTime]]] = defaultdict(list)
    for call in calls:
        for timing in call.rounds:
            by_round[timing.index].append(timing)
            forming[(timing.index, call.peer)].append(timing)
            if timing.alone:
                alone[timing.index].append((call.peer, timing))

    def spread(values: list[float]) -> str:
        if not values:
            return "-"
        return f"{_quantile(values, 0.5):.1f} / {_quantile(values, 0.9):.1f}"

    return [
        f"round {index}: {len(times)} met a group, {sum(t.averaged for t in times)} averaged; "
        f"started {spread([t.started for t in times])} s, formed in "
        f"{spread([t.formed - t.started for t in times])} s, all-reduce "
        f"{spread([t.ended - t.formed for t in times if t.averaged])} s"
        + (
            f"; alone in {len(alone[index])} ("
            f"{sum(_met_nobody(peer, t, forming) for peer, t in alone[index])} with a planned "
            "member in the round meanwhile)"
            if alone[index]
            else ""
        )
        for index, times in sorted(by_round.items())
    ]


def _met_nobody(
    peer: str, timing: RoundTime, forming: dict[tuple[int, str], list[RoundTime]]
) -> bool:
    """A planned member of `peer`'s group was forming its group of the same round while
    `peer` waited for its own, alone in the end."""
    return any(
        other.started < timing.formed and timing.started < other.formed
        for member in timing.planned
        if member != peer
        for other in forming.get((timing.index, member), ())
    )


def _yielding(tries: list[Round], taken: float, holder: str | None) -> Round:
    """Of a step's tries opened before it was taken, the one whose call gave `holder` (its
    first holder) the step: that peer's last call of it started before then."""
    calls = [
        (a.started, r_index)
        for r_index, r in enumerate(tries)
        for a in r.calls
        if a.peer == holder and a.started < taken
    ]
    return tries[max(calls)[1]] if calls else tries[-1]


def _most_common_average(calls: list[Attempt]) -> int:
    counts = Counter(a.average for a in calls if a.average)
    return max(counts.values(), default=0)


def _reason(why: str) -> str:
    """A failure's kind, without the peer ids that make each one unique (also within
    parentheses: "incomplete (12D3KooW...: ...)" counted each peer apart)."""
    return _PEER_ID.sub("<peer>", " ".join(why.split()))[:70]


def _by_path(paths: dict[Path, int]) -> str:
    """Direct / punched / none (relayed or failed): data-plane pairs, by what carried them."""
    none = paths[Path.RELAYED] + paths[Path.FAILED]
    return f"{paths[Path.DIRECT]} / {paths[Path.PUNCHED]} / {none}"


def _share(flags: Iterable[bool]) -> float:
    values = list(flags)
    return sum(values) / len(values) if values else 0.0


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _window(window: Window | None) -> str:
    if window is None:
        return "-"
    what = ", ".join(f"{kind} {share:.0%}" for kind, share in window.what)
    return (
        f"{window.busiest * 8 / 1e6:.1f} Mbit/s at {window.start:.0f}-{window.end:.0f} s"
        f" ({window.ratio:.1f}x): {what}"
    )


def rows(summary: Summary) -> list[tuple[str, str]]:
    s = summary
    return [
        ("peers, minutes simulated", f"{s.peers}, {s.minutes:g} (wall {s.wall_seconds:.0f} s)"),
        ("churn: left / joined / downloads", f"{s.departures} / {s.arrivals} / {s.downloads}"),
        ("backbone failures (each restarted)", str(s.backbone_failures)),
        (
            "steps (per hour / ideal)",
            f"{s.steps} ({s.steps_per_hour:.0f} / {s.ideal_steps_per_hour:.0f} = {s.steps_per_hour / s.ideal_steps_per_hour:.2f}x)",
        ),
        (
            "averaging calls with an average / over their whole view",
            f"{s.averaged_share:.1%} / {s.complete_share:.1%} of {s.attempts}",
        ),
        (
            "rounds that yield a step / whose calls all complete",
            f"{s.agreed_rounds:.1%} / {s.complete_rounds:.1%} of {s.rounds}"
            f" ({s.cut_rounds} cut by the end)",
        ),
        ("peers on their round's step (mean)", f"{s.peers_on_the_step:.1%}"),
        (
            "a step's seconds: to its call / averaging / election (median)",
            " / ".join(f"{x:.1f}" if math.isfinite(x) else "-" for x in s.step_phases),
        ),
        ("gatherings that missed the round taking their step", str(s.late_gatherings)),
        ("DHT stores+gets per trainer per step", f"{s.dht_ops_per_step:.0f}"),
        ("DHT store p50 / p99", f"{s.store_p50 * 1000:.0f} / {s.store_p99 * 1000:.0f} ms"),
        ("DHT get p50 / p99", f"{s.get_p50 * 1000:.0f} / {s.get_p99 * 1000:.0f} ms"),
        ("DHT traffic per trainer", f"{s.dht_bytes_per_peer * 8 / 1e6:.2f} Mbit/s"),
        (
            "busiest node's DHT replies (x the mean node's / the mean DHT server's)",
            f"{s.hottest_node_bytes * 8 / 1e6:.1f} Mbit/s"
            f" ({s.hottest_node_bytes / max(s.mean_node_reply_bytes, 1e-9):.1f}x"
            f" / {s.hottest_node_bytes / max(s.mean_server_reply_bytes, 1e-9):.1f}x)",
        ),
        (
            "busiest node in a 30 s window (x the mean DHT server's then): its replies",
            _window(s.busiest_window),
        ),
        (
            "progress read coverage (mean / min)",
            f"{s.view_coverage:.1%} / {s.min_view_coverage:.1%}",
        ),
        (
            "candidates won / lost / stalled (mean wait)",
            " / ".join(str(s.elections.get(k, 0)) for k in ("won", "lost", "stalled"))
            + f" ({s.election_seconds:.1f} s)",
        ),
        ("digests of the newest step agree", "yes" if s.digests_agree else "NO"),
        ("safety violations (a step taken as two states)", str(s.safety_violations)),
        ("volunteers behind NAT / symmetric", f"{s.behind_nat} / {s.symmetric} of {s.volunteers}"),
        (
            "NAT, whole run: connections direct / punched / relayed / failed",
            " / ".join(str(s.connections[path]) for path in Path),
        ),
        ("  bytes the backbones relayed", f"{s.relayed_bytes / 1e6:.2f} MB"),
        (
            "  to NATed reducers: direct / punched / none (rounds cut)",
            f"{_by_path(s.reducer_paths)} ({s.rounds_cut})",
        ),
        ("  to NATed state donors: direct / punched / none", _by_path(s.donor_paths)),
        *((f"  failed: {why}", str(n)) for why, n in s.failure_reasons),
    ]
