"""RPC over real libp2p streams on loopback: round trips, deadlines, cancellation, bad input."""

from __future__ import annotations

from collections.abc import AsyncIterator

import msgspec
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from libp2p.peer.id import ID

from peer.errors import DeadlineExceeded, RemoteError, RpcError
from peer.net.framing import encode_frame, encode_varint
from peer.net.host import Node
from peer.net.rpc import (
    READ_CHUNK,
    Err,
    FramedStream,
    Ok,
    Reply,
    Request,
    RpcServer,
    protocol_id,
)
from tests.helpers import nodes

LIMIT = 64 * 1024


class Echo(msgspec.Struct):
    text: str
    times: int = 1


class Count(msgspec.Struct):
    upto: int


class Slow(msgspec.Struct):
    pass


class Nap(msgspec.Struct):
    seconds: float


class Service:
    """A test service that records what its handlers saw."""

    def __init__(self, node: Node, *, max_message_bytes: int = LIMIT, **limits: float) -> None:
        self.cancelled = trio.Event()
        self.server = server = RpcServer(
            node.host, "test", max_message_bytes=max_message_bytes, **limits
        )
        server.add_unary("echo", Echo, self.echo)
        server.add_unary("slow", Slow, self.slow)
        server.add_unary("forbid", Slow, self.forbid)
        server.add_unary("crash", Slow, self.crash)
        server.add_unary("stale", Slow, self.stale)
        server.add_streaming("count", Count, self.count)
        server.add_unary("nap", Nap, self.nap)

    async def echo(self, caller: ID, request: Echo) -> Echo:
        return Echo(request.text * request.times, request.times)

    async def slow(self, caller: ID, request: Slow) -> Slow:
        try:
            await trio.sleep_forever()
        finally:
            self.cancelled.set()

    async def nap(self, caller: ID, request: Nap) -> Nap:
        await trio.sleep(request.seconds)
        return request

    async def forbid(self, caller: ID, request: Slow) -> Slow:
        raise RpcError("forbidden", "not for you")

    async def stale(self, caller: ID, request: Slow) -> Slow:
        async with trio.open_nursery():  # raised in a nursery: an exception group
            raise RemoteError("the state moved on; ask again")

    async def crash(self, caller: ID, request: Slow) -> Slow:
        raise ValueError("a bug in the handler")

    async def count(self, caller: ID, request: Count) -> AsyncIterator[Count]:
        for i in range(request.upto):
            yield Count(i)


async def good_call(client: Node, server: Node) -> None:
    reply = await client.rpc.call(server.peer_id, "test", "echo", Echo("ab", 2), Echo, timeout=5)
    assert reply.text == "abab"


async def connected(client: Node, server: Node) -> None:
    await client.connect(server.peer_id, server.announce, timeout=5)


async def test_unary_and_streaming_round_trips():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server)
        await connected(client, server)
        for _ in range(3):  # the second and third calls reuse the pooled stream
            await good_call(client, server)
        async with client.rpc.stream(
            server.peer_id, "test", "count", Count(5), Count, timeout=5
        ) as items:
            got = [item.upto async for item in items]
        assert got == [0, 1, 2, 3, 4]
        await good_call(client, server)


async def test_deadline_raises_and_cancels_the_remote_handler():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        service = Service(server)
        await connected(client, server)
        with pytest.raises(DeadlineExceeded, match=r"test\.slow"):
            await client.rpc.call(server.peer_id, "test", "slow", Slow(), Slow, timeout=0.3)
        with trio.fail_after(5):
            await service.cancelled.wait()  # the reset reached the server and stopped its handler
        await good_call(client, server)


async def test_a_server_call_deadline_ends_a_handler_the_caller_would_wait_on():
    """A server's `call_deadline` bounds each call whatever the caller's own deadline (a DHT
    node must not hold a reply for a caller that never reads it)."""
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        service = Service(server, call_deadline=0.5)
        await connected(client, server)
        with trio.fail_after(20), pytest.raises(RemoteError):
            await client.rpc.call(server.peer_id, "test", "slow", Slow(), Slow, timeout=60)
        assert service.cancelled.is_set()
        await good_call(client, server)


async def test_caller_cancellation_propagates():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        service = Service(server)
        await connected(client, server)
        with trio.move_on_after(0.3) as scope:
            await client.rpc.call(server.peer_id, "test", "slow", Slow(), Slow, timeout=60)
        assert scope.cancelled_caught
        with trio.fail_after(5):
            await service.cancelled.wait()
        await good_call(client, server)


async def test_typed_errors_reach_the_caller():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server)
        await connected(client, server)
        with pytest.raises(RpcError) as info:
            await client.rpc.call(server.peer_id, "test", "forbid", Slow(), Slow, timeout=5)
        assert (info.value.code, info.value.message) == ("forbidden", "not for you")
        with pytest.raises(RpcError) as info:
            await client.rpc.call(server.peer_id, "test", "crash", Slow(), Slow, timeout=5)
        assert info.value.code == "internal"
        assert "ValueError" not in info.value.message  # no internals leak to the caller
        # A peer's fault raised inside a nursery is answered as one, not as our crash.
        with pytest.raises(RpcError) as info:
            await client.rpc.call(server.peer_id, "test", "stale", Slow(), Slow, timeout=5)
        assert (info.value.code, info.value.message) == (
            "bad_request",
            "the state moved on; ask again",
        )
        await good_call(client, server)


def request(method: str, body: object) -> bytes:
    return msgspec.msgpack.encode(Request(method, msgspec.Raw(msgspec.msgpack.encode(body))))


BAD_INPUTS = [
    # (name, raw bytes sent, expected error code or None for "stream closed without reply")
    ("truncated frame", encode_varint(100) + b"x" * 10, None),
    ("length prefix 2^40", encode_varint(2**40), "too_large"),
    ("garbage msgpack", encode_frame(b"\xc1\xff\x00garbage"), "bad_request"),
    (
        "not a request",
        encode_frame(msgspec.msgpack.encode({"type": "Ok", "body": 1})),
        "bad_request",
    ),
    ("wrong field types", encode_frame(request("echo", {"text": 5, "times": "x"})), "bad_request"),
    ("missing field", encode_frame(request("echo", {"times": 1})), "bad_request"),
    ("unknown method", encode_frame(request("launch_missiles", {})), "unknown_method"),
]


@pytest.mark.parametrize(("name", "wire", "code"), BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_gets_an_error_and_the_server_keeps_serving(name, wire, code):
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server)
        await connected(client, server)
        stream = await client.host.new_stream(server.peer_id, [protocol_id("test")])
        framed = FramedStream(stream, LIMIT)
        await stream.write(wire)
        if code is None:
            await stream.close()  # EOF in the middle of the frame
        with trio.fail_after(5):
            try:
                frame = await framed.read_frame()
            except Exception:  # the server may reset instead of closing: both end the stream
                frame = None
        if code is None:
            assert frame is None
        else:
            reply = msgspec.msgpack.decode(frame, type=Reply)
            assert isinstance(reply, Err), reply
            assert reply.code == code
        await good_call(client, server)


async def test_wrong_field_type_names_the_field():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server)
        await connected(client, server)
        with pytest.raises(RpcError) as info:
            await client.rpc.call(server.peer_id, "test", "echo", {"text": 5}, Echo, timeout=5)
        assert info.value.code == "bad_request"
        assert "$.text" in info.value.message


async def test_oversized_request_is_refused_then_server_still_answers():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server)
        await connected(client, server)
        with pytest.raises(RpcError) as info:
            await client.rpc.call(
                server.peer_id, "test", "echo", Echo("x" * (LIMIT + 1)), Echo, timeout=5
            )
        assert info.value.code == "too_large"
        await good_call(client, server)


@given(st.text(max_size=50), st.binary(max_size=50), st.integers(-(2**63), 2**64 - 1))
def test_envelope_round_trips(method, blob, number):
    body = {"blob": blob, "n": number}
    decoded = msgspec.msgpack.decode(request(method, body), type=Request)
    assert decoded.method == method
    assert msgspec.msgpack.decode(decoded.body) == body
    reply = msgspec.msgpack.decode(
        msgspec.msgpack.encode(Ok(msgspec.Raw(msgspec.msgpack.encode(body)))), type=Reply
    )
    assert isinstance(reply, Ok)


async def wait_until(predicate, *, timeout: float = 5) -> None:
    with trio.fail_after(timeout):
        while not predicate():
            await trio.sleep(0.01)


async def test_frames_being_received_stay_within_the_byte_budget():
    big = 4 * READ_CHUNK  # larger than one read, so a frame is reserved before it is complete
    async with nodes(2, max_message_bytes=big) as (client, server):
        budget = 2 * big + 4096  # room for two huge frames and small calls
        service = Service(server, max_message_bytes=big, max_buffered_bytes=budget)
        await connected(client, server)
        hogs = []
        for _ in range(2):  # each announces a maximum-size frame and sends only its start
            stream = await client.host.new_stream(server.peer_id, [protocol_id("test")])
            await stream.write(encode_varint(big) + b"x" * 1000)
            hogs.append(stream)
        await wait_until(lambda: service.server.statistics().buffered_bytes == 2 * big)
        # A third huge frame does not fit: refused with a typed error, nothing buffered for it.
        huge = Echo("x" * (big - 100))
        with pytest.raises(RpcError) as info:
            await client.rpc.call(server.peer_id, "test", "echo", huge, Echo, timeout=5)
        assert info.value.code == "unavailable"
        assert service.server.statistics().buffered_bytes == 2 * big
        await good_call(client, server)  # small calls still fit
        for stream in hogs:
            await stream.reset()
        await wait_until(lambda: service.server.statistics().buffered_bytes == 0)
        reply = await client.rpc.call(server.peer_id, "test", "echo", huge, Echo, timeout=5)
        assert reply.text == huge.text


async def test_one_peer_cannot_hold_more_than_its_share_of_streams():
    async with nodes(3, max_message_bytes=LIMIT) as (greedy, server, other):
        service = Service(server, max_streams_per_peer=3)
        await connected(greedy, server)
        await connected(other, server)
        held = []
        for _ in range(3):
            stream = await greedy.host.new_stream(server.peer_id, [protocol_id("test")])
            await stream.write(encode_varint(5))  # start a frame, keep the stream busy
            held.append(stream)
        await wait_until(lambda: service.server.statistics().open_streams == 3)
        with pytest.raises(RpcError) as info:
            await greedy.rpc.call(server.peer_id, "test", "echo", Echo("hi"), Echo, timeout=5)
        assert info.value.code == "unavailable"
        await good_call(other, server)  # everyone else is still served
        before = service.server.statistics().open_streams
        await held[0].reset()
        await wait_until(lambda: service.server.statistics().open_streams < before)
        await good_call(greedy, server)


async def test_a_handler_may_run_longer_than_the_idle_timeout():
    async with nodes(2, max_message_bytes=LIMIT) as (client, server):
        Service(server, idle_timeout=0.2)
        await connected(client, server)
        reply = await client.rpc.call(server.peer_id, "test", "nap", Nap(0.5), Nap, timeout=5)
        assert reply.seconds == 0.5


async def test_one_peer_cannot_take_the_whole_byte_budget():
    big = 4 * READ_CHUNK
    async with nodes(3, max_message_bytes=big) as (greedy, server, other):
        service = Service(
            server,
            max_message_bytes=big,
            max_buffered_bytes=10 * big,
            max_buffered_per_peer=2 * big + 4096,
        )
        for peer in (greedy, other):
            await connected(peer, server)
        for _ in range(2):
            stream = await greedy.host.new_stream(server.peer_id, [protocol_id("test")])
            await stream.write(encode_varint(big) + b"x" * 1000)
        await wait_until(lambda: service.server.statistics().buffered_bytes == 2 * big)
        huge = Echo("x" * (big - 100))
        with pytest.raises(RpcError, match="your share") as info:
            await greedy.rpc.call(server.peer_id, "test", "echo", huge, Echo, timeout=5)
        assert info.value.code == "unavailable"
        reply = await other.rpc.call(server.peer_id, "test", "echo", huge, Echo, timeout=5)
        assert reply.text == huge.text  # the server had room: only the greedy peer was capped


def test_a_service_names_its_version_in_its_protocol_id():
    """A service whose messages changed takes the next version: a peer of the old one is
    refused when the stream is negotiated, not fed messages it misreads."""
    assert protocol_id("dht") == "/peertrain/dht/1"
    assert protocol_id("state/2") == "/peertrain/state/2"
