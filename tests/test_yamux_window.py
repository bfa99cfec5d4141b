"""py-libp2p's yamux keeps whatever a sender sends past its window (`host._bound_yamux_buffers`)."""

from __future__ import annotations

import struct

import trio
from libp2p.stream_muxer.yamux.yamux import TYPE_DATA, YAMUX_HEADER_FORMAT

from peer.net.host import MAX_STREAM_BUFFER
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
