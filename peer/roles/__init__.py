"""Role assignment (DeDLOC): who computes gradients and who reduces which share of them.

A pure function of the group's capability records, so every peer computes the same answer
without a coordinator. `model` holds the cost model, `shares` the exact all-reduce LP for fixed
roles, `search` the choice of computing peers, `lp` the HiGHS reference used by tests.
"""

from peer.roles.model import PeerCapacity, Prediction, aggregators, predict
from peer.roles.search import EXACT_LIMIT, Assignment, PeerRole, assign_roles
from peer.roles.shares import MAX_SHARE_RATIO, cap_shares, optimal_shares, share_cap

__all__ = [
    "EXACT_LIMIT",
    "MAX_SHARE_RATIO",
    "Assignment",
    "PeerCapacity",
    "PeerRole",
    "Prediction",
    "aggregators",
    "assign_roles",
    "cap_shares",
    "optimal_shares",
    "predict",
    "share_cap",
]
