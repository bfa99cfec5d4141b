"""Record rules, pure: latest-wins, tombstones, owner signatures, limits, expiry."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.dht.records import (
    Entry,
    Limits,
    RecordStore,
    entry_bytes,
    live,
    make_entry,
    merge,
    owner_key,
)
from peer.errors import ProtocolError

LIMITS = Limits(max_value_bytes=100, max_subkeys=3, max_keys=2, max_ttl=60.0, max_clock_skew=5.0)
NOW = 1_000_000.0


def owner():
    key_pair = create_new_key_pair()
    return key_pair, ID.from_pubkey(key_pair.public_key).to_base58()


def test_latest_expiration_wins_regardless_of_order():
    store = RecordStore(LIMITS)
    assert store.store("k", "s", Entry(b"new", NOW + 20), now=NOW)
    assert not store.store("k", "s", Entry(b"old", NOW + 10), now=NOW)
    assert store.get("k", now=NOW)["s"].value == b"new"


def test_tie_break_is_independent_of_arrival_order():
    a, b = Entry(b"aaa", NOW + 10), Entry(b"bbb", NOW + 10)
    first, second = RecordStore(LIMITS), RecordStore(LIMITS)
    first.store("k", "s", a, now=NOW)
    first.store("k", "s", b, now=NOW)
    second.store("k", "s", b, now=NOW)
    second.store("k", "s", a, now=NOW)
    assert first.get("k", now=NOW) == second.get("k", now=NOW)


def test_expired_entries_are_never_returned_and_get_purged():
    store = RecordStore(LIMITS)
    store.store("k", "s", Entry(b"v", NOW + 5), now=NOW)
    assert live(store.get("k", now=NOW + 4), now=NOW + 4)
    assert store.get("k", now=NOW + 5) == {}
    assert len(store) == 0


def test_purge_counts_and_drops_expired():
    store = RecordStore(LIMITS)
    store.store("a", "s", Entry(b"v", NOW + 5), now=NOW)
    store.store("b", "s", Entry(b"v", NOW + 50), now=NOW)
    assert store.purge(now=NOW + 10) == 1
    assert list(store.keys()) == ["b"]


def test_tombstone_supersedes_and_hides():
    store = RecordStore(LIMITS)
    store.store("k", "s", Entry(b"v", NOW + 10), now=NOW)
    store.store("k", "s", Entry(None, NOW + 11), now=NOW)
    assert live(store.get("k", now=NOW), now=NOW) == {}


def test_owner_subkey_requires_owner_signature():
    key_pair, peer = owner()
    store = RecordStore(LIMITS)
    good = make_entry("k", peer, b"v", NOW + 10, signer=key_pair.private_key)
    assert store.store("k", peer, good, now=NOW)
    with pytest.raises(ProtocolError, match="not signed by its owner"):
        store.store("k", peer, Entry(b"forged", NOW + 20), now=NOW)
    mallory, _ = owner()
    forged = make_entry("k", peer, b"forged", NOW + 20, signer=mallory.private_key)
    with pytest.raises(ProtocolError, match="not signed by its owner"):
        store.store("k", peer, forged, now=NOW)
    # Signatures of the wrong length (found by fuzzing: nacl raised its own ValueError).
    for signature in (b"\x00", good.signature + b"\x00", good.signature[:63]):
        with pytest.raises(ProtocolError, match="not signed by its owner"):
            store.store("k", peer, Entry(b"v2", NOW + 20, signature), now=NOW)
    assert store.get("k", now=NOW)[peer].value == b"v"


def test_signature_binds_key_value_and_expiration():
    key_pair, peer = owner()
    entry = make_entry("k", peer, b"v", NOW + 10, signer=key_pair.private_key)
    store = RecordStore(LIMITS)
    for key, changed in [
        ("other", entry),
        ("k", Entry(b"w", entry.expiration, entry.signature)),
        ("k", Entry(b"v", entry.expiration + 1, entry.signature)),
    ]:
        with pytest.raises(ProtocolError):
            store.store(key, peer, changed, now=NOW)


def test_open_subkeys_need_no_signature():
    assert owner_key("worker-3") is None
    assert owner_key("12D3KooWnotreallyapeerid") is None
    _, peer = owner()
    assert owner_key(peer) is not None


def test_limits_value_size_ttl_subkeys_keys():
    store = RecordStore(LIMITS)
    with pytest.raises(ProtocolError, match="value of 101 bytes"):
        store.store("k", "s", Entry(b"x" * 101, NOW + 1), now=NOW)
    with pytest.raises(ProtocolError, match="ahead of now"):
        store.store("k", "s", Entry(b"x", NOW + 66), now=NOW)
    store.store("k", "s", Entry(b"x", NOW + 64), now=NOW)  # within max_ttl + skew
    for i in range(2):
        store.store("k", f"s{i}", Entry(b"x", NOW + 10), now=NOW)
    with pytest.raises(ProtocolError, match="full"):
        store.store("k", "s9", Entry(b"x", NOW + 10), now=NOW)
    store.store("k2", "s", Entry(b"x", NOW + 10), now=NOW)
    with pytest.raises(ProtocolError, match="store full"):
        store.store("k3", "s", Entry(b"x", NOW + 10), now=NOW)


def test_total_bytes_are_capped_counted_exactly_and_freed_by_expiry():
    limits = Limits(
        max_value_bytes=100, max_subkeys=100, max_keys=100, max_ttl=60.0, max_clock_skew=5.0,
        max_total_bytes=1000,
    )  # fmt: skip
    store = RecordStore(limits)
    cost = entry_bytes("k", "s0", Entry(b"x" * 100, NOW + 1))
    kept = 0
    with pytest.raises(ProtocolError, match="store full: 1000 bytes"):
        for i in range(100):
            store.store("k", f"s{i}", Entry(b"x" * 100, NOW + 1 + i % 2), now=NOW)
            kept += 1
    assert kept == 1000 // cost and store.total_bytes == kept * cost
    # Replacing an entry costs only the difference; a smaller value frees bytes.
    store.store("k", "s0", Entry(b"y", NOW + 5), now=NOW)
    assert store.total_bytes == (kept - 1) * cost + entry_bytes("k", "s0", Entry(b"y", NOW + 5))
    # Once the entries expire, the purge the full store runs makes room again.
    store.store("k2", "s", Entry(b"x" * 100, NOW + 10), now=NOW + 3)
    assert store.get("k2", now=NOW + 3)
    assert set(store.get("k", now=NOW + 3)) == {"s0"}
    assert store.total_bytes == sum(
        entry_bytes(k, s, e) for k in ("k", "k2") for s, e in store.get(k, now=NOW + 3).items()
    )


def test_a_key_emptied_by_the_purge_a_store_runs_still_keeps_the_new_entry():
    limits = Limits(
        max_value_bytes=100, max_subkeys=1, max_keys=1, max_ttl=60.0, max_clock_skew=5.0
    )
    store = RecordStore(limits)
    store.store("k", "old", Entry(b"x", NOW + 1), now=NOW)
    assert store.store("k", "new", Entry(b"y", NOW + 10), now=NOW + 2)  # purges "old" first
    assert set(store.get("k", now=NOW + 2)) == {"new"}


def test_nan_expiration_is_rejected():
    with pytest.raises(ProtocolError):
        RecordStore(LIMITS).store("k", "s", Entry(b"x", float("nan")), now=NOW)


entries = st.dictionaries(
    st.sampled_from(["a", "b", "c"]),
    st.builds(Entry, st.one_of(st.none(), st.binary(max_size=4)), st.floats(0, 100)),
    max_size=3,
)


@given(st.lists(entries, max_size=5), st.randoms())
def test_merge_is_order_independent(replies, rng):
    one: dict[str, Entry] = {}
    for reply in replies:
        merge(one, reply)
    shuffled = list(replies)
    rng.shuffle(shuffled)
    two: dict[str, Entry] = {}
    for reply in shuffled:
        merge(two, reply)
    assert one == two
