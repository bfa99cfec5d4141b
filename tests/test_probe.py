"""Link probes: the pure rate and budget rules, then the protocol over real libp2p on loopback."""

from __future__ import annotations

import dataclasses
import time

import msgspec
import pytest
import trio

from peer.config import ProbeConfig
from peer.errors import NotABackbone, ProtocolError, RemoteError, Unreachable
from peer.measure import probe as probe_module
from peer.measure.attestation import Evidence, attest, attested_link, signed
from peer.measure.probe import (
    PROTOCOL,
    Accepted,
    Measured,
    Ping,
    Probe,
    ProbeServer,
    Refused,
    _replies,
    checked_attestation,
    measure_link,
    measured_window,
    rate,
    receive_counted,
)
from peer.net.ratelimit import ByteBudgets
from peer.net.rpc import TRANSPORT_ERRORS, FramedStream
from tests.helpers import new_identity, nodes

# ---------------------------------------------------------------------------- pure


def test_the_first_quarter_of_the_bytes_is_left_out():
    # 100 bytes: 25 in the first 5 s (slow start), then 75 in 1 s.
    samples = [(0.0, 0), (5.0, 25), (5.5, 60), (6.0, 100)]
    assert measured_window(samples) == (75, 1.0)
    assert rate(measured_window(samples)) == 75.0


def test_short_transfers_count_whole_and_empty_ones_give_zero():
    assert measured_window([(0.0, 0), (2.0, 100)]) == (100, 2.0)
    assert measured_window([(1.0, 0)]) == (0, 0.0)
    assert rate((0, 0.0)) == 0.0


def test_byte_budget_refills_over_its_window_per_caller():
    budgets = ByteBudgets(capacity=100, window=10.0)  # refills 10 bytes/s
    assert budgets.try_spend("a", 80, now=0.0) == 0.0
    assert budgets.try_spend("a", 40, now=0.0) == pytest.approx(2.0)  # 20 left, needs 20 more
    assert budgets.try_spend("b", 100, now=0.0) == 0.0  # other callers are not affected
    assert budgets.try_spend("a", 40, now=2.0) == 0.0
    assert budgets.try_spend("a", 1000, now=100.0) == 0.0  # capped at capacity, never starved


def test_byte_budget_forgets_refilled_callers_when_full():
    budgets = ByteBudgets(capacity=100, window=10.0, max_callers=2)
    budgets.try_spend("a", 100, now=0.0)
    budgets.try_spend("b", 100, now=0.0)
    budgets.try_spend("c", 10, now=20.0)  # a and b have refilled: dropped
    assert set(budgets._buckets) == {"c"}


# ---------------------------------------------------------------------------- protocol

SMALL = ProbeConfig(max_bytes=4 << 20, budget_bytes=16 << 20)


async def probe_once(client, server_id, direction: str, size: int):
    """A raw probe: the Accepted/Refused reply and, for a download, the bytes received."""
    stream = await client.host.new_stream(server_id, [PROTOCOL])
    framed = FramedStream(stream, 1024)
    await framed.write_frame(msgspec.msgpack.encode(Probe(direction, size)))
    reply = _replies.decode(await framed.read_frame())
    received = 0
    if isinstance(reply, Accepted) and direction == "download":
        samples: list = []
        await receive_counted(framed, reply.bytes, samples, deadline=float("inf"))
        received = samples[-1][1]
        await framed.write_frame(msgspec.msgpack.encode(Measured(received, 1.0)))
        await stream.close()
    await framed.reset()
    return reply, received


async def test_measure_link_reports_both_directions_and_rtt():
    async with nodes(2) as (backbone, peer):
        server = ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        link = await measure_link(peer, backbone.peer_id, target_seconds=0.2, max_bytes=4 << 20)
        assert link.upload_bps > 1e6 and link.download_bps > 1e6  # loopback: far above 1 MB/s
        assert 0 < link.rtt_s < 1.0
        # The backbone learned its own capacity from serving the probes.
        up, down = server.capacity(now=server.clock())
        assert up > 1e6 and down > 1e6


async def test_a_peer_given_as_a_backbone_is_told_apart_from_one_we_cannot_reach():
    """A node that answers but serves no probe (a peer's address passed as --backbone) is
    `NotABackbone`; one that cannot be reached is only `Unreachable`: only the first is a
    definite answer (`Measurements` stops a peer that has no backbone at all)."""
    async with nodes(2) as (plain, peer):
        await peer.connect(plain.peer_id, plain.announce, timeout=5)
        with trio.fail_after(20), pytest.raises(NotABackbone, match="is a peer, not a backbone"):
            await measure_link(peer, plain.peer_id, target_seconds=0.1)
        gone = new_identity().peer_id  # nobody has its key: no address, no connection
        with trio.fail_after(20), pytest.raises(Unreachable) as caught:
            await measure_link(peer, gone, target_seconds=0.1)
        assert not isinstance(caught.value, NotABackbone)


async def test_the_backbone_signs_what_it_measured_of_the_caller():
    """The upload's reply carries the backbone's attestation: the upload it received and the
    download the caller reported (capped by its send rate), signed with its identity key, and
    valid for a verifier that trusts that backbone."""
    async with nodes(2) as (backbone, peer):
        server = ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        link = await measure_link(peer, backbone.peer_id, target_seconds=0.1, max_bytes=1 << 20)
        attestation = link.attestation
        assert attestation is not None and signed(attestation)
        assert attestation.subject == peer.peer_id.to_base58()
        assert attestation.signer == backbone.peer_id.to_base58() == server.signer
        assert attestation.upload_bps == link.upload_bps  # what the backbone measured
        assert 0 < attestation.download_bps <= server.capacity(now=server.clock())[0]
        evidence = Evidence(
            trusted=frozenset({server.signer}), at=time.time(), max_age=60.0, floor=1.0
        )
        figures = attested_link(peer.peer_id.to_base58(), [attestation], evidence)
        assert figures == (attestation.upload_bps, attestation.download_bps)


def test_a_peer_keeps_only_attestations_of_itself_by_the_backbone_it_probed():
    backbone, peer, other = new_identity(), new_identity(), new_identity()

    def by(key_of, subject, **changes):
        a = attest(key_of.key_pair.private_key, signer=key_of.peer_id.to_base58(),
                   subject=subject.peer_id.to_base58(), upload_bps=1e7, download_bps=1e7,
                   issued_at=time.time())  # fmt: skip
        return msgspec.structs.replace(a, **changes)

    def check(a):
        return checked_attestation(a, subject=peer.peer_id, signer=backbone.peer_id)

    good = by(backbone, peer)
    assert check(good) is good
    assert check(None) is None
    assert check(by(backbone, other)) is None  # another peer's
    assert check(by(other, peer)) is None  # another signer's
    assert check(by(backbone, peer, upload_bps=1e10)) is None  # altered after signing
    forged = by(other, peer, signer=backbone.peer_id.to_base58())
    assert check(forged) is None  # signed by another key in the backbone's name


async def test_a_probe_is_granted_at_most_max_bytes():
    async with nodes(2) as (backbone, peer):
        ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        reply, received = await probe_once(peer, backbone.peer_id, "download", 1 << 30)
        assert isinstance(reply, Accepted) and reply.bytes == SMALL.max_bytes
        assert received == SMALL.max_bytes


async def test_a_probe_stops_after_max_seconds():
    async with nodes(2) as (backbone, peer):
        # A 1 GiB grant that would take seconds on loopback, cut off after 50 ms.
        limits = ProbeConfig(max_bytes=1 << 30, budget_bytes=1 << 30, max_seconds=0.05)
        ProbeServer(backbone.host, limits)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        with trio.fail_after(30):
            reply, received = await probe_once(peer, backbone.peer_id, "download", 1 << 30)
        assert isinstance(reply, Accepted) and reply.bytes == 1 << 30
        assert 0 < received < 1 << 30


async def test_each_caller_is_rate_limited_and_told_when_to_retry():
    async with nodes(3) as (backbone, greedy, other):
        ProbeServer(backbone.host, SMALL)
        for peer in (greedy, other):
            await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        for _ in range(4):  # 4 x 4 MiB spends the 16 MiB budget
            reply, _ = await probe_once(greedy, backbone.peer_id, "download", 4 << 20)
            assert isinstance(reply, Accepted)
        reply, _ = await probe_once(greedy, backbone.peer_id, "download", 4 << 20)
        assert isinstance(reply, Refused) and "rate limited" in reply.reason
        assert reply.retry_after > 1.0
        with pytest.raises(RemoteError, match=r"rate limited.*retry in"):
            await measure_link(greedy, backbone.peer_id, target_seconds=0.1)
        reply, _ = await probe_once(other, backbone.peer_id, "download", 4 << 20)
        assert isinstance(reply, Accepted)  # the others still get theirs


async def test_concurrent_probes_are_capped():
    async with nodes(2) as (backbone, peer):
        server = ProbeServer(backbone.host, dataclasses.replace(SMALL, max_concurrent=1))
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        server.running = 1  # one probe in flight
        reply, _ = await probe_once(peer, backbone.peer_id, "upload", 1024)
        assert isinstance(reply, Refused) and "busy" in reply.reason
        server.running = 0
        reply, _ = await probe_once(peer, backbone.peer_id, "download", 1024)
        assert isinstance(reply, Accepted)


async def test_one_caller_runs_one_probe_at_a_time_and_others_get_the_free_slots():
    async with nodes(3) as (backbone, greedy, other):
        limits = dataclasses.replace(SMALL, max_concurrent=2, max_seconds=5.0)
        server = ProbeServer(backbone.host, limits)
        for peer in (greedy, other):
            await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        # greedy starts an upload and sends nothing: its probe holds a slot until max_seconds
        stream = await greedy.host.new_stream(backbone.peer_id, [PROTOCOL])
        framed = FramedStream(stream, 1024)
        await framed.write_frame(msgspec.msgpack.encode(Probe("upload", 1 << 20)))
        assert isinstance(_replies.decode(await framed.read_frame()), Accepted)
        assert server.running == 1
        reply, _ = await probe_once(greedy, backbone.peer_id, "download", 1024)
        assert isinstance(reply, Refused) and "your other probe" in reply.reason
        reply, _ = await probe_once(other, backbone.peer_id, "download", 1024)
        assert isinstance(reply, Accepted)  # the free slot went to someone else
        await framed.reset()


@pytest.mark.parametrize(
    "wire",
    [
        msgspec.msgpack.encode({"type": "Probe", "direction": "sideways", "bytes": 10}),
        msgspec.msgpack.encode({"type": "Probe", "direction": "upload", "bytes": -5}),
        b"\xc1garbage",
    ],
    ids=["bad direction", "negative size", "garbage"],
)
async def test_malformed_requests_end_the_stream_and_the_server_goes_on(wire):
    async with nodes(2) as (backbone, peer):
        ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        stream = await peer.host.new_stream(backbone.peer_id, [PROTOCOL])
        framed = FramedStream(stream, 1024)
        await framed.write_frame(wire)
        with trio.fail_after(5):
            try:
                frame = await framed.read_frame()
            except (ProtocolError, *TRANSPORT_ERRORS):  # a reset ends the stream just the same
                frame = None
        assert frame is None  # no reply to a request that does not parse
        reply, _ = await probe_once(peer, backbone.peer_id, "download", 1024)
        assert isinstance(reply, Accepted)


async def test_a_silent_caller_is_hung_up_on(monkeypatch):
    monkeypatch.setattr(probe_module, "CONTROL_TIMEOUT", 0.2)
    async with nodes(2) as (backbone, peer):
        ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        stream = await peer.host.new_stream(backbone.peer_id, [PROTOCOL])
        with trio.fail_after(5):
            assert await FramedStream(stream, 1024).read_frame() is None  # closed on us
        reply, _ = await probe_once(peer, backbone.peer_id, "download", 1024)
        assert isinstance(reply, Accepted)


async def test_pings_per_stream_are_capped():
    async with nodes(2) as (backbone, peer):
        ProbeServer(backbone.host, SMALL)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        framed = FramedStream(await peer.host.new_stream(backbone.peer_id, [PROTOCOL]), 1024)
        pongs = 0
        with trio.fail_after(10):
            for _ in range(probe_module.MAX_PINGS + 5):
                await framed.write_frame(msgspec.msgpack.encode(Ping()))
            while await framed.read_frame() is not None:
                pongs += 1
        assert pongs == probe_module.MAX_PINGS


@pytest.mark.parametrize(
    "reply",
    [
        {"type": "Accepted", "bytes": 1024, "seconds": float("nan")},
        {"type": "Accepted", "bytes": 1024, "seconds": float("inf")},
        {"type": "Accepted", "bytes": 1 << 40, "seconds": 1.0},  # more than was asked for
        {"type": "Refused", "reason": "no", "retry_after": -1.0},
    ],
    ids=["nan seconds", "endless", "oversized grant", "negative retry"],
)
async def test_a_hostile_backbones_replies_are_protocol_errors(reply):
    async def hostile(stream):
        framed = FramedStream(stream, 1024)
        await framed.read_frame()
        await framed.write_frame(msgspec.msgpack.encode(reply))
        await trio.sleep(30)

    async with nodes(2) as (backbone, peer):
        backbone.host.set_stream_handler(PROTOCOL, hostile)
        await peer.connect(backbone.peer_id, backbone.announce, timeout=5)
        with trio.fail_after(20), pytest.raises(ProtocolError):
            await probe_module._probe(peer, backbone.peer_id, "download", 1024)
