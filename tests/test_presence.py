"""Reading presence records: only owner-signed entries that name their own peer count."""

from __future__ import annotations

import msgspec

from peer.dht.records import Entry
from peer.presence import PresenceRecord, decode_presence
from tests.helpers import new_identity


def entry(record: PresenceRecord | bytes) -> Entry:
    value = record if isinstance(record, bytes) else msgspec.msgpack.encode(record)
    return Entry(value, 1e12)


def record(peer_id: str, role: str = "peer") -> PresenceRecord:
    return PresenceRecord(peer_id, role, [], "0.1.0", 0.0, 0.0)  # type: ignore[arg-type]


def test_only_owner_signed_self_describing_records_are_read():
    alice, bob, carol = (new_identity().peer_id.to_base58() for _ in range(3))
    entries = {
        alice: entry(record(alice)),
        bob: entry(record(alice)),  # names another peer: dropped
        carol: entry(b"\xc1 not msgpack"),  # malformed: dropped
        "mallory": entry(record("mallory", "backbone")),  # open subkey: nobody signed it
    }
    assert [r.peer_id for r in decode_presence(entries)] == [alice]


def test_backbones_are_listed_first():
    ids = sorted(new_identity().peer_id.to_base58() for _ in range(3))
    entries = {ids[0]: entry(record(ids[0])), ids[2]: entry(record(ids[2], "backbone"))}
    assert [r.role for r in decode_presence(entries)] == ["backbone", "peer"]
