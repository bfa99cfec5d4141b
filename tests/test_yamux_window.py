"""py-libp2p's yamux kept whatever a sender sent past its window (`libp2p_patches`)."""

from __future__ import annotations

import struct

import trio
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT

from peer.net.libp2p_patches import MAX_STREAM_BUFFER
from tests.helpers import nodes

PROTOCOL = "/peertrain/test-window/1"


async def test_a_sender_past_the_receive_window_loses_its_connection():
    """A stream whose reader reads nothing: an honest sender stops at the window; one that
    writes yamux DATA frames past it has its connection closed by the receiver, instead of
    growing the receiver's buffer without bound."""
    async with nodes(2) as (receiver, sender):
        held = trio.Event()

        async def handler(stream) -> None:  # reads nothing
            held.set()
            await trio.sleep_forever()

        receiver.host.set_stream_handler(PROTOCOL, handler)
        await sender.connect(receiver.peer_id, receiver.announce, timeout=5)
        stream = await sender.host.new_stream(receiver.peer_id, [PROTOCOL])
        await stream.write(b"x")
        with trio.fail_after(10):
            await held.wait()
        muxed = stream.muxed_conn
        stream_id = stream.muxed_stream.stream_id
        frame = 1 << 20
        sent = 0
        with trio.fail_after(30):
            while not muxed.is_closed and sent <= 3 * MAX_STREAM_BUFFER:
                header = struct.pack(YAMUX_HEADER_FORMAT, 0, TYPE_DATA, 0, stream_id, frame)
                try:
                    await muxed.secured_conn.write(header + bytes(frame))
                except Exception:  # the receiver closed the connection under us
                    break
                sent += frame
                await trio.sleep(0)
            while receiver.host.get_network().connections.get(sender.peer_id):
                await trio.sleep(0.05)
        assert sent < 2 * MAX_STREAM_BUFFER, sent  # cut off near the bound, not at 3x
        buffers = [
            len(b)
            for conns in receiver.host.get_network().connections.values()
            for c in conns
            for b in getattr(c.muxed_conn, "stream_buffers", {}).values()
        ]
        assert sum(buffers) < MAX_STREAM_BUFFER


def test_the_connection_total_follows_every_change_and_drops_what_nobody_reads():
    """The running total (no sum over a remote's thousands of streams per frame) follows the
    reader taking bytes, streams going away, and drops bytes for a reset stream (a reducer
    giving up on a sender, over retried rounds, used to keep them counted for 60 s) and bytes
    after a sender's FIN."""
    from types import SimpleNamespace

    from peer.net.libp2p_patches import _BoundedBuffers

    streams = {1: SimpleNamespace(reset_received=False, recv_closed=False),
               2: SimpleNamespace(reset_received=False, recv_closed=False)}  # fmt: skip
    buffers = _BoundedBuffers(SimpleNamespace(streams=streams), {})
    buffers[1], buffers[2] = bytearray(), bytearray()
    buffers[1].extend(b"a" * 100)
    buffers[2].extend(b"b" * 50)
    assert buffers.total == 150
    del buffers[1][:30]  # the reader took 30 bytes
    assert buffers.total == 120 and len(buffers[1]) == 70
    streams[2].recv_closed = True  # FIN: more bytes are a violation, what was sent stays
    buffers[2].extend(b"c" * 10)
    assert buffers.total == 120 and bytes(buffers[2]) == b"b" * 50
    streams[1].reset_received = True  # reset: what it held goes
    buffers[1].extend(b"d" * 10)
    assert buffers.total == 50 and len(buffers[1]) == 0
    buffers.pop(2)
    assert buffers.total == 0
    buffers[3] = bytearray(b"e" * 5)
    buffers.clear()
    assert buffers.total == 0
