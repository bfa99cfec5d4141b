"""State download, the parts both sides share: `Snapshot` and the data-plane framing.

The protocol is described in the package docstring (`peer.training.statesync`).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol

import trio

from peer.errors import RemoteError

MAGIC = b"PTSTATE1"  # first bytes of a data connection: protocol and version
REQUEST = struct.Struct(">I")  # chunk index
REPLY = struct.Struct(">BIQ")  # kind, chunk index, length
KIND_CHUNK, KIND_ERROR = 0, 1
MAX_ERROR_BYTES = 1024
HASH_WORKERS = max(1, min(4, os.cpu_count() or 1))
# Errors of a data connection that end it (and drop its donor).
CONNECTION_ERRORS = (
    RemoteError,
    OSError,
    trio.BrokenResourceError,
    trio.ClosedResourceError,
    trio.TooSlowError,
)


class Sliced(Protocol):
    """Bytes read in slices (`state.StateBytes`: a state's layout over its own tensors)."""

    def __len__(self) -> int: ...
    def __getitem__(self, part: slice, /) -> bytes | memoryview: ...


@dataclass(frozen=True)
class Snapshot:
    """A training state at a step boundary, serialized (safetensors bytes; opaque here)."""

    step: int
    blob: bytes | Sliced
    """Bytes (a download, a keeper's checkpoint), or slices read from the tensors (a trainer)."""
    parts: tuple[int, ...] = field(default=(), compare=False)
    """Where the parts of the blob's layout end (its header, then each tensor), where known: a
    donor cuts its chunks along them (`chunks.chunk_ends`)."""
    hashes: Mapping[tuple[int, int], bytes] = field(default_factory=dict, compare=False)
    """`chunk_hash` of byte ranges [start, end) of the blob, where known: a trainer's from its
    step's digest, a download's from its chunks, each checked against the bytes received."""
    disposable: bool = field(default=False, compare=False)
    """The blob is this snapshot's alone (a download's result): whoever loads it may give its
    pages back as it goes (`state.restore`'s `release`)."""
    members: tuple[str, ...] = field(default=(), compare=False)
    """The members of the state's electorate (who votes on the next step), where known: a
    donor's from its plans, a download's as its manifest claimed them (checked by whoever
    uses them)."""


def sliceable(blob: bytes | Sliced) -> memoryview | Sliced:
    """What chunks are cut from without copying the whole: a view of bytes, or `blob` itself."""
    return memoryview(blob).cast("B") if isinstance(blob, bytes | bytearray) else blob


__all__ = [
    "CONNECTION_ERRORS",
    "HASH_WORKERS",
    "KIND_CHUNK",
    "KIND_ERROR",
    "MAGIC",
    "MAX_ERROR_BYTES",
    "REPLY",
    "REQUEST",
    "Sliced",
    "Snapshot",
    "sliceable",
]
