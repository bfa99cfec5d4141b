"""The data planes over libp2p streams, for peers with no direct path (`peer.net.streamio`).

Real nodes on loopback, in process. A member or donor "without a direct path" either
advertises no data address (port 0) or advertises a port nothing listens on (the dial is
refused, as a NATed port drops it): its traffic must then go over a libp2p stream, with the
same bits as the direct path. Hostile streams: a hello naming another peer than the stream's
authenticated one, and a stream from a peer no round lists, which must cost nothing.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager

import msgspec
import numpy as np
import pytest
import trio

from peer.averaging import allreduce as allreduce_module
from peer.averaging.allreduce import DataServer, Member, RoundReport, RoundSpec, allreduce
from peer.averaging.wire import ACCEPT, Hello, receive_exactly, send_frame
from peer.net.host import Node
from peer.net.streamio import (
    ALLREDUCE_PROTOCOL,
    STATE_PROTOCOL,
    STREAM_PATH,
    TLS_PATH,
    Libp2pStream,
    open_stream,
)
from peer.training.chunks import SERVICE, Manifest, ManifestRequest
from peer.training.statesync import StateDonor, StateDownload, held
from peer.training.statesync.wire import KIND_ERROR, MAGIC, REPLY, REQUEST, Snapshot
from tests.helpers import data_identity, nodes

SIZE = 10_007
CHUNK = 1024
STALL = 3.0


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released): a dial to it is refused."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def connect_all(peers: list[Node]) -> None:
    for i, a in enumerate(peers):
        for b in peers[i + 1 :]:
            await a.connect(b.peer_id, b.announce, timeout=5)


@contextlib.contextmanager
def silent_port() -> Iterator[int]:
    """A loopback port that completes TCP handshakes (the kernel's backlog) and then says
    nothing: a direct dial to it connects but never finishes TLS."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield int(listener.getsockname()[1])


@asynccontextmanager
async def data_servers(
    count: int, *, direct_timeout: float = 2.0
) -> AsyncIterator[tuple[list[Node], list[DataServer], list[int]]]:
    """`count` connected nodes, each with a data server that also takes libp2p streams,
    sorted by peer id (as a spec lists them)."""
    async with nodes(count) as peers, trio.open_nursery() as nursery:
        peers = sorted(peers, key=lambda n: n.peer_id.to_base58())
        await connect_all(peers)
        servers = [
            DataServer(data_identity(n.identity), node=n, direct_timeout=direct_timeout)
            for n in peers
        ]
        ports = [await nursery.start(s.serve, "127.0.0.1", 0) for s in servers]
        yield peers, servers, ports
        nursery.cancel_scope.cancel()


def spec_for(
    servers: list[DataServer], ports: list[int], weights: list[float], round_id: bytes
) -> RoundSpec:
    members = tuple(
        Member(
            peer_id=s.identity.peer_id,
            host="127.0.0.1",
            port=port,
            computes=True,
            share=1.0,
            weight=w,
            cert=s.identity.certificate,
        )
        for s, port, w in zip(servers, ports, weights, strict=True)
    )
    return RoundSpec(
        round_id=round_id, members=members, size=SIZE, codec="none", chunk_elements=CHUNK
    )


async def run_round(
    spec: RoundSpec, servers: list[DataServer], vectors: list[np.ndarray]
) -> list[RoundReport]:
    reports: list[RoundReport] = [None] * len(servers)  # type: ignore[list-item]

    async def play(i: int) -> None:
        reports[i] = await allreduce(
            spec, vectors[i], servers[i], deadline=trio.current_time() + 30, stall_timeout=STALL
        )

    with trio.fail_after(40):
        async with trio.open_nursery() as nursery:
            for i in range(len(servers)):
                nursery.start_soon(play, i)
    return reports


@pytest.mark.parametrize("hidden", ["no address", "refused port", "silent port"])
async def test_an_allreduce_with_a_member_without_direct_path_goes_over_streams(
    hidden: str,
) -> None:
    rng = np.random.default_rng(3)
    originals = [rng.standard_normal(SIZE).astype(np.float32) * 3 for _ in range(3)]
    weights = [1.0, 2.0, 3.0]
    async with (
        data_servers(3, direct_timeout=0.5) as (_, servers, ports),
        contextlib.AsyncExitStack() as stack,
    ):
        direct = spec_for(servers, ports, weights, b"direct")
        vectors = [v.copy() for v in originals]
        reports = await run_round(direct, servers, vectors)
        assert all(r.complete for r in reports)
        assert {p for r in reports for p in r.reducer_paths.values()} == {TLS_PATH}
        assert {p for r in reports for p in r.sender_paths.values()} == {TLS_PATH}

        # Member 1 cannot be dialled: no data address, or a port that refuses.
        unreachable = servers[1].identity.peer_id
        port = {
            "no address": lambda: 0,
            "refused port": closed_port,
            "silent port": lambda: stack.enter_context(silent_port()),
        }[hidden]()
        members = list(spec_for(servers, ports, weights, b"streams").members)
        members[1] = dataclasses.replace(members[1], port=port)
        streams = dataclasses.replace(direct, round_id=b"streams", members=tuple(members))
        allreduce_module.check_spec(streams, servers[0].identity.peer_id)
        over_streams = [v.copy() for v in originals]
        reports = await run_round(streams, servers, over_streams)

    assert all(r.complete and r.exact_over is not None for r in reports)
    for i, (a, b) in enumerate(zip(vectors, over_streams, strict=True)):
        assert np.array_equal(a.view(np.uint32), b.view(np.uint32)), f"member {i} differs"
    expected = sum(w * v.astype(np.float64) for w, v in zip(weights, originals, strict=True))
    np.testing.assert_allclose(vectors[0], expected / sum(weights), rtol=1e-5, atol=1e-5)
    # Senders reach member 1 over streams (and it takes theirs so); everything else is direct.
    for i, report in enumerate(reports):
        for reducer, path in report.reducer_paths.items():
            assert path == (STREAM_PATH if reducer == unreachable else TLS_PATH), (i, reducer)
        for sender, path in report.sender_paths.items():
            assert path == (STREAM_PATH if i == 1 else TLS_PATH), (i, sender)
        assert len(report.reducer_paths) == len(report.sender_paths) == 2
    assert servers[1].paths[STREAM_PATH] == 2  # the two senders' streams it accepted


async def test_a_stream_writer_outwaits_a_reader_that_pauses_past_yamux_5_s() -> None:
    """yamux's own write gives up (a reset) after 5 s without a window update; a reducer holds
    back a sender far ahead of the others for longer. `send_all` waits for the window itself."""
    payload = np.random.default_rng(7).bytes(12 << 20)  # past the window (4 MiB here)
    received = bytearray()
    async with nodes(2) as (writer, reader):
        await connect_all([writer, reader])

        async def slow_reader(raw) -> None:  # type: ignore[no-untyped-def]
            stream = Libp2pStream(raw)
            await trio.sleep(6)
            while data := await stream.receive_some(1 << 16):
                received.extend(data)
            await stream.aclose()

        reader.host.set_stream_handler("/peertrain/test-slow/1", slow_reader)
        stream = await open_stream(writer.host, reader.peer_id, "/peertrain/test-slow/1")
        with trio.fail_after(30):
            await stream.send_all(payload)
            await stream.aclose()
            while len(received) < len(payload):
                await trio.sleep(0.05)
    assert bytes(received) == payload


async def _greet(stream: Libp2pStream, round_id: bytes, sender: str) -> bool:
    """Send a hello; whether the reducer answered ACCEPT (False: it hung up or reset)."""
    try:
        with trio.fail_after(5):
            await send_frame(stream, msgspec.msgpack.encode(Hello(round_id, sender)))
            answer = bytearray(len(ACCEPT))
            return await receive_exactly(stream, memoryview(answer)) and answer == ACCEPT
    except trio.BrokenResourceError:
        return False


async def test_a_stream_whose_hello_names_another_peer_is_refused() -> None:
    async with data_servers(3) as (peers, servers, _):
        reducer, alice, bob = servers
        senders = {s.identity.peer_id: s.identity.certificate for s in (alice, bob)}
        inbox = reducer.open_inbox(b"round", senders)
        try:
            # Alice's stream (Noise says it is Alice's) claims to be Bob's: refused.
            stream = await open_stream(peers[1].host, peers[0].peer_id, ALLREDUCE_PROTOCOL)
            assert not await _greet(stream, b"round", bob.identity.peer_id)
            await stream.aclose()
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            # The same stream naming Alice herself is taken (the check is the name, not her).
            stream = await open_stream(peers[1].host, peers[0].peer_id, ALLREDUCE_PROTOCOL)
            assert await _greet(stream, b"round", alice.identity.peer_id)
            handoff = inbox.receive_nowait()
            assert (handoff.sender, handoff.path) == (alice.identity.peer_id, STREAM_PATH)
            handoff.released.set()
            await stream.aclose()
        finally:
            reducer.close_inbox(b"round")


async def test_a_stream_from_a_peer_not_in_the_round_costs_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hellos_read: list[str] = []
    read_hello = allreduce_module._read_hello

    async def counting(stream):  # type: ignore[no-untyped-def]
        hellos_read.append(str(getattr(stream, "remote_peer_id", "tls")))
        return await read_hello(stream)

    monkeypatch.setattr(allreduce_module, "_read_hello", counting)
    async with data_servers(3) as (peers, servers, _):
        reducer, member, stranger = servers
        inbox = reducer.open_inbox(b"round", {member.identity.peer_id: member.identity.certificate})
        try:
            # A stranger naming itself, then naming the member: reset before any read.
            for name in (stranger.identity.peer_id, member.identity.peer_id):
                try:
                    stream = await open_stream(peers[2].host, peers[0].peer_id, ALLREDUCE_PROTOCOL)
                except OSError:
                    continue  # the reset came before libp2p's own negotiation was read
                assert not await _greet(stream, b"round", name)
                await stream.aclose()
            assert hellos_read == []
            assert reducer.stream_gate.statistics() == (0, 0)
            with pytest.raises(trio.WouldBlock):
                inbox.receive_nowait()
            # The listed member gets through the same door (so the refusal is about the peer).
            stream = await open_stream(peers[1].host, peers[0].peer_id, ALLREDUCE_PROTOCOL)
            assert await _greet(stream, b"round", member.identity.peer_id)
            assert hellos_read == [str(peers[1].peer_id)]
            inbox.receive_nowait().released.set()
            await stream.aclose()
        finally:
            reducer.close_inbox(b"round")


# ---------------------------------------------------------------- state download

BLOB_BYTES = 300_000
STATE_CHUNK = 64 * 1024


@asynccontextmanager
async def hidden_donor(state: bytes) -> AsyncIterator[tuple[list[Node], StateDonor]]:
    """nodes[0] donates `state` but advertises a data port that refuses every dial."""
    async with nodes(3) as peers, trio.open_nursery() as nursery:
        await connect_all(peers)
        donor = StateDonor(
            peers[0],
            held(Snapshot(7, state)),
            chunk_bytes=STATE_CHUNK,
            advertised_host="127.0.0.1",
            advertised_port=closed_port(),
            stall_timeout=5.0,
        )
        await nursery.start(donor.serve, "127.0.0.1", 0)
        yield peers, donor
        nursery.cancel_scope.cancel()


async def test_a_state_download_from_a_donor_reachable_only_by_libp2p() -> None:
    state = np.random.default_rng(5).bytes(BLOB_BYTES)
    async with hidden_donor(state) as (peers, donor):
        download = StateDownload(peers[1], [peers[0].peer_id], min_step=7, stall_timeout=5)
        with trio.fail_after(30):
            snapshot = await download.run(deadline=trio.current_time() + 20)
        assert snapshot.blob == state
        stats = download.statistics()
        assert stats.paths == {str(peers[0].peer_id): STREAM_PATH}
        assert stats.chunks_from == {str(peers[0].peer_id): stats.chunks}
        assert donor.statistics().bytes_served == BLOB_BYTES


async def _ask_chunk(stream: Libp2pStream, ticket: bytes) -> tuple[int, bytes]:
    """Greet with `ticket`, ask for chunk 0: (reply kind, first bytes), or (-1, b"") if the
    donor reset the stream."""
    try:
        with trio.fail_after(5):
            await stream.send_all(MAGIC + ticket + REQUEST.pack(0))
            header = bytearray(REPLY.size)
            if not await receive_exactly(stream, memoryview(header)):
                return -1, b""
            kind, _, length = REPLY.unpack(header)
            body = bytearray(min(length, 64))
            await receive_exactly(stream, memoryview(body))
            return kind, bytes(body)
    except trio.BrokenResourceError:
        return -1, b""


async def test_a_state_stream_needs_a_ticket_of_its_own_peer() -> None:
    state = np.random.default_rng(6).bytes(BLOB_BYTES)
    async with hidden_donor(state) as (peers, donor):
        donor_id = peers[0].peer_id
        manifest = await peers[1].rpc.call(
            donor_id, SERVICE, "manifest", ManifestRequest(7), Manifest, timeout=5
        )
        # A peer without a ticket of its own: reset before a byte is read, whatever it shows.
        with contextlib.suppress(OSError):  # the reset may come before libp2p's negotiation
            stream = await open_stream(peers[2].host, donor_id, STATE_PROTOCOL)
            assert await _ask_chunk(stream, manifest.ticket) == (-1, b"")
            await stream.aclose()
        assert donor.statistics().chunks_served == 0
        # With a ticket of its own, peer 2 still cannot use peer 1's.
        await peers[2].rpc.call(
            donor_id, SERVICE, "manifest", ManifestRequest(7), Manifest, timeout=5
        )
        stream = await open_stream(peers[2].host, donor_id, STATE_PROTOCOL)
        kind, message = await _ask_chunk(stream, manifest.ticket)
        assert kind == KIND_ERROR and b"not your ticket" in message
        await stream.aclose()
        # Peer 1 with its own ticket gets the chunk.
        stream = await open_stream(peers[1].host, donor_id, STATE_PROTOCOL)
        kind, data = await _ask_chunk(stream, manifest.ticket)
        assert kind != KIND_ERROR and data == state[: len(data)] and data
        await stream.aclose()
        assert donor.stream_gate.statistics() == (0, 0)
