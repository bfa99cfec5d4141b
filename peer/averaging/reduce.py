"""The arithmetic of one butterfly round, pure: reducing a part, and assembling the result.

A reducer owns one part of the flat vector. `PartReducer` takes each sender's chunks and, once
no sender still in the round owes a chunk (it *settles*), lines that chunk's contributions up
in a fixed order (`order`: by the block each sender's value stands for, `moshpit.py`), not as
they arrived; `average` adds them, weighted, in that order: float addition is not associative,
and the groups of a Moshpit round that hold the same blocks must compute bit-identical
averages. Chunks wait until they settle (`queued`; the shell stops reading from a sender that
is far ahead, the reducer's own contribution included, so this stays a few chunks per sender)
and then until averaged (the shell averages settled chunks as they come, and stops reading
while a few wait). Senders of weight 0 (a member that only needs the average) are checked and
counted but add nothing. Each chunk records which senders it *includes*: those whose
contribution it holds.

Threads. The bookkeeping (`add_checked`, `drop`, `take_complete`, `ResultAssembler.check` and
`record`) belongs to one thread, the event loop's; the passes over values need not: `check`
(before `add_checked`), `average` (of a settled chunk; one at a time) and
`ResultAssembler.write` touch only their own chunk's memory and state that is final by then
(`average` may still leave a sender out of its chunk's books: the loop reads a settled
chunk's only once it is averaged), so the shell runs them in worker threads while the loop
goes on with other chunks.

A sender that fails is dropped: it leaves every chunk that has not settled yet, even those it
delivered, so that the reducer's chunks include the same senders wherever it can; only the
chunks already settled (and sent out) keep it. Each chunk is normalised by the total weight of
the senders it includes. A chunk that fails validation is never added, and its sender is dropped.

Precision. The weighted sum is float64 (`weighted_mean`), the weights and their total too, and
only the mean is rounded to float32: sample counts are exact up to 2^53 (a float32 weight is
exact only up to 2^24: 2^24 + 1 samples counted as 2^24), and finite contributions cannot make
it overflow (a float32 sum of two float32-max values is inf: the chunk was lost for everyone
while nobody was at fault). With weights of at most `MAX_WEIGHT` the sum stays far inside
float64's range, and the mean within its contributions' range, so it is finite. A contribution
that is not finite never gets that far (`check`), except one that `prepare` makes (our own, as
the codec decodes it): that one is left out of its chunk, and `unfit` names its sender for the
caller to drop.

With a `norm_factor` the reducer is robust instead (`peer.averaging.robust`): it averages each
settled chunk with CenteredClip.

A member's `ResultAssembler` writes the averaged chunks it receives into its own vector;
chunks that never arrive keep the member's local values, and the report says which chunks were
averaged over which senders.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from peer.averaging.compression import BadPart
from peer.averaging.partition import chunk_ranges
from peer.averaging.robust import robust_average

MAX_WEIGHT = 2.0**53
"""The largest weight a sender may have: integers up to it are exact in float64."""
SLICE_ELEMENTS = 1 << 15
"""Elements per float64 pass of `weighted_mean`: its two scratch slices (512 KiB) stay in cache."""


@dataclass(frozen=True)
class ChunkResult:
    start: int
    """Offset in the flat vector."""
    end: int
    senders: int
    """Contributions averaged into this chunk; 0 if it kept local values."""
    included: frozenset[str] = frozenset()
    """The senders whose contributions it averages (empty if it kept local values)."""


class PartReducer:
    """Weighted average of the elements [start, end), built chunk by chunk."""

    def __init__(
        self,
        start: int,
        end: int,
        *,
        chunk_elements: int,
        weights: Mapping[str, float],
        order: Sequence[str] | None = None,
        norm_factor: float | None = None,
    ) -> None:
        """`weights`: every sender's weight; `order`: the senders in the order their
        contributions are added (default: sorted)."""
        for sender, weight in weights.items():
            if not (np.isfinite(weight) and 0 <= weight <= MAX_WEIGHT):
                raise ValueError(
                    f"weight of {sender} is {weight!r}; expected a number in [0, {MAX_WEIGHT:g}]"
                )
        order = sorted(weights) if order is None else list(order)
        if sorted(order) != sorted(weights):
            raise ValueError("the order must list every sender exactly once")
        self.start, self.end = start, end
        self.chunks = chunk_ranges(0, end - start, chunk_elements)
        self.weights = dict(weights)
        self.sum = np.zeros(end - start, dtype=np.float32)
        self.chunk_weight = np.zeros(len(self.chunks), dtype=np.float64)
        self.pending = {sender: set(range(len(self.chunks))) for sender in weights}
        self.dropped: dict[str, str] = {}
        self.owed = [len(weights)] * len(self.chunks)  # per chunk: senders in the round owing it
        self.settled: set[int] = set()  # chunks whose contributions were added
        self.ready: list[int] = []  # settled, not yet taken
        self.senders: list[set[str]] = [set() for _ in self.chunks]  # included, per chunk
        self.order = [sender for sender in order if weights[sender] > 0]
        self.early: list[dict[str, np.ndarray]] = [{} for _ in self.chunks]  # until it settles
        # Settled, in `order`, until averaged: (sender, values) of every sender of weight > 0.
        self.contributions: list[list[tuple[str, np.ndarray]]] = [[] for _ in self.chunks]
        self.queued: dict[str, int] = dict.fromkeys(weights, 0)  # chunks waiting, per sender
        # Per chunk, senders left out of its average for values `prepare` made not finite.
        self._unfit: list[dict[str, str]] = [{} for _ in self.chunks]
        self.norm_factor = norm_factor
        self._scratch: np.ndarray | None = None  # `weighted_mean`'s, reused: one average at a time
        for index in range(len(self.chunks)):  # without senders every chunk is settled (empty)
            self._settle(index)

    def release(self) -> None:
        """Let go of the part's sums and buffers (`_Round.release` says why): nothing is
        added or read after this."""
        self.sum = np.empty(0, np.float32)
        self.early = [{} for _ in self.chunks]
        self.contributions = [[] for _ in self.chunks]
        self._scratch = None

    def chunk_size(self, index: int) -> int:
        lo, hi = self.chunks[index]
        return hi - lo

    def check(self, index: int, values: np.ndarray) -> None:
        """BadPart unless `values` can be chunk `index` (float32, its length, finite): the pass
        over the values, safe in a worker thread (it reads nothing that changes)."""
        lo, hi = self.chunks[index]
        if values.dtype != np.float32 or values.shape != (hi - lo,):
            raise BadPart(
                f"chunk {index}: {values.dtype}{values.shape}, expected float32({hi - lo},)"
            )
        if not np.isfinite(values).all():
            raise BadPart(f"chunk {index} holds NaN or Inf")

    def add(self, sender: str, index: int, values: np.ndarray) -> None:
        """Add `sender`'s chunk `index`; raises BadPart (drop the sender) if it is not valid."""
        self._check_sender(sender, index)
        try:
            self.check(index, values)
        except BadPart as error:
            raise BadPart(f"{error} (from {sender})") from None
        self._accept(sender, index, values)

    def add_checked(self, sender: str, index: int, values: np.ndarray) -> None:
        """`add` for values that passed `check` already (in a worker thread): only the cheap
        checks here (shape and type again: a caller's mix-up is not worth a wrong sum)."""
        self._check_sender(sender, index)
        lo, hi = self.chunks[index]
        if values.dtype != np.float32 or values.shape != (hi - lo,):
            raise BadPart(f"chunk {index} from {sender}: {values.dtype}{values.shape}")
        self._accept(sender, index, values)

    def _check_sender(self, sender: str, index: int) -> None:
        if sender in self.dropped:
            raise BadPart(f"{sender} was dropped from this part ({self.dropped[sender]})")
        pending = self.pending.get(sender)
        if pending is None:
            raise BadPart(f"{sender} is not a sender of part [{self.start}, {self.end})")
        if index not in pending:
            raise BadPart(f"chunk {index} from {sender} is out of range or came twice")

    def _accept(self, sender: str, index: int, values: np.ndarray) -> None:
        self.pending[sender].discard(index)
        self.owed[index] -= 1
        self.senders[index].add(sender)
        if self.weights[sender] > 0:
            self.early[index][sender] = values
            self.queued[sender] += 1
        self._settle(index)

    def _settle(self, index: int) -> None:
        """Line chunk `index`'s contributions up in `order` once nobody in the round owes it."""
        if self.owed[index] or index in self.settled:
            return
        self.settled.add(index)
        early = self.early[index]
        lined_up = []
        for sender in self.order:
            values = early.pop(sender, None)
            if values is not None:
                self.queued[sender] -= 1
                # The total weight too, in order: any float sum must be the same in every group.
                self.chunk_weight[index] += self.weights[sender]
                lined_up.append((sender, values))
        self.contributions[index] = lined_up
        self.ready.append(index)

    def drop(self, sender: str, reason: str) -> None:
        """Stop waiting for `sender`; it leaves every chunk that has not settled (what it
        delivered there too); the rest go on without it."""
        if sender not in self.pending or sender in self.dropped:
            return
        self.dropped[sender] = reason
        for index in self.pending[sender]:
            self.owed[index] -= 1
        for index in range(len(self.chunks)):
            if index in self.settled:
                continue
            if self.early[index].pop(sender, None) is not None:
                self.queued[sender] -= 1
            self.senders[index].discard(sender)
            self._settle(index)

    @property
    def done(self) -> bool:
        """Every sender still in the round delivered every chunk."""
        return all(
            not pending for sender, pending in self.pending.items() if sender not in self.dropped
        )

    def waiting_for(self) -> list[str]:
        return sorted(s for s, p in self.pending.items() if p and s not in self.dropped)

    def take_complete(self) -> list[int]:
        """Chunks that settled since the last call (no sender still in the round owes them),
        each returned once."""
        ready, self.ready = sorted(self.ready), []
        return ready

    def included(self, index: int) -> frozenset[str]:
        """The senders whose contributions chunk `index` holds (final once it settled)."""
        return frozenset(self.senders[index])

    def unfit(self, index: int) -> dict[str, str]:
        """Senders left out of chunk `index`'s average (and why): their values, as `prepare`
        gave them, were not finite. Read once `average` returned: the caller drops them."""
        return dict(self._unfit[index])

    def average(
        self,
        index: int,
        *,
        out: np.ndarray | None = None,
        prepare: Callable[[str, np.ndarray], np.ndarray] | None = None,
    ) -> tuple[np.ndarray | None, int]:
        """(average, senders) of a settled chunk, computed in `out` (float32, at least the
        chunk's length: a caller's scratch) or else in place of its sum; (None, 0) if no sender
        of weight > 0 delivered it. The average is finite. `prepare(sender, values)`, if given,
        gives the values to add for each contribution (the shell passes its own through the
        codec here, into a buffer it reuses); a sender whose prepared values are not finite is
        left out (`unfit`). Once per chunk, one chunk at a time; safe in a worker thread while
        the loop goes on with other chunks (it writes only this chunk's books)."""
        lined_up, self.contributions[index] = self.contributions[index], []
        if prepare is not None:
            lined_up = self._prepared(index, lined_up, prepare)
        if not lined_up:
            return None, 0
        lo, hi = self.chunks[index]
        # A part-sized sum is fresh memory every round: the kernel zeroes each page at its
        # first write (a tenth of a round's CPU at 100 MB). One reused chunk is not.
        chunk = self.sum[lo:hi] if out is None else out[: hi - lo]
        weights = [self.weights[sender] for sender, _ in lined_up]
        if self.norm_factor is not None:
            chunk[:] = robust_average(
                [values for _, values in lined_up], weights, norm_factor=self.norm_factor
            )  # in `order`: the same input everywhere
            return chunk, len(self.senders[index])
        if self._scratch is None:
            largest = max(b - a for a, b in self.chunks)
            self._scratch = np.empty((2, min(SLICE_ELEMENTS, largest)), np.float64)
        weighted_mean(
            [values for _, values in lined_up],
            weights,
            float(self.chunk_weight[index]),
            out=chunk,
            scratch=self._scratch,
        )
        return chunk, len(self.senders[index])

    def _prepared(
        self,
        index: int,
        lined_up: list[tuple[str, np.ndarray]],
        prepare: Callable[[str, np.ndarray], np.ndarray],
    ) -> list[tuple[str, np.ndarray]]:
        """`lined_up` through `prepare`, without the senders it made not finite (then the
        chunk's senders and total weight are theirs less those; values it returns as they
        were passed `check` already)."""
        kept, unfit = [], {}
        for sender, values in lined_up:
            prepared = prepare(sender, values)
            if prepared is values or np.isfinite(prepared).all():
                kept.append((sender, prepared))
            else:
                unfit[sender] = f"chunk {index} is not finite as the codec decodes it"
        if unfit:
            self._unfit[index] = unfit
            self.senders[index] = self.senders[index] - unfit.keys()
            total = 0.0
            for sender, _ in kept:  # in order, as `_settle` adds them
                total += self.weights[sender]
            self.chunk_weight[index] = total
        return kept


def weighted_mean(
    contributions: Sequence[np.ndarray],
    weights: Sequence[float],
    total: float,
    *,
    out: np.ndarray,
    scratch: np.ndarray,
) -> None:
    """out[:] = sum_i weights[i] * contributions[i] / total, added in the order given, in
    float64, then rounded to float32 (`out`). Contributions are finite float32 of out's length,
    weights in [0, MAX_WEIGHT] and `total` their float64 sum, in order (> 0).

    Why float64: float32 weights are exact only up to 2^24, and a float32 sum of finite values
    overflows (two float32-max contributions). In float64 every product and partial sum is at
    most n x 2^53 x 3.4e38 (far below 1.8e308), and the mean lies within the contributions'
    range (to float64 rounding, far below float32's half step at its largest value), so it is
    finite as float32. Each element is the same sequence of IEEE operations (one multiply and
    one add per contribution, never fused, then one divide and one rounding to float32),
    whatever the slicing and the machine: groups adding the same bits in the same order get
    the same bits.

    Cost: it goes `scratch.shape[1]` elements at a time (`scratch`: float64 (2, >= 1)) so that
    its float64 sums stay in cache; each contribution is read once, `out` written once."""
    step = scratch.shape[1]
    accumulated, product = scratch[0], scratch[1]
    size = len(out)
    for start in range(0, size, step):
        end = min(size, start + step)
        into, term = accumulated[: end - start], product[: end - start]
        for k, (values, weight) in enumerate(zip(contributions, weights, strict=True)):
            piece = values[start:end]
            if k == 0:
                # The sum starts at it, not 0. dtype: numpy 1.x picks the float32 loop for a
                # float32 array times a float64 scalar whatever `out` is (review find).
                np.multiply(piece, np.float64(weight), out=into, dtype=np.float64)
            elif weight == 1.0:
                np.add(into, piece, out=into)
            else:  # a float64 weight (np.float64: a Python float would make it a float32 product)
                np.multiply(piece, np.float64(weight), out=term, dtype=np.float64)
                np.add(into, term, out=into)
        np.divide(into, total, out=out[start:end], casting="same_kind")


class ResultAssembler:
    """Writes averaged chunks into `vector` (the member's own values) as they arrive."""

    def __init__(self, vector: np.ndarray, parts: list[tuple[int, int]], *, chunk_elements: int):
        self.vector = vector
        self.parts = parts
        self.chunks = [chunk_ranges(lo, hi, chunk_elements) for lo, hi in parts]
        self.received: dict[tuple[int, int], frozenset[str]] = {}  # (part, chunk) -> senders

    def release(self) -> None:
        """Let go of the vector (`_Round.release` says why)."""
        self.vector = np.empty(0, np.float32)

    def put(self, part: int, index: int, values: np.ndarray, included: frozenset[str]) -> None:
        """Place chunk `index` of `part`, the average over `included`; raises BadPart if it
        does not fit or is not finite."""
        self.check(part, index, included)
        self.write(part, index, values)
        self.record(part, index, included)

    def check(self, part: int, index: int, included: frozenset[str]) -> None:
        """BadPart unless chunk `index` of `part` exists, is still due, and `included` names
        somebody (`put`'s first step: the shell does the other two, `write` off the loop)."""
        if not (0 <= part < len(self.chunks) and 0 <= index < len(self.chunks[part])):
            raise BadPart(f"no chunk {index} in part {part}")
        if (part, index) in self.received:
            raise BadPart(f"chunk {index} of part {part} came twice")
        if not included:
            raise BadPart(f"chunk {index} of part {part} is not a finite average")

    def write(self, part: int, index: int, values: np.ndarray) -> None:
        """Copy a checked chunk's values into the vector; BadPart (and the vector untouched)
        if they do not fit or are not finite. Touches only that chunk: safe in a worker thread
        while no other call writes the same chunk."""
        lo, hi = self.chunks[part][index]
        if values.dtype != np.float32 or values.shape != (hi - lo,):
            raise BadPart(f"chunk {index} of part {part}: {values.dtype}{values.shape}")
        if not np.isfinite(values).all():
            raise BadPart(f"chunk {index} of part {part} is not a finite average")
        self.vector[lo:hi] = values

    def record(self, part: int, index: int, included: frozenset[str]) -> None:
        """Note that chunk `index` of `part` holds the average over `included` (written)."""
        self.received[(part, index)] = included

    def part_complete(self, part: int) -> bool:
        return all((part, i) in self.received for i in range(len(self.chunks[part])))

    def report(self) -> list[ChunkResult]:
        """Every chunk of the vector: which senders its value averages (none: kept local)."""
        results = []
        for part, chunks in enumerate(self.chunks):
            for index, (lo, hi) in enumerate(chunks):
                included = self.received.get((part, index), frozenset())
                results.append(ChunkResult(lo, hi, len(included), included))
        return results
