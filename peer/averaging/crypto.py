"""Authenticated, encrypted data-plane frames between the members of one round, pure.

The data plane is plain TCP (libp2p's Noise + yamux stream tops out near 0.3 GB/s); its keys
come from the libp2p identities, so unauthenticated bytes never reach a reduction:

1. For every round, each member makes an ephemeral X25519 key pair and signs
   (domain, round id, public key) with its Ed25519 peer key: a `KeyAnnouncement` that anyone
   can check against the member's peer id. Announcements travel with the group's membership.
2. Two members derive the keys of each connection between them with X25519 + HKDF-SHA256,
   one key per direction of each connection (the info string names round, dialing sender,
   reducer and direction), so nobody else in the group, the leader included, can read or
   forge their traffic, and frames of one direction or connection never open in another.
3. Frames are AES-256-GCM with a counter nonce per key (never reused: a key lives for one
   direction of one connection of one round). A frame that fails to open, or arrives out of order, is
   `BadPart`: its sender is dropped. AES-GCM runs at ~13 GB/s here (AES-NI), far above the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey, X25519PublicKey
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from libp2p.crypto.keys import PrivateKey

from peer.averaging.compression import BadPart
from peer.dht.records import owner_key, signed_by

DOMAIN = b"peertrain/allreduce-key/1"
TAG_BYTES = 16


class KeyAnnouncement(msgspec.Struct, frozen=True):
    peer_id: str
    public_key: bytes
    signature: bytes


def _signed_payload(round_id: bytes, public_key: bytes) -> bytes:
    return DOMAIN + len(round_id).to_bytes(2, "big") + round_id + public_key


class RoundKey:
    """This member's ephemeral key for one round."""

    def __init__(self, round_id: bytes, peer_id: str, identity_key: PrivateKey) -> None:
        self.round_id = round_id
        self.peer_id = peer_id
        self._private = X25519PrivateKey.generate()
        public = self._private.public_key().public_bytes_raw()
        signature = identity_key.sign(_signed_payload(round_id, public))
        self.announcement = KeyAnnouncement(peer_id, public, signature)

    def connection_keys(self, other: KeyAnnouncement, *, we_dial: bool) -> ConnectionKeys:
        """The keys of the data-plane connection between us and `other`; `we_dial` says who
        opened it (the sender of contributions). Raises BadPart if `other`'s announcement is
        not signed by the peer it names."""
        secret = self._private.exchange(verify_announcement(self.round_id, other))
        sender, reducer = (
            (self.peer_id, other.peer_id) if we_dial else (other.peer_id, self.peer_id)
        )
        return ConnectionKeys(
            contributions=_derive(secret, self.round_id, sender, reducer, b"contributions"),
            averages=_derive(secret, self.round_id, sender, reducer, b"averages"),
        )


@dataclass(frozen=True)
class ConnectionKeys:
    """One key per direction of one connection: two members that both compute and reduce
    have two connections, so four keys, and no (key, nonce) pair is ever used twice."""

    contributions: bytes
    """Sender (the dialer) to reducer."""
    averages: bytes
    """Reducer to sender."""


def verify_announcement(round_id: bytes, announcement: KeyAnnouncement) -> X25519PublicKey:
    owner = owner_key(announcement.peer_id)
    payload = _signed_payload(round_id, announcement.public_key)
    if owner is None or len(announcement.public_key) != 32:
        raise BadPart(f"key announcement of {announcement.peer_id[:20]!r} is malformed")
    if not signed_by(owner, payload, announcement.signature):
        raise BadPart(f"key announcement of {announcement.peer_id} is not signed by it")
    return X25519PublicKey.from_public_bytes(announcement.public_key)


def _derive(secret: bytes, round_id: bytes, sender: str, reducer: str, purpose: bytes) -> bytes:
    info = b"|".join((DOMAIN, round_id, sender.encode(), reducer.encode(), purpose))
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


class Sealer:
    """Seals the frames of one direction: nonce = frame counter."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = 0

    def seal(self, plaintext: bytes | memoryview, associated: bytes = b"") -> bytes:
        nonce = self._counter.to_bytes(12, "big")
        self._counter += 1
        return self._aead.encrypt(nonce, plaintext, associated)


class Opener:
    """Opens the frames of one direction, in order."""

    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)
        self._counter = 0

    def open(self, sealed: bytes | memoryview, associated: bytes = b"") -> bytes:
        nonce = self._counter.to_bytes(12, "big")
        try:
            plaintext = self._aead.decrypt(nonce, sealed, associated)
        except InvalidTag:
            raise BadPart(
                "a data frame failed authentication (forged, altered or reordered)"
            ) from None
        self._counter += 1
        return plaintext
