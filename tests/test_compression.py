"""The wire codecs against their reference: the plain numpy implementation they replaced
(several passes and copies per chunk, kept here as the specification). Every peer must decode
the same bits, so the fast paths (torch's casts, buffers brought by the caller) must give the
reference's bytes on random vectors and on the edge cases: large finite values (fp16 clips
them), inf and NaN, subnormals, signed zeros, short and partial blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import peer.averaging.compression as compression
from peer.averaging.compression import BLOCK, CODECS, FP16_MAX, BadPart

assert torch  # imported: the fp16 casts take torch's path where a process has loaded it

# ---------------------------------------------------------------------------- the reference


def reference_encode(name: str, values: np.ndarray) -> bytes:
    if name == "none":
        return np.ascontiguousarray(values, dtype=np.float32).tobytes()
    if name == "fp16":
        clipped = np.where(np.isinf(values), values, np.clip(values, -FP16_MAX, FP16_MAX))
        return clipped.astype(np.float16).tobytes()
    count = len(values)
    full = count - count % BLOCK
    blocks = [values[:full].reshape(-1, BLOCK)]
    if full < count:
        tail = np.zeros((1, BLOCK), dtype=np.float32)
        tail[0, : count - full] = values[full:]
        blocks.append(tail)
    scales, quantized = [], []
    for block in blocks:
        scale = (np.maximum(block.max(axis=1), -block.min(axis=1)) / 127).astype(np.float32)
        with np.errstate(over="ignore"):
            inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        inverse[np.isinf(inverse)] = 0.0
        scaled = block * inverse[:, None]
        np.rint(scaled, out=scaled)
        scales.append(scale)
        with np.errstate(invalid="ignore"):
            quantized.append(scaled.astype(np.int8).reshape(-1))
    return np.concatenate(scales).tobytes() + np.concatenate(quantized)[:count].tobytes()


def reference_decode(name: str, data: bytes, count: int) -> np.ndarray:
    if name == "none":
        return np.frombuffer(data, dtype=np.float32).copy()
    if name == "fp16":
        return np.frombuffer(data, dtype=np.float16).astype(np.float32)
    blocks = -(-count // BLOCK)
    scales = np.frombuffer(data, dtype=np.float32, count=blocks)
    quantized = np.frombuffer(data, dtype=np.int8, offset=4 * blocks)
    out = np.empty(count, dtype=np.float32)
    full = count - count % BLOCK
    np.multiply(
        quantized[:full].reshape(-1, BLOCK),
        scales[: full // BLOCK, None],
        out=out[:full].reshape(-1, BLOCK),
    )
    if full < count:
        out[full:] = quantized[full:] * scales[-1]
    return out


def vectors(count: int, seed: int) -> list[np.ndarray]:
    """Random vectors at several scales, and edge cases spliced in."""
    rng = np.random.default_rng(seed)
    out = [
        (rng.standard_normal(count) * scale).astype(np.float32)
        for scale in (1e-6, 1.0, 3e4, 1e6, 1e30)
    ]
    edges = np.array(
        [0.0, -0.0, 65504, 65519.99, 65520, -65520, 1e38, -3.4e38, 6e-8, 3e-8, -1e-45, 1e-40,
         2.0**-24, 2.0**-25, 1 + 2.0**-11, 1 + 3 * 2.0**-11],
        dtype=np.float32,
    )  # fmt: skip
    spliced = out[1].copy()
    spliced[: len(edges)] = edges[: len(spliced)]
    out.append(spliced)
    out.append(np.zeros(count, np.float32))
    out.append(np.full(count, -0.0, np.float32))
    # Random bit patterns: every exponent, fp16 rounding ties among them (finite ones only).
    bits = rng.integers(0, 2**32, count, dtype=np.uint64).astype(np.uint32).view(np.float32)
    out.append(np.where(np.isfinite(bits), bits, np.float32(1.0)).astype(np.float32))
    return out


COUNTS = [1, 7, BLOCK - 1, BLOCK, 3 * BLOCK + 17, 70_001]


@pytest.fixture(params=["torch", "numpy"])
def cast_path(request, monkeypatch):
    """Run a test with fp16 cast by torch (loaded here) and by numpy (a process without it)."""
    if request.param == "numpy":
        monkeypatch.setattr(compression, "_loaded_torch", lambda: None)
    else:
        assert compression._loaded_torch() is torch
    return request.param


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("name", sorted(CODECS))
def test_encode_and_decode_give_the_reference_bytes(name, count, cast_path):
    codec = CODECS[name]
    for values in vectors(count, seed=count):
        wire = codec.encode(values)
        assert bytes(wire) == reference_encode(name, values)
        decoded = codec.decode(wire, count)
        assert decoded.dtype == np.float32 and decoded.shape == (count,)
        assert decoded.tobytes() == reference_decode(name, bytes(wire), count).tobytes()


@pytest.mark.parametrize("name", sorted(CODECS))
def test_inf_and_nan_stay_what_they_are(name, cast_path):
    """Inputs the all-reduce never encodes (it refuses a vector with NaN or Inf, and keeps an
    overflowing average local), yet the codec stays the reference: inf is not clipped to a
    finite value, NaN stays NaN, and int8's scale says so (its bytes are arbitrary then)."""
    codec = CODECS[name]
    values = np.random.default_rng(1).standard_normal(3 * BLOCK).astype(np.float32)
    values[[5, BLOCK + 9, 2 * BLOCK + 1]] = [np.inf, -np.inf, np.nan]
    with np.errstate(invalid="ignore"):
        wire, expected = bytes(codec.encode(values)), reference_encode(name, values)
    if name == "int8":
        scales = np.frombuffer(wire, np.float32, count=3)
        assert np.array_equal(scales, np.frombuffer(expected, np.float32, count=3), equal_nan=True)
        assert not np.isfinite(scales).any()
        with pytest.raises(BadPart, match="scale"):
            codec.decode(wire, len(values))
        return
    decoded = codec.decode(wire, len(values))
    finite = np.isfinite(values)
    assert (
        decoded[finite].tobytes() == reference_decode(name, expected, len(values))[finite].tobytes()
    )
    assert list(decoded[~finite][:2]) == [np.inf, -np.inf] and np.isnan(decoded[~finite][2])


def test_every_fp16_value_decodes_alike_with_torch_and_numpy(monkeypatch):
    wire = np.arange(2**16, dtype=np.uint32).astype(np.uint16).tobytes()
    fast = CODECS["fp16"].decode(bytearray(wire), 2**16)
    monkeypatch.setattr(compression, "_loaded_torch", lambda: None)
    slow = CODECS["fp16"].decode(bytearray(wire), 2**16)
    finite = np.isfinite(slow)
    assert fast[finite].tobytes() == slow[finite].tobytes()
    assert np.array_equal(np.isnan(fast), np.isnan(slow)) and np.array_equal(
        np.isinf(fast), np.isinf(slow)
    )


def test_rounding_ties_encode_alike_with_torch_and_numpy(monkeypatch):
    """float32 values exactly halfway between two float16 values (and one float32 step either
    side of it), over every float16 exponent: round half to even, everywhere."""
    halves = np.arange(2**15, dtype=np.uint32).astype(np.uint16).view(np.float16)
    low = halves[np.isfinite(halves)][:-1].astype(np.float64)
    high = np.nextafter(halves[np.isfinite(halves)][:-1], np.float16(np.inf)).astype(np.float64)
    ties = ((low + high) / 2).astype(np.float32)
    values = np.concatenate([ties, np.nextafter(ties, 0), np.nextafter(ties, np.inf), -ties])
    fast = bytes(CODECS["fp16"].encode(values))
    monkeypatch.setattr(compression, "_loaded_torch", lambda: None)
    assert fast == bytes(CODECS["fp16"].encode(values)) == reference_encode("fp16", values)


# ---------------------------------------------------------------------------- buffers


@pytest.mark.parametrize("name", ["fp16", "int8"])
def test_encode_and_decode_write_into_the_buffers_they_are_given(name):
    codec = CODECS[name]
    values = np.random.default_rng(2).standard_normal(BLOCK + 5).astype(np.float32)
    wire = np.full(codec.wire_bytes(4 * BLOCK), 0xAB, np.uint8)  # larger than needed
    encoded = codec.encode(values, out=wire)
    assert np.shares_memory(np.frombuffer(encoded, np.uint8), wire)
    assert bytes(encoded) == reference_encode(name, values)
    assert (wire[len(encoded) :] == 0xAB).all()  # nothing past the chunk's bytes
    out = np.full(4 * BLOCK, np.nan, np.float32)
    decoded = codec.decode(encoded, len(values), out=out)
    assert np.shares_memory(decoded, out) and len(decoded) == len(values)
    assert decoded.tobytes() == reference_decode(name, bytes(encoded), len(values)).tobytes()
    assert np.isnan(out[len(values) :]).all()
    with pytest.raises(ValueError, match="writable"):
        codec.encode(values, out=bytes(len(wire)))
    with pytest.raises(ValueError, match="float32"):
        codec.decode(encoded, len(values), out=np.empty(len(values), np.float64))


def test_none_is_zero_copy_both_ways():
    codec = CODECS["none"]
    values = np.arange(10, dtype=np.float32)
    wire = codec.encode(values, out=bytearray(40))  # `out` is not needed, and not written
    assert np.shares_memory(np.frombuffer(wire, np.float32), values)
    frame = bytearray(wire)
    decoded = codec.decode(frame, 10)
    assert np.shares_memory(decoded, np.frombuffer(frame, np.uint8))
    assert not decoded.flags.writeable  # a view of received bytes is never written through
    copied = codec.decode(frame, 10, out=np.empty(10, np.float32))
    assert copied.flags.writeable and np.array_equal(copied, values)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_a_wrong_length_is_a_bad_part_whatever_the_buffer(name):
    codec = CODECS[name]
    wire = bytearray(codec.encode(np.ones(100, np.float32)))
    for data in (bytes(wire[:-1]), memoryview(wire)[1:], np.frombuffer(wire + b"x", np.uint8)):
        with pytest.raises(BadPart, match="bytes for 100 values"):
            codec.decode(data, 100, out=np.empty(100, np.float32))
