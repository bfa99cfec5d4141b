"""Frames on a data-plane TCP connection: the thin I/O shell of the all-reduce.

    frame = length (4 bytes, big endian) | associated data (8 bytes) | AES-GCM ciphertext + tag

The associated data (chunk index, sender count) is authenticated but not encrypted, so the
payload is sealed and opened without being copied into a bigger buffer first. A connection
opens with one cleartext `Hello{round_id, sender}` frame that lets the reducer find the
connection's keys; the reducer answers with a fresh random challenge (cleartext), and the
sender's first sealed frame must hold hello + challenge, so a forged, altered or replayed hello
is caught before any data is read.
"""

from __future__ import annotations

import struct

import msgspec
import trio

from peer.averaging.compression import BadPart
from peer.averaging.crypto import TAG_BYTES, Opener, Sealer

LENGTH = struct.Struct(">I")
META = struct.Struct(">II")  # chunk index, senders averaged (0 in contributions)
DONE = 0xFFFFFFFF  # chunk index of the frame that ends a direction
MAX_HELLO_BYTES = 512


class Hello(msgspec.Struct, frozen=True):
    round_id: bytes
    sender: str


async def receive_exactly(stream: trio.SocketStream, view: memoryview) -> bool:
    """Fill `view` from the socket; False on a clean EOF before the first byte."""
    got = 0
    while got < len(view):
        count = await stream.socket.recv_into(view[got:])
        if count == 0:
            if got == 0:
                return False
            raise BadPart(f"connection ended {got} bytes into a {len(view)}-byte frame")
        got += count
    return True


async def receive_frame(stream: trio.SocketStream, *, max_bytes: int) -> bytearray | None:
    """The next frame's body, or None at a clean end of the connection."""
    header = bytearray(LENGTH.size)
    if not await receive_exactly(stream, memoryview(header)):
        return None
    (length,) = LENGTH.unpack(header)
    if length > max_bytes:
        raise BadPart(f"a frame of {length} bytes was announced; the limit is {max_bytes}")
    body = bytearray(length)
    if length and not await receive_exactly(stream, memoryview(body)):
        raise BadPart("connection ended after a frame header")
    return body


async def send_frame(stream: trio.SocketStream, *pieces: bytes | memoryview) -> None:
    await stream.send_all(LENGTH.pack(sum(len(p) for p in pieces)))
    for piece in pieces:
        await stream.send_all(piece)


class SealedChannel:
    """One data-plane connection seen from one end: seal what we send, open what we get."""

    def __init__(self, stream: trio.SocketStream, *, send_key: bytes, receive_key: bytes) -> None:
        self.stream = stream
        self.sealer = Sealer(send_key)
        self.opener = Opener(receive_key)
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send(self, index: int, senders: int, payload: bytes | memoryview) -> None:
        meta = META.pack(index, senders)
        sealed = self.sealer.seal(payload, meta)
        await send_frame(self.stream, meta, sealed)
        self.bytes_sent += LENGTH.size + len(meta) + len(sealed)

    async def receive(self, *, max_payload: int) -> tuple[int, int, bytes] | None:
        """(index, senders, payload) of the next frame; None at a clean end of the connection."""
        body = await receive_frame(self.stream, max_bytes=META.size + max_payload + TAG_BYTES)
        if body is None:
            return None
        self.bytes_received += LENGTH.size + len(body)
        if len(body) < META.size + TAG_BYTES:
            raise BadPart(f"a data frame of {len(body)} bytes is too short")
        view = memoryview(body)
        meta = bytes(view[: META.size])
        payload = self.opener.open(view[META.size :], meta)
        index, senders = META.unpack(meta)
        return index, senders, payload
