"""Step certificates (pure): which peers signed that they hold the parameters `digest` at `step`.

No single record moves the collaboration. A peer that applies a step signs the statement
(collaboration, step, digest) with its libp2p identity key (Ed25519, libp2p's own signing) and
publishes the signature in its progress record. The members of an averaging round apply the same
average to the same state, so they sign the same statement; each copies the others' signatures
from their records into its own (`merge_signatures`), so a record keeps carrying the round's
certificate after its other members leave. A (step, digest) counts as the collaboration's
(`CollaborationView.certified`) once at least `averaging.min_group_size` distinct peers signed it.

A peer signs only what it holds: a state its own averaging produced, or one it downloaded for a
certified (step, digest) and checked. Step 0, the task's initial state that every peer builds
itself, needs no certificate.

What remains (see docs/SECURITY.md): `min_group_size` identities that agree can certify anything
(Sybil: identities cost nothing in a public collaboration); with `min_group_size = 1` any single
peer can.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Annotated

import msgspec
from libp2p.crypto.keys import PrivateKey

from peer.config import MAX_STEP_SIGNERS
from peer.dht.records import owner_key, signed_by

#: Version 2: the digest signed hashes its pieces with BLAKE3 (SHA-256 in version 1), so a
#: version 1 signature never certifies a version 2 digest of other bytes, nor the reverse.
DOMAIN = b"peertrain/step/2"
MAX_SIGNATURES = MAX_STEP_SIGNERS
"""Signatures a record may carry (what a reader accepts; a certificate needs `min_group_size`)."""
CARRIED_SIGNATURES = 4
"""Signatures a record carries unless the quorum needs more (`carried`): enough for it to
certify its step after the other signers leave. At ~120 bytes each, 16 made a record 2.5 KB, so
a 192 KiB DHT reply held ~80 records: each peer of a simulated collaboration of 100 read 85 %
of the others' (`simulation/`, docs/scale.md)."""


def carried(quorum: int) -> int:
    """How many signatures a record carries in a collaboration certifying with `quorum`."""
    return min(MAX_SIGNATURES, max(quorum, CARRIED_SIGNATURES))


class StepSignature(msgspec.Struct, frozen=True, array_like=True):
    signer: Annotated[str, msgspec.Meta(max_length=128)]
    """The signer's peer id (an Ed25519 one: it holds the public key)."""
    signature: Annotated[bytes, msgspec.Meta(max_length=64)]


def statement(collaboration: str, step: int, digest: str) -> bytes:
    return DOMAIN + msgspec.msgpack.encode((collaboration, step, digest))


def sign_step(
    key: PrivateKey, signer: str, collaboration: str, step: int, digest: str
) -> StepSignature:
    return StepSignature(signer, key.sign(statement(collaboration, step, digest)))


@functools.lru_cache(maxsize=8192)
def _valid(signature: StepSignature, collaboration: str, step: int, digest: str) -> bool:
    # Cached: every read of the progress records sees the same signatures again.
    owner = owner_key(signature.signer)
    return owner is not None and signed_by(
        owner, statement(collaboration, step, digest), signature.signature
    )


def valid_signatures(
    signatures: Iterable[StepSignature], collaboration: str, step: int, digest: str
) -> list[StepSignature]:
    """The signatures that are their signer's over (collaboration, step, digest), one per
    signer, in signer order. Never raises on a peer's bytes."""
    by_signer = {s.signer: s for s in signatures if _valid(s, collaboration, step, digest)}
    return [by_signer[signer] for signer in sorted(by_signer)]


def merge_signatures(
    own: StepSignature, others: Iterable[StepSignature], *, limit: int
) -> list[StepSignature]:
    """Our signature first, then others' (already validated) for the same statement, at most
    `limit` (`carried`) in all, in signer order: what our record carries."""
    rest = sorted(
        {s.signer: s for s in others if s.signer != own.signer}.values(), key=lambda s: s.signer
    )
    return [own, *rest[: max(0, limit - 1)]]
