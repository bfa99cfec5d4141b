"""The cost model of one collaborative step, pure: who computes, who aggregates, how long it takes.

A step (DeDLOC, Diskin et al. 2021, section 3.2): the computing peers process the target batch
B together, then average their gradients of P bytes with a butterfly all-reduce in which peer i
reduces a share g_i of the vector (sum g = 1). With K computing peers and c_i = 1 if peer i
computes, peer i sends (and receives) per round

    bytes_i = c_i (1 - g_i) P  +  g_i P (K - c_i)  =  P (c_i + g_i (K - 2 c_i))

(its own gradient's other parts out, averaged parts back; for its own part, the other computing
peers' contributions in and the average back out). Upload and download volumes are equal, so
peer i needs bytes_i / min(u_i, d_i) seconds, and the round takes the slowest peer's time.
Compute takes B / (sum of s_i over computing peers). A step takes compute + communication, or
the max of the two when parameter updates are delayed (compute overlaps communication).

Two rules on top of the formula:
- A peer that cannot be reached inbound (client-only) holds no share when K >= 2.
- K = 1: the lone computing peer holds the whole vector and nobody sends anything, whatever
  its reachability, because nobody needs to connect to it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class PeerCapacity:
    """What the solver knows of one peer, from its capability record."""

    peer_id: str
    samples_per_s: float
    """Measured training throughput; 0 = cannot compute (a backbone, or not measured yet)."""
    upload_bps: float
    """Measured upload, bytes/s; 0 = unknown."""
    download_bps: float
    """Measured download, bytes/s; 0 = unknown."""
    reachable: bool
    """Others can dial it: it may aggregate."""

    def __post_init__(self) -> None:
        for name in ("samples_per_s", "upload_bps", "download_bps"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{self.peer_id}: {name} = {value!r}; expected a number >= 0")

    @property
    def bandwidth(self) -> float:
        """Bytes/s it can both send and receive: the model's traffic is symmetric."""
        return min(self.upload_bps, self.download_bps)

    @property
    def can_aggregate(self) -> bool:
        return self.reachable and self.bandwidth > 0


def aggregators(reachable: Sequence[bool], punchable: Sequence[bool]) -> list[bool]:
    """Who may hold a share among peers that all send to every holder (pure): a reachable
    peer, and one reachable only by hole punching when every peer is reachable or punchable.
    A punch needs the NATs at both ends to keep their peer's address: a peer behind a
    symmetric NAT reaches only reachable ones, so with one among them nobody behind NAT holds
    a share; a reachable peer reaches a punchable one (its own dial goes straight in)."""
    if len(reachable) != len(punchable):
        raise ValueError("one reachable and one punchable flag per peer")
    everyone = all(r or p for r, p in zip(reachable, punchable, strict=True))
    return [r or (p and everyone) for r, p in zip(reachable, punchable, strict=True)]


def bytes_per_round(*, computes: bool, share: float, computing: int) -> float:
    """Bytes peer i sends (and receives) per round, in units of P: c + g (K - 2c)."""
    c = 1.0 if computes else 0.0
    return c + share * (computing - 2.0 * c)


@dataclass(frozen=True)
class Prediction:
    compute_time: float
    """Seconds for the computing peers to process the target batch."""
    comm_time: float
    """Seconds of the slowest peer's all-reduce traffic."""
    step_time: float
    samples_per_s: float
    peer_bytes: tuple[float, ...]
    """Bytes each peer sends (and receives) per round."""
    peer_comm_time: tuple[float, ...]


def step_time(compute_time: float, comm_time: float, *, delayed: bool) -> float:
    return max(compute_time, comm_time) if delayed else compute_time + comm_time


def predict(
    peers: Sequence[PeerCapacity],
    computes: Sequence[bool],
    shares: Sequence[float],
    *,
    gradient_bytes: float,
    target_batch: float,
    delayed: bool,
) -> Prediction:
    """Evaluate any role assignment under the model (the reference the solver is checked against)."""
    k = sum(computes)
    speed = sum(p.samples_per_s for p, c in zip(peers, computes, strict=True) if c)
    compute = target_batch / speed if speed > 0 else math.inf
    peer_bytes = tuple(
        gradient_bytes * bytes_per_round(computes=c, share=g, computing=k)
        for c, g in zip(computes, shares, strict=True)
    )
    peer_times = tuple(
        0.0 if b <= 0 else (b / p.bandwidth if p.bandwidth > 0 else math.inf)
        for p, b in zip(peers, peer_bytes, strict=True)
    )
    comm = max(peer_times, default=0.0)
    step = step_time(compute, comm, delayed=delayed)
    return Prediction(
        compute_time=compute,
        comm_time=comm,
        step_time=step,
        samples_per_s=target_batch / step if step > 0 else math.inf,
        peer_bytes=peer_bytes,
        peer_comm_time=peer_times,
    )
