"""DHT records, pure: `key -> {subkey: Entry(value, expiration, signature)}`.

Rules every node applies identically, so that any replica answers the same:
- **Latest expiration wins.** Of two entries for one (key, subkey), the one that expires later
  is kept. A writer that updates a value therefore always supersedes its older copy, because its new
  expiration (its clock now + ttl) is later. Ties are broken by a total order on the rest of
  the entry, so the choice never depends on arrival order.
- **Tombstones.** An entry whose value is None deletes: it supersedes older entries like any
  other write and is never returned to readers.
- **Owner-signed subkeys.** A subkey that is an Ed25519 peer id (`12D3KooW...`) belongs to that
  peer: its entry must carry that peer's signature over (key, subkey, value, expiration), and
  every node rejects it otherwise. Other subkeys are open to any writer.
- **Expiration** is an absolute wall-clock time (seconds since the epoch). Clocks of peers differ
  by a few seconds; a node accepts an expiration up to `max_ttl + max_clock_skew` ahead of its
  own clock and never returns an entry its own clock says has expired. TTLs far above the skew
  (presence: 30 s TTL, 10 s refresh) keep records visible across skewed readers.
- **Bounds.** Value size, subkeys per key and keys per node are capped; expired entries are
  purged periodically and on access.
"""

from __future__ import annotations

import functools
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


def entry_bytes(key: str, subkey: str, entry: Entry) -> int:
    """What holding an entry costs, for the store's byte limit (64 bytes of overhead)."""
    return len(key) + len(subkey) + len(entry.value or b"") + len(entry.signature) + 64


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
    if owner is not None:
        payload = signing_payload(key, subkey, entry.value, entry.expiration)
        if not signed_by(owner, payload, entry.signature):
            raise ProtocolError(f"entry {key!r}/{subkey[:16]}... is not signed by its owner")


def merge(into: dict[str, Entry], entries: Mapping[str, Entry]) -> None:
    """Merge replies from several replicas: latest expiration wins per subkey."""
    for subkey, entry in entries.items():
        current = into.get(subkey)
        if current is None or entry.supersedes(current):
            into[subkey] = entry


def live(entries: Mapping[str, Entry], *, now: float) -> dict[str, Entry]:
    """What a reader may see: neither expired nor tombstoned."""
    return {s: e for s, e in entries.items() if e.value is not None and e.expiration > now}


class RecordStore:
    """The entries one node holds. All methods take `now` so tests control time."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self._records: dict[str, dict[str, Entry]] = {}
        self.total_bytes = 0

    def __len__(self) -> int:
        return len(self._records)

    def store(self, key: str, subkey: str, entry: Entry, *, now: float) -> bool:
        """Validate and keep `entry` if it supersedes what we hold. Returns whether it was kept.

        Raises ProtocolError for an invalid entry or when this node is full.
        """
        validate_entry(key, subkey, entry, now=now, limits=self.limits)
        if entry.expiration <= now:
            return False
        subkeys = self._records.get(key)
        if subkeys is None:
            if len(self._records) >= self.limits.max_keys:
                self.purge(now=now)
                if len(self._records) >= self.limits.max_keys:
                    raise ProtocolError(f"store full: {self.limits.max_keys} keys")
            subkeys = self._records[key] = {}
        current = subkeys.get(subkey)
        if current is not None and not entry.supersedes(current):
            return False
        if current is None and len(subkeys) >= self.limits.max_subkeys:
            self._purge_key(key, now=now)
            if len(subkeys) >= self.limits.max_subkeys:
                raise ProtocolError(f"key {key!r} is full: {self.limits.max_subkeys} subkeys")
        growth = entry_bytes(key, subkey, entry) - (
            entry_bytes(key, subkey, current) if current is not None else 0
        )
        if self.total_bytes + growth > self.limits.max_total_bytes:
            self.purge(now=now)
            if self.total_bytes + growth > self.limits.max_total_bytes:
                if not subkeys:
                    self._records.pop(key, None)
                raise ProtocolError(f"store full: {self.limits.max_total_bytes} bytes")
        # A purge above may have dropped the key's (emptied) dict: attach it again.
        self._records[key] = subkeys
        subkeys[subkey] = entry
        self.total_bytes += growth
        return True

    def get(self, key: str, *, now: float) -> dict[str, Entry]:
        """Every unexpired entry of `key`, tombstones included (replicas must spread them)."""
        self._purge_key(key, now=now)
        return dict(self._records.get(key, {}))

    def purge(self, *, now: float) -> int:
        """Drop expired entries; returns how many."""
        return sum(self._purge_key(key, now=now) for key in list(self._records))

    def _purge_key(self, key: str, *, now: float) -> int:
        subkeys = self._records.get(key)
        if subkeys is None:
            return 0
        expired = [s for s, e in subkeys.items() if e.expiration <= now]
        for subkey in expired:
            self.total_bytes -= entry_bytes(key, subkey, subkeys.pop(subkey))
        if not subkeys:
            del self._records[key]
        return len(expired)

    def keys(self) -> Iterable[str]:
        return self._records.keys()
