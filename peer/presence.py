"""Presence: each node's signed, expiring "I am here" record in the DHT.

Key `<collaboration>/presence`, subkey = the node's peer id, so the entry is owner-signed and
no one else can write or withdraw it. The node rewrites it every `refresh` seconds with a
`ttl`-second expiration; a node that dies simply stops refreshing and its entry expires.
A node that stops cleanly withdraws it with a tombstone.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Annotated, Literal

import msgspec
import trio

from peer.dht.node import DHT
from peer.dht.records import owner_key
from peer.errors import DECODE_ERRORS, RemoteError
from peer.measure.capabilities import Capabilities

log = logging.getLogger("peertrain.presence")

Role = Literal["peer", "backbone"]


class PresenceRecord(msgspec.Struct, frozen=True):
    peer_id: Annotated[str, msgspec.Meta(max_length=128)]
    role: Role
    addrs: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=256)]], msgspec.Meta(max_length=16)
    ]
    version: Annotated[str, msgspec.Meta(max_length=64)]
    started_at: float
    updated_at: float
    capabilities: Capabilities | None = None
    """Measured figures; None until the first measurement finishes. The figures are the peer's
    claims; `capabilities.attestations` are what backbones measured and signed."""
    aggregator: bool = False
    """A backbone that joins averaging as an aggregator-only member (`peer.training.aggregator`)."""
    reduced: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.0
    """Such a backbone: the fraction of the vector it reduced in its last averaging (a trainer
    states its own in its progress record)."""


def presence_key(collaboration: str) -> str:
    return f"{collaboration}/presence"


async def keep_present(
    dht: DHT,
    make_record: Callable[[], PresenceRecord],
    *,
    collaboration: str,
    ttl: float,
    refresh: float,
    wait_changed: Callable[[], Awaitable[None]] = trio.sleep_forever,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Publish our presence now, every `refresh` seconds, and as soon as `wait_changed()`
    returns (new measurements); withdraw it when cancelled."""
    key = presence_key(collaboration)
    subkey = dht.node.peer_id.to_base58()
    started = False
    last_expiration = 0.0
    try:
        while True:
            record = make_record()
            last_expiration = record.updated_at + ttl
            try:
                # Bounded by refresh so a slow round never lets the record lapse unnoticed.
                with trio.move_on_after(refresh):
                    replicas = await dht.store(
                        key, subkey, msgspec.msgpack.encode(record), expiration=last_expiration
                    )
                    if replicas == 0:
                        log.warning(
                            "presence record stored on no replica; retrying in %.3gs", refresh
                        )
            except RemoteError as error:
                log.warning("could not publish presence: %s", error)
            if not started:
                started = True
                task_status.started()
            with trio.move_on_after(refresh):
                await wait_changed()
    finally:
        # The tombstone must outlive the record it replaces, hence last_expiration + 1.
        with trio.CancelScope(shield=True), trio.move_on_after(1.0):
            try:
                replicas = await dht.withdraw(key, subkey, expiration=last_expiration + 1.0)
                log.debug("presence withdrawn from %d replicas", replicas)
            except RemoteError as error:
                log.debug("could not withdraw presence: %s", error)


def decode_presence(entries: dict[str, object]) -> list[PresenceRecord]:
    """Records from a presence get. Only owner-signed entries count (the subkey is a peer id,
    so the DHT checked its signature), and only if the record names that same peer."""
    records = []
    for subkey, entry in entries.items():
        if owner_key(subkey) is None:
            log.debug("ignoring a presence entry under open subkey %r", subkey[:64])
            continue
        try:
            record = msgspec.msgpack.decode(entry.value, type=PresenceRecord)  # type: ignore[attr-defined]
        except DECODE_ERRORS:
            log.debug("ignoring malformed presence record under %s", subkey)
            continue
        if record.peer_id == subkey:
            records.append(record)
    return sorted(records, key=lambda r: (r.role != "backbone", r.peer_id))
