"""DHT records, pure: `key -> {subkey: Entry(value, expiration, signature)}`.

Rules every node applies identically, so that any replica answers the same:
- **Latest expiration wins.** Of two entries for one (key, subkey), the one that expires later
  is kept. A writer that updates a value therefore always supersedes its older copy, because its new
  expiration (its clock now + ttl) is later. Ties are broken by a total order on the rest of
  the entry, so the choice never depends on arrival order.
- **Tombstones.** An entry whose value is None deletes: it supersedes older entries like any
  other write and is never returned to readers.
- **Owner-signed subkeys.** A subkey that is an Ed25519 peer id (`12D3KooW...`) belongs to that
  peer: only that peer may store it (the writer is the authenticated RPC caller), its entry must
  carry that peer's signature over (key, subkey, value, expiration), and every node and reader
  rejects it otherwise. Other subkeys are open: any writer may hold up to `MAX_OPEN_SUBKEYS` of
  a key, unsigned. Every record peers read (presence, progress, tickets) is owner-signed.
- **Expiration** is an absolute wall-clock time (seconds since the epoch). Clocks of peers differ
  by a few seconds; a node accepts an expiration up to `max_ttl + max_clock_skew` ahead of its
  own clock and never returns an entry its own clock says has expired. TTLs far above the skew
  (presence: 30 s TTL, 10 s refresh) keep records visible across skewed readers.
- **Bounds.** Value size, subkeys per key, keys and bytes per node are capped, and so is what one
  writer holds on a node (`MAX_WRITER_ENTRIES`, `MAX_WRITER_BYTES`): its oldest writes make
  room for its newest, so a flooder crowds out only itself. Expired entries are purged
  periodically and on access.
- **Replies are bounded** (`select`): the owner-signed, small and freshest entries that fit a
  byte budget, at most `MAX_REPLY_ENTRIES`; a reader applies the same rule to what it is sent.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec
from libp2p.crypto.ed25519 import Ed25519PublicKey
from libp2p.crypto.keys import PrivateKey
from libp2p.peer.id import ID

from peer.errors import ProtocolError

SIGNATURE_DOMAIN = b"peertrain/dht-entry/1"
SIGNATURE_BYTES = 64  # Ed25519
MAX_KEY_BYTES = 512
MAX_SUBKEY_BYTES = 128
#: Open subkeys one writer may hold per key: no caller writes any today (each writes its own
#: peer id); a few serve tools and tests, and keep one identity's share of a key small.
MAX_OPEN_SUBKEYS = 4
#: Entries one writer may hold on a node, its oldest making room for its newest. A trainer holds
#: a presence, a progress record and a ticket per step of the last ~10 minutes; filling a
#: node's 100,000 keys now takes ~400 identities instead of one.
MAX_WRITER_ENTRIES = 256
#: Bytes one writer may hold on a node (same rule): hundreds of real records (~1 KB), or about
#: four of the largest values (a node raises it to four whatever `dht.max_value_bytes` is);
#: filling a node's 256 MiB takes ~1,000 identities.
MAX_WRITER_BYTES = 256 * 1024
#: Longest lifetime a node accepts, whatever `dht.max_ttl` says: the longest-lived record peers
#: write is a ticket, 10 minutes past its gathering; junk stored once cannot last a day.
MAX_TTL = 3600.0
#: Entries in one get reply, so also the signatures a reader checks per reply: 512 x ~0.11 ms
#: = 60 ms at most; a reply's bytes (`node.REPLY_BYTES`) hold ~200-500 real records anyway.
MAX_REPLY_ENTRIES = 512
#: Invalid entries after which a reader drops a replica's whole reply: an honest replica
#: validated all it holds, so even one is a lie; a few allow for a replica's skewed clock.
MAX_INVALID_ENTRIES = 8
#: What msgpack adds to an entry in a reply, at most (field names, headers: 45 bytes measured).
ENTRY_OVERHEAD = 64


class Entry(msgspec.Struct, frozen=True):
    """One value under (key, subkey). `value=None` is a tombstone."""

    value: bytes | None
    expiration: float
    signature: bytes = b""

    def supersedes(self, other: Entry) -> bool:
        return self._order() > other._order()

    def _order(self) -> tuple[float, bool, bytes, bytes]:
        # A total order, so every replica keeps the same entry whatever the arrival order.
        return (self.expiration, self.value is not None, self.value or b"", self.signature)


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_value_bytes: int
    max_subkeys: int
    max_keys: int
    max_ttl: float
    max_clock_skew: float
    max_total_bytes: int = 256 << 20
    """Bytes of keys, subkeys, values and signatures one node holds, at most."""
    max_open_subkeys: int = MAX_OPEN_SUBKEYS
    """Open subkeys of one key one writer may hold."""
    max_writer_entries: int = MAX_WRITER_ENTRIES
    """Entries one writer may hold on this node; its oldest make room for its newest."""
    max_writer_bytes: int = MAX_WRITER_BYTES
    """Bytes (`entry_bytes`) one writer may hold on this node; same rule."""


def entry_bytes(key: str, subkey: str, entry: Entry) -> int:
    """What holding an entry costs, for the store's byte limits (64 bytes of overhead)."""
    return len(key) + len(subkey) + len(entry.value or b"") + len(entry.signature) + 64


def wire_bytes(subkey: str, entry: Entry) -> int:
    """An entry's size in a reply, at most."""
    return len(subkey.encode()) + len(entry.value or b"") + len(entry.signature) + ENTRY_OVERHEAD


@functools.lru_cache(maxsize=4096)
def owner_key(subkey: str) -> Ed25519PublicKey | None:
    """The public key a subkey names, if it is an Ed25519 peer id; else None (open subkey)."""
    if not subkey.startswith("12D3KooW"):
        return None
    try:
        public_key = ID.from_base58(subkey).extract_public_key()
    except Exception:  # base58 / multihash / protobuf each raise their own types
        return None
    return public_key if isinstance(public_key, Ed25519PublicKey) else None


def signed_by(owner: Ed25519PublicKey, payload: bytes, signature: bytes) -> bool:
    """Whether `signature` is `owner`'s over `payload`. Never raises on a peer's bytes: nacl
    raises its own ValueError for a signature that is not 64 bytes (found by fuzzing)."""
    if len(signature) != SIGNATURE_BYTES:
        return False
    try:
        return bool(owner.verify(payload, signature))
    except Exception:  # nacl's CryptoError family; libp2p catches only BadSignatureError
        return False


def signing_payload(key: str, subkey: str, value: bytes | None, expiration: float) -> bytes:
    return SIGNATURE_DOMAIN + msgspec.msgpack.encode((key, subkey, value, expiration))


def make_entry(
    key: str, subkey: str, value: bytes | None, expiration: float, *, signer: PrivateKey | None
) -> Entry:
    """An entry ready to store; owner subkeys must be signed by their owner's key."""
    signature = b""
    if signer is not None:
        signature = signer.sign(signing_payload(key, subkey, value, expiration))
    return Entry(value, expiration, signature)


def validate_entry(key: str, subkey: str, entry: Entry, *, now: float, limits: Limits) -> None:
    """Raise ProtocolError if a node must refuse to store or return this entry."""
    if not key or len(key.encode()) > MAX_KEY_BYTES:
        raise ProtocolError(f"key of {len(key.encode())} bytes; expected 1..{MAX_KEY_BYTES}")
    if not subkey or len(subkey.encode()) > MAX_SUBKEY_BYTES:
        raise ProtocolError(
            f"subkey of {len(subkey.encode())} bytes; expected 1..{MAX_SUBKEY_BYTES}"
        )
    if entry.value is not None and len(entry.value) > limits.max_value_bytes:
        raise ProtocolError(f"value of {len(entry.value)} bytes; limit is {limits.max_value_bytes}")
    if (
        not entry.expiration == entry.expiration
        or entry.expiration > now + limits.max_ttl + limits.max_clock_skew
    ):
        raise ProtocolError(
            f"expiration {entry.expiration!r} is more than max_ttl={limits.max_ttl}s ahead of now"
        )
    owner = owner_key(subkey)
    if owner is None:
        # So a signature marks an owner-signed entry, which `select` serves first.
        if entry.signature:
            raise ProtocolError(f"entry {key!r}/{subkey[:16]!r} is open but carries a signature")
        return
    payload = signing_payload(key, subkey, entry.value, entry.expiration)
    if len(entry.signature) != SIGNATURE_BYTES:
        raise ProtocolError(f"entry {key!r}/{subkey[:16]}... is not signed by its owner")
    # A trainer reads the same progress records every second from several replicas: each
    # entry is checked once. What is remembered names exactly what was checked: a signature
    # of fixed length, then the payload (which holds the key, the subkey, the value and the
    # expiration).
    checked = hashlib.sha256(entry.signature + payload).digest()
    if checked in _VERIFIED:
        _VERIFIED.move_to_end(checked)
        return
    if not signed_by(owner, payload, entry.signature):
        raise ProtocolError(f"entry {key!r}/{subkey[:16]}... is not signed by its owner")
    _VERIFIED[checked] = None
    if len(_VERIFIED) > VERIFIED_CACHE:
        _VERIFIED.popitem(last=False)


#: Entries whose signature checked out lately (digests of what was checked), newest last.
VERIFIED_CACHE = 8192
_VERIFIED: OrderedDict[bytes, None] = OrderedDict()


def page_of(subkey: str, pages: int) -> int:
    """The page of `pages` a subkey is read in: its hash, so every replica pages alike and a
    page's share of a key's entries does not move as entries come and go."""
    if pages <= 1:
        return 0
    return _subkey_hash(subkey) % pages


@functools.lru_cache(maxsize=4096)
def _subkey_hash(subkey: str) -> int:
    """A replica pages a key's every entry at each page asked (a key of 1,000 records read by
    1,000 simulated peers: a hash each time)."""
    return int.from_bytes(hashlib.blake2b(subkey.encode(), digest_size=8).digest(), "big")


def pages_for(entries: Mapping[str, Entry], *, budget: int) -> int:
    """Pages that `entries` fill at about three quarters of `budget` each (hash pages are
    uneven), at least 1."""
    total = sum(wire_bytes(subkey, entry) for subkey, entry in entries.items())
    return max(1, math.ceil(total / (0.75 * budget)))


def merge(into: dict[str, Entry], entries: Mapping[str, Entry]) -> None:
    """Merge replies from several replicas: per subkey, the entry that supersedes the other
    (`Entry.supersedes`: the latest expiration first). The expirations are compared before
    `supersedes` builds its tuples, as a read merges each entry it gets two or three times."""
    for subkey, entry in entries.items():
        current = into.get(subkey)
        if (
            current is None
            or entry.expiration > current.expiration
            or (entry.expiration == current.expiration and entry.supersedes(current))
        ):
            into[subkey] = entry


def live(entries: Mapping[str, Entry], *, now: float) -> dict[str, Entry]:
    """What a reader may see: neither expired nor tombstoned."""
    return {s: e for s, e in entries.items() if e.value is not None and e.expiration > now}


def select(entries: Mapping[str, Entry], *, budget: int, max_entries: int) -> dict[str, Entry]:
    """The entries a reply carries: at most `max_entries`, of `wire_bytes` summing to at most
    `budget`, chosen in this order:

    1. owner-signed before open (every record peers read is owner-signed: one per identity);
    2. smaller before larger, by power-of-two size class (real records are a few hundred
       bytes; 64 KiB of junk comes last);
    3. the freshest (latest expiration) first, then by subkey, so every replica picks alike.

    An entry that does not fit what is left of the budget is skipped: a smaller one after it
    may still fit. So K flooding identities displace an honest record only with K signed
    entries no larger than it, and only once the budget holds no more.
    """
    sizes = {subkey: wire_bytes(subkey, entry) for subkey, entry in entries.items()}
    if len(sizes) <= max_entries and sum(sizes.values()) <= budget:
        return dict(entries)  # all of them, in any order (a page of a large key usually fits)
    order = sorted(
        entries.items(),
        key=lambda item: (
            not item[1].signature,
            sizes[item[0]].bit_length(),
            -item[1].expiration,
            item[0],
        ),
    )
    chosen: dict[str, Entry] = {}
    left = budget
    for subkey, entry in order:
        if len(chosen) >= max_entries:
            break
        size = sizes[subkey]
        if size <= left:
            chosen[subkey] = entry
            left -= size
    return chosen


@dataclass(slots=True)
class _Held:
    entry: Entry
    writer: str
    size: int  # entry_bytes


class RecordStore:
    """The entries one node holds, each with the writer that stored it (the authenticated
    caller, or this node). All methods take `now` so tests control time."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._records: dict[str, dict[str, _Held]] = {}
        # writer -> (key, subkey) -> bytes, oldest write first: whose entries make room.
        self._writes: dict[str, OrderedDict[tuple[str, str], int]] = {}
        self._writer_bytes: dict[str, int] = {}
        self.total_bytes = 0
        # key -> at most its entries' earliest expiration: a key with none due is not scanned
        # (a hot shard is read many times a second, and each read purged its key first).
        self._soonest: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._records)

    def store(self, key: str, subkey: str, entry: Entry, *, now: float, writer: str) -> bool:
        """Validate and keep `entry` if it supersedes what we hold. Returns whether it was kept.

        `writer` is who sends it (a peer id in base58). Raises ProtocolError for an invalid
        entry, a subkey `writer` may not write, or when this node is full. A writer at its
        limits loses its own oldest entries to the new one.
        """
        owned = owner_key(subkey) is not None
        if owned and subkey != writer:  # checked first: it costs no signature check
            raise ProtocolError(f"{writer[:16]}... may not write {key!r}/{subkey[:16]}...")
        validate_entry(key, subkey, entry, now=now, limits=self.limits)
        if entry.expiration <= now:
            return False
        self._purge_key(key, now=now)
        subkeys = self._records.get(key, {})
        held = subkeys.get(subkey)
        if held is not None and not entry.supersedes(held.entry):
            return False
        size = entry_bytes(key, subkey, entry)
        if size > self.limits.max_writer_bytes:
            limit = self.limits.max_writer_bytes
            raise ProtocolError(f"entry of {size} bytes; one writer may hold {limit} at most")
        if not owned and (held is None or held.writer != writer):
            open_held = self._open_subkeys(writer, key)
            if open_held >= self.limits.max_open_subkeys:
                raise ProtocolError(
                    f"{writer[:16]}... holds {open_held} open subkeys of {key!r} already; "
                    f"limit is {self.limits.max_open_subkeys}"
                )
        if held is None:
            self._check_room(key, subkeys, now=now)
        growth = size - (held.size if held is not None else 0)
        if self.total_bytes + growth > self.limits.max_total_bytes:
            self.purge(now=now)
            if self.total_bytes + growth > self.limits.max_total_bytes:
                raise ProtocolError(f"store full: {self.limits.max_total_bytes} bytes")
        if held is not None:
            self._drop(key, subkey)
        self._make_room(writer, size)
        self._records.setdefault(key, {})[subkey] = _Held(entry, writer, size)
        self._soonest[key] = min(self._soonest.get(key, math.inf), entry.expiration)
        self._writes.setdefault(writer, OrderedDict())[key, subkey] = size
        self._writer_bytes[writer] = self._writer_bytes.get(writer, 0) + size
        self.total_bytes += size
        return True

    def get(self, key: str, *, now: float) -> dict[str, Entry]:
        """Every unexpired entry of `key`, tombstones included (replicas must spread them)."""
        self._purge_key(key, now=now)
        return {subkey: held.entry for subkey, held in self._records.get(key, {}).items()}

    def held_by(self, writer: str) -> tuple[int, int]:
        """Entries and bytes `writer` holds on this node (expired ones until purged)."""
        return len(self._writes.get(writer, ())), self._writer_bytes.get(writer, 0)

    def purge(self, *, now: float) -> int:
        """Drop expired entries; returns how many."""
        return sum(self._purge_key(key, now=now) for key in list(self._records))

    def keys(self) -> Iterable[str]:
        return self._records.keys()

    def _check_room(self, key: str, subkeys: dict[str, _Held], *, now: float) -> None:
        """Raise ProtocolError unless a new subkey of `key` fits (`subkeys` is purged)."""
        if not subkeys and len(self._records) >= self.limits.max_keys:
            self.purge(now=now)
            if len(self._records) >= self.limits.max_keys:
                raise ProtocolError(f"store full: {self.limits.max_keys} keys")
        if len(subkeys) >= self.limits.max_subkeys:
            raise ProtocolError(f"key {key!r} is full: {self.limits.max_subkeys} subkeys")

    def _open_subkeys(self, writer: str, key: str) -> int:
        held = self._writes.get(writer, ())
        return sum(1 for k, s in held if k == key and owner_key(s) is None)

    def _make_room(self, writer: str, size: int) -> None:
        """Drop `writer`'s oldest entries until one more of `size` bytes fits its limits."""
        writes = self._writes.get(writer)
        while writes and (
            len(writes) >= self.limits.max_writer_entries
            or self._writer_bytes[writer] + size > self.limits.max_writer_bytes
        ):
            self._drop(*next(iter(writes)))

    def _drop(self, key: str, subkey: str) -> None:
        subkeys = self._records[key]
        held = subkeys.pop(subkey)
        if not subkeys:
            del self._records[key], self._soonest[key]
        self.total_bytes -= held.size
        writes = self._writes[held.writer]
        del writes[key, subkey]
        self._writer_bytes[held.writer] -= held.size
        if not writes:
            del self._writes[held.writer], self._writer_bytes[held.writer]

    def _purge_key(self, key: str, *, now: float) -> int:
        subkeys = self._records.get(key)
        if subkeys is None or self._soonest[key] > now:
            return 0
        expired = [s for s, held in subkeys.items() if held.entry.expiration <= now]
        for subkey in expired:
            self._drop(key, subkey)
        if subkeys:
            self._soonest[key] = min(held.entry.expiration for held in subkeys.values())
        return len(expired)
