"""The shares LP in its textbook form, solved by HiGHS: the reference for `shares.py`.

Same program as in `shares.py`, with variables (g_1 .. g_n, t), t in seconds per byte of P:

    minimise t  s.t.  g_i (K - 2 c_i) / b_i - t <= -c_i / b_i   (peers that take part)
                      sum g_i = 1,  0 <= g_i <= 1,  g_i = 0 unless i can aggregate

Tests check that its optimal t equals the closed form's; the benchmark times both. scipy is
imported here only, so the daemon does not need it.
"""

from __future__ import annotations

from collections.abc import Sequence

from peer.roles.model import PeerCapacity


def shares_lp(peers: Sequence[PeerCapacity], computes: Sequence[bool]) -> tuple[list[float], float]:
    """Optimal shares and round time per byte of P for fixed roles, by HiGHS (K >= 2)."""
    import numpy as np
    from scipy.optimize import linprog

    n, k = len(peers), sum(computes)
    if k < 2:
        raise ValueError("the LP is for K >= 2 computing peers; K = 1 needs no traffic")
    # HiGHS's tolerances are absolute (~1e-7): in bytes/s the coefficients would be ~1e-8 and
    # every t would look feasible. Measure bandwidth in units of the fastest peer's instead.
    unit = max(p.bandwidth for p in peers)
    bw = [p.bandwidth / unit for p in peers]
    rows, rhs = [], []
    for i in range(n):
        if computes[i] or peers[i].can_aggregate:  # everyone else sends nothing
            row = np.zeros(n + 1)
            row[i] = (k - 2 * computes[i]) / bw[i]
            row[n] = -1.0
            rows.append(row)
            rhs.append(-computes[i] / bw[i])
    objective = np.zeros(n + 1)
    objective[n] = 1.0
    result = linprog(
        objective,
        A_ub=np.array(rows),
        b_ub=np.array(rhs),
        A_eq=np.array([[1.0] * n + [0.0]]),
        b_eq=np.array([1.0]),
        bounds=[(0.0, 1.0 if p.can_aggregate else 0.0) for p in peers] + [(0.0, None)],
        method="highs",
    )
    if result.status != 0:
        raise ValueError(f"HiGHS found no optimum: {result.message}")
    return [float(g) for g in result.x[:n]], float(result.x[n]) / unit
