"""Length-prefixed frames, sans-IO.

A frame is an unsigned LEB128 varint length (as libp2p uses for its own length-prefixed
messages) followed by that many payload bytes. `FrameDecoder` is a pure state machine: bytes
in, whole frames out. It checks the announced length against the limit as soon as the varint is
complete, before a single payload byte is buffered, so a hostile "2^40 bytes follow" costs
nothing. The I/O shell (`read_frame`) lives in `peer.net.rpc`.
"""

from __future__ import annotations

from peer.errors import MessageTooLarge, ProtocolError

# 10 varint bytes hold 64 bits; more than that is malformed, not merely large.
MAX_VARINT_BYTES = 10


def encode_varint(value: int) -> bytes:
    if value < 0:
        raise ValueError(f"varint must be >= 0, got {value!r}")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def encode_frame(payload: bytes) -> bytes:
    return encode_varint(len(payload)) + payload


class FrameDecoder:
    """Splits a byte stream into frames of at most `max_size` payload bytes.

    `feed()` bytes as they arrive, then call `next_frame()` until it returns None.
    After a `ProtocolError` the stream cannot be resynchronised: close it.
    """

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._buffer = bytearray()
        self._expected: int | None = None  # payload length once the varint is parsed
        self._broken = False

    @property
    def announced_length(self) -> int | None:
        """Payload length of the frame being received, once its length prefix is complete."""
        return self._expected

    @property
    def has_partial_frame(self) -> bool:
        """True when some bytes of an unfinished frame are buffered (EOF now = truncation)."""
        return bool(self._buffer) or self._expected is not None

    def take_leftover(self) -> bytes:
        """Bytes received after the last whole frame, for a protocol that switches to raw bytes."""
        if self._expected is not None:
            raise ProtocolError("a frame is only partly received; no raw bytes follow it yet")
        rest, self._buffer = bytes(self._buffer), bytearray()
        return rest

    def feed(self, data: bytes) -> None:
        if self._broken:
            raise ProtocolError("frame decoder used after a protocol error")
        self._buffer += data

    def next_frame(self) -> bytes | None:
        if self._broken:
            raise ProtocolError("frame decoder used after a protocol error")
        if self._expected is None:
            self._expected = self._parse_length()
            if self._expected is None:
                return None
        if len(self._buffer) < self._expected:
            return None
        frame = bytes(self._buffer[: self._expected])
        del self._buffer[: self._expected]
        self._expected = None
        return frame

    def _parse_length(self) -> int | None:
        value = 0
        for index, byte in enumerate(self._buffer):
            if index >= MAX_VARINT_BYTES:
                break
            value |= (byte & 0x7F) << (7 * index)
            if not byte & 0x80:
                del self._buffer[: index + 1]
                if value > self.max_size:
                    self._broken = True
                    raise MessageTooLarge(
                        f"frame of {value} bytes announced, limit is {self.max_size}"
                    )
                return value
        if len(self._buffer) >= MAX_VARINT_BYTES:
            self._broken = True
            raise ProtocolError("frame length prefix longer than 10 bytes")
        return None
