"""Who computes: the combinatorial layer over the shares LP, and the full role assignment.

`assign_roles` picks the computing set C that maximises samples/s under `model.py`, then the
canonical optimal shares for it (`shares.py`). The round time of any C follows in O(1) from
five sums (`round_time_per_byte`), so:

- up to `EXACT_LIMIT` compute-capable peers, every non-empty subset is scored: the result is
  the exhaustive-search optimum;
- above it, a search over the sets that matter and a certified bound. For every threshold b
  (the slowest computing peer's bandwidth, which sets the floor P/b of the round), the peers
  at or above it are ranked by speed and by bandwidth and every prefix of both rankings is
  scored (vectorised), then single add/remove moves improve the best set until none helps.
  The bound: a set whose slowest member has bandwidth b and size K has at most the K fastest
  eligible peers' speed and at most the K best eligible aggregators' bandwidth, and at least
  max(0, K - eligible client-only peers) computing aggregators; putting those extremes in the
  formula bounds every such set. `Assignment.upper_bound` is the max over (b, K); the answer
  is within `upper_bound / samples_per_s - 1` of the optimum.

Everything is a function of the records sorted by peer id, with ties broken by a fixed rule
(higher samples/s, then less traffic, then the earlier set in enumeration order), and only
order-preserving float operations (Python sums, numpy cumulative sums and element-wise
arithmetic): every peer computes the same assignment bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from peer.errors import RoleAssignmentError
from peer.roles.model import PeerCapacity, predict, step_time
from peer.roles.shares import no_aggregator_error, optimal_shares, round_time_per_byte

EXACT_LIMIT = 12


@dataclass(frozen=True)
class PeerRole:
    peer_id: str
    computes: bool
    share: float
    """Fraction of the vector this peer reduces (0 for client-only peers)."""
    bytes_per_round: float
    """Bytes it sends, and receives, in one all-reduce."""
    comm_time: float
    """Seconds its traffic takes at its measured bandwidth."""


@dataclass(frozen=True)
class Assignment:
    roles: tuple[PeerRole, ...]
    """One per peer, sorted by peer id."""
    compute_time: float
    comm_time: float
    step_time: float
    samples_per_s: float
    exact: bool
    """True when every computing set was scored (the exhaustive optimum)."""
    upper_bound: float
    """No assignment exceeds this many samples/s (equals samples_per_s when exact)."""


def assign_roles(
    records: Sequence[PeerCapacity],
    *,
    gradient_bytes: float,
    target_batch: float,
    delayed: bool,
) -> Assignment:
    """The throughput-maximising roles for a group, identical on every peer that runs it."""
    if gradient_bytes <= 0 or target_batch <= 0:
        raise ValueError(
            f"gradient_bytes and target_batch must be > 0, got {gradient_bytes!r}, {target_batch!r}"
        )
    peers = sorted(records, key=lambda p: p.peer_id)
    if len({p.peer_id for p in peers}) != len(peers):
        raise ValueError("two capability records name the same peer")
    candidates = [i for i, p in enumerate(peers) if p.samples_per_s > 0]
    if not candidates:
        raise RoleAssignmentError(
            "no peer has measured compute yet: start at least one `peer join` with a device"
        )
    if len(candidates) > 1 and not any(p.can_aggregate for p in peers):
        raise no_aggregator_error()
    problem = _Problem(peers, gradient_bytes, target_batch, delayed)
    exact = len(candidates) <= EXACT_LIMIT
    if exact:
        chosen, _ = problem.exhaustive(candidates)
    else:
        chosen, _ = problem.improve(*problem.prefix_search(candidates))
    computes = [i in chosen for i in range(len(peers))]
    shares, _ = optimal_shares(peers, computes)
    prediction = predict(
        peers,
        computes,
        shares,
        gradient_bytes=gradient_bytes,
        target_batch=target_batch,
        delayed=delayed,
    )
    roles = tuple(
        PeerRole(p.peer_id, c, g, b, t)
        for p, c, g, b, t in zip(
            peers,
            computes,
            shares,
            prediction.peer_bytes,
            prediction.peer_comm_time,
            strict=True,
        )
    )
    return Assignment(
        roles=roles,
        compute_time=prediction.compute_time,
        comm_time=prediction.comm_time,
        step_time=prediction.step_time,
        samples_per_s=prediction.samples_per_s,
        exact=exact,
        upper_bound=(
            prediction.samples_per_s
            if exact
            else problem.upper_bound(candidates, prediction.samples_per_s)
        ),
    )


class _Problem:
    """Scores computing sets of one group; `value` is samples/s (higher is better)."""

    def __init__(
        self, peers: list[PeerCapacity], gradient_bytes: float, target_batch: float, delayed: bool
    ) -> None:
        self.peers = peers
        self.p = gradient_bytes
        self.b = target_batch
        self.delayed = delayed
        self.speed = [p.samples_per_s for p in peers]
        self.bw = [p.bandwidth for p in peers]
        self.aggregates = [p.can_aggregate for p in peers]
        self.speed_array = np.array(self.speed, dtype=float)
        self.bw_array = np.array(self.bw, dtype=float)
        self.agg_array = np.array(self.aggregates, dtype=float)
        self.aggregator_bw = math.fsum(
            b for b, a in zip(self.bw, self.aggregates, strict=True) if a
        )

    def score(self, members: Sequence[int]) -> tuple[float, float]:
        """(samples/s, round time per byte) of computing set `members`."""
        tau = round_time_per_byte(
            computing=len(members),
            computing_aggregators=sum(self.aggregates[i] for i in members),
            computing_aggregator_bw=math.fsum(self.bw[i] for i in members if self.aggregates[i]),
            aggregator_bw=self.aggregator_bw,
            min_computing_bw=min(self.bw[i] for i in members),
        )
        speed = math.fsum(self.speed[i] for i in members)
        step = step_time(self.b / speed, tau * self.p, delayed=self.delayed)
        return self.b / step, tau

    def exhaustive(self, candidates: list[int]) -> tuple[set[int], float]:
        best: tuple[float, float] = (-1.0, 0.0)
        best_set: list[int] = []
        for mask in range(1, 1 << len(candidates)):
            members = [c for bit, c in enumerate(candidates) if mask >> bit & 1]
            value, tau = self.score(members)
            if value > best[0] or (value == best[0] and tau < best[1]):
                best, best_set = (value, tau), members
        return set(best_set), best[0]

    def prefix_search(self, candidates: list[int]) -> tuple[set[int], float]:
        """Best prefix of the speed and bandwidth rankings above every bandwidth threshold."""
        best_set = [max(candidates, key=lambda i: (self.speed[i], -i))]
        best_value = self.score(best_set)[0]  # the fastest peer alone: always feasible
        by_speed = np.array(sorted(candidates, key=lambda i: (-self.speed[i], i)))
        # The prefixes of the bandwidth ranking are those of every threshold's ranking at once.
        rankings = [self._by_bandwidth(candidates)]
        for threshold in sorted({self.bw[i] for i in candidates if self.bw[i] > 0}, reverse=True):
            rankings.append(by_speed[self.bw_array[by_speed] >= threshold])
        for order in rankings:
            if not len(order):
                continue  # nobody with bandwidth yet: only the lone fastest peer counts
            values = self._prefix_values(
                self.speed_array[order], self.bw_array[order], self.agg_array[order]
            )
            k = int(np.argmax(values))
            if values[k] > best_value:
                best_value, best_set = float(values[k]), order[: k + 1].tolist()
        return set(best_set), best_value

    def _by_bandwidth(self, candidates: list[int]) -> np.ndarray:
        """Candidates that can send anything, best-connected first."""
        return np.array(
            sorted((i for i in candidates if self.bw[i] > 0), key=lambda i: (-self.bw[i], i)),
            dtype=np.intp,
        )

    def _prefix_values(self, speed: np.ndarray, bw: np.ndarray, agg: np.ndarray) -> np.ndarray:
        """samples/s of every prefix of a ranking (the O(1) round time, vectorised)."""
        k = np.arange(1, len(speed) + 1, dtype=float)
        k_r = np.cumsum(agg)
        w = np.cumsum(bw * agg)
        t_c = 1.0 / np.minimum.accumulate(bw)
        with np.errstate(divide="ignore", invalid="ignore"):
            t_star = k * (k - 2 + k_r) / ((k - 2) * self.aggregator_bw + 2.0 * w)
            k2 = np.where(k_r > 0, t_c, np.maximum(t_c, 2.0 / self.aggregator_bw))
        tau = np.where(k == 1, 0.0, np.where(k == 2, k2, np.maximum(t_c, t_star)))
        compute = self.b / np.cumsum(speed)
        comm = tau * self.p
        step = np.maximum(compute, comm) if self.delayed else compute + comm
        return self.b / step

    def improve(self, members: set[int], value: float) -> tuple[set[int], float]:
        """Add or remove one peer while that helps (first improvement, in id order)."""
        candidates = [i for i, s in enumerate(self.speed) if s > 0]
        improved = True
        while improved:
            improved = False
            for i in candidates:
                trial = members ^ {i}
                if not trial:
                    continue
                trial_value = self.score(sorted(trial))[0]
                if trial_value > value:
                    members, value, improved = trial, trial_value, True
        return members, value

    def upper_bound(self, candidates: list[int], achieved: float) -> float:
        """No computing set beats this (see the module docstring); at least `achieved`.

        Sets are grouped by their slowest member's bandwidth (the threshold). A quick bound per
        group skips groups that cannot beat what is known; the others get the tight bound.
        """
        bound = max(achieved, max(self.speed[i] for i in candidates))  # K = 1: fastest alone
        by_bw = self._by_bandwidth(candidates)
        for count in range(2, len(by_bw) + 1):
            if count < len(by_bw) and self.bw[by_bw[count]] == self.bw[by_bw[count - 1]]:
                continue  # a threshold admits every peer with that bandwidth
            eligible = by_bw[:count]
            threshold = self.bw[by_bw[count - 1]]
            if self._quick_bound(threshold, eligible) > bound:
                bound = max(bound, self._tight_bound(threshold, eligible))
        return bound

    def _quick_bound(self, threshold: float, eligible: np.ndarray) -> float:
        """Per size K: the K fastest eligible peers' speed, the K best aggregators' bandwidth,
        and the fewest computing aggregators K can have. O(len(eligible))."""
        agg = self.agg_array[eligible] > 0
        top_speed = np.cumsum(-np.sort(-self.speed_array[eligible]))
        top_agg_bw = np.concatenate(([0.0], np.cumsum(self.bw_array[eligible][agg])))
        k = np.arange(1, len(eligible) + 1, dtype=float)
        k_r = np.maximum(0.0, k - np.count_nonzero(~agg))
        w = top_agg_bw[np.minimum(k, len(top_agg_bw) - 1).astype(int)]
        some_aggregator = bool(agg.any())  # then a pair may hold one: the K = 2 best case
        values = self._values(
            k, k_r, w, top_speed, 1.0 / threshold, pair_aggregates=some_aggregator
        )
        return float(np.max(values))

    def _tight_bound(self, threshold: float, eligible: np.ndarray) -> float:
        """Per (computing aggregators k_r, computing client-only k_c): the k_r fastest and k_r
        best-connected eligible aggregators, the k_c fastest client-only peers. O(k_r * k_c)."""
        agg = self.agg_array[eligible] > 0
        agg_speed = np.concatenate(([0.0], np.cumsum(-np.sort(-self.speed_array[eligible][agg]))))
        agg_bw = np.concatenate(([0.0], np.cumsum(self.bw_array[eligible][agg])))
        client_speed = np.concatenate(
            ([0.0], np.cumsum(-np.sort(-self.speed_array[eligible][~agg])))
        )
        k_r = np.arange(len(agg_speed), dtype=float)[:, None]
        k_c = np.arange(len(client_speed), dtype=float)[None, :]
        k = k_r + k_c
        speed = agg_speed[:, None] + client_speed[None, :]
        values = self._values(
            k, k_r, agg_bw[:, None], speed, 1.0 / threshold, pair_aggregates=k_r > 0
        )
        return float(np.max(np.where(k >= 2, values, 0.0)))

    def _values(
        self,
        k: np.ndarray,
        k_r: np.ndarray,
        w: np.ndarray,
        speed: np.ndarray,
        t_c: float,
        *,
        pair_aggregates: np.ndarray | bool,
    ) -> np.ndarray:
        """samples/s bound for sets of size k (>= 2 where it matters) with at least k_r
        computing aggregators of bandwidth at most w, speed at most `speed`, floor t_c;
        `pair_aggregates`: a K = 2 set may contain an aggregator."""
        with np.errstate(divide="ignore", invalid="ignore"):
            t_star = k * (k - 2 + k_r) / ((k - 2) * self.aggregator_bw + 2.0 * w)
            pair = np.where(pair_aggregates, t_c, max(t_c, 2.0 / self.aggregator_bw))
            tau = np.where(k == 2, pair, np.maximum(t_c, t_star))
            compute = self.b / speed
        comm = tau * self.p
        step = np.maximum(compute, comm) if self.delayed else compute + comm
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(k >= 2, self.b / step, 0.0)
