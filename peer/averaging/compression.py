"""Wire encodings of float32 vectors, pure: none, fp16, and 8-bit blockwise.

Averages always accumulate in float32; compression applies only to bytes on the wire (both
the contributions sent to reducers and the averages sent back).

- `none`: the float32 bytes as they are (4 bytes per element, zero-copy both ways).
- `fp16`: IEEE half precision (2 bytes). Finite values beyond +-65504 are clipped first, so a
  large but finite gradient never turns into inf (which a receiver rejects as bad input); a
  real inf or NaN stays what it is and is rejected.
- `int8`: blocks of 1024 elements, each sent as a float32 scale (its largest magnitude / 127)
  and 1024 signed bytes (x / scale, rounded): 1.004 bytes per element; the error of an
  element is at most half its block's scale.

`decode` checks the byte length against the element count it is told to expect, and raises
`BadPart` (a ProtocolError) on any mismatch; finiteness is the reducer's check.

Cost. A round encodes and decodes every byte of the vector several times, so each codec makes
one pass over the values where it can, into a buffer the caller may bring (`out`): the
all-reduce keeps a few per connection rather than allocating per chunk. numpy's
float32 <-> float16 casts run in software (its wheels leave F16C out of their baseline:
60-130 ms per 100 MB float32 -> float16 here, 45 back: more than halving the bytes saves on
a fast link); torch's use the CPU's conversion instructions (5 and 6 ms). So fp16 casts
with torch where torch is loaded already (every training peer), and with numpy elsewhere: a
backbone never imports torch (1-2 s, which inside a round would stall it past its peers'
timeouts). Both round to nearest even as IEEE 754 defines, so every peer decodes the same
bits whichever it uses (tested). Callers run encode and decode off the event loop
(`allreduce.py`): per 1 MiB chunk, fp16 0.07 ms to encode and 0.06 to decode, int8 0.35
and 0.1 (numpy's broadcast multiply by each block's scale is most of it).
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Protocol

import numpy as np

from peer.errors import ProtocolError

BLOCK = 1024
FP16_MAX = float(np.finfo(np.float16).max)
# Elements per torch cast: below torch's parallel grain (32768) a cast runs on the calling
# thread, not on torch's OpenMP pool (whose threads spin after each region: CPU nobody asked
# for, taken from the training thread and the other peers of a shared machine; called from a
# worker thread, a whole 1 MiB chunk took 10x longer here). As large as that allows: each call
# costs a few microseconds and a GIL round trip (32704: 0.05 ms per 1 MiB, 16384: 0.07-0.15).
TORCH_SLICE = 32704

Buffer = bytes | bytearray | memoryview | np.ndarray


class BadPart(ProtocolError):
    """Bytes received for a part do not decode to the expected values."""


class Codec(Protocol):
    name: str
    transforms: bool
    """False if the wire bytes are the float32 bytes themselves (no work to move off the loop)."""

    def wire_bytes(self, count: int) -> int: ...

    def encode(self, values: np.ndarray, *, out: Buffer | None = None) -> memoryview:
        """The wire bytes of `values` (float32, contiguous): written into `out` (at least
        `wire_bytes(len(values))` writable bytes) if given, else into a new buffer; `none`
        returns a view of `values` and never writes `out`."""
        ...

    def decode(self, data: Buffer, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        """`count` float32 values from `data` (BadPart if its length is not theirs): written
        into `out` (float32, at least `count`) if given, else a new array; `none` without
        `out` returns a read-only view of `data`."""
        ...


def _check_length(codec: Codec, data: Buffer, count: int) -> None:
    size, expected = memoryview(data).nbytes, codec.wire_bytes(count)
    if size != expected:
        raise BadPart(f"{codec.name}: {size} bytes for {count} values, expected {expected}")


def _bytes_out(out: Buffer | None, size: int) -> np.ndarray:
    """`size` writable bytes: the start of `out`, or new (uninitialised: every byte is
    written)."""
    if out is None:
        return np.empty(size, dtype=np.uint8)
    view = np.frombuffer(out, dtype=np.uint8, count=size)
    if not view.flags.writeable:
        raise ValueError("out must be a writable buffer")
    return view


def _values_out(out: np.ndarray | None, count: int) -> np.ndarray:
    if out is None:
        return np.empty(count, dtype=np.float32)
    if out.dtype != np.float32 or out.ndim != 1 or len(out) < count:
        raise ValueError(f"out is {out.dtype}{out.shape}, expected float32 of >= {count}")
    return out[:count]


def _loaded_torch() -> ModuleType | None:
    """torch if this process has imported it (fully: not another thread's import under way)."""
    torch = sys.modules.get("torch")
    if torch is None or getattr(getattr(torch, "__spec__", None), "_initializing", False):
        return None
    return torch


def _cast(source: np.ndarray, target: np.ndarray) -> None:
    """target[:] = source, float32 <-> float16, rounding to nearest even (IEEE 754)."""
    torch = _loaded_torch()
    # torch.from_numpy wants writable arrays (a read-only one warns): numpy for those.
    if torch is None or not (source.flags.writeable and target.flags.writeable):
        with np.errstate(over="ignore"):  # beyond +-65504: inf, as with torch (then clipped)
            np.copyto(target, source, casting="same_kind")
        return
    src, dst = torch.from_numpy(source), torch.from_numpy(target)
    for start in range(0, len(source), TORCH_SLICE):
        dst[start : start + TORCH_SLICE].copy_(src[start : start + TORCH_SLICE])


class NoCompression:
    name = "none"
    transforms = False

    def wire_bytes(self, count: int) -> int:
        return 4 * count

    def encode(self, values: np.ndarray, *, out: Buffer | None = None) -> memoryview:
        return memoryview(np.ascontiguousarray(values, dtype=np.float32)).cast("B")

    def decode(self, data: Buffer, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        _check_length(self, data, count)
        values = np.frombuffer(data, dtype=np.float32, count=count)
        if out is None:
            values.flags.writeable = False  # a view of someone's bytes: never written through
            return values
        target = _values_out(out, count)
        np.copyto(target, values)
        return target


class Float16:
    name = "fp16"
    transforms = True

    def wire_bytes(self, count: int) -> int:
        return 2 * count

    def encode(self, values: np.ndarray, *, out: Buffer | None = None) -> memoryview:
        values = np.ascontiguousarray(values, dtype=np.float32)
        wire = _bytes_out(out, self.wire_bytes(len(values)))
        halves = wire.view(np.float16)
        _cast(values, halves)  # one pass; |x| >= 65520 rounds to inf
        # Clipping first would be two more passes over every chunk for what almost never
        # happens; a scan of the 2-byte output for an exponent of all ones is cheap.
        exponents = np.bitwise_and(halves.view(np.uint16), 0x7C00)
        if exponents.max(initial=0) == 0x7C00:  # inf (or NaN), rare: clip; inf stays inf
            clipped = np.where(np.isinf(values), values, np.clip(values, -FP16_MAX, FP16_MAX))
            _cast(clipped, halves)
        return memoryview(wire)

    def decode(self, data: Buffer, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        _check_length(self, data, count)
        target = _values_out(out, count)
        _cast(np.frombuffer(data, dtype=np.float16, count=count), target)
        return target


class Blockwise8Bit:
    name = "int8"
    transforms = True

    def wire_bytes(self, count: int) -> int:
        return 4 * -(-count // BLOCK) + count

    def encode(self, values: np.ndarray, *, out: Buffer | None = None) -> memoryview:
        values = np.ascontiguousarray(values, dtype=np.float32)
        count = len(values)
        blocks = -(-count // BLOCK)
        wire = _bytes_out(out, self.wire_bytes(count))
        scales = wire[: 4 * blocks].view(np.float32)
        quantized = wire[4 * blocks :].view(np.int8)
        full = count - count % BLOCK
        self._quantize(values[:full].reshape(-1, BLOCK), scales[: full // BLOCK], quantized[:full])
        if full < count:  # the last, partial block, padded with zeros as a whole one
            tail = np.zeros((1, BLOCK), dtype=np.float32)
            tail[0, : count - full] = values[full:]
            padded = np.empty(BLOCK, dtype=np.int8)
            self._quantize(tail, scales[-1:], padded)
            quantized[full:] = padded[: count - full]
        return memoryview(wire)

    @staticmethod
    def _quantize(blocks: np.ndarray, scales: np.ndarray, quantized: np.ndarray) -> None:
        """scales[i], quantized[i * BLOCK:(i + 1) * BLOCK] of blocks[i]; the float32
        arithmetic of every step is fixed (peers must agree on the bits)."""
        if not len(blocks):
            return
        scale = (np.maximum(blocks.max(axis=1), -blocks.min(axis=1)) / 127).astype(np.float32)
        with np.errstate(over="ignore"):
            inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        inverse[np.isinf(inverse)] = 0.0  # a block of values below ~1e-37 quantises to 0
        scaled = np.multiply(blocks, inverse[:, None])
        np.rint(scaled, out=scaled)
        with np.errstate(invalid="ignore"):  # NaN or inf: its scale is too, the peer rejects it
            np.copyto(quantized.reshape(-1, BLOCK), scaled, casting="unsafe")
        scales[:] = scale

    def decode(self, data: Buffer, count: int, *, out: np.ndarray | None = None) -> np.ndarray:
        _check_length(self, data, count)
        blocks = -(-count // BLOCK)
        scales = np.frombuffer(data, dtype=np.float32, count=blocks)
        if not (np.isfinite(scales).all() and (scales >= 0).all()):
            raise BadPart("int8: a block scale is negative or not finite")
        quantized = np.frombuffer(data, dtype=np.int8, offset=4 * blocks, count=count)
        target = _values_out(out, count)
        full = count - count % BLOCK
        np.multiply(
            quantized[:full].reshape(-1, BLOCK),
            scales[: full // BLOCK, None],
            out=target[:full].reshape(-1, BLOCK),
        )
        if full < count:  # the last, partial block
            np.multiply(quantized[full:], scales[-1], out=target[full:])
        return target


CODECS: dict[str, Codec] = {c.name: c for c in (NoCompression(), Float16(), Blockwise8Bit())}
