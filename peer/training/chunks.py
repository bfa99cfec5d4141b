"""State download, the pure part: the wire schemas, manifest checks, and who fetches which chunk.

Theory of operation (the shell is `peer.training.statesync`):

1. **Offers.** The downloader asks several donors for a `Manifest` of their state at
   `step >= min_step`: total length, where each chunk ends, the hash (`chunk_hash`) of every
   chunk, and a ticket for the donor's data port. `check_manifest` rejects anything malformed
   (ends that do not tile the length, a chunk over MAX_CHUNK_BYTES, a hash count that does not
   match, a step below the one asked for). Chunks follow the state's layout (`chunk_ends`): a
   large tensor is cut into chunks of its own from its first byte, so their hashes are those
   its step's digest already took (`peer.training.state.state_digest`), and small parts share
   a chunk.
2. **One manifest.** `choose_manifest` takes the step that the most donors hold (ties: the
   higher step), then, among the donors at that step, the manifest of which the donors can
   serve the most bytes. Donors at one step may hold blobs that differ in some bytes (per-peer
   optimizer state in DiLoCo), so the result is exactly the chosen donor's blob.
3. **Who serves what.** A donor may serve chunk i when its manifest's chunk i covers the same
   bytes and has the same hash (`servable_chunks`).
4. **Work stealing.** Up to `parallel` donors fetch at once; each pulls the lowest pending chunk
   it may serve (`claim`). A received chunk is checked against the chosen manifest's hash; a
   bad one goes back to pending and drops its donor. When a donor's connection ends, only its
   own task calls `stopped`, which requeues the chunks it had claimed: no other donor writes
   a chunk's bytes while the first one might still be writing them.
5. **The end.** `complete` when every chunk is verified. `unservable()` lists pending chunks
   that no live donor can serve: the shell asks more donors, or gives up with a clear error.
6. **In turn** (a download into the downloader's own tensors): `DownloadPlan(held_back=True)`
   holds every chunk back; the shell `admit`s some (the header first, then what the state's
   check needs), and once they are `settled`, the rest, `skip`ping those it has no use for.

Chunk states and the events that move them (anything else is our own bug):

    PENDING --claim--> FETCHING --received--> CHECKING --verified--> DONE
       ^                  |                      |
       +-----stopped------+                      |
       +-----------------rejected----------------+
    PENDING --skipped--> DONE   (held back, then never fetched: `skip`)

Donor states: RESERVE (offered, not started) -> ACTIVE -> IDLE (nothing left it could serve;
restarted when chunks come back) or DROPPED (failed: never used again).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Annotated, Generic, TypeVar

import msgspec
from blake3 import blake3

from peer.errors import ProtocolError
from peer.net.tls import MAX_CERT_BYTES

#: Version 2: each chunk's end in the manifest (not one chunk size), and BLAKE3 chunk hashes.
SERVICE = "state/2"
HASH_BYTES = 32  # BLAKE3's default output
TICKET_BYTES = 32
MIN_CHUNK_BYTES = 64 * 1024
MAX_CHUNK_BYTES = 64 * 1024 * 1024
MAX_CHUNKS = 16384  # ~700 KB of hashes and ends in a manifest
#: A donor's chunk size by default, and the pieces a step's digest hashes large tensors in
#: (`peer.training.state.state_digest`): a donor's chunks of them are the digest's pieces.
PIECE_BYTES = 4 << 20
MAX_HOST_CHARS = 255
#: A manifest names the members of the state's electorate (`steprule`): a Moshpit plan of
#: up to this many peers, each by its peer id's text (~52 characters for Ed25519).
MAX_MEMBERS = 4096
MAX_PEER_ID_CHARS = 128


def chunk_hash(data: memoryview | bytes) -> bytes:
    """The hash of a chunk or of a digest's piece: BLAKE3, a cryptographic hash at 5.4-5.7 GB/s
    on one core of this machine class, where SHA-256 ran 1.35 GB/s (64 MiB inputs). A joiner
    hashes everything it receives once; so did a trainer's digest at every step. Releases the
    GIL, like hashlib."""
    return blake3(data).digest()


D = TypeVar("D", bound=Hashable)


# ---------------------------------------------------------------------------- wire schemas


class ManifestRequest(msgspec.Struct, frozen=True):
    min_step: Annotated[int, msgspec.Meta(ge=0)]


class Manifest(msgspec.Struct, frozen=True):
    """A donor's offer: what its state is, how it is cut, and where to fetch it."""

    step: Annotated[int, msgspec.Meta(ge=0)]
    total_bytes: Annotated[int, msgspec.Meta(ge=0)]
    ends: Annotated[list[Annotated[int, msgspec.Meta(ge=1)]], msgspec.Meta(max_length=MAX_CHUNKS)]
    """Where each chunk ends (exclusive), ascending; the last is `total_bytes`."""
    hashes: Annotated[
        list[Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]],
        msgspec.Meta(max_length=MAX_CHUNKS),
    ]
    data_host: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_CHARS)]
    data_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    ticket: Annotated[bytes, msgspec.Meta(min_length=TICKET_BYTES, max_length=TICKET_BYTES)]
    data_cert: Annotated[bytes, msgspec.Meta(max_length=MAX_CERT_BYTES)]
    """The donor's data-plane TLS certificate (`peer.net.tls`); it must name the donor."""
    members: Annotated[
        list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_PEER_ID_CHARS)]],
        msgspec.Meta(max_length=MAX_MEMBERS),
    ] = []
    """Who votes on the step after this state (`peer.training.steprule`), where the donor
    knows: a claim, which the downloader takes only if its digest is the electorate the
    state's holders name (`StepPolicy.learn_members`). Empty: not known."""

    def chunk(self, index: int) -> tuple[int, int]:
        """[start, end) of chunk `index` (of a checked manifest)."""
        return chunk_span(self.ends, index)


class Release(msgspec.Struct, frozen=True):
    ticket: Annotated[bytes, msgspec.Meta(min_length=TICKET_BYTES, max_length=TICKET_BYTES)]


class Released(msgspec.Struct, frozen=True):
    pass


# ---------------------------------------------------------------------------- chunk plan


class BadManifest(ProtocolError):
    """A donor's manifest is malformed or is not what was asked for."""


def chunk_span(ends: Sequence[int], index: int) -> tuple[int, int]:
    """[start, end) of chunk `index` of chunks that end at `ends`."""
    return (ends[index - 1] if index else 0), ends[index]


def fixed_ends(total_bytes: int, chunk_bytes: int) -> list[int]:
    """Chunk ends for chunks of `chunk_bytes` (the last may be short)."""
    return [*range(chunk_bytes, total_bytes, chunk_bytes), total_bytes] if total_bytes else []


def chunk_ends(total_bytes: int, parts: Sequence[int], piece: int) -> list[int]:
    """Chunk ends for a blob whose parts (a state's header, then each tensor) end at `parts`:
    a part of at least `piece // 4` bytes is cut into chunks of `piece` from its own start
    (the pieces its step's digest hashed, where `piece` is the digest's); smaller parts share
    chunks of at most `piece`. Without parts that tile the blob, fixed chunks of `piece`."""
    if not parts or parts[-1] != total_bytes or any(b < a for a, b in pairwise([0, *parts])):
        return fixed_ends(total_bytes, piece)
    ends: list[int] = []
    start = part_start = 0  # start: of the chunk that small parts share
    for part_end in parts:
        if part_end - part_start >= piece // 4:
            if start < part_start:
                ends.append(part_start)
            ends.extend(range(part_start + piece, part_end, piece))
            ends.append(part_end)
            start = part_end
        elif part_end - start > piece:
            ends.append(part_start)
            start = part_start
        part_start = part_end
    if start < total_bytes:
        ends.append(total_bytes)
    return ends


def donor_chunk_bytes(total_bytes: int, preferred: int, *, max_chunks: int = MAX_CHUNKS) -> int:
    """The chunk size a donor uses: `preferred` (clamped to the bounds), raised when the state
    would otherwise need more than `max_chunks` chunks (the manifest must fit one message)."""
    size = min(max(preferred, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES)
    return max(size, min(-(-total_bytes // max_chunks), MAX_CHUNK_BYTES))


def check_manifest(manifest: Manifest, *, min_step: int, max_total_bytes: int) -> None:
    """Raise BadManifest unless `manifest` is well formed and at `min_step` or later.

    The schema has already checked types, hash and ticket lengths, the port and the host."""
    if manifest.step < min_step:
        raise BadManifest(f"manifest of step {manifest.step}, but step >= {min_step} was asked for")
    if manifest.total_bytes > max_total_bytes:
        raise BadManifest(
            f"state of {manifest.total_bytes} bytes, above the {max_total_bytes} we accept"
        )
    if len(manifest.hashes) != len(manifest.ends):
        raise BadManifest(f"{len(manifest.hashes)} chunk hashes for {len(manifest.ends)} chunks")
    if (manifest.ends[-1] if manifest.ends else 0) != manifest.total_bytes:
        raise BadManifest(f"chunks that do not end at the state's {manifest.total_bytes} bytes")
    start = 0
    for index, end in enumerate(manifest.ends):
        if not start < end <= start + MAX_CHUNK_BYTES:
            raise BadManifest(
                f"chunk {index} ends at {end} after {start}: not ascending, or over "
                f"{MAX_CHUNK_BYTES} bytes"
            )
        start = end


def servable_chunks(chosen: Manifest, offer: Manifest) -> frozenset[int]:
    """Chunks of `chosen` that the donor of `offer` holds byte for byte (same hash, same range)."""
    if offer.step != chosen.step:
        return frozenset()
    same_cuts = offer.ends == chosen.ends  # as donors at one step cut: no range compared then
    return frozenset(
        index
        for index, (ours, theirs) in enumerate(zip(chosen.hashes, offer.hashes, strict=False))
        if ours == theirs and (same_cuts or offer.chunk(index) == chosen.chunk(index))
    )


def choose_manifest(offers: Mapping[D, Manifest]) -> D | None:
    """The donor whose manifest the download follows (see the module docstring, step 2).

    `offers` are checked manifests in the caller's order of preference, which breaks the
    remaining ties. None when there are no offers."""
    if not offers:
        return None
    holders: dict[int, int] = {}
    for manifest in offers.values():
        holders[manifest.step] = holders.get(manifest.step, 0) + 1
    step = max(holders, key=lambda s: (holders[s], s))
    at_step = [(donor, m) for donor, m in offers.items() if m.step == step]

    def coverage(manifest: Manifest) -> int:
        """Bytes of it the donors can serve: in bytes, not chunks, or one donor cutting its
        state into 16,384 chunks only it holds would outweigh three that agree."""
        return sum(
            sum(end - start for start, end in map(manifest.chunk, servable_chunks(manifest, other)))
            for _, other in at_step
        )

    best = max(coverage(m) for _, m in at_step)
    return next(donor for donor, m in at_step if coverage(m) == best)


# ---------------------------------------------------------------------------- the download


class ChunkState(enum.Enum):
    PENDING = "pending"
    FETCHING = "fetching"
    CHECKING = "checking"
    DONE = "done"


class DonorState(enum.Enum):
    RESERVE = "reserve"
    ACTIVE = "active"
    IDLE = "idle"
    DROPPED = "dropped"


# (event, from) -> to. Events come from our own shell, so a missing pair is a local bug.
CHUNK_TRANSITIONS: dict[tuple[str, ChunkState], ChunkState] = {
    ("claim", ChunkState.PENDING): ChunkState.FETCHING,
    ("received", ChunkState.FETCHING): ChunkState.CHECKING,
    ("verified", ChunkState.CHECKING): ChunkState.DONE,
    ("rejected", ChunkState.CHECKING): ChunkState.PENDING,
    ("stopped", ChunkState.FETCHING): ChunkState.PENDING,
    ("skipped", ChunkState.PENDING): ChunkState.DONE,
}
LIVE = (DonorState.RESERVE, DonorState.ACTIVE, DonorState.IDLE)


@dataclass(frozen=True)
class PlanStatistics(Generic[D]):
    done: int
    chunks: int
    chunks_from: dict[D, int]
    """Verified chunks per donor."""
    rejected: dict[D, int]
    """Chunks per donor that failed their hash."""
    dropped: dict[D, str]
    """Donors no longer used, and why."""


class DownloadPlan(Generic[D]):
    """Which donor fetches which chunk of the chosen manifest; see the module docstring."""

    def __init__(
        self, owner: D, manifest: Manifest, *, parallel: int, held_back: bool = False
    ) -> None:
        """`held_back`: no chunk may be claimed until it is `admit`ted."""
        if parallel < 1:
            raise ValueError(f"parallel={parallel!r}, expected at least 1")
        self.manifest = manifest
        self.parallel = parallel
        self.chunks = [ChunkState.PENDING] * len(manifest.hashes)
        self.holder: dict[int, D] = {}  # FETCHING or CHECKING chunk -> its donor
        self.donors: dict[D, DonorState] = {}
        self.servable: dict[D, frozenset[int]] = {}
        self.reasons: dict[D, str] = {}
        self.chunks_from: dict[D, int] = {}
        self.rejected_from: dict[D, int] = {}
        everything = set(range(len(self.chunks)))
        self._held_back = everything if held_back else set()
        self._pending = set() if held_back else everything  # PENDING, and admitted
        self._done = 0
        self.add_donor(owner, manifest)

    # ------------------------------------------------------------ donors

    def add_donor(self, donor: D, manifest: Manifest) -> str | None:
        """Take `donor` as a reserve; the reason it is of no use, or None."""
        if donor in self.donors:
            return "already offered"
        servable = servable_chunks(self.manifest, manifest)
        if not servable and self.chunks:
            return (
                f"holds no chunk of the chosen state (step {manifest.step}, "
                f"{len(manifest.ends)} chunks; chosen: step {self.manifest.step}, "
                f"{len(self.manifest.ends)})"
            )
        self.donors[donor] = DonorState.RESERVE
        self.servable[donor] = servable
        return None

    def donors_to_start(self) -> list[D]:
        """Reserve or idle donors to start fetching now (marked ACTIVE), up to `parallel`."""
        active = sum(state is DonorState.ACTIVE for state in self.donors.values())
        out = []
        for donor, state in self.donors.items():
            if active >= self.parallel:
                break
            if state in (DonorState.RESERVE, DonorState.IDLE) and self._work_for(donor):
                self.donors[donor] = DonorState.ACTIVE
                active += 1
                out.append(donor)
        return out

    def live_donors(self) -> int:
        return sum(state in LIVE for state in self.donors.values())

    def _work_for(self, donor: D) -> bool:
        return not self._pending.isdisjoint(self.servable[donor])

    # ------------------------------------------------------------ chunk events

    def claim(self, donor: D) -> int | None:
        """The lowest pending chunk `donor` may serve, now FETCHING by it; None if none.

        A donor dropped by another task (a chunk of it failed its check) gets None: its pull
        may run on until its next checkpoint delivers the cancellation."""
        if self.donors[donor] is not DonorState.ACTIVE:
            return None
        candidates = self._pending & self.servable[donor]
        if not candidates:
            return None
        index = min(candidates)
        self._move(index, "claim")
        self.holder[index] = donor
        return index

    def received(self, donor: D, index: int) -> None:
        assert self.holder.get(index) == donor, (index, donor)
        self._move(index, "received")

    def verified(self, donor: D, index: int) -> None:
        assert self.holder.get(index) == donor, (index, donor)
        self._move(index, "verified")
        del self.holder[index]
        self.chunks_from[donor] = self.chunks_from.get(donor, 0) + 1

    def rejected(self, donor: D, index: int) -> None:
        """Chunk `index` from `donor` failed its hash: refetch it elsewhere, drop the donor."""
        assert self.holder.get(index) == donor, (index, donor)
        self._move(index, "rejected")
        del self.holder[index]
        self.rejected_from[donor] = self.rejected_from.get(donor, 0) + 1
        self.drop(donor, f"chunk {index} failed its hash check")

    def drop(self, donor: D, reason: str) -> None:
        """Use `donor` no more. Its claimed chunks stay claimed until its task calls stopped()."""
        if self.donors[donor] is not DonorState.DROPPED:
            self.donors[donor] = DonorState.DROPPED
            self.reasons[donor] = reason

    def stopped(self, donor: D, reason: str | None) -> None:
        """`donor`'s connection ended (its task no longer writes any chunk): requeue what it had
        claimed. `reason` None: it ran out of chunks it could serve; else it failed."""
        for index in [i for i, d in self.holder.items() if d == donor]:
            if self.chunks[index] is ChunkState.FETCHING:
                self._move(index, "stopped")
                del self.holder[index]
        if reason is not None:
            self.drop(donor, reason)
        elif self.donors[donor] is DonorState.ACTIVE:
            self.donors[donor] = DonorState.IDLE

    def admit(self, indices: Iterable[int]) -> None:
        """Chunks held back that may now be claimed."""
        admitted = self._held_back & set(indices)
        self._held_back -= admitted
        self._pending |= admitted

    def skip(self, indices: Iterable[int]) -> None:
        """Chunks held back that are never to be fetched: done as they are."""
        for index in sorted(self._held_back & set(indices)):
            self._held_back.discard(index)
            self._move(index, "skipped")

    def held_back(self) -> list[int]:
        return sorted(self._held_back)

    def _move(self, index: int, event: str) -> None:
        before = self.chunks[index]
        after = CHUNK_TRANSITIONS.get((event, before))
        assert after is not None, f"chunk {index}: no transition {event!r} from {before}"
        self.chunks[index] = after
        if before is ChunkState.PENDING:
            self._pending.discard(index)  # (admitted or, when skipped, held back)
        if after is ChunkState.PENDING:
            self._pending.add(index)
        if after is ChunkState.DONE:
            self._done += 1

    # ------------------------------------------------------------ progress

    @property
    def complete(self) -> bool:
        return self._done == len(self.chunks)

    @property
    def settled(self) -> bool:
        """Every chunk admitted is done (the rest are held back)."""
        return self._done + len(self._held_back) == len(self.chunks)

    def unservable(self) -> list[int]:
        """Pending chunks that no live donor may serve."""
        live = [self.servable[d] for d, state in self.donors.items() if state in LIVE]
        return sorted(i for i in self._pending if not any(i in s for s in live))

    def statistics(self) -> PlanStatistics[D]:
        return PlanStatistics(
            done=self._done,
            chunks=len(self.chunks),
            chunks_from=dict(self.chunks_from),
            rejected=dict(self.rejected_from),
            dropped=dict(self.reasons),
        )


__all__ = [
    "CHUNK_TRANSITIONS",
    "MAX_CHUNKS",
    "MAX_CHUNK_BYTES",
    "MIN_CHUNK_BYTES",
    "PIECE_BYTES",
    "SERVICE",
    "BadManifest",
    "ChunkState",
    "DonorState",
    "DownloadPlan",
    "Manifest",
    "ManifestRequest",
    "PlanStatistics",
    "Release",
    "Released",
    "check_manifest",
    "choose_manifest",
    "chunk_ends",
    "chunk_span",
    "donor_chunk_bytes",
    "fixed_ends",
    "servable_chunks",
]
