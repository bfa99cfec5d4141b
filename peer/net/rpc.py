"""Framed msgpack RPC over libp2p streams.

Wire format (every message is one frame, see `peer.net.framing`), protocol id
`/peertrain/<service>/1`:

    caller -> Request{method, body}
    callee -> Ok{body}                        unary reply
            | Item{body} ... Item{body} End{}  streaming reply
            | Err{code, message}              at any point; ends the call

A stream carries one call at a time and may carry many in sequence: the client keeps idle
streams in a small pool per (peer, protocol), which saves the multistream-select round trips
of opening a stream for every call. Every body is decoded into the method's msgspec schema
before a handler sees it; anything else gets `Err{bad_request}`. A frame over the size limit
gets `Err{too_large}` and the stream is reset, since the rest of it cannot be parsed.
Deadlines belong to the caller: `call()` takes a `timeout`; the server only bounds idle streams.
A caller keeps its side of the stream open until the reply: the server takes an end of stream
during a call as the caller hanging up (py-libp2p reports a reset as EOF) and cancels the handler.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, TypeVar

import msgspec
import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.peer.id import ID

from peer.errors import (
    DECODE_ERRORS,
    DeadlineExceeded,
    MalformedReply,
    MessageTooLarge,
    PeertrainError,
    ProtocolError,
    RemoteError,
    RpcError,
    Unreachable,
    UserError,
    first_error,
)
from peer.net.framing import FrameDecoder, encode_frame

log = logging.getLogger("peertrain.rpc")

T = TypeVar("T")
READ_CHUNK = 64 * 1024
# Server limits: frames of this many maximum-size messages may be in flight at once per
# service, and one peer may keep this many streams of a service open (its pooled idle ones too).
BUFFERED_FRAMES = 16
PEER_BUFFERED_FRAMES = 4  # one peer's share of those
MAX_STREAMS_PER_PEER = 32
MAX_LINGERING_REFUSALS = 4
# Errors after which the server resets the stream: it must not go back to the pool.
STREAM_ENDING_CODES = frozenset({"too_large", "unavailable"})
# Errors py-libp2p and trio raise when a stream or connection goes away under us.
TRANSPORT_ERRORS = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)


def protocol_id(service: str) -> str:
    """`/peertrain/<name>/<version>` for a service "name" (version 1) or "name/version": a
    service whose messages change takes the next version, and a peer of the old one is
    refused when the stream is negotiated ("protocol not supported")."""
    name, _, version = service.partition("/")
    return f"/peertrain/{name}/{version or 1}"


class Request(msgspec.Struct, tag=True):
    method: str
    body: msgspec.Raw


class Ok(msgspec.Struct, tag=True):
    body: msgspec.Raw


class Item(msgspec.Struct, tag=True):
    body: msgspec.Raw


class End(msgspec.Struct, tag=True):
    pass


class Err(msgspec.Struct, tag=True):
    code: str
    message: str


Reply = Ok | Item | End | Err
_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def _raw(value: Any) -> msgspec.Raw:
    return msgspec.Raw(_encoder.encode(value))


class ByteBudget:
    """Bytes that the frames a server is receiving may hold at once.

    A frame reserves its announced length before its payload is buffered and returns it when
    complete, so many peers each sending the start of a huge frame cannot add up past `limit`.
    """

    def __init__(self, limit: int, name: str = "the server") -> None:
        self.limit = limit
        self.name = name
        self.used = 0

    def try_take(self, size: int) -> bool:
        if self.used + size > self.limit:
            return False
        self.used += size
        return True

    def give_back(self, size: int) -> None:
        self.used -= size


class OverBudget(Exception):
    """A frame would push the server's buffered bytes past its budget."""


class FramedStream:
    """A libp2p stream that reads and writes whole frames.

    With `budgets`, each frame's announced length is reserved from all of them before the
    payload is buffered; the owner must call `release()` when done with the stream.
    """

    def __init__(
        self, stream: INetStream, max_size: int, *, budgets: Sequence[ByteBudget] = ()
    ) -> None:
        self.stream = stream
        self.decoder = FrameDecoder(max_size)
        self.budgets = budgets
        self.reserved = 0
        self.last_used = time.monotonic()
        self.hung_up = False  # set when the caller reset the stream mid-call

    async def read_frame(self) -> bytes | None:
        """The next frame, or None on a clean end of stream between frames.

        Raises OverBudget when the announced length does not fit the budget.
        """
        while True:
            frame = self.decoder.next_frame()
            if frame is not None:
                self.release()
                return frame
            self._reserve(self.decoder.announced_length)
            try:
                data = await self.stream.read(READ_CHUNK)
            except EOFError:
                data = b""
            if not data:
                if self.decoder.has_partial_frame:
                    raise ProtocolError("stream ended in the middle of a frame (truncated)")
                return None
            self.decoder.feed(data)

    def _reserve(self, size: int | None) -> None:
        if size is None or self.reserved:
            return
        for taken, budget in enumerate(self.budgets):
            if not budget.try_take(size):
                for earlier in self.budgets[:taken]:
                    earlier.give_back(size)
                raise OverBudget(
                    f"a frame of {size} bytes does not fit: {budget.used} of {budget.limit} "
                    f"bytes of {budget.name} are being received already"
                )
        self.reserved = size

    def release(self) -> None:
        for budget in self.budgets:
            budget.give_back(self.reserved)
        self.reserved = 0

    async def write_frame(self, payload: bytes) -> None:
        await self.stream.write(encode_frame(payload))
        self.last_used = time.monotonic()

    async def reset(self) -> None:
        """Abort the stream; safe to call from a cancelled scope."""
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(TRANSPORT_ERRORS):
            await self.stream.reset()


# ---------------------------------------------------------------------------- server


Handler = Callable[[ID, Any], Awaitable[Any]]
StreamHandler = Callable[[ID, Any], AsyncIterator[Any]]


@dataclass(frozen=True)
class _Method:
    request_type: type
    handler: Handler | StreamHandler
    streaming: bool


@dataclass(frozen=True)
class RpcServerStatistics:
    open_streams: int
    buffered_bytes: int
    """Bytes reserved by frames being received right now."""
    buffered_bytes_limit: int


class RpcServer:
    """Serves the methods of one service on `/peertrain/<service>/1`.

    Memory stays bounded whatever peers send: frames being received hold at most
    `max_buffered_bytes` (default `BUFFERED_FRAMES * max_message_bytes`) plus one read chunk
    per open stream; one peer's frames at most `max_buffered_per_peer` of that (default
    `PEER_BUFFERED_FRAMES` messages), so no single peer can starve the rest; and one peer may
    hold at most `max_streams_per_peer` streams open. Beyond any limit the stream is answered
    `Err{unavailable}` and reset.
    """

    def __init__(
        self,
        host: IHost,
        service: str,
        *,
        max_message_bytes: int,
        max_buffered_bytes: int | None = None,
        max_buffered_per_peer: int | None = None,
        max_streams_per_peer: int = MAX_STREAMS_PER_PEER,
        idle_timeout: float = 60.0,
        call_deadline: float = math.inf,
    ) -> None:
        self.host = host
        self.call_deadline = call_deadline
        self.service = service
        self.max_message_bytes = max_message_bytes
        self.budget = ByteBudget(max_buffered_bytes or BUFFERED_FRAMES * max_message_bytes)
        self.peer_budget_bytes = max_buffered_per_peer or PEER_BUFFERED_FRAMES * max_message_bytes
        self.max_streams_per_peer = max_streams_per_peer
        self.idle_timeout = idle_timeout
        self._methods: dict[str, _Method] = {}
        self._streams: dict[ID, int] = {}  # open streams per calling peer
        self._peer_budgets: dict[ID, ByteBudget] = {}  # while it has streams open
        self._refusing: dict[ID, int] = {}  # refusals still lingering, per peer
        host.set_stream_handler(protocol_id(service), self._serve_stream)

    def add_unary(
        self, name: str, request_type: type[T], handler: Callable[[ID, T], Awaitable[Any]]
    ) -> None:
        self._methods[name] = _Method(request_type, handler, streaming=False)

    def add_streaming(
        self, name: str, request_type: type[T], handler: Callable[[ID, T], AsyncIterator[Any]]
    ) -> None:
        self._methods[name] = _Method(request_type, handler, streaming=True)

    async def _serve_stream(self, stream: INetStream) -> None:
        caller = stream.muxed_conn.peer_id
        if self._streams.get(caller, 0) >= self.max_streams_per_peer:
            message = f"more than {self.max_streams_per_peer} open {self.service} streams from you"
            await self._refuse(caller, FramedStream(stream, 1), "unavailable", message)
            return
        if caller not in self._streams:
            self._streams[caller] = 0
            self._peer_budgets[caller] = ByteBudget(self.peer_budget_bytes, "your share")
        self._streams[caller] += 1
        budgets = (self._peer_budgets[caller], self.budget)
        framed = FramedStream(stream, self.max_message_bytes, budgets=budgets)
        try:
            await self._serve_frames(caller, framed)
        finally:
            framed.release()
            self._streams[caller] -= 1
            if not self._streams[caller]:
                del self._streams[caller], self._peer_budgets[caller]

    def statistics(self) -> RpcServerStatistics:
        return RpcServerStatistics(
            open_streams=sum(self._streams.values()),
            buffered_bytes=self.budget.used,
            buffered_bytes_limit=self.budget.limit,
        )

    async def _serve_frames(self, caller: ID, framed: FramedStream) -> None:
        stream = framed.stream
        try:
            while True:
                frame = None  # stays None when the stream idles (or trickles) too long
                with trio.move_on_after(self.idle_timeout):
                    frame = await framed.read_frame()
                if frame is None:
                    break
                # The caller's own deadline resets the stream, which cancels the handler (see
                # _cancel_on_reset); `call_deadline` bounds a caller that never reads the reply.
                with trio.move_on_after(self.call_deadline) as call:
                    await self._answer(caller, framed, frame)
                if call.cancelled_caught:
                    log.debug("a %s call from %s passed its deadline", self.service, caller)
                    await framed.reset()
                    return
            with trio.move_on_after(1.0):
                await stream.close()
        except MessageTooLarge as error:
            await self._refuse(caller, framed, "too_large", str(error))
        except OverBudget as error:
            await self._refuse(caller, framed, "unavailable", f"server busy: {error}")
        except ProtocolError as error:
            log.debug("closing stream from %s: %s", caller, error)
            await framed.reset()
        except TRANSPORT_ERRORS as error:
            log.debug("stream from %s failed: %r", caller, error)
            await framed.reset()

    async def _answer(self, caller: ID, framed: FramedStream, frame: bytes) -> None:
        try:
            request = _request_decoder.decode(frame)
        except DECODE_ERRORS as error:
            await self._send_error(framed, "bad_request", f"malformed request: {error}")
            return
        method = self._methods.get(request.method)
        if method is None:
            known = ", ".join(sorted(self._methods))
            await self._send_error(
                framed,
                "unknown_method",
                f"{self.service} has no method {request.method!r} (known: {known})",
            )
            return
        try:
            body = msgspec.msgpack.decode(request.body, type=method.request_type)
        except DECODE_ERRORS as error:  # ValidationError is a subclass
            await self._send_error(framed, "bad_request", f"{request.method}: {error}")
            return
        outcome: BaseException | None = None
        async with trio.open_nursery() as nursery:
            # A caller that gives up resets the stream: stop working for it.
            nursery.start_soon(_cancel_on_reset, framed, nursery.cancel_scope)
            outcome = await self._run_catching(method, caller, body, framed)
            nursery.cancel_scope.cancel()
        if framed.hung_up:
            raise ProtocolError("the caller reset the stream before the reply")
        if isinstance(outcome, TRANSPORT_ERRORS):
            raise outcome
        if isinstance(outcome, BaseExceptionGroup):  # from a nursery inside the handler
            ours, rest = outcome.split(PeertrainError)
            if ours is not None and rest is None:
                outcome = first_error(ours)
        if isinstance(outcome, RpcError):
            await self._send_error(framed, outcome.code, outcome.message)
        elif isinstance(outcome, (RemoteError, UserError)):
            await self._send_error(framed, "bad_request", str(outcome))
        elif outcome is not None:
            log.error("handler %s.%s failed", self.service, request.method, exc_info=outcome)
            await self._send_error(framed, "internal", "the handler failed; see the callee's log")

    async def _run_catching(
        self, method: _Method, caller: ID, body: Any, framed: FramedStream
    ) -> BaseException | None:
        """Run a handler; its failure is returned (to be answered), cancellation propagates."""
        try:
            await self._run(method, caller, body, framed)
        except Exception as error:
            return error
        return None

    @staticmethod
    async def _run(method: _Method, caller: ID, body: Any, framed: FramedStream) -> None:
        if method.streaming:
            async for item in method.handler(caller, body):  # type: ignore[attr-defined]
                await framed.write_frame(_encoder.encode(Item(_raw(item))))
            await framed.write_frame(_encoder.encode(End()))
        else:
            result = await method.handler(caller, body)  # type: ignore[misc]
            await framed.write_frame(_encoder.encode(Ok(_raw(result))))

    async def _refuse(self, caller: ID, framed: FramedStream, code: str, message: str) -> None:
        """Answer `Err` and end a stream whose further input we will not parse.

        A reset right after the reply would drop the reply too (the caller may still be
        writing), so: reply, half-close, discard input until the caller hangs up or 1 s passes.
        A peer with several refusals lingering already just gets resets.
        """
        if self._refusing.get(caller, 0) >= MAX_LINGERING_REFUSALS:
            await framed.reset()
            return
        self._refusing[caller] = self._refusing.get(caller, 0) + 1
        try:
            await self._send_error(framed, code, message)
            with trio.move_on_after(1.0), suppress(EOFError, *TRANSPORT_ERRORS):
                await framed.stream.close()
                while await framed.stream.read(READ_CHUNK):
                    pass
            await framed.reset()
        finally:
            self._refusing[caller] -= 1
            if not self._refusing[caller]:
                del self._refusing[caller]

    @staticmethod
    async def _send_error(framed: FramedStream, code: str, message: str) -> None:
        try:
            with trio.move_on_after(2.0):
                await framed.write_frame(_encoder.encode(Err(code, message[:1000])))
        except TRANSPORT_ERRORS:
            pass


async def _cancel_on_reset(framed: FramedStream, handler_scope: trio.CancelScope) -> None:
    # py-libp2p reports a caller's reset as plain EOF, so the protocol asks callers to keep
    # their side open until the reply: EOF during a call means the caller is gone.
    try:
        data = await framed.stream.read(READ_CHUNK)
    except (EOFError, *TRANSPORT_ERRORS):
        data = b""
    if data:
        framed.decoder.feed(data)  # a pipelined next request: keep it for the serving loop
    else:
        framed.hung_up = True
        handler_scope.cancel()


# ---------------------------------------------------------------------------- client


class RpcClient:
    """Calls methods on other peers, reusing idle streams."""

    def __init__(
        self,
        host: IHost,
        *,
        max_message_bytes: int,
        max_idle_per_peer: int = 4,
        idle_timeout: float = 30.0,
    ) -> None:
        self.host = host
        self.max_message_bytes = max_message_bytes
        self.max_idle_per_peer = max_idle_per_peer
        self.idle_timeout = (
            idle_timeout  # below the server's, so we never reuse a stream it dropped
        )
        self._idle: dict[tuple[ID, str], list[FramedStream]] = {}

    async def call(
        self,
        peer_id: ID,
        service: str,
        method: str,
        request: Any,
        response_type: type[T],
        *,
        timeout: float,
    ) -> T:
        """One unary call. Raises RpcError, DeadlineExceeded, Unreachable or ProtocolError."""
        try:
            with trio.fail_after(timeout):
                return await self._call(peer_id, service, method, request, response_type)
        except trio.TooSlowError:
            raise DeadlineExceeded(
                f"{service}.{method} to {peer_id} took over {timeout:.3g}s"
            ) from None

    async def call_each(
        self,
        calls: Sequence[tuple[ID, Any]],
        service: str,
        method: str,
        response_type: type[T],
        *,
        timeout: float,
    ) -> list[T | RemoteError]:
        """`method` on several peers at once, each (peer, request) a call under `timeout`:
        each call's reply or the RemoteError it raised, in the order of `calls` (a fan-out
        that waits for all: a DHT store to a key's holders, a read of many keys)."""
        outcomes: list[T | RemoteError] = [Unreachable("not called")] * len(calls)

        async def one(index: int, peer_id: ID, request: Any) -> None:
            try:
                outcomes[index] = await self.call(
                    peer_id, service, method, request, response_type, timeout=timeout
                )
            except RemoteError as error:
                outcomes[index] = error

        async with trio.open_nursery() as nursery:
            for index, (peer_id, request) in enumerate(calls):
                nursery.start_soon(one, index, peer_id, request)
        return outcomes

    async def _call(
        self, peer_id: ID, service: str, method: str, request: Any, response_type: type[T]
    ) -> T:
        payload = _encoder.encode(Request(method, _raw(request)))
        # A pooled stream may have died since its last use: then retry once on a fresh one.
        for reused in (True, False):
            framed = await self._checkout(peer_id, service, reuse=reused)
            if framed is None:
                continue
            try:
                await framed.write_frame(payload)
                frame = await framed.read_frame()
            except BaseException as error:
                await framed.reset()
                if reused and isinstance(error, (*TRANSPORT_ERRORS, ProtocolError)):
                    continue
                if isinstance(error, TRANSPORT_ERRORS):
                    raise Unreachable(
                        f"{service}.{method} to {peer_id}: stream failed ({error!r})"
                    ) from error
                raise
            if frame is None:
                await framed.reset()
                if reused:
                    continue
                raise ProtocolError(
                    f"{peer_id} closed the stream without answering {service}.{method}"
                )
            reply = self._decode_reply(frame, peer_id)
            if isinstance(reply, Err):
                if reply.code in STREAM_ENDING_CODES:
                    await framed.reset()
                else:
                    await self._checkin(peer_id, service, framed)
                raise RpcError(reply.code, reply.message)
            if not isinstance(reply, Ok):
                await framed.reset()
                raise ProtocolError(f"{peer_id} sent {type(reply).__name__} to a unary call")
            await self._checkin(peer_id, service, framed)
            return _decode_body(reply.body, response_type, peer_id)
        raise AssertionError("unreachable: the fresh-stream attempt always returns or raises")

    @asynccontextmanager
    async def stream(
        self,
        peer_id: ID,
        service: str,
        method: str,
        request: Any,
        item_type: type[T],
        *,
        timeout: float,
    ) -> AsyncIterator[AsyncIterator[T]]:
        """A streaming call: `async with client.stream(...) as items: async for item in items`.

        `timeout` bounds the wait for each item, not the whole stream.
        """
        framed = await self._open(peer_id, service)
        done = False

        async def items() -> AsyncIterator[T]:
            nonlocal done
            while True:
                try:
                    with trio.fail_after(timeout):
                        frame = await framed.read_frame()
                except trio.TooSlowError:
                    raise DeadlineExceeded(
                        f"{service}.{method} from {peer_id}: no item within {timeout:.3g}s"
                    ) from None
                except TRANSPORT_ERRORS as error:
                    raise Unreachable(
                        f"{service}.{method} from {peer_id}: stream failed ({error!r})"
                    ) from error
                if frame is None:
                    raise ProtocolError(f"{peer_id} ended {service}.{method} without End")
                reply = self._decode_reply(frame, peer_id)
                if isinstance(reply, End):
                    done = True
                    return
                if isinstance(reply, Err):
                    raise RpcError(reply.code, reply.message)
                if not isinstance(reply, Item):
                    raise ProtocolError(f"{peer_id} sent {type(reply).__name__} in a stream")
                yield _decode_body(reply.body, item_type, peer_id)

        try:
            with trio.fail_after(timeout):
                await framed.write_frame(_encoder.encode(Request(method, _raw(request))))
        except trio.TooSlowError:
            await framed.reset()
            raise DeadlineExceeded(
                f"{service}.{method} to {peer_id}: request not sent in {timeout:.3g}s"
            ) from None
        except TRANSPORT_ERRORS as error:
            await framed.reset()
            raise Unreachable(
                f"{service}.{method} to {peer_id}: stream failed ({error!r})"
            ) from error
        try:
            yield items()
        finally:
            if done:
                await self._checkin(peer_id, service, framed)
            else:
                await framed.reset()

    def _decode_reply(self, frame: bytes, peer_id: ID) -> Reply:
        try:
            return _reply_decoder.decode(frame)
        except DECODE_ERRORS as error:
            raise MalformedReply(f"{peer_id} sent a malformed reply: {error}") from None

    async def _checkout(self, peer_id: ID, service: str, *, reuse: bool) -> FramedStream | None:
        if not reuse:
            return await self._open(peer_id, service)
        pool = self._idle.get((peer_id, service), [])
        now = time.monotonic()
        while pool:
            framed = pool.pop()
            if now - framed.last_used < self.idle_timeout:
                return framed
            await framed.reset()
        return None

    async def _checkin(self, peer_id: ID, service: str, framed: FramedStream) -> None:
        pool = self._idle.setdefault((peer_id, service), [])
        if len(pool) < self.max_idle_per_peer:
            pool.append(framed)
        else:
            await framed.reset()

    async def _open(self, peer_id: ID, service: str) -> FramedStream:
        try:
            stream = await self.host.new_stream(peer_id, [protocol_id(service)])
        except TRANSPORT_ERRORS as error:
            raise Unreachable(
                f"cannot open {protocol_id(service)} to {peer_id}: {error}"
            ) from error
        return FramedStream(stream, self.max_message_bytes)

    def forget(self, peer_id: ID) -> None:
        """Drop pooled streams to a peer (it left, or its connection closed)."""
        for key in [key for key in self._idle if key[0] == peer_id]:
            del self._idle[key]


def _decode_body(body: msgspec.Raw, type_: type[T], peer_id: ID) -> T:
    try:
        return msgspec.msgpack.decode(body, type=type_)
    except DECODE_ERRORS as error:
        raise MalformedReply(
            f"{peer_id} sent a reply that does not fit the schema: {error}"
        ) from None


__all__ = ["FramedStream", "RpcClient", "RpcServer", "protocol_id"]
