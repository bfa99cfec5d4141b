"""`peer status`: a view of the collaboration from any machine that can reach a backbone.

It runs a short-lived DHT *client* with a throw-away identity: it asks, never stores, and no
routing table adds it. The result is plain data (`StatusReport`) that the CLI renders as a
table or JSON.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.config import PeerConfig
from peer.daemon import join, parse_backbones
from peer.dht.node import DHT
from peer.errors import Unreachable
from peer.net.host import open_node
from peer.net.identity import Identity
from peer.presence import decode_presence, presence_key

STATUS_JOIN_BACKOFF = (0.5, 1.0)


@dataclass(frozen=True)
class PeerRow:
    peer_id: str
    role: str
    addrs: list[str]
    version: str
    started_at: float
    uptime_s: float
    last_seen_s: float  # seconds since the peer last refreshed its presence
    expires_in_s: float


@dataclass(frozen=True)
class CollaborationSummary:
    name: str
    peers_online: int
    backbones_online: int
    backbones_reached: list[str]
    queried_at: float


@dataclass(frozen=True)
class StatusReport:
    collaboration: CollaborationSummary
    peers: list[PeerRow]

    def to_json(self) -> dict:
        return {
            "collaboration": asdict(self.collaboration),
            "peers": [asdict(row) for row in self.peers],
        }


def ephemeral_identity() -> Identity:
    key_pair = create_new_key_pair()
    return Identity(key_pair=key_pair, peer_id=ID.from_pubkey(key_pair.public_key), path=None)


async def collect_status(config: PeerConfig) -> StatusReport:
    seeds = parse_backbones(config.collaboration.backbones)
    if not seeds:
        raise Unreachable("no backbone given; pass --backbone MADDR (printed by `backbone start`)")
    async with open_node(
        ephemeral_identity(), listen=[], announce=[], max_message_bytes=config.net.max_message_bytes
    ) as node:
        dht = DHT(node, config.dht, server=False, rpc_timeout=config.net.rpc_timeout)
        reached = await join(dht, seeds, backoff=STATUS_JOIN_BACKOFF)
        entries = await dht.get(presence_key(config.collaboration.name))
    now = time.time()
    records = decode_presence(entries)
    rows = [
        PeerRow(
            peer_id=r.peer_id,
            role=r.role,
            addrs=r.addrs,
            version=r.version,
            started_at=r.started_at,
            uptime_s=max(0.0, now - r.started_at),
            last_seen_s=max(0.0, now - r.updated_at),
            expires_in_s=entries[r.peer_id].expiration - now,
        )
        for r in records
    ]
    summary = CollaborationSummary(
        name=config.collaboration.name,
        peers_online=sum(row.role == "peer" for row in rows),
        backbones_online=sum(row.role == "backbone" for row in rows),
        backbones_reached=[str(peer_id) for peer_id in reached],
        queried_at=now,
    )
    return StatusReport(summary, rows)
