"""Role assignment solve time for 16 to 1024 peers, next to HiGHS solving the shares LP.

    .venv/bin/python -m benchmarks.roles_solve [--peers 16 64 256 1024] [--repeat 20]

Groups are random but realistic (P = 20 MB of compressed gradients and B = 4096, as for
ALBERT-large in DeDLOC): speeds over three orders of magnitude (15 % of peers cannot compute:
backbones, CPU-less), upload and download each between 10 kB/s and 100 MB/s, 70 % reachable.
Timed: the full assignment (who computes + shares + prediction); the closed-form shares alone
with every compute-capable peer computing (an LP over all n peers); and HiGHS
(`scipy.optimize.linprog(method="highs")`) solving that same shares LP, the baseline of the
same run. `gap` is the certified distance to the optimum (upper bound / achieved - 1).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from peer.roles import PeerCapacity, assign_roles, optimal_shares
from peer.roles.lp import shares_lp


def random_group(rng: random.Random, n: int) -> list[PeerCapacity]:
    return [
        PeerCapacity(
            peer_id=f"peer-{i:05d}",
            samples_per_s=0.0 if rng.random() < 0.15 else 10 ** rng.uniform(-1, 2),
            upload_bps=10 ** rng.uniform(4, 8),
            download_bps=10 ** rng.uniform(4, 8),
            reachable=rng.random() < 0.7 or i == 0,
        )
        for i in range(n)
    ]


def median_ms(fn, repeat: int) -> float:
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--peers", type=int, nargs="+", default=[16, 64, 256, 1024])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    rng = random.Random(0)
    header = f"{'peers':>6} {'full assignment':>16} {'shares (ours)':>14} {'shares (HiGHS)':>15}"
    print(f"{header} {'HiGHS / ours':>13} {'computing':>10} {'gap':>9}   (median ms)")
    print(f"{'':>6} {'':>16} {'':>14} {'(baseline)':>15}")
    for n in args.peers:
        group = random_group(rng, n)

        def solve(group=group):
            return assign_roles(group, gradient_bytes=2e7, target_batch=4096, delayed=False)

        a = solve()
        ordered = sorted(group, key=lambda p: p.peer_id)
        # Shares are timed for every peer that can compute computing: an LP over all n peers.
        computes = [p.samples_per_s > 0 and p.bandwidth > 0 for p in ordered]
        full = median_ms(solve, args.repeat)
        ours = median_ms(lambda o=ordered, c=computes: optimal_shares(o, c), args.repeat)
        highs = median_ms(lambda o=ordered, c=computes: shares_lp(o, c), args.repeat)
        gap = a.upper_bound / a.samples_per_s - 1
        print(
            f"{n:>6} {full:>16.2f} {ours:>14.3f} {highs:>15.2f} {highs / ours:>12,.0f}x"
            f" {sum(r.computes for r in a.roles):>10} {gap:>9.1e}"
        )


if __name__ == "__main__":
    main()
