"""What both ends of a circuit share: the protocol ids, what reading a control message may
raise, status checks, stream resets, and the relayed address format."""

from __future__ import annotations

from contextlib import suppress

import trio
from google.protobuf.message import DecodeError
from libp2p.abc import INetStream
from libp2p.relay.circuit_v2.protocol import PROTOCOL_ID as HOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol import STOP_PROTOCOL_ID as STOP_PROTOCOL
from libp2p.relay.circuit_v2.protocol_buffer import StatusCode

from peer.errors import Unreachable
from peer.net.prefix import prefix_of
from peer.net.relayed import parse_relayed_addr, relayed_addr
from peer.net.rpc import TRANSPORT_ERRORS

CLOSE_SECONDS = 1.0
# What reading a control message from a peer may raise: its fault, the stream is dropped.
MESSAGE_ERRORS = (*TRANSPORT_ERRORS, EOFError, ValueError, DecodeError)


class RelayRefused(Unreachable):
    """The relay (or the target through it) answered a request with an error status."""

    def __init__(self, message: str, status: StatusCode) -> None:
        super().__init__(message)
        self.status = status


def check_status(is_status: bool, status: int, who: str) -> None:
    """RelayRefused unless the reply was a status message saying OK."""
    if not is_status:
        raise RelayRefused(f"{who} sent no status", StatusCode.UNEXPECTED_MESSAGE)
    if status != StatusCode.OK:
        try:
            code = StatusCode(status)
        except ValueError:
            code = StatusCode.UNUSED
        raise RelayRefused(f"{who} refused: {code.name} ({status})", code)


def stream_source(stream: INetStream) -> str:
    """What per-source caps count for the connection a stream runs on (`prefix_of`)."""
    address = stream.muxed_conn.get_remote_address()  # type: ignore[attr-defined]
    return prefix_of(address[0]) if address else "?"


async def reset_stream(stream: INetStream) -> None:
    """Reset a stream, bounded and shielded (cleanup that must run while being cancelled)."""
    with (
        trio.CancelScope(shield=True),
        trio.move_on_after(CLOSE_SECONDS),
        suppress(*TRANSPORT_ERRORS),
    ):
        await stream.reset()


__all__ = [
    "CLOSE_SECONDS",
    "HOP_PROTOCOL",
    "MESSAGE_ERRORS",
    "STOP_PROTOCOL",
    "RelayRefused",
    "check_status",
    "parse_relayed_addr",
    "relayed_addr",
    "reset_stream",
    "stream_source",
]
