"""Wire encodings of float32 vectors, pure numpy: none, fp16, and 8-bit blockwise.

Averages always accumulate in float32; compression applies only to bytes on the wire (both
the contributions sent to reducers and the averages sent back).

- `none`: the float32 bytes as they are (4 bytes per element, zero-copy on the sending side).
- `fp16`: IEEE half precision (2 bytes). Finite values beyond +-65504 are clipped first, so a
  large but finite gradient never turns into inf (which a receiver rejects as bad input); a
  real inf or NaN stays what it is and is rejected.
- `int8`: blocks of 1024 elements, each sent as a float32 scale (its largest magnitude / 127)
  and 1024 signed bytes (x / scale, rounded): 1.004 bytes per element; the error of an
  element is at most half its block's scale.

`decode` checks the byte length against the element count it is told to expect, and raises
`BadPart` (a ProtocolError) on any mismatch; finiteness is the reducer's check.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from peer.errors import ProtocolError

BLOCK = 1024
FP16_MAX = float(np.finfo(np.float16).max)


class BadPart(ProtocolError):
    """Bytes received for a part do not decode to the expected values."""


class Codec(Protocol):
    name: str

    def wire_bytes(self, count: int) -> int: ...

    def encode(self, values: np.ndarray) -> bytes | memoryview: ...

    def decode(self, data: bytes | memoryview, count: int) -> np.ndarray: ...


def _check_length(codec: Codec, data: bytes | memoryview, count: int) -> None:
    expected = codec.wire_bytes(count)
    if len(data) != expected:
        raise BadPart(f"{codec.name}: {len(data)} bytes for {count} values, expected {expected}")


class NoCompression:
    name = "none"

    def wire_bytes(self, count: int) -> int:
        return 4 * count

    def encode(self, values: np.ndarray) -> bytes | memoryview:
        return memoryview(np.ascontiguousarray(values, dtype=np.float32)).cast("B")

    def decode(self, data: bytes | memoryview, count: int) -> np.ndarray:
        _check_length(self, data, count)
        return np.frombuffer(data, dtype=np.float32)


class Float16:
    name = "fp16"

    def wire_bytes(self, count: int) -> int:
        return 2 * count

    def encode(self, values: np.ndarray) -> bytes | memoryview:
        # Clip large finite values; inf stays inf so the receiver rejects it like with `none`.
        clipped = np.where(np.isinf(values), values, np.clip(values, -FP16_MAX, FP16_MAX))
        return memoryview(clipped.astype(np.float16)).cast("B")

    def decode(self, data: bytes | memoryview, count: int) -> np.ndarray:
        _check_length(self, data, count)
        return np.frombuffer(data, dtype=np.float16).astype(np.float32)


class Blockwise8Bit:
    name = "int8"

    def wire_bytes(self, count: int) -> int:
        return 4 * -(-count // BLOCK) + count

    def encode(self, values: np.ndarray) -> bytes | memoryview:
        count = len(values)
        full = count - count % BLOCK
        blocks = [values[:full].reshape(-1, BLOCK)]  # a view: no copy of the bulk
        if full < count:
            tail = np.zeros((1, BLOCK), dtype=np.float32)
            tail[0, : count - full] = values[full:]
            blocks.append(tail)
        scales, quantized = [], []
        for block in blocks:
            scale = (np.maximum(block.max(axis=1), -block.min(axis=1)) / 127).astype(np.float32)
            with np.errstate(over="ignore"):
                inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
            inverse[np.isinf(inverse)] = 0.0  # a block of values below ~1e-37 quantises to 0
            scaled = block * inverse[:, None]
            np.rint(scaled, out=scaled)
            scales.append(scale)
            quantized.append(scaled.astype(np.int8).reshape(-1))
        return np.concatenate(scales).tobytes() + np.concatenate(quantized)[:count].tobytes()

    def decode(self, data: bytes | memoryview, count: int) -> np.ndarray:
        _check_length(self, data, count)
        blocks = -(-count // BLOCK)
        scales = np.frombuffer(data, dtype=np.float32, count=blocks)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise BadPart("int8: a block scale is negative or not finite")
        quantized = np.frombuffer(data, dtype=np.int8, offset=4 * blocks)
        out = np.empty(count, dtype=np.float32)
        full = count - count % BLOCK
        np.multiply(
            quantized[:full].reshape(-1, BLOCK),
            scales[: full // BLOCK, None],
            out=out[:full].reshape(-1, BLOCK),
        )
        if full < count:  # the last, partial block
            out[full:] = quantized[full:] * scales[-1]
        return out


CODECS: dict[str, Codec] = {c.name: c for c in (NoCompression(), Float16(), Blockwise8Bit())}
