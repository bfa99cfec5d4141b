"""The data planes over a libp2p stream, for peers with no direct path between them.

The all-reduce and the state download move bulk bytes over their own TLS 1.3 connections
(`peer.net.tls`): a py-libp2p Noise + yamux stream tops out near 0.3 GB/s. A peer behind NAT
cannot be dialled on those ports, though, while its libp2p connection may be up (hole punched,
or relayed). Then the same protocol runs over a libp2p stream on that connection
(`/peertrain/allreduce-data/1`, `/peertrain/state-data/1`), and the stream's remote peer id,
which Noise authenticated, takes the place of the pinned certificate: no TLS inside.

`Libp2pStream` gives a py-libp2p stream the byte-stream surface the data planes use on
`TlsStream` (`DataStream`: `send_all`, `receive_into`, `receive_some`, `aclose`), with
libp2p's errors turned into trio's, so the protocol code above is the same on either path.
`StreamGate` bounds the streams a handler holds before it knows what they are for.

Two yamux traps (docs: py-libp2p-0.8.1 notes) shape `send_all`: a write that waits 5 s for a
window update gives up with a reset, and a reducer stops reading a sender that is far ahead
(`allreduce._held_back`) for as long as it takes the slowest one to catch up. So `send_all`
waits for the window itself, without that limit (the caller's deadlines bound it, as TCP's
backpressure is bounded over TLS), and writes at most what the window takes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any, Protocol

import trio
from libp2p.abc import IHost, INetStream
from libp2p.exceptions import BaseLibp2pError
from libp2p.network.stream.exceptions import StreamEOF
from libp2p.peer.id import ID

from peer.net.relay.internals import (
    direct_conn,
    is_relayed,
    live_conn,
    punch_failed,
    stream_on,
)

log = logging.getLogger("peertrain.streamio")

ALLREDUCE_PROTOCOL = "/peertrain/allreduce-data/1"
STATE_PROTOCOL = "/peertrain/state-data/1"
TLS_PATH, STREAM_PATH = "tls", "libp2p"  # how a data-plane connection went, for reports
WRITE_BYTES = 1 << 18  # per libp2p write at most: yamux cuts it into 64 KiB frames anyway
READ_BYTES = 1 << 20  # per libp2p read at most (yamux copies out of its buffer once)
WINDOW_POLL = 0.01  # yamux has no event for a window update: it polls at this rate too
PUNCH_SECONDS = 5.0
"""Seconds a relayed connection is given to become direct (a hole punch: one exchange over
the relay, then simultaneous dials) before a data plane gives up on the peer for this try."""
PUNCH_POLL = 0.05
NEGOTIATE_SECONDS = 5.0  # multistream-select of a data-plane protocol on a live connection
# Errors py-libp2p and trio raise when a stream or its connection goes away under us.
TRANSPORT_ERRORS = (BaseLibp2pError, trio.BrokenResourceError, trio.ClosedResourceError, OSError)


class DataStream(Protocol):
    """What the data planes read and write: a `TlsStream` or a `Libp2pStream`."""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None: ...
    async def receive_into(self, view: memoryview) -> int: ...
    async def receive_some(self, max_bytes: int | None = None) -> bytes: ...
    async def aclose(self) -> None: ...


#: Seconds a direct data-plane dial (TCP, admission, TLS) may take before a libp2p stream is
#: tried instead: a NATed peer's port drops our SYN rather than refusing it.
DIRECT_TIMEOUT = 2.0


class Libp2pStream(trio.abc.Stream):
    """A py-libp2p stream as a trio byte stream. A reset or a dead connection raises
    `trio.BrokenResourceError` (a connection error to both data planes); the remote's
    half-close is the end of the stream (0 bytes). `aclose` half-closes (our FIN goes after
    every byte we wrote, so the other end reads all of them); `reset` aborts."""

    def __init__(self, stream: INetStream) -> None:
        self.stream = stream
        self.remote_peer_id: ID = stream.muxed_conn.peer_id
        """The peer at the other end, as the connection's Noise handshake authenticated it."""
        self.relayed = is_relayed(stream.muxed_conn)
        """Whether the connection runs through a relay, which carries no tensors: its circuits
        have a small byte budget (`relay.circuit_bytes`), and a round through one stalled."""
        self._pending = memoryview(b"")  # read from libp2p, not yet handed out
        self._closed = False

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        view = memoryview(data).cast("B")
        try:
            while view:
                allowed = await self._wait_send_window()
                piece = view[: min(WRITE_BYTES, allowed)]
                await self.stream.write(bytes(piece))  # yamux slices and concatenates bytes
                view = view[len(piece) :]
        except BaseLibp2pError as error:
            raise trio.BrokenResourceError(f"libp2p stream: {error!r}") from error
        await trio.lowlevel.checkpoint()

    async def _wait_send_window(self) -> int:
        """Bytes the stream's yamux send window takes now (at least 1), waiting for an update
        without yamux's own 5 s limit; any number for a muxer without a window."""
        muxed = self.stream.muxed_stream
        if not hasattr(muxed, "send_window"):
            return WRITE_BYTES
        while muxed.send_window <= 0:
            if _ended(muxed):
                raise trio.BrokenResourceError("the stream was reset, closed or its connection")
            await trio.sleep(WINDOW_POLL)
        return int(muxed.send_window)

    async def receive_into(self, view: memoryview) -> int:
        """Bytes into `view` (at least one); 0 at the end of the stream."""
        if not self._pending:
            data = await self._read(min(len(view), READ_BYTES))
            if not data:
                return 0
            self._pending = memoryview(data)
        count = min(len(view), len(self._pending))
        view[:count] = self._pending[:count]
        self._pending = self._pending[count:]
        return count

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """Up to `max_bytes` bytes; b"" at the end of the stream."""
        buffer = bytearray(max_bytes or 65536)
        count = await self.receive_into(memoryview(buffer))
        return bytes(buffer[:count])

    async def _read(self, count: int) -> bytes:
        if self._closed:
            raise trio.ClosedResourceError("the stream is closed")
        try:
            return await self.stream.read(count)
        except StreamEOF:
            return b""
        except BaseLibp2pError as error:  # a reset, or the connection went away
            raise trio.BrokenResourceError(f"libp2p stream: {error!r}") from error

    async def wait_send_all_might_not_block(self) -> None:
        await self._wait_send_window()

    async def aclose(self) -> None:
        """Half-close (best effort, 1 s): the other end reads what we sent, then the end."""
        if self._closed:
            return
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(*TRANSPORT_ERRORS):
            await self.stream.close()

    async def reset(self) -> None:
        """Abort both directions at once (a stream we refuse): nothing of it is read."""
        self._closed = True
        with trio.CancelScope(shield=True), trio.move_on_after(1.0), suppress(*TRANSPORT_ERRORS):
            await self.stream.reset()


def _ended(muxed: object) -> bool:
    """Whether a yamux stream can no longer send: reset, closed, or its connection gone."""
    conn = getattr(muxed, "conn", None)
    shutting_down = getattr(conn, "event_shutting_down", None)
    return any(
        getattr(muxed, flag, False) for flag in ("closed", "send_closed", "reset_received")
    ) or (shutting_down is not None and shutting_down.is_set())


async def open_stream(
    host: IHost, peer_id: ID, protocol: str, *, punch_seconds: float = PUNCH_SECONDS
) -> Libp2pStream:
    """A new stream of `protocol` to `peer_id` over our direct libp2p connection to it, made
    if there is none (through a relay where the peer is reached so). A relayed connection
    carries no tensors: we wait up to `punch_seconds` for the hole punch the end that accepted
    it starts (`peer.net.holepunch`) to add a direct one, and no longer once it failed.
    OSError if no stream can be opened: to the data planes that is the same failure as a
    refused TCP dial."""
    network: Any = host.get_network()
    try:
        if live_conn(network, peer_id) is None:
            await network.dial_peer(peer_id)
        conn = direct_conn(network, peer_id)
        with trio.move_on_after(punch_seconds):
            while conn is None and live_conn(network, peer_id) is not None:
                if punch_failed(network, peer_id):  # the punch ran, and failed: no use waiting
                    break
                await trio.sleep(PUNCH_POLL)
                conn = direct_conn(network, peer_id)
        if conn is not None:
            # On exactly that connection: `host.new_stream` may pick a relayed one beside it.
            return Libp2pStream(await stream_on(conn, protocol, timeout=NEGOTIATE_SECONDS))
    except (*TRANSPORT_ERRORS, trio.TooSlowError) as error:
        raise OSError(f"cannot open {protocol} to {peer_id}: {error!r}"[:300]) from error
    raise OSError(f"no direct connection to {peer_id}, only relayed: relays carry no tensors")


@dataclass(frozen=True, kw_only=True)
class StreamLimits:
    max_per_peer: int = 4
    """Streams of one peer held before they said what they are for (an honest member needs one
    per round it sends to us in; a downloader one or two per ticket)."""
    max_total: int = 64
    """Of all peers at once."""
    deadline: float = 3.0
    """Seconds to say what a stream is for (its hello or ticket: a few hundred bytes)."""


class StreamGate:
    """Counts one protocol's streams that have not been admitted yet, per peer and in total.
    Over a cap a stream is refused before a byte of it is read."""

    def __init__(self, limits: StreamLimits | None = None) -> None:
        self.limits = limits or StreamLimits()
        self._held: dict[ID, int] = {}
        self._total = 0

    @contextmanager
    def slot(self, peer_id: ID) -> Iterator[trio.CancelScope | None]:
        """A cancel scope carrying the admission deadline, or None: refuse the stream now."""
        held = self._held.get(peer_id, 0)
        if held >= self.limits.max_per_peer or self._total >= self.limits.max_total:
            yield None
            return
        self._held[peer_id] = held + 1
        self._total += 1
        try:
            yield trio.CancelScope(deadline=trio.current_time() + self.limits.deadline)
        finally:
            self._total -= 1
            left = self._held[peer_id] - 1
            if left:
                self._held[peer_id] = left
            else:
                del self._held[peer_id]

    def statistics(self) -> tuple[int, int]:
        """(streams waiting to be admitted, peers they come from)."""
        return self._total, len(self._held)


__all__ = [
    "ALLREDUCE_PROTOCOL",
    "STATE_PROTOCOL",
    "STREAM_PATH",
    "TLS_PATH",
    "DataStream",
    "Libp2pStream",
    "StreamGate",
    "StreamLimits",
    "open_stream",
]
