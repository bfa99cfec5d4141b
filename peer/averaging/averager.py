"""Averaging a vector with the collaboration: gather, then Moshpit rounds of grouped all-reduce.

    averager.average(vector, weight=..., epoch=..., fingerprint=..., gather_until=...)

declares this peer's ticket, waits until `gather_until` (a wall-clock time every peer of the
epoch uses, read on the DHT's clock: the backbones' time, peer.measure.clock), reads every
ticket, and runs k = ceil(log_m N) rounds: in each, the Moshpit group forms (`matchmaking.py`) and runs one all-reduce (`allreduce.py`) with deadlines derived from
the bytes each member moves and its measured bandwidth (`group.round_timeouts`). A round whose
group is too small, or that fails, is reported and skipped: the vector keeps what the earlier
rounds made of it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import trio

from peer.averaging.allreduce import DataServer, RoundReport, RoundSpec, allreduce
from peer.averaging.compression import CODECS
from peer.averaging.crypto import RoundKey
from peer.averaging.group import Joined, Ticket, round_timeouts
from peer.averaging.matchmaking import Matchmaker, RoundShape, TooFewPeers
from peer.averaging.moshpit import rounds_for
from peer.config import AveragingConfig
from peer.dht.node import DHT
from peer.measure.capabilities import Capabilities

log = logging.getLogger("peertrain.averager")


def fingerprint(tensors: Sequence[tuple[str, Sequence[int], str]]) -> str:
    """A model's identity for matchmaking: names, shapes and dtypes of its tensors, in order.
    Peers with different fingerprints never meet, so never average incompatible vectors."""
    digest = hashlib.blake2b(digest_size=12)
    for name, shape, dtype in tensors:
        digest.update(f"{name}:{tuple(shape)}:{dtype};".encode())
    return digest.hexdigest()


@dataclass
class AveragingResult:
    peers_seen: int
    """Tickets this peer read when the gathering closed (itself included)."""
    rounds: list[RoundReport] = field(default_factory=list)
    groups: list[list[str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    """Why rounds were skipped (group too small, ...)."""


class Averager:
    def __init__(
        self,
        dht: DHT,
        config: AveragingConfig,
        *,
        collaboration: str,
        data_server: DataServer,
        data_host: str,
        data_port: int,
    ) -> None:
        self.dht = dht
        self.config = config
        self.collaboration = collaboration
        self.data_server = data_server
        self.data_host = data_host
        self.data_port = data_port
        self.me = dht.node.peer_id.to_base58()
        self.matchmaker = Matchmaker(
            dht,
            group_size=config.group_size,
            min_group_size=config.min_group_size,
            join_timeout=config.join_timeout,
        )

    async def average(
        self,
        vector: np.ndarray,
        *,
        weight: float,
        epoch: int,
        fingerprint: str,
        gather_until: float,
        capabilities: Capabilities | None = None,
        computes: bool | None = None,
        on_round: Callable[[int, RoundReport], None] = lambda index, report: None,
    ) -> AveragingResult:
        """Average `vector` (float32, updated in place) with every peer of the epoch.

        `weight` is the samples behind it. `computes` (default: weight > 0) makes this member
        send its vector and receive the average; weight 0 with computes=True receives the
        average and adds nothing to it (a trainer that has no samples yet), weight 0 with
        computes=False only reduces its share for the others (an aggregator).
        """
        namespace = f"{self.collaboration}/avg/{fingerprint}/{epoch}"
        ticket = Ticket(
            peer_id=self.me,
            rpc_addrs=self.dht.node.public_addrs(),
            data_host=self.data_host,
            data_port=self.data_port,
            computes=weight > 0 if computes is None else computes,
            weight=weight,
            capabilities=capabilities,
        )
        await self.matchmaker.declare(namespace, ticket, expiration=gather_until + 600)
        if self.dht.clock() > gather_until:
            log.warning(
                "our ticket for epoch %d was stored %.1fs after the gathering closed: other "
                "peers may not have seen it (a longer gathering window helps)",
                epoch,
                self.dht.clock() - gather_until,
            )
        await trio.sleep(max(0.0, gather_until - self.dht.clock()))
        view = await self.matchmaker.read_tickets(namespace)
        if self.me not in {t.peer_id for t in view}:
            view.append(ticket)  # our own store may not be readable yet
        result = AveragingResult(peers_seen=len(view))
        shape = RoundShape(
            epoch=epoch,
            size=len(vector),
            codec=self.config.codec,
            chunk_elements=self.config.chunk_elements,
        )
        try:
            for index in range(rounds_for(len(view), self.config.group_size)):
                report = await self._round(namespace, index, view, ticket, vector, shape, result)
                if report is not None:
                    on_round(index, report)
        finally:
            self.matchmaker.forget(namespace)
        return result

    async def _round(
        self,
        namespace: str,
        index: int,
        view: list[Ticket],
        ticket: Ticket,
        vector: np.ndarray,
        shape: RoundShape,
        result: AveragingResult,
    ) -> RoundReport | None:
        key = RoundKey(
            f"{namespace}|{index}".encode(), self.me, self.dht.node.identity.key_pair.private_key
        )
        try:
            spec = await self.matchmaker.form_group(
                namespace, index, view, Joined(ticket, key.announcement), shape
            )
        except TooFewPeers as error:
            result.skipped.append(f"round {index}: {error}")
            return None
        problem = _spec_problem(spec, shape, self.me)
        if problem:
            result.skipped.append(f"round {index}: the leader's spec {problem}")
            return None
        bandwidth = {
            t.peer_id: min(t.capabilities.upload_bps, t.capabilities.download_bps)
            for t in view
            if t.capabilities is not None
        }
        duration, stall = round_timeouts(
            spec,
            bandwidth,
            wire_bytes_per_element=CODECS[shape.codec].wire_bytes(1 << 20) / (1 << 20),
            floor=self.config.timeout_floor,
            multiplier=self.config.timeout_multiplier,
        )
        report = await allreduce(
            spec,
            key,
            vector,
            self.data_server,
            deadline=trio.current_time() + duration,
            stall_timeout=stall,
            norm_factor=(
                self.config.norm_factor if self.config.aggregation == "centered_clip" else None
            ),
        )
        result.rounds.append(report)
        result.groups.append([m.peer_id for m in spec.members])
        return report


def _spec_problem(spec: RoundSpec, shape: RoundShape, me: str) -> str | None:
    """What is wrong with a leader's spec for us, or None."""
    ours = (shape.size, shape.codec, shape.chunk_elements)
    if (spec.size, spec.codec, spec.chunk_elements) != ours:
        return f"does not match our vector: {spec.size} values, {spec.codec}, {spec.chunk_elements}"
    if me not in [m.peer_id for m in spec.members]:
        return "leaves us out"
    return None
