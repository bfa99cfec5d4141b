"""The arithmetic of one butterfly round, pure: reducing a part, and assembling the result.

A reducer owns one part of the flat vector. `PartReducer` adds each sender's chunks, weighted,
into one float32 sum and counts per chunk the weight and the senders that made it. It adds the
contributions of a chunk in a fixed order (`order`: by the block each sender's value stands
for, `moshpit.py`), not as they arrive: float addition is not associative, and the groups of
a Moshpit round that hold the same blocks must compute bit-identical averages. A chunk that
arrives before its turn waits (`queued`; the shell stops reading from a sender that is far
ahead, so this stays a few chunks per sender). Senders of weight 0 (a member that only needs
the average) are checked and counted but add nothing. A sender that fails is dropped: the
chunks it already delivered keep its contribution, the rest are averaged without it (each
chunk is normalised by its own total weight; the round is then incomplete, and its result is
not applied). A chunk that fails validation is never added, and its sender is dropped.

With a `norm_factor` the reducer is robust instead (`peer.averaging.robust`): it keeps every
sender's chunks (memory: senders x part) and averages each complete chunk with CenteredClip.

A member's `ResultAssembler` writes the averaged chunks it receives into its own vector;
chunks that never arrive keep the member's local values, and the report says which chunks were
averaged over how many senders.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from peer.averaging.compression import BadPart
from peer.averaging.partition import chunk_ranges
from peer.averaging.robust import robust_average


@dataclass(frozen=True)
class ChunkResult:
    start: int
    """Offset in the flat vector."""
    end: int
    senders: int
    """Contributions averaged into this chunk; 0 if it kept local values."""


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
            if not (np.isfinite(weight) and weight >= 0):
                raise ValueError(f"weight of {sender} is {weight!r}; expected a number >= 0")
        order = sorted(weights) if order is None else list(order)
        if sorted(order) != sorted(weights):
            raise ValueError("the order must list every sender exactly once")
        self.start, self.end = start, end
        self.chunks = chunk_ranges(0, end - start, chunk_elements)
        self.weights = dict(weights)
        self.sum = np.zeros(end - start, dtype=np.float32)
        self.chunk_weight = np.zeros(len(self.chunks), dtype=np.float64)
        self.chunk_senders = np.zeros(len(self.chunks), dtype=np.int64)
        self.pending = {sender: set(range(len(self.chunks))) for sender in weights}
        self.dropped: dict[str, str] = {}
        self.taken: set[int] = set()  # chunks already averaged (or given up)
        self.order = [sender for sender in order if weights[sender] > 0]
        self.turn = [0] * len(self.chunks)  # per chunk: the position in `order` to add next
        self.early: list[dict[str, np.ndarray]] = [{} for _ in self.chunks]  # before their turn
        self.queued: dict[str, int] = dict.fromkeys(weights, 0)  # chunks waiting, per sender
        self.norm_factor = norm_factor
        # Robust mode: every sender's values of each chunk, until the chunk is averaged.
        self.kept: list[dict[str, np.ndarray]] | None = (
            [{} for _ in self.chunks] if norm_factor is not None else None
        )

    def chunk_size(self, index: int) -> int:
        lo, hi = self.chunks[index]
        return hi - lo

    def add(self, sender: str, index: int, values: np.ndarray) -> None:
        """Add `sender`'s chunk `index`; raises BadPart (drop the sender) if it is not valid."""
        if sender in self.dropped:
            raise BadPart(f"{sender} was dropped from this part ({self.dropped[sender]})")
        pending = self.pending.get(sender)
        if pending is None:
            raise BadPart(f"{sender} is not a sender of part [{self.start}, {self.end})")
        if index not in pending:
            raise BadPart(f"chunk {index} from {sender} is out of range or came twice")
        lo, hi = self.chunks[index]
        if values.dtype != np.float32 or values.shape != (hi - lo,):
            raise BadPart(
                f"chunk {index} from {sender}: {values.dtype}{values.shape}, "
                f"expected float32({hi - lo},)"
            )
        if not np.isfinite(values).all():
            raise BadPart(f"chunk {index} from {sender} holds NaN or Inf")
        weight = self.weights[sender]
        self.chunk_senders[index] += 1
        pending.discard(index)
        if weight > 0:
            self.early[index][sender] = values
            self.queued[sender] += 1
            self._advance(index)

    def _advance(self, index: int) -> None:
        """Add chunk `index`'s contributions whose turn has come, in `order`."""
        early, turn = self.early[index], self.turn[index]
        while turn < len(self.order):
            sender = self.order[turn]
            if sender in early:
                self.queued[sender] -= 1
                self._add(index, sender, early.pop(sender))
            elif sender not in self.dropped:
                break  # still owed: later contributions wait for it
            turn += 1
        self.turn[index] = turn

    def _add(self, index: int, sender: str, values: np.ndarray) -> None:
        # The total weight too, in order: any float sum must be the same in every group.
        self.chunk_weight[index] += self.weights[sender]
        if self.kept is not None:
            self.kept[index][sender] = values.copy()
            return
        lo, hi = self.chunks[index]
        weight = self.weights[sender]
        with np.errstate(over="ignore"):  # an overflowing chunk is caught when averaged
            self.sum[lo:hi] += values if weight == 1.0 else values * np.float32(weight)

    def drop(self, sender: str, reason: str) -> None:
        """Stop waiting for `sender`: what it delivered stays, the rest goes on without it."""
        if sender in self.pending and sender not in self.dropped:
            self.dropped[sender] = reason
            for index in range(len(self.chunks)):
                self._advance(index)

    @property
    def done(self) -> bool:
        """Every sender still in the round delivered every chunk."""
        return all(
            not pending for sender, pending in self.pending.items() if sender not in self.dropped
        )

    def waiting_for(self) -> list[str]:
        return sorted(s for s, p in self.pending.items() if p and s not in self.dropped)

    def take_complete(self) -> list[int]:
        """Chunks that no sender still in the round owes, each returned once."""
        owed = set().union(*(p for s, p in self.pending.items() if s not in self.dropped))
        ready = [i for i in range(len(self.chunks)) if i not in owed and i not in self.taken]
        assert not any(self.early[i] for i in ready), "a complete chunk has nothing waiting"
        self.taken.update(ready)
        return ready

    def average(self, index: int) -> tuple[np.ndarray | None, int]:
        """(average, senders) of a complete chunk, computed in place of its sum; (None, 0) if no
        sender delivered it."""
        total = self.chunk_weight[index]
        if total <= 0:
            return None, 0
        lo, hi = self.chunks[index]
        if self.kept is not None:
            kept, self.kept[index] = self.kept[index], {}
            assert self.norm_factor is not None
            self.sum[lo:hi] = robust_average(
                list(kept.values()), [self.weights[s] for s in kept], norm_factor=self.norm_factor
            )  # `kept` holds them in `order`: the same input everywhere
        else:
            with np.errstate(over="ignore", invalid="ignore"):
                self.sum[lo:hi] /= np.float32(total)
        return self.sum[lo:hi], int(self.chunk_senders[index])


class ResultAssembler:
    """Writes averaged chunks into `vector` (the member's own values) as they arrive."""

    def __init__(self, vector: np.ndarray, parts: list[tuple[int, int]], *, chunk_elements: int):
        self.vector = vector
        self.parts = parts
        self.chunks = [chunk_ranges(lo, hi, chunk_elements) for lo, hi in parts]
        self.received: dict[tuple[int, int], int] = {}  # (part, chunk) -> senders

    def put(self, part: int, index: int, values: np.ndarray, senders: int) -> None:
        """Place chunk `index` of `part`; raises BadPart if it does not fit or is not finite."""
        if not (0 <= part < len(self.chunks) and 0 <= index < len(self.chunks[part])):
            raise BadPart(f"no chunk {index} in part {part}")
        if (part, index) in self.received:
            raise BadPart(f"chunk {index} of part {part} came twice")
        lo, hi = self.chunks[part][index]
        if values.dtype != np.float32 or values.shape != (hi - lo,):
            raise BadPart(f"chunk {index} of part {part}: {values.dtype}{values.shape}")
        if not np.isfinite(values).all() or senders < 1:
            raise BadPart(f"chunk {index} of part {part} is not a finite average")
        self.vector[lo:hi] = values
        self.received[(part, index)] = senders

    def part_complete(self, part: int) -> bool:
        return all((part, i) in self.received for i in range(len(self.chunks[part])))

    def report(self) -> list[ChunkResult]:
        """Every chunk of the vector: how many senders its value averages (0: kept local)."""
        return [
            ChunkResult(lo, hi, self.received.get((part, index), 0))
            for part, chunks in enumerate(self.chunks)
            for index, (lo, hi) in enumerate(chunks)
        ]
