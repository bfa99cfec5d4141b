"""Frames on a data-plane connection: the thin I/O shell of the all-reduce.

A connection is TCP, then admission (`peer.net.admission`: the network key, if any), then
TLS 1.3 with both members' pinned certificates (`peer.net.tls`). Inside TLS the dialing member
sends one `Hello{round_id, sender}` frame; the reducer checks the round is open, that `sender`
is one of its members, and that the certificate of this connection is that member's, and
answers `ACCEPT`. A reducer that has not opened the round yet hangs up and the sender dials
again. Then both directions carry data frames:

    frame = length (4 bytes, big endian) | chunk index (4) | senders averaged (4) | payload

TLS authenticates and orders every byte, so a frame needs no tag or counter of its own.
"""

from __future__ import annotations

import struct

import msgspec

from peer.errors import ProtocolError
from peer.net.tls import TlsStream

LENGTH = struct.Struct(">I")
HEADER = struct.Struct(">III")  # payload length, chunk index, senders averaged (0 in contributions)
DONE = 0xFFFFFFFF  # chunk index of the frame that ends a direction
MAX_HELLO_BYTES = 512
ACCEPT = b"\x01"


class Hello(msgspec.Struct, frozen=True):
    round_id: bytes
    sender: str


async def receive_exactly(stream: TlsStream, view: memoryview) -> bool:
    """Fill `view`; False on a clean end of the stream before the first byte."""
    got = 0
    while got < len(view):
        count = await stream.receive_into(view[got:])
        if count == 0:
            if got == 0:
                return False
            raise ProtocolError(f"connection ended {got} bytes into a {len(view)}-byte frame")
        got += count
    return True


async def receive_frame(stream: TlsStream, *, max_bytes: int) -> bytearray | None:
    """The next length-prefixed frame's body, or None at a clean end of the connection."""
    header = bytearray(LENGTH.size)
    if not await receive_exactly(stream, memoryview(header)):
        return None
    (length,) = LENGTH.unpack(header)
    if length > max_bytes:
        raise ProtocolError(f"a frame of {length} bytes was announced; the limit is {max_bytes}")
    body = bytearray(length)
    if length and not await receive_exactly(stream, memoryview(body)):
        raise ProtocolError("connection ended after a frame header")
    return body


async def send_frame(stream: TlsStream, body: bytes) -> None:
    await stream.send_all(LENGTH.pack(len(body)) + body)


class Channel:
    """One all-reduce connection seen from one end, after the hello: data frames both ways."""

    def __init__(self, stream: TlsStream) -> None:
        self.stream = stream
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send(self, index: int, senders: int, payload: bytes | memoryview) -> None:
        # Header and payload go as two writes: no copy of the payload into a bigger buffer.
        await self.stream.send_all(HEADER.pack(len(payload), index, senders))
        if len(payload):
            await self.stream.send_all(payload)
        self.bytes_sent += HEADER.size + len(payload)

    async def receive(self, *, max_payload: int) -> tuple[int, int, bytearray] | None:
        """(index, senders, payload) of the next frame; None at a clean end of the connection."""
        header = bytearray(HEADER.size)
        if not await receive_exactly(self.stream, memoryview(header)):
            return None
        length, index, senders = HEADER.unpack(header)
        if length > max_payload:
            raise ProtocolError(
                f"a frame of {length} bytes was announced; the limit is {max_payload}"
            )
        payload = bytearray(length)
        if length and not await receive_exactly(self.stream, memoryview(payload)):
            raise ProtocolError("connection ended after a frame header")
        self.bytes_received += HEADER.size + length
        return index, senders, payload
