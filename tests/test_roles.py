"""Role assignment: hand-checked cases, exhaustive optimality, the HiGHS reference, properties,
determinism across processes, and the edge cases of the issue."""

from __future__ import annotations

import itertools
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from peer.errors import RoleAssignmentError
from peer.roles import (
    MAX_SHARE_RATIO,
    PeerCapacity,
    assign_roles,
    cap_shares,
    optimal_shares,
    predict,
    share_cap,
)
from peer.roles import search as search_module
from peer.roles.lp import shares_lp

ROOT = Path(__file__).resolve().parent.parent


def peer(i: int, speed: float, bw: float, *, reachable: bool = True, down: float | None = None):
    return PeerCapacity(
        peer_id=f"peer-{i:04d}",
        samples_per_s=speed,
        upload_bps=bw,
        download_bps=bw if down is None else down,
        reachable=reachable,
    )


def random_group(rng: random.Random, n: int) -> list[PeerCapacity]:
    """Speeds over 3 orders of magnitude (some 0), bandwidths over 5, some client-only."""
    reach = rng.random()
    return [
        peer(
            i,
            0.0 if rng.random() < 0.15 else 10 ** rng.uniform(-1, 2),
            10 ** rng.uniform(3, 8),
            down=10 ** rng.uniform(3, 8),
            reachable=rng.random() < reach or i == 0,  # at least one aggregator
        )
        for i in range(n)
    ]


def brute_force(peers, *, gradient_bytes, target_batch, delayed) -> float:
    """Best samples/s over every computing set, with shares from the closed form and the time
    from the model's own evaluation (not the search's O(1) scoring)."""
    best = 0.0
    capable = [i for i, p in enumerate(peers) if p.samples_per_s > 0]
    for size in range(1, len(capable) + 1):
        for chosen in itertools.combinations(capable, size):
            computes = [i in chosen for i in range(len(peers))]
            shares, _ = optimal_shares(peers, computes)
            result = predict(
                peers,
                computes,
                shares,
                gradient_bytes=gradient_bytes,
                target_batch=target_batch,
                delayed=delayed,
            )
            best = max(best, result.samples_per_s)
    return best


# ---------------------------------------------------------------------------- hand-checked


def test_two_equal_peers_sum_mode_tie_goes_to_less_traffic():
    # Solo: 20 samples / 10 per s = 2 s. Both: 1 s compute + 100 B / 100 B/s = 2 s. A tie,
    # broken towards less traffic: one peer trains alone.
    a = assign_roles(
        [peer(1, 10, 100), peer(2, 10, 100)], gradient_bytes=100, target_batch=20, delayed=False
    )
    assert a.samples_per_s == 10.0
    assert [(r.computes, r.share) for r in a.roles] == [(True, 1.0), (False, 0.0)]
    assert a.comm_time == 0.0


def test_two_equal_peers_delayed_updates_overlap_compute_and_traffic():
    # Both compute: max(1 s, 1 s) = 1 s per 20 samples.
    a = assign_roles(
        [peer(1, 10, 100), peer(2, 10, 100)], gradient_bytes=100, target_batch=20, delayed=True
    )
    assert a.samples_per_s == 20.0
    assert all(r.computes for r in a.roles)
    assert sum(r.share for r in a.roles) == pytest.approx(1.0)


def test_a_fast_backbone_takes_the_whole_share():
    # 3 peers (10 samples/s, 100 B/s) + a backbone (1000 B/s), P = 100 B, B = 30.
    # K = 3: compute 1 s; each computing peer must move P once (1 s); the backbone holding
    # everything moves 3 P = 300 B in 0.3 s. Step 2 s -> 15 samples/s (K = 2: 2.5 s, solo: 3 s).
    group = [peer(1, 10, 100), peer(2, 10, 100), peer(3, 10, 100), peer(9, 0, 1000)]
    a = assign_roles(group, gradient_bytes=100, target_batch=30, delayed=False)
    assert a.samples_per_s == pytest.approx(15.0)
    assert [r.computes for r in a.roles] == [True, True, True, False]
    assert [r.share for r in a.roles] == pytest.approx([0, 0, 0, 1])
    assert [r.comm_time for r in a.roles] == pytest.approx([1, 1, 1, 0.3])
    assert (a.compute_time, a.comm_time) == pytest.approx((1.0, 1.0))


def test_client_only_peers_compute_but_hold_no_share():
    group = [peer(1, 50, 1e6, reachable=False), peer(2, 50, 1e6, reachable=False), peer(3, 1, 1e7)]
    a = assign_roles(group, gradient_bytes=1e6, target_batch=100, delayed=True)
    shares = {r.peer_id: r.share for r in a.roles}
    assert shares["peer-0001"] == shares["peer-0002"] == 0.0
    assert shares["peer-0003"] == pytest.approx(1.0)
    assert a.roles[0].computes and a.roles[1].computes


def test_a_peer_on_a_slow_link_is_left_out_of_computing():
    # 10^4 x less bandwidth than the rest: making it compute would multiply the round time.
    group = [peer(i, 10, 1e8) for i in range(8)] + [peer(8, 10, 1e4)]
    a = assign_roles(group, gradient_bytes=1e7, target_batch=1000, delayed=False)
    assert not a.roles[8].computes
    assert a.roles[8].share < 1e-3  # it may hold a sliver, never enough to slow the round
    assert a.comm_time < 1.0  # 1e7 B at 1e8 B/s-ish, not 1e7 B at 1e4 B/s (1000 s)


# ---------------------------------------------------------------------------- optimality


@pytest.mark.parametrize("seed", range(40))
def test_matches_exhaustive_search_up_to_ten_peers(seed):
    rng = random.Random(seed)
    group = random_group(rng, rng.randint(1, 10))
    if sum(p.samples_per_s > 0 for p in group) == 0:
        group[0] = peer(0, 1.0, 1e5)
    kwargs = dict(
        gradient_bytes=10 ** rng.uniform(5, 9),
        target_batch=10 ** rng.uniform(1, 4),
        delayed=rng.random() < 0.5,
    )
    a = assign_roles(group, **kwargs)
    assert a.exact
    assert a.samples_per_s == pytest.approx(brute_force(group, **kwargs), rel=1e-12)


@pytest.mark.parametrize("seed", range(40))
def test_the_large_group_search_is_certified_against_exhaustive_search(seed, monkeypatch):
    """Forced onto the search used above EXACT_LIMIT: on small groups it must still find the
    optimum, and its bound must never fall below the optimum."""
    monkeypatch.setattr(search_module, "EXACT_LIMIT", 0)
    rng = random.Random(1000 + seed)
    group = random_group(rng, rng.randint(2, 10))
    group[1] = peer(1, 5.0, 1e6)  # two compute-capable peers at least
    kwargs = dict(
        gradient_bytes=10 ** rng.uniform(5, 9),
        target_batch=10 ** rng.uniform(1, 4),
        delayed=rng.random() < 0.5,
    )
    a = assign_roles(group, **kwargs)
    optimum = brute_force(group, **kwargs)
    assert not a.exact
    assert a.samples_per_s == pytest.approx(optimum, rel=1e-12)
    assert a.upper_bound >= optimum * (1 - 1e-12)


@pytest.mark.parametrize("spread", [2.0, 1e5])  # similar links: the water level binds
@pytest.mark.parametrize("seed", range(20))
def test_closed_form_shares_are_the_highs_lp_optimum(seed, spread):
    rng = random.Random(2000 + seed)
    group = [
        peer(i, 1.0, 1e6 * rng.uniform(1, spread), reachable=rng.random() < 0.7 or i == 0)
        for i in range(rng.randint(2, 12))
    ]
    computes = [rng.random() < 0.6 for _ in group]
    computes[0] = computes[1] = True
    shares, t = optimal_shares(group, computes)
    _, t_lp = shares_lp(group, computes)
    assert t == pytest.approx(t_lp, rel=1e-7)
    # And the model, evaluating those shares, takes exactly that long.
    result = predict(group, computes, shares, gradient_bytes=1.0, target_batch=1.0, delayed=False)
    assert result.comm_time == pytest.approx(t, rel=1e-12)


# ---------------------------------------------------------------------------- properties

capacities = st.builds(
    lambda s, u, d, r: (s, u, d, r),
    st.sampled_from([0.0, 0.5, 3.0, 40.0, 700.0]) | st.floats(0.01, 1e3),
    st.floats(1e3, 1e9),
    st.floats(1e3, 1e9),
    st.booleans(),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(capacities, min_size=2, max_size=16), st.floats(1e4, 1e9), st.booleans())
def test_shares_are_a_distribution_and_times_respect_the_lower_bounds(raw, p_bytes, delayed):
    group = [
        PeerCapacity(
            peer_id=f"p{i:02d}", samples_per_s=s, upload_bps=u, download_bps=d, reachable=r
        )
        for i, (s, u, d, r) in enumerate(raw)
    ]
    try:
        a = assign_roles(group, gradient_bytes=p_bytes, target_batch=512, delayed=delayed)
    except RoleAssignmentError:
        assert not any(p.samples_per_s > 0 for p in group) or not any(p.reachable for p in group)
        return
    shares = [r.share for r in a.roles]
    assert all(g >= 0 for g in shares)
    assert math.fsum(shares) == pytest.approx(1.0, abs=1e-12)
    computing = sum(r.computes for r in a.roles)
    for p, r in zip(sorted(group, key=lambda p: p.peer_id), a.roles, strict=True):
        if computing >= 2 and not p.reachable:
            assert r.share == 0.0
        if computing >= 2 and r.computes:
            assert a.comm_time >= p_bytes / p.bandwidth * (1 - 1e-12)
    assert a.compute_time >= 512 / sum(p.samples_per_s for p in group) * (1 - 1e-12)
    assert a.upper_bound >= a.samples_per_s


# ---------------------------------------------------------------------------- determinism

SOLVE_SCRIPT = """
import json, random, sys
from peer.roles import PeerCapacity, assign_roles
records = [PeerCapacity(**r) for r in json.loads(sys.stdin.read())]
random.Random(int(sys.argv[1])).shuffle(records)  # arrival order differs from peer to peer
out = []
for delayed in (False, True):
    a = assign_roles(records, gradient_bytes=3.3e8, target_batch=4096, delayed=delayed)
    out.append([a.samples_per_s.hex(), a.upper_bound.hex(), a.comm_time.hex()])
    out.append([[r.peer_id, r.computes, r.share.hex()] for r in a.roles])
print(json.dumps(out))
"""


def test_separate_processes_compute_identical_assignments_bit_for_bit():
    rng = random.Random(5)
    records = [
        {
            "peer_id": p.peer_id,
            "samples_per_s": p.samples_per_s,
            "upload_bps": p.upload_bps,
            "download_bps": p.download_bps,
            "reachable": p.reachable,
        }
        for p in random_group(rng, 9) + random_group(rng, 60)[9:]  # exact and search paths
    ]
    outputs = set()
    for shuffle, hash_seed in ((1, "0"), (2, "12345"), (3, "random")):
        result = subprocess.run(
            [sys.executable, "-c", SOLVE_SCRIPT, str(shuffle)],
            input=json.dumps(records),
            capture_output=True,
            text=True,
            cwd=ROOT,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        outputs.add(result.stdout)
    assert len(outputs) == 1


# ---------------------------------------------------------------------------- edge cases


@pytest.mark.parametrize("reachable", [True, False])
def test_a_single_peer_trains_alone(reachable):
    a = assign_roles(
        [peer(1, 7.0, 0.0, reachable=reachable)], gradient_bytes=1e8, target_batch=70, delayed=False
    )
    (role,) = a.roles
    assert (role.computes, role.share, a.comm_time) == (True, 1.0, 0.0)
    assert a.samples_per_s == pytest.approx(7.0)


def test_no_reachable_peer_is_a_clear_error():
    group = [peer(1, 5, 1e6, reachable=False), peer(2, 5, 1e6, reachable=False)]
    with pytest.raises(
        RoleAssignmentError, match="at least one publicly reachable peer or backbone"
    ):
        assign_roles(group, gradient_bytes=1e6, target_batch=10, delayed=False)


def test_no_measured_compute_is_a_clear_error():
    with pytest.raises(RoleAssignmentError, match="no peer has measured compute"):
        assign_roles(
            [peer(1, 0, 1e6), peer(2, 0, 0)], gradient_bytes=1e6, target_batch=10, delayed=False
        )


def test_missing_bandwidth_means_no_share_and_no_computing_with_others():
    others = [peer(2, 10, 1e6), peer(3, 10, 1e6), peer(4, 0, 1e7)]
    # Slower than the others together: it sits out (it could only ever train alone).
    a = assign_roles([peer(1, 5, 0.0), *others], gradient_bytes=1e5, target_batch=100, delayed=True)
    assert (a.roles[0].computes, a.roles[0].share) == (False, 0.0)
    assert a.samples_per_s == pytest.approx(20.0)  # 100 samples / max(5 s, 0.1 s)
    # Faster alone than everyone else together: it trains alone, nobody sends anything.
    a = assign_roles(
        [peer(1, 100, 0.0), *others], gradient_bytes=1e5, target_batch=100, delayed=True
    )
    assert [r.computes for r in a.roles] == [True, False, False, False]
    assert (a.roles[0].share, a.comm_time) == (1.0, 0.0)


def test_bad_measurements_are_refused_at_the_boundary():
    with pytest.raises(ValueError, match="samples_per_s = nan"):
        peer(1, float("nan"), 1e6)
    with pytest.raises(ValueError, match="upload_bps = -1"):
        peer(1, 1.0, -1.0)
    with pytest.raises(ValueError, match="same peer"):
        assign_roles(
            [peer(1, 1, 1e6), peer(1, 2, 1e6)], gradient_bytes=1, target_batch=1, delayed=False
        )


def test_many_peers_with_compute_but_no_bandwidth_yet_train_alone():
    # Start-up: compute is measured before the links are; above EXACT_LIMIT candidates.
    group = [peer(i, 10.0 + i, 0.0) for i in range(20)] + [peer(99, 0.0, 1e8)]
    a = assign_roles(group, gradient_bytes=1e6, target_batch=100, delayed=False)
    assert not a.exact
    assert [r.peer_id for r in a.roles if r.computes] == ["peer-0019"]  # the fastest
    assert a.comm_time == 0.0


def test_a_thousand_peers_get_a_certified_assignment():
    rng = random.Random(11)
    group = random_group(rng, 1000)
    a = assign_roles(group, gradient_bytes=4e8, target_batch=8192, delayed=False)
    assert len(a.roles) == 1000 and not a.exact
    assert math.fsum(r.share for r in a.roles) == pytest.approx(1.0, abs=1e-12)
    assert a.samples_per_s > 0 and a.upper_bound >= a.samples_per_s


# ---------------------------------------------------------------------------- the share cap


def test_the_share_cap_hand_checked():
    # m = 3: cap 1/2; the excess 0.4 goes to the others in proportion (0.05 : 0.05).
    assert cap_shares([0.9, 0.05, 0.05], [True] * 3) == pytest.approx([0.5, 0.25, 0.25])
    # m = 4: cap 3/8. 0.6 is held; 0.625 spread 3:1 lifts the second (0.46875) too; the last
    # 0.25 goes to the third, and the zero share stays zero until nobody else can take it.
    assert cap_shares([0.6, 0.3, 0.1, 0.0], [True] * 4) == pytest.approx([0.375, 0.375, 0.25, 0])
    assert cap_shares([1.0, 0.0, 0.0, 0.0], [True] * 4) == pytest.approx(
        [0.375, 0.625 / 3, 0.625 / 3, 0.625 / 3]
    )
    # Client-only members stay at 0, and only the m reducers count: 1.5 / 2.
    assert cap_shares([1.0, 0.0, 0.0], [True, True, False]) == pytest.approx([0.75, 0.25, 0.0])
    # Under the cap nothing moves (normalised only); one reducer holds everything.
    assert cap_shares([2.0, 1.0, 1.0], [True] * 3) == pytest.approx([0.5, 0.25, 0.25])
    assert cap_shares([1.0, 0.0], [True, False]) == [1.0, 0.0]
    assert share_cap(1) == share_cap(0) == 1.0 and share_cap(8) == MAX_SHARE_RATIO / 8
    with pytest.raises(ValueError):
        cap_shares([0.5, 0.5], [True, False])  # a share for a member that cannot reduce


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1e6), st.booleans()), min_size=1, max_size=40))
def test_capped_shares_add_up_stay_under_the_cap_and_never_shrink_an_uncapped_one(members):
    shares = [g if ok else 0.0 for g, ok in members]
    eligible = [ok for _, ok in members]
    if not any(eligible) or math.fsum(shares) <= 0:
        return
    capped = cap_shares(shares, eligible)
    cap = share_cap(sum(eligible))
    total = math.fsum(shares)
    assert math.fsum(capped) == pytest.approx(1.0, abs=1e-12)
    for before, after, ok in zip(shares, capped, eligible, strict=True):
        assert after <= cap and (ok or after == 0.0)
        assert after >= min(before / total, cap) - 1e-12  # only the excess moves
    assert cap_shares(list(reversed(shares)), list(reversed(eligible))) == list(reversed(capped))
