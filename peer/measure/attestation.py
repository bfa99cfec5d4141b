"""Backbone-signed measurements of a peer's link (pure): the evidence shares and deadlines use.

A peer's own figures (`Capabilities.upload_bps`, `download_bps`) are claims: a member that
claimed 10 GB/s got (nearly) the whole vector to reduce, and with `centered_clip` the clip then
ran inside its own reducer. So the figures that decide who reduces what, and how long anyone
waits, come from measurements others made:

- **Who signs what.** A backbone serving a peer's probes (`peer.measure.probe`) measures the
  peer's upload itself (the receiving side measures) and takes its download as the peer
  reported it, capped by how fast the backbone's bytes left. After the upload probe it signs
  `(subject, signer, upload_bps, download_bps, issued_at)` with its libp2p Ed25519 identity key
  (libp2p's own signing, as step certificates do) and hands the `Attestation` back in the
  `Measured` reply. A download report is only capped by an overestimate, so a peer can inflate
  it; bandwidth is min(up, down), so that gains it nothing beyond the upload the backbone saw.
- **Who carries it.** The peer keeps the newest attestation of each backbone (at most
  `MAX_ATTESTATIONS`) in `Capabilities.attestations`: in its presence record and in every
  averaging ticket.
- **Who trusts whom.** A verifier counts an attestation only if its signer is one of the
  backbones *it* was given (`collaboration.backbones`, `--backbone`), never one announced in
  the DHT (anyone can announce a "backbone"), as the clock does (`peer.measure.clock`); the
  subject is the ticket's peer id; the signature is the signer's; it was issued at most
  `averaging.attestation_max_age` before the gathering closed (and at most `FUTURE_SKEW` after).
  Per signer the newest counts; over signers the lower median of each direction, clamped to
  [`averaging.min_bandwidth`, `MAX_BANDWIDTH`]. A peer picks which attestations it carries, so
  one dishonest trusted backbone can vouch for a colluder: the share cap
  (`peer.roles.cap_shares`) bounds what that buys.
- **Without evidence** a member counts at `averaging.min_bandwidth`, whatever it claims.

Compute (samples/s) cannot be measured by others: shares ignore it (every member of an
averaging sends its whole vector whatever its speed); it only sizes a peer's part of the batch
(`peer.training`), where a high claim makes the others compute less, never average wrongly.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Annotated

import msgspec
from libp2p.crypto.keys import PrivateKey

from peer.dht.records import owner_key, signed_by

DOMAIN = b"peertrain/attestation/1"
MAX_ATTESTATIONS = 8
"""Attestations a peer carries at most (one per backbone it probed, the newest)."""
MAX_BANDWIDTH = 1.25e9
"""Bytes/s (10 Gbit/s) an attested figure counts as at most: far above what one py-libp2p
stream moves (~300 MB/s), so it only bounds a backbone's mistake."""
FUTURE_SKEW = 60.0
"""Seconds an attestation may be issued after the gathering closed: the most a peer corrects
its clock toward the backbones' (`peer.measure.clock.MAX_CORRECTION`)."""

Rate = Annotated[float, msgspec.Meta(ge=0, le=1e13)]


class Attestation(msgspec.Struct, frozen=True, array_like=True):
    subject: Annotated[str, msgspec.Meta(max_length=128)]
    """The measured peer's id."""
    signer: Annotated[str, msgspec.Meta(max_length=128)]
    """The backbone's peer id (an Ed25519 one: it holds the public key)."""
    upload_bps: Rate
    download_bps: Rate
    issued_at: Annotated[float, msgspec.Meta(ge=0, le=1e11)]
    """The backbone's wall clock (the collaboration's reference time) when it signed."""
    signature: Annotated[bytes, msgspec.Meta(max_length=64)]


def statement(
    subject: str, signer: str, upload_bps: float, download_bps: float, issued_at: float
) -> bytes:
    return DOMAIN + msgspec.msgpack.encode((subject, signer, upload_bps, download_bps, issued_at))


def attest(
    key: PrivateKey,
    *,
    signer: str,
    subject: str,
    upload_bps: float,
    download_bps: float,
    issued_at: float,
) -> Attestation:
    """`signer` (whose identity key is `key`) states what it measured of `subject`."""
    payload = statement(subject, signer, upload_bps, download_bps, issued_at)
    return Attestation(subject, signer, upload_bps, download_bps, issued_at, key.sign(payload))


@functools.lru_cache(maxsize=4096)
def signed(attestation: Attestation) -> bool:
    """Whether the signature is its signer's. Never raises on a peer's bytes. Cached: every
    ticket and presence record of a peer carries the same attestations until it re-probes."""
    a = attestation
    owner = owner_key(a.signer)
    payload = statement(a.subject, a.signer, a.upload_bps, a.download_bps, a.issued_at)
    return owner is not None and signed_by(owner, payload, a.signature)


@dataclass(frozen=True, kw_only=True)
class Evidence:
    """What a verifier accepts as a measurement of a peer's link, and how it bounds it."""

    trusted: frozenset[str]
    """Peer ids whose attestations count: the backbones this peer was given."""
    at: float
    """The collaboration's time the figures are for (an averaging's gathering close)."""
    max_age: float
    """Seconds before `at` an attestation may have been issued."""
    floor: float
    """Bytes/s a member counts as at least, and without any valid attestation."""
    ceiling: float = MAX_BANDWIDTH


def valid(attestation: Attestation, subject: str, evidence: Evidence) -> bool:
    a = attestation
    return (
        a.subject == subject
        and a.signer in evidence.trusted
        and evidence.at - evidence.max_age <= a.issued_at <= evidence.at + FUTURE_SKEW
        and signed(a)  # last: the only costly check
    )


def attested_link(
    subject: str, attestations: Iterable[Attestation], evidence: Evidence
) -> tuple[float, float] | None:
    """(upload, download) bytes/s that trusted backbones measured of `subject`: per trusted
    signer its newest attestation, if valid, over signers the lower median of each direction,
    each clamped to [floor, ceiling]; None when none is valid.

    At most one signature check per trusted signer, whatever a ticket carries: the newest is
    picked before any check (a peer that carries a bad newest one only loses that signer)."""
    newest: dict[str, Attestation] = {}
    for a in attestations:
        if a.signer in evidence.trusted and (
            a.signer not in newest or a.issued_at > newest[a.signer].issued_at
        ):
            newest[a.signer] = a
    chosen = [newest[s] for s in sorted(newest) if valid(newest[s], subject, evidence)]
    if not chosen:
        return None

    def clamp(value: float) -> float:
        return min(max(value, evidence.floor), evidence.ceiling)

    return (
        clamp(statistics.median_low(a.upload_bps for a in chosen)),
        clamp(statistics.median_low(a.download_bps for a in chosen)),
    )
