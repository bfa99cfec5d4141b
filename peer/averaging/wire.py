"""Frames on a data-plane connection: the thin I/O shell of the all-reduce.

A connection is TCP, then admission (`peer.net.admission`: the network key, if any), then
TLS 1.3 with both members' pinned certificates (`peer.net.tls`); or, where the reducer cannot
be dialled directly, a libp2p stream `/peertrain/allreduce-data/1` (`peer.net.streamio`), whose
remote peer id Noise authenticated. Inside, the dialing member sends one
`Hello{round_id, sender}` frame; the reducer checks the round is open, that `sender` is one of
its members, and that this connection is that member's (its certificate is the listed one; on
a stream, `sender` is the stream's authenticated peer id), and answers `ACCEPT`. A reducer that has not opened the round yet hangs up and the sender dials
again. Then both directions carry data frames:

    frame = length (4 bytes, big endian) | chunk index (4) | senders averaged (4) | payload

A sender's frames carry its contributions (senders 0), then `DONE`. A reducer's frames carry
averages: the payload is the chunk's *include mask* (`mask_bytes(n)` bytes: bit i, little
endian, is the i-th computing member of the spec in spec order; set if its contribution is in
the average, and as many bits set as the header's count) followed by the codec's bytes; then
`DONE`. Once a sender holds its reducer's whole part it says so with one `RECEIVED` frame:
a reducer only counts its part as delivered to the senders that did.

TLS (or Noise, on a stream) authenticates and orders every byte, so a frame needs no tag or
counter of its own.
"""

from __future__ import annotations

import struct
from collections.abc import Collection, Sequence

import msgspec

from peer.errors import ProtocolError
from peer.net.streamio import DataStream

LENGTH = struct.Struct(">I")
HEADER = struct.Struct(">III")  # payload length, chunk index, senders averaged (0 in contributions)
DONE = 0xFFFFFFFF  # chunk index of the frame that ends a direction
RECEIVED = 0xFFFFFFFE  # chunk index of a sender's receipt: it holds the reducer's whole part
MAX_HELLO_BYTES = 512
ACCEPT = b"\x01"


class Hello(msgspec.Struct, frozen=True):
    round_id: bytes
    sender: str


async def receive_exactly(stream: DataStream, view: memoryview) -> bool:
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


async def receive_frame(stream: DataStream, *, max_bytes: int) -> bytearray | None:
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


async def send_frame(stream: DataStream, body: bytes) -> None:
    await stream.send_all(LENGTH.pack(len(body)) + body)


def mask_bytes(members: int) -> int:
    """Length of an include mask over `members` computing members."""
    return -(-members // 8)


def include_mask(included: Collection[str], members: Sequence[str]) -> bytes:
    """The mask naming `included` among `members` (the spec's computing members, in order)."""
    positions = {peer_id: i for i, peer_id in enumerate(members)}
    bits = sum(1 << positions[peer_id] for peer_id in set(included))
    return bits.to_bytes(mask_bytes(len(members)), "little")


def included_by(mask: bytes | memoryview, members: Sequence[str]) -> frozenset[str]:
    """Who a peer's include mask names; ProtocolError unless it is one over `members`."""
    if len(mask) != mask_bytes(len(members)):
        raise ProtocolError(f"an include mask of {len(mask)} bytes for {len(members)} members")
    bits = int.from_bytes(mask, "little")
    if bits >> len(members):
        raise ProtocolError(f"an include mask names senders past the {len(members)} members")
    return frozenset(peer_id for i, peer_id in enumerate(members) if bits >> i & 1)


class Channel:
    """One all-reduce connection seen from one end, after the hello: data frames both ways."""

    def __init__(self, stream: DataStream) -> None:
        self.stream = stream
        self.bytes_sent = 0
        self.bytes_received = 0

    async def send(
        self, index: int, senders: int, payload: bytes | memoryview, *, prefix: bytes = b""
    ) -> None:
        """One frame whose payload is `prefix` (an include mask) then `payload`."""
        # Header and payload go as two writes: no copy of the payload into a bigger buffer.
        length = len(prefix) + len(payload)
        await self.stream.send_all(HEADER.pack(length, index, senders) + prefix)
        if len(payload):
            await self.stream.send_all(payload)
        self.bytes_sent += HEADER.size + length

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
