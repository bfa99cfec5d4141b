"""State download into the downloader's own tensors, the pure part: which chunks come first
(`Placement.early`), which go straight into a tensor (`late`), which are never fetched.

A trained peer that fell behind held its whole state beside the whole download until the
download was checked: 24 bytes per parameter with AdamW, 2.4-2.5x the state at 100 M. In place:

1. The header (the chunks up to `state.header_bytes`), then every chunk that is not one piece
   of one tensor (small tensors share chunks: `chunks.chunk_ends`) are fetched into
   `EarlyChunks`, a few MB aside.
2. The state's digest is taken from them and the manifest's hashes of the rest: a large
   tensor's chunks are exactly the pieces its digest hashes (`state.state_digest`). It is
   checked against the certificate, and the state's shapes against ours, before any byte of
   ours changes (`Sink.admit`).
3. The rest is received straight into our tensors, each chunk checked against the manifest's
   hash, the very one the certified digest took, before it counts.

Chunks of tensors that are neither loaded nor certified (a donor's extras) are not fetched.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from peer.errors import ProtocolError
from peer.training.chunks import Manifest, chunk_hash
from peer.training.state import BlobLayout

#: Where a chunk received late goes: a view of our own tensor's bytes (None: not fetched).
Where = Callable[[int], memoryview | None]


class Sink(Protocol):
    """Where `StateDownload.run_into` puts a state, asked in turn."""

    async def first(self, manifest: Manifest, early: EarlyChunks) -> Collection[int]:
        """Chunks to fetch into `early` before `admit`, given those fetched so far (none left:
        admit). ProtocolError if what they hold is no state we could take."""
        ...

    async def admit(self, manifest: Manifest, early: EarlyChunks) -> Where:
        """Check the state (RemoteError: refused, nothing of ours changed) and take it: where
        each chunk not fetched yet goes."""
        ...


class EarlyChunks:
    """The chunks fetched before the state is checked, each in a buffer of its own."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self._buffers: dict[int, bytearray] = {}

    def view(self, index: int) -> memoryview:
        """Where chunk `index` is received (the same buffer again if it is fetched again)."""
        if index not in self._buffers:
            start, end = self.manifest.chunk(index)
            self._buffers[index] = bytearray(end - start)
        return memoryview(self._buffers[index])

    def __contains__(self, index: int) -> bool:
        return index in self._buffers

    def chunks_over(self, start: int, end: int) -> list[int]:
        """The chunks that hold bytes [start, end)."""
        ends = self.manifest.ends
        first = bisect.bisect_right(ends, start)
        last = bisect.bisect_left(ends, end)
        return list(range(first, min(last, len(ends) - 1) + 1)) if end > start else []

    def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), which early chunks must hold (else ProtocolError)."""
        out = []
        for index in self.chunks_over(start, end):
            if index not in self._buffers:
                raise ProtocolError(f"bytes {start}-{end} lie in chunk {index}, not fetched yet")
            first, _ = self.manifest.chunk(index)
            out.append(self._buffers[index][max(start, first) - first : end - first])
        return b"".join(out)

    def pieces(self) -> Mapping[int, tuple[int, memoryview]]:
        """Each chunk held: (where it starts, its bytes)."""
        return {i: (self.manifest.chunk(i)[0], memoryview(b)) for i, b in self._buffers.items()}


@dataclass(frozen=True)
class Placement:
    early: frozenset[int]
    """Fetched aside before the check: the header's chunks, and those not one piece of one
    tensor (small tensors share chunks; a donor may cut where it likes)."""
    late: Mapping[int, tuple[str, int]]
    """Received after the check into a tensor: chunk -> (tensor name, byte offset in it)."""
    skipped: frozenset[int]
    """Never fetched: only bytes of tensors neither loaded nor certified."""


def place(
    manifest: Manifest,
    layout: BlobLayout,
    *,
    loaded: Collection[str],
    certified: Collection[str],
) -> Placement:
    """Where each chunk of `manifest` (of a state laid out as `layout`) goes; see `Placement`.
    A chunk of a certified tensor goes late only if it is exactly one piece of its digest
    (`BlobLayout.piece_range`): only then is its hash in the manifest the digest's."""
    spans = sorted((span, name) for name, span in layout.spans.items() if span[1] > span[0])
    starts = [span[0] for span, _ in spans]
    data_start = layout.parts[0] if layout.parts else 0
    early, skipped = set(), set()
    late: dict[int, tuple[str, int]] = {}
    for index in range(len(manifest.ends)):
        start, end = manifest.chunk(index)
        names, at = [], max(0, bisect.bisect_right(starts, start) - 1)
        while at < len(spans) and spans[at][0][0] < end:
            if spans[at][0][1] > start:
                names.append(spans[at][1])
            at += 1
        wanted = [n for n in names if n in loaded or n in certified]
        if start < data_start or len(wanted) > 1:
            early.add(index)
        elif not wanted:
            skipped.add(index)
        elif len(names) > 1:
            early.add(index)  # shares its bytes with a tensor we have no use for
        else:
            name = names[0]
            span = layout.spans[name]
            if name in certified and layout.piece_range(span, start) != (start, end):
                early.add(index)
            elif name in loaded:
                late[index] = (name, start - span[0])
            else:
                skipped.add(index)  # certified, not loaded: the manifest's hash is enough
    return Placement(frozenset(early), late, frozenset(skipped))


class KnownPieces:
    """The hashes of a digest's pieces (`BlobLayout.known`'s mapping) for a state not here yet:
    a piece that is a whole chunk has the manifest's hash (the bytes we load of it are checked
    against that hash when they arrive; a certified digest vouches for the hash itself), any
    other is hashed from the early chunks that hold it."""

    def __init__(self, manifest: Manifest, early: EarlyChunks) -> None:
        self._hashes = {manifest.chunk(i): h for i, h in enumerate(manifest.hashes)}
        self._early = early

    def get(self, span: tuple[int, int]) -> bytes:
        return self._hashes.get(span) or chunk_hash(self._early.read(*span))


__all__ = ["EarlyChunks", "KnownPieces", "Placement", "Sink", "Where", "place"]
