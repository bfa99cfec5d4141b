"""One error hierarchy for peertrain.

A remote peer's fault (a bad message, a missed deadline, an unreachable address) is a
`RemoteError`: the caller drops or bans that peer and carries on. A user's fault (a wrong config
value, a key file in use) is a `UserError`: the CLI prints its one-line message and exits 2.
Anything else is our own bug and crashes loudly.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from contextlib import contextmanager

import msgspec

#: What decoding a peer's msgpack may raise: msgspec's errors (ValidationError included), and
#: UnicodeDecodeError, which msgspec 0.22 lets out as is when a str field holds invalid UTF-8
#: (found by tests/test_fuzz_decoders.py).
DECODE_ERRORS = (msgspec.DecodeError, UnicodeDecodeError)

#: What libraries raise on values they cannot use (UnicodeError and msgspec's errors are
#: ValueErrors too): on a peer's data, that peer's fault.
PEER_DATA_ERRORS = (
    ValueError,
    KeyError,
    IndexError,
    OverflowError,
    ZeroDivisionError,
    struct.error,
    *DECODE_ERRORS,
)


def first_error(group: BaseExceptionGroup) -> BaseException:
    """The first leaf of a (nested) exception group, such as trio's nurseries raise."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    return error


class PeertrainError(Exception):
    """Base class of every error peertrain raises on purpose."""


class UserError(PeertrainError):
    """Bad input from the person running peertrain; the message says what to do."""


def find_error(error: BaseException) -> PeertrainError | None:
    """The first of our own (user or remote) errors in a possibly nested exception group."""
    if isinstance(error, PeertrainError):
        return error
    if isinstance(error, BaseExceptionGroup):
        for inner in error.exceptions:
            found = find_error(inner)
            if found is not None:
                return found
    return None


class ConfigError(UserError):
    """A configuration value is unknown, of the wrong type or out of range."""


class NoBackbone(UserError):
    """Every backbone a peer was given or found is a peer: nobody can check its reachability
    or serve the DHT, so it cannot train with anyone."""


class IdentityError(UserError):
    """The identity key file cannot be used (in use, unreadable, malformed)."""


class RemoteError(PeertrainError):
    """Something another peer did, or failed to do."""


class ProtocolError(RemoteError):
    """A peer sent bytes that break the protocol (malformed, truncated, oversized, wrong type)."""


class MalformedReply(ProtocolError):
    """A reply that does not decode to the type the call expects (out of bounds, wrong shape):
    the replier sent it as such, unlike a cut stream."""


class MessageTooLarge(ProtocolError):
    """A frame announced a length above the limit; nothing was allocated for it."""


class Unreachable(RemoteError):
    """No connection could be made to a peer or to any backbone."""


class NotABackbone(Unreachable):
    """A peer we were told is a backbone answers, but serves no backbone's protocols: it is a
    peer (an address copied from `peer join`'s output, not `backbone start`'s)."""


class DeadlineExceeded(RemoteError):
    """A remote call did not complete before its deadline."""


class RpcError(RemoteError):
    """The remote side answered a call with an error.

    `code` is one of `RpcError.CODES`; `message` is the remote's explanation.
    """

    CODES = frozenset(
        {"bad_request", "unknown_method", "too_large", "forbidden", "unavailable", "internal"}
    )

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class RoleAssignmentError(PeertrainError):
    """The collaboration's capabilities admit no role assignment (no compute, no aggregator)."""


@contextmanager
def peer_fault(what: str) -> Iterator[None]:
    """Work on values a peer sent: what a library raises on them becomes a `ProtocolError`
    naming `what`, which drops that peer, instead of an exception that ends the daemon."""
    try:
        yield
    except PEER_DATA_ERRORS as error:
        raise ProtocolError(f"{what}: {error!r}"[:300]) from error
