"""Shares and deadlines from evidence, not claims: backbone-signed link measurements, who counts
them, and what a member claiming 10 GB/s gets (pure)."""

from __future__ import annotations

import dataclasses
import random

import msgspec
import pytest

from peer.averaging.averager import bandwidths, patience
from peer.averaging.group import shares_for
from peer.config import AveragingConfig
from peer.measure.attestation import (
    FUTURE_SKEW,
    MAX_BANDWIDTH,
    Attestation,
    Evidence,
    attest,
    attested_link,
    signed,
)
from peer.measure.capabilities import Capabilities
from tests.helpers import new_identity
from tests.test_group import BACKBONE, EVIDENCE, NOW, attested, caps, joined, spec_of

PEER = new_identity().peer_id.to_base58()


def fresh(subject: str = PEER, bw: float = 5e7, **kwargs) -> Attestation:
    return attested(subject, bw, **kwargs)


# ---------------------------------------------------------------------------- signatures


def test_an_attestation_is_its_signers_and_any_change_breaks_it():
    good = fresh()
    assert signed(good)
    for field, value in (("upload_bps", 1e10), ("download_bps", 1e10), ("issued_at", NOW),
                         ("subject", new_identity().peer_id.to_base58())):  # fmt: skip
        assert not signed(msgspec.structs.replace(good, **{field: value})), field
    other = new_identity()
    # Another key signing in the backbone's name, and a signature cut short: never raises.
    forged = attest(other.key_pair.private_key, signer=BACKBONE.peer_id.to_base58(),
                    subject=PEER, upload_bps=1e10, download_bps=1e10, issued_at=NOW)  # fmt: skip
    assert not signed(forged)
    assert not signed(msgspec.structs.replace(good, signature=good.signature[:10]))
    assert not signed(msgspec.structs.replace(good, signer="not-a-peer-id"))
    # It survives the wire (array-like msgpack) and decodes with bounds.
    wire = msgspec.msgpack.encode(good)
    assert signed(msgspec.msgpack.decode(wire, type=Attestation))
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(
            msgspec.structs.replace(good, upload_bps=-1.0)), type=Attestation)  # fmt: skip


def test_only_fresh_attestations_by_a_trusted_signer_of_the_subject_count():
    untrusted = new_identity()
    forged = attest(new_identity().key_pair.private_key, signer=BACKBONE.peer_id.to_base58(),
                    subject=PEER, upload_bps=1e9, download_bps=1e9, issued_at=NOW)  # fmt: skip
    ignored = {
        "forged": forged,
        "expired": fresh(issued_at=NOW - EVIDENCE.max_age - 1),
        "from the future": fresh(issued_at=NOW + FUTURE_SKEW + 1),
        "another subject": fresh(subject=new_identity().peer_id.to_base58()),
        "untrusted signer": fresh(signer=untrusted),
    }
    for why, attestation in ignored.items():
        assert attested_link(PEER, [attestation], EVIDENCE) is None, why
    # One signature check per trusted signer, whatever a ticket carries: its newest. Older
    # junk and untrusted signers cost nothing; a bad newest loses the peer that signer.
    junk = [ignored["expired"], ignored["untrusted signer"]] * 100
    assert attested_link(PEER, [*junk, fresh(bw=3e7)], EVIDENCE) == (3e7, 3e7)
    assert attested_link(PEER, [fresh(bw=3e7), ignored["from the future"]], EVIDENCE) is None
    assert attested_link(PEER, [fresh(issued_at=NOW + FUTURE_SKEW)], EVIDENCE) == (5e7, 5e7)


def test_figures_are_the_lower_median_over_signers_newest_first_and_clamped():
    signers = [new_identity() for _ in range(3)]
    evidence = Evidence(
        trusted=frozenset(s.peer_id.to_base58() for s in signers), at=NOW, max_age=600.0,
        floor=1e6,
    )  # fmt: skip
    # One lying backbone of three moves nothing.
    three = [fresh(bw=bw, signer=s) for bw, s in zip((2e7, 5e7, 1e12), signers, strict=True)]
    assert attested_link(PEER, three, evidence) == (5e7, 5e7)
    # Two: the lower. Per signer only its newest counts (an old fast figure is replaced).
    old = fresh(bw=9e8, signer=signers[0], issued_at=NOW - 300)
    new = fresh(bw=1e7, signer=signers[0], issued_at=NOW - 10)
    assert attested_link(PEER, [old, new, three[1]], evidence) == (1e7, 1e7)
    # Clamped to [floor, ceiling].
    assert attested_link(PEER, [three[2]], evidence) == (MAX_BANDWIDTH, MAX_BANDWIDTH)
    assert attested_link(PEER, [fresh(bw=10.0, signer=signers[0])], evidence) == (1e6, 1e6)


# ---------------------------------------------------------------------------- shares


def claiming(bw: float, *, measured: float | None = None):
    return joined(caps(bw), measured=measured)


def shares_of(members) -> dict[str, float]:
    """Each member's share in the spec a leader trusting BACKBONE builds."""
    return {m.peer_id: m.share for m in spec_of(members).members}


def test_a_member_claiming_10_gbps_without_evidence_reduces_no_more_than_the_others():
    """The attack: a ticket claiming 10 GB/s each way got (nearly) the whole vector to reduce,
    and with centered_clip the clip then ran inside its own reducer."""
    liar = claiming(1e10)
    honest = [claiming(5e7, measured=5e7) for _ in range(3)]
    shares = shares_of([liar, *honest])
    assert shares[liar.ticket.peer_id] < min(shares[j.ticket.peer_id] for j in honest)
    # Nobody measured (no trusted backbone): equal shares, whatever anyone claims.
    plain = [claiming(1e10), claiming(1e6), claiming(1e6)]
    tickets = [j.ticket for j in plain]
    assert shares_for(tickets, evidence=EVIDENCE) == pytest.approx([1 / 3] * 3)
    assert shares_for(tickets) == pytest.approx([1 / 3] * 3)  # no evidence at all: the same


def test_a_member_truly_measured_at_10_gbps_reduces_at_most_the_cap():
    fast = claiming(1e10, measured=1e10)
    slow = [claiming(1e6, measured=1e6) for _ in range(3)]
    shares = shares_of([fast, *slow])
    assert shares[fast.ticket.peer_id] == pytest.approx(1.5 / 4)  # 3/8 of the vector
    assert sum(shares.values()) == pytest.approx(1.0)


def test_shares_are_the_same_bits_whoever_computes_them():
    """Any member (any leader) building the spec of the same members at the same gathering gets
    identical floats, in whatever order it heard of them."""
    rng = random.Random(7)
    members = [claiming(rng.uniform(1e6, 1e10), measured=rng.uniform(1e6, 1e9)) for _ in range(7)]
    members.append(claiming(1e10))  # no evidence
    ids = sorted(j.ticket.peer_id for j in members)
    reference = [m.share for m in spec_of(members).members]
    assert max(reference) <= 1.5 / len(members) and sum(reference) == pytest.approx(1.0)
    for leader in ids[:3]:
        shuffled = rng.sample(members, len(members))
        assert [m.share for m in spec_of(shuffled, leader=leader).members] == reference
    sorted_tickets = sorted([j.ticket for j in members], key=lambda t: t.peer_id)
    assert shares_for(sorted_tickets, evidence=dataclasses.replace(EVIDENCE)) == reference


def test_deadlines_count_a_claim_only_where_it_is_slower_than_the_evidence():
    """Three tickets claiming 10 GB/s shrank the median that bounds a later round's patience
    below what the two honest, slower members needed."""
    config = AveragingConfig()
    liars = [claiming(1e10) for _ in range(3)]
    honest = [claiming(2e6, measured=2e6), claiming(1e6, measured=5e6)]
    view = [j.ticket for j in (*liars, *honest)]
    rates = bandwidths(view, config, evidence=EVIDENCE)
    assert [rates[j.ticket.peer_id] for j in liars] == [config.min_bandwidth] * 3
    assert [rates[j.ticket.peer_id] for j in honest] == [2e6, config.min_bandwidth]
    honest_only = bandwidths([j.ticket for j in honest], config, evidence=EVIDENCE)
    size = 10_000_000
    assert patience(size, list(rates.values()), config) >= patience(
        size, list(honest_only.values()), config
    )


def test_capabilities_without_attestations_still_decode():
    """Records and tickets of peers from before attestations decode (no field: none)."""
    older = msgspec.msgpack.encode(
        {f: v for f, v in msgspec.structs.asdict(caps(1e7)).items() if f != "attestations"}
    )
    assert msgspec.msgpack.decode(older, type=Capabilities).attestations == ()
    crowded = msgspec.structs.replace(caps(1e7), attestations=(fresh(),) * 9)
    with pytest.raises(msgspec.ValidationError):
        msgspec.msgpack.decode(msgspec.msgpack.encode(crowded), type=Capabilities)


def test_a_peer_trusts_the_backbones_it_was_given_and_itself():
    """An aggregating backbone is not among its own seeds: without trusting itself, as a
    leader it counted itself at the floor, and its share hung on who led."""
    from types import SimpleNamespace

    from peer.averaging.averager import Averager

    seed = new_identity().peer_id
    me = SimpleNamespace(
        trusted=None, dht=SimpleNamespace(seeds=[(seed, None)]), me="me",
        config=AveragingConfig(),
    )  # fmt: skip
    evidence = Averager.evidence(me, 100.0)  # type: ignore[arg-type]
    assert evidence.trusted == {seed.to_base58(), "me"}
