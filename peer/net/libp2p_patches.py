"""Fixes to the pinned py-libp2p 0.8.1 that no setting reaches: its classes patched once, when
the first host is made (`patch_libp2p`, from `peer.net.host.create_host`). Each was found
by a test or a review; each is tested with the patch off too (the test fails):

- multistream-select decoded a remote's protocol line as UTF-8 outside its own error
  handling: `UnicodeDecodeError` went past every handler of libp2p's errors (a member or donor
  reached over a stream could end the averaging and the daemon). `tests/test_host.py`.
- its TCP stream reported no remote address for an IPv6 connection (`getpeername` gives four
  items where it expects two): the dial-back could not tell where an IPv6 caller came from.
  `tests/test_reachability.py`, `tests/test_cli_e2e.py`.
- yamux only logged a sender that went past the receive window it granted, and buffered every
  byte: one stream could grow our memory without bound. Stream buffers are bounded (32 MiB
  each, 128 MiB per connection); past them the connection is closed. `tests/test_yamux_window.py`.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

import trio
from libp2p.io.trio import TrioTCPStream
from libp2p.protocol_muxer.exceptions import MultiselectCommunicatorError
from libp2p.protocol_muxer.multiselect_communicator import MultiselectCommunicator
from libp2p.stream_muxer.yamux.yamux import MAX_WINDOW_SIZE, Yamux

_patched = False


def patch_libp2p() -> None:
    """Apply the patches below, once per process (each wraps the method it replaces)."""
    global _patched
    if _patched:
        return
    _patched = True
    _decode_multiselect_safely()
    _report_ipv6_remote_addresses()
    _bound_yamux_buffers()


def _decode_multiselect_safely() -> None:
    """py-libp2p's multistream-select reader decodes a remote's protocol line as UTF-8 outside
    its own error handling: invalid bytes raised `UnicodeDecodeError` past every handler that
    expects libp2p's errors (a stream opened to a member or donor that answers so ended the
    averaging, and the daemon). It raises its own `MultiselectCommunicatorError` instead."""
    original = MultiselectCommunicator.read

    async def read(self: Any) -> str:
        try:
            return await original(self)
        except UnicodeDecodeError as error:
            raise MultiselectCommunicatorError("a protocol name that is not UTF-8") from error

    MultiselectCommunicator.read = read  # type: ignore[method-assign]


def _report_ipv6_remote_addresses() -> None:
    """py-libp2p's TCP stream gives no remote address for an IPv6 connection (its
    `getpeername` has four items where it expects two): the dial-back could not tell where a
    caller on IPv6 came from."""
    original = TrioTCPStream.get_remote_address

    def get_remote_address(self: Any) -> tuple[str, int] | None:
        address = original(self)
        if address is None:
            with suppress(AttributeError, OSError):
                peer = self.stream.socket.getpeername()
                if isinstance(peer, tuple) and len(peer) >= 2:
                    address = (str(peer[0]), int(peer[1]))
        return address

    TrioTCPStream.get_remote_address = get_remote_address  # type: ignore[method-assign]


MAX_STREAM_BUFFER = 2 * MAX_WINDOW_SIZE
"""Bytes a yamux stream's receive buffer may hold: twice the largest window py-libp2p grants
(16 MiB). An honest sender never has more than the window in flight."""
MAX_CONNECTION_BUFFER = 8 * MAX_WINDOW_SIZE
"""...and all streams of one connection together (eight full windows: our data planes hold a
few streams per peer at once)."""


class WindowExceeded(trio.TooSlowError):
    """A peer sent past the receive window. A `TooSlowError` because that is what py-libp2p's
    yamux reader closes the connection on, wherever it is raised; any other error while it
    reads a frame only ends that stream, and the sender's next frames are read and dropped."""


class _BoundedBuffer(bytearray):
    """One yamux stream's receive buffer, counted in its connection's total."""

    def __init__(self, data: Any = b"", *, owner: _BoundedBuffers, key: int) -> None:
        super().__init__(data)
        self.owner, self.key = owner, key

    def extend(self, data: Any) -> None:
        stream = self.owner.muxed.streams.get(self.key)
        if stream is not None and stream.reset_received:  # reset: nobody reads it any more
            self.clear()
            return
        if stream is not None and stream.recv_closed:  # bytes after the sender's FIN
            return
        if len(self) + len(data) > MAX_STREAM_BUFFER:
            raise WindowExceeded(
                f"a stream's sender went {len(self) + len(data)} B past its window"
            )
        if self.owner.total + len(data) > MAX_CONNECTION_BUFFER:
            raise WindowExceeded("the streams' senders went past their windows together")
        super().extend(data)
        self.owner.total += len(data)

    def __delitem__(self, index: Any) -> None:  # the reader takes bytes off the front
        before = len(self)
        super().__delitem__(index)
        self.owner.total -= before - len(self)

    def clear(self) -> None:
        self.owner.total -= len(self)
        super().clear()


class _BoundedBuffers(dict):
    """A yamux connection's stream buffers, with their running total (no sum per frame: a
    remote may hold thousands of streams)."""

    def __init__(self, muxed: Any, buffers: dict) -> None:
        super().__init__()
        self.muxed = muxed
        self.total = 0
        for key, value in buffers.items():
            self[key] = value

    def __setitem__(self, key: Any, value: Any) -> None:
        if isinstance(value, bytearray) and not isinstance(value, _BoundedBuffer):
            value = _BoundedBuffer(value, owner=self, key=key)
        old = self.get(key)
        self.total += len(value) - (len(old) if old is not None else 0)
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.total -= len(self[key])
        super().__delitem__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        if key in self:
            self.total -= len(self[key])
        return super().pop(key, *default)

    def clear(self) -> None:
        self.total = 0
        super().clear()


def _bound_yamux_buffers() -> None:
    """py-libp2p's yamux only logs a sender that goes past the receive window and keeps every
    byte: a peer could grow our memory without bound over one stream. Its streams' buffers
    are made bounded (`MAX_STREAM_BUFFER`, `MAX_CONNECTION_BUFFER`); past them the connection
    is closed."""
    original = Yamux.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.stream_buffers = _BoundedBuffers(self, self.stream_buffers)

    Yamux.__init__ = __init__  # type: ignore[method-assign]
