"""Record rules, pure: latest-wins, tombstones, owner signatures, limits, expiry, what one
writer may hold, and which entries a bounded reply carries."""

import contextlib
import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st
from libp2p.crypto.ed25519 import create_new_key_pair
from libp2p.peer.id import ID

from peer.dht.records import (
    MAX_TTL,
    Entry,
    Limits,
    RecordStore,
    entry_bytes,
    live,
    make_entry,
    merge,
    owner_key,
    select,
    wire_bytes,
)
from peer.errors import ProtocolError

LIMITS = Limits(max_value_bytes=100, max_subkeys=3, max_keys=2, max_ttl=60.0, max_clock_skew=5.0)
NOW = 1_000_000.0
W = "writer"  # an open-subkey writer


def owner():
    key_pair = create_new_key_pair()
    return key_pair, ID.from_pubkey(key_pair.public_key).to_base58()


def test_latest_expiration_wins_regardless_of_order():
    store = RecordStore(LIMITS)
    assert store.store("k", "s", Entry(b"new", NOW + 20), now=NOW, writer=W)
    assert not store.store("k", "s", Entry(b"old", NOW + 10), now=NOW, writer=W)
    assert store.get("k", now=NOW)["s"].value == b"new"


def test_tie_break_is_independent_of_arrival_order():
    a, b = Entry(b"aaa", NOW + 10), Entry(b"bbb", NOW + 10)
    first, second = RecordStore(LIMITS), RecordStore(LIMITS)
    first.store("k", "s", a, now=NOW, writer=W)
    first.store("k", "s", b, now=NOW, writer=W)
    second.store("k", "s", b, now=NOW, writer=W)
    second.store("k", "s", a, now=NOW, writer=W)
    assert first.get("k", now=NOW) == second.get("k", now=NOW)


def test_expired_entries_are_never_returned_and_get_purged():
    store = RecordStore(LIMITS)
    store.store("k", "s", Entry(b"v", NOW + 5), now=NOW, writer=W)
    assert live(store.get("k", now=NOW + 4), now=NOW + 4)
    assert store.get("k", now=NOW + 5) == {}
    assert len(store) == 0


def test_purge_counts_and_drops_expired():
    store = RecordStore(LIMITS)
    store.store("a", "s", Entry(b"v", NOW + 5), now=NOW, writer=W)
    store.store("b", "s", Entry(b"v", NOW + 50), now=NOW, writer=W)
    assert store.purge(now=NOW + 10) == 1
    assert list(store.keys()) == ["b"]


def test_tombstone_supersedes_and_hides():
    store = RecordStore(LIMITS)
    store.store("k", "s", Entry(b"v", NOW + 10), now=NOW, writer=W)
    store.store("k", "s", Entry(None, NOW + 11), now=NOW, writer=W)
    assert live(store.get("k", now=NOW), now=NOW) == {}


def test_owner_subkey_requires_owner_signature():
    key_pair, peer = owner()
    store = RecordStore(LIMITS)
    good = make_entry("k", peer, b"v", NOW + 10, signer=key_pair.private_key)
    assert store.store("k", peer, good, now=NOW, writer=peer)
    with pytest.raises(ProtocolError, match="not signed by its owner"):
        store.store("k", peer, Entry(b"forged", NOW + 20), now=NOW, writer=peer)
    mallory, _ = owner()
    forged = make_entry("k", peer, b"forged", NOW + 20, signer=mallory.private_key)
    with pytest.raises(ProtocolError, match="not signed by its owner"):
        store.store("k", peer, forged, now=NOW, writer=peer)
    # Signatures of the wrong length (found by fuzzing: nacl raised its own ValueError).
    for signature in (b"\x00", good.signature + b"\x00", good.signature[:63]):
        with pytest.raises(ProtocolError, match="not signed by its owner"):
            store.store("k", peer, Entry(b"v2", NOW + 20, signature), now=NOW, writer=peer)
    assert store.get("k", now=NOW)[peer].value == b"v"


def test_signature_binds_key_value_and_expiration():
    key_pair, peer = owner()
    entry = make_entry("k", peer, b"v", NOW + 10, signer=key_pair.private_key)
    store = RecordStore(LIMITS)
    # Checked once and remembered (`records._VERIFIED`): what is remembered is the whole
    # entry, so the same signature over anything else is checked again, and refused.
    assert store.store("k", peer, entry, now=NOW, writer=peer)
    for key, changed in [
        ("other", entry),
        ("k", Entry(b"w", entry.expiration, entry.signature)),
        ("k", Entry(b"v", entry.expiration + 1, entry.signature)),
    ]:
        with pytest.raises(ProtocolError):
            store.store(key, peer, changed, now=NOW, writer=peer)


def test_open_subkeys_need_no_signature():
    assert owner_key("worker-3") is None
    assert owner_key("12D3KooWnotreallyapeerid") is None
    _, peer = owner()
    assert owner_key(peer) is not None


def test_limits_value_size_ttl_subkeys_keys():
    store = RecordStore(LIMITS)
    with pytest.raises(ProtocolError, match="value of 101 bytes"):
        store.store("k", "s", Entry(b"x" * 101, NOW + 1), now=NOW, writer=W)
    with pytest.raises(ProtocolError, match="ahead of now"):
        store.store("k", "s", Entry(b"x", NOW + 66), now=NOW, writer=W)
    store.store("k", "s", Entry(b"x", NOW + 64), now=NOW, writer=W)  # within max_ttl + skew
    for i in range(2):
        store.store("k", f"s{i}", Entry(b"x", NOW + 10), now=NOW, writer=W)
    with pytest.raises(ProtocolError, match="full"):
        store.store("k", "s9", Entry(b"x", NOW + 10), now=NOW, writer=W)
    store.store("k2", "s", Entry(b"x", NOW + 10), now=NOW, writer=W)
    with pytest.raises(ProtocolError, match="store full"):
        store.store("k3", "s", Entry(b"x", NOW + 10), now=NOW, writer=W)


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
            store.store("k", f"s{i}", Entry(b"x" * 100, NOW + 1 + i % 2), now=NOW, writer=f"w{i}")
            kept += 1
    assert kept == 1000 // cost and store.total_bytes == kept * cost
    # Replacing an entry costs only the difference; a smaller value frees bytes.
    store.store("k", "s0", Entry(b"y", NOW + 5), now=NOW, writer=W)
    assert store.total_bytes == (kept - 1) * cost + entry_bytes("k", "s0", Entry(b"y", NOW + 5))
    # Once the entries expire, the purge the full store runs makes room again.
    store.store("k2", "s", Entry(b"x" * 100, NOW + 10), now=NOW + 3, writer=W)
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
    store.store("k", "old", Entry(b"x", NOW + 1), now=NOW, writer=W)
    # The store purges "old" first.
    assert store.store("k", "new", Entry(b"y", NOW + 10), now=NOW + 2, writer=W)
    assert set(store.get("k", now=NOW + 2)) == {"new"}


def test_nan_expiration_is_rejected():
    with pytest.raises(ProtocolError):
        RecordStore(LIMITS).store("k", "s", Entry(b"x", float("nan")), now=NOW, writer=W)


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


@given(
    st.dictionaries(
        st.sampled_from(["a", "b"]),
        st.builds(
            Entry,
            st.one_of(st.none(), st.binary(max_size=2)),
            st.sampled_from([1.0, 2.0]),
            st.binary(max_size=2),
        ),
    ),
    st.dictionaries(
        st.sampled_from(["a", "b", "c"]),
        st.builds(
            Entry,
            st.one_of(st.none(), st.binary(max_size=2)),
            st.sampled_from([1.0, 2.0]),
            st.binary(max_size=2),
        ),
    ),
)
def test_merge_keeps_the_entry_that_supersedes(held, reply):
    """Expirations compared first (`merge`'s shortcut) pick what `Entry.supersedes` picks, also
    between entries of one expiration."""
    merged = dict(held)
    merge(merged, reply)
    for subkey in held.keys() | reply.keys():
        old, new = held.get(subkey), reply.get(subkey)
        expected = new if old is None or (new is not None and new.supersedes(old)) else old
        assert merged[subkey] is expected


# ---------------------------------------------------------------------------- bounded writers

ROOMY = Limits(
    max_value_bytes=1000, max_subkeys=1000, max_keys=1000, max_ttl=60.0, max_clock_skew=5.0,
    max_open_subkeys=2, max_writer_entries=4, max_writer_bytes=2000,
)  # fmt: skip


def test_an_owner_subkey_is_written_by_its_owner_only():
    """A validly signed entry replayed by someone else is refused before its signature is
    checked: each identity holds one owner-signed subkey per key, whoever forwards it."""
    key_pair, peer = owner()
    _, mallory = owner()
    good = make_entry("k", peer, b"v", NOW + 10, signer=key_pair.private_key)
    store = RecordStore(ROOMY)
    with pytest.raises(ProtocolError, match="may not write"):
        store.store("k", peer, good, now=NOW, writer=mallory)
    assert store.store("k", peer, good, now=NOW, writer=peer)


def test_open_entries_carry_no_signature():
    with pytest.raises(ProtocolError, match="open but carries a signature"):
        RecordStore(ROOMY).store("k", "s", Entry(b"v", NOW + 10, b"x" * 64), now=NOW, writer=W)


def test_a_writer_holds_a_few_open_subkeys_per_key_and_may_take_over_another_writers():
    store = RecordStore(ROOMY)
    for subkey in ("a", "b"):
        assert store.store("k", subkey, Entry(b"v", NOW + 10), now=NOW, writer="w1")
    with pytest.raises(ProtocolError, match="holds 2 open subkeys of 'k' already"):
        store.store("k", "c", Entry(b"v", NOW + 10), now=NOW, writer="w1")
    assert store.store("k", "a", Entry(b"v2", NOW + 20), now=NOW, writer="w1")  # an update
    assert store.store("other", "c", Entry(b"v", NOW + 10), now=NOW, writer="w1")  # another key
    # A newer write to an open subkey takes it over: w1 then holds one fewer of "k".
    assert store.store("k", "a", Entry(b"w2", NOW + 30), now=NOW, writer="w2")
    assert store.store("k", "c", Entry(b"v", NOW + 10), now=NOW, writer="w1")
    assert store.held_by("w2") == (1, entry_bytes("k", "a", Entry(b"w2", NOW + 30)))


def test_a_writer_at_its_limits_loses_its_own_oldest_entries_and_nobody_elses():
    store = RecordStore(ROOMY)
    assert store.store("k0", "s", Entry(b"other", NOW + 50), now=NOW, writer="honest")
    for i in range(10):  # 4 entries at most
        assert store.store(f"k{i}", "x", Entry(b"v", NOW + 50), now=NOW, writer="flood")
    assert [k for k in sorted(store.keys()) if "x" in store.get(k, now=NOW)] == [
        "k6", "k7", "k8", "k9"
    ]  # fmt: skip
    assert store.held_by("flood")[0] == 4
    big = Entry(b"x" * 900, NOW + 50)  # 2000 bytes hold two of these
    for i in range(3):
        assert store.store(f"big{i}", "x", big, now=NOW, writer="flood")
    assert [k for k in sorted(store.keys()) if k.startswith("big")] == ["big1", "big2"]
    assert store.held_by("flood") == (2, 2 * entry_bytes("big0", "x", big))
    assert store.get("k0", now=NOW)["s"].value == b"other"
    assert store.total_bytes == sum(store.held_by(w)[1] for w in ("honest", "flood"))
    with pytest.raises(ProtocolError, match="one writer may hold 2000 at most"):
        RecordStore(dataclasses.replace(ROOMY, max_value_bytes=4000)).store(
            "k", "s", Entry(b"x" * 3000, NOW + 1), now=NOW, writer=W
        )


def test_expiry_frees_a_writers_share():
    store = RecordStore(ROOMY)
    store.store("k", "s", Entry(b"v", NOW + 1), now=NOW, writer=W)
    assert store.purge(now=NOW + 2) == 1
    assert store.held_by(W) == (0, 0) and store.total_bytes == 0


def test_no_record_outlives_an_hour_whatever_the_config():
    assert 600 < MAX_TTL <= 3600  # tickets live 10 minutes past their gathering


operations = st.lists(
    st.tuples(
        st.sampled_from(["k1", "k2", "k3"]),
        st.sampled_from(["a", "b", "c", "d"]),
        st.sampled_from(["w1", "w2", "w3"]),
        st.integers(0, 600),
        st.integers(1, 50),
    ),
    max_size=40,
)


@given(operations)
def test_writer_limits_and_byte_counts_hold_after_any_writes(ops):
    store = RecordStore(dataclasses.replace(ROOMY, max_subkeys=3, max_total_bytes=3000))
    for now, (key, subkey, writer, size, ttl) in enumerate(ops):
        with contextlib.suppress(ProtocolError):
            store.store(
                key, subkey, Entry(b"x" * size, NOW + now + ttl), now=NOW + now, writer=writer
            )
        held = {w: store.held_by(w) for w in ("w1", "w2", "w3")}
        assert all(n <= ROOMY.max_writer_entries and b <= ROOMY.max_writer_bytes
                   for n, b in held.values())  # fmt: skip
        assert store.total_bytes == sum(b for _, b in held.values()) <= 3000
        for k in sorted(store.keys()):
            assert len(store.get(k, now=NOW + now)) <= 3


# ---------------------------------------------------------------------------- bounded replies


def test_select_serves_signed_then_small_then_fresh_entries_within_budget_and_count():
    signed = b"s" * 64
    entries = {
        "junk-big": Entry(b"j" * 1000, NOW + 99),  # open and large: last
        "junk-small": Entry(b"j", NOW + 99),  # open: after every signed one
        "old": Entry(b"v" * 100, NOW + 10, signed),
        "new": Entry(b"v" * 100, NOW + 20, signed),  # same size class, fresher: first
        "huge": Entry(b"h" * 600, NOW + 30, signed),  # a larger class: after both
    }
    assert select(entries, budget=10_000, max_entries=10) == entries  # all fit: all of them
    # One fewer than all: in order, the large junk left out.
    assert list(select(entries, budget=10_000, max_entries=4)) == [
        "new",
        "old",
        "huge",
        "junk-small",
    ]
    assert list(select(entries, budget=10_000, max_entries=2)) == ["new", "old"]
    # "huge" does not fit what is left of 700 bytes, and the smaller "junk-small" still does.
    fitting = select(entries, budget=700, max_entries=10)
    assert list(fitting) == ["new", "old", "junk-small"]
    assert sum(wire_bytes(s, e) for s, e in fitting.items()) <= 700
    assert wire_bytes("new", entries["new"]) == 3 + 100 + 64 + 64
    assert select({}, budget=0, max_entries=0) == {}


@given(
    st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.builds(
            Entry,
            st.one_of(st.none(), st.binary(max_size=300)),
            st.floats(0, 100),
            st.sampled_from([b"", b"s" * 64]),
        ),
        max_size=30,
    ),
    st.integers(0, 3000),
    st.integers(0, 40),
)
def test_select_fits_and_is_independent_of_order(entries, budget, count):
    chosen = select(entries, budget=budget, max_entries=count)
    assert len(chosen) <= count
    assert sum(wire_bytes(s, e) for s, e in chosen.items()) <= budget
    assert select(dict(reversed(list(entries.items()))), budget=budget, max_entries=count) == chosen
