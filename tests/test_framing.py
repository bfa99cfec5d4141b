"""The frame codec, as a pure state machine (no sockets)."""

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from peer.errors import MessageTooLarge, ProtocolError
from peer.net.framing import FrameDecoder, encode_frame, encode_varint


def test_varint_matches_leb128_examples():
    assert encode_varint(0) == b"\x00"
    assert encode_varint(127) == b"\x7f"
    assert encode_varint(128) == b"\x80\x01"
    assert encode_varint(300) == b"\xac\x02"


def test_length_of_2_pow_40_is_refused_before_buffering():
    decoder = FrameDecoder(max_size=1024)
    decoder.feed(encode_varint(2**40))
    with pytest.raises(MessageTooLarge, match=str(2**40)):
        decoder.next_frame()
    with pytest.raises(ProtocolError):  # the stream cannot be resynchronised afterwards
        decoder.feed(b"x")


def test_overlong_varint_is_malformed():
    decoder = FrameDecoder(max_size=1024)
    decoder.feed(b"\xff" * 11)
    with pytest.raises(ProtocolError, match="longer than 10 bytes"):
        decoder.next_frame()


def test_partial_frame_is_reported_for_truncation():
    decoder = FrameDecoder(max_size=1024)
    decoder.feed(encode_frame(b"hello")[:-2])
    assert decoder.next_frame() is None
    assert decoder.has_partial_frame
    decoder.feed(b"lo")
    assert decoder.next_frame() == b"hello"
    assert not decoder.has_partial_frame


def test_empty_frame_round_trips():
    decoder = FrameDecoder(max_size=10)
    decoder.feed(encode_frame(b""))
    assert decoder.next_frame() == b""
    assert decoder.next_frame() is None


def test_raw_bytes_after_a_frame_are_handed_back_once():
    decoder = FrameDecoder(max_size=10)
    decoder.feed(encode_frame(b"hdr") + b"raw bytes")
    assert decoder.next_frame() == b"hdr"
    assert decoder.take_leftover() == b"raw bytes"
    assert decoder.take_leftover() == b""
    decoder.feed(encode_varint(5) + b"ab")
    assert decoder.next_frame() is None
    with pytest.raises(ProtocolError, match="partly received"):
        decoder.take_leftover()


@given(
    frames=st.lists(st.binary(max_size=300), max_size=20),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=30),
)
def test_any_split_of_a_byte_stream_yields_the_same_frames(frames, cuts):
    wire = b"".join(encode_frame(f) for f in frames)
    points = sorted({c % (len(wire) + 1) for c in cuts} | {0, len(wire)})
    decoder = FrameDecoder(max_size=300)
    out = []
    for start, end in itertools.pairwise(points):
        decoder.feed(wire[start:end])
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
    assert out == frames
    assert not decoder.has_partial_frame


@given(st.binary(max_size=64))
def test_garbage_never_crashes_only_protocol_errors(data):
    decoder = FrameDecoder(max_size=16)
    decoder.feed(data)
    try:
        while decoder.next_frame() is not None:
            pass
    except ProtocolError:
        pass
