"""A trainer's catch-up in place: the certified state downloaded straight into its own tensors.

`InPlaceCatchUp` is the `statesync.inplace.Sink` a trainer hands to `StateDownload.run_into`:
it asks for the header, then for the chunks the state's digest needs that the manifest's
hashes cannot give (small tensors share chunks), checks the digest against the certificate and
the shapes against our model before anything of ours changes, then gives the download our own
tensors to receive the rest into (`TorchWorker.take_in_place`); `finish` loads it. A peer
that fell behind then holds one state, not its own beside the whole download.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection

import torch
import trio

from peer.training import state as states
from peer.training.chunks import Manifest
from peer.training.statesync.inplace import EarlyChunks, KnownPieces, Placement, Where, place
from peer.training.worker import TorchWorker

#: Raises RemoteError unless a state of this step with this digest may be taken.
Certify = Callable[[int, str], None]


class InPlaceCatchUp:
    def __init__(self, worker: TorchWorker, certify: Certify) -> None:
        self.worker = worker
        self.certify = certify
        self.state: states.TrainingState | None = None
        """The state the header describes (meta tensors), once parsed."""
        self.layout: states.BlobLayout | None = None
        self.placement: Placement | None = None
        self.digest: str | None = None
        self.receivers: dict[str, torch.Tensor] | None = None
        self.members: tuple[str, ...] = ()
        """The electorate's members the followed manifest claims (`Manifest.members`)."""

    async def first(self, manifest: Manifest, early: EarlyChunks) -> Collection[int]:
        header = 8  # the header's length, then the header
        if all(index in early for index in early.chunks_over(0, header)):
            header = states.header_bytes(early.read(0, header))
            if header > manifest.total_bytes:
                raise states.StateMismatch(
                    f"a {header}-byte header in a state of {manifest.total_bytes} bytes"
                )
        missing = [i for i in early.chunks_over(0, header) if i not in early]
        if missing:
            return missing
        if self.placement is None:
            self.state, self.layout = await trio.to_thread.run_sync(
                states.parse_header, early.read(0, header), manifest.total_bytes
            )
            loaded, certified = self._wanted(self.state)
            self.placement = place(manifest, self.layout, loaded=loaded, certified=certified)
        return self.placement.early

    def _wanted(self, state: states.TrainingState) -> tuple[set[str], set[str]]:
        """The tensors we load (the model's and the shared optimizers'), and those a step
        certifies."""
        worker = self.worker
        shared = worker.strategy.shared
        optimizers = {n for n in state.tensors if n.partition(".")[0] in shared}
        certified = states.certified_tensors(state, worker.certified_names, shared)
        return {n for n in state.tensors if n.startswith("model.")} | optimizers, set(certified)

    async def admit(self, manifest: Manifest, early: EarlyChunks) -> Where:
        state, layout, placement = self.state, self.layout, self.placement
        assert state is not None and layout is not None and placement is not None
        if state.step != manifest.step:
            raise states.StateMismatch(f"a state of step {state.step} offered as {manifest.step}")
        known = layout.known(KnownPieces(manifest, early))  # type: ignore[arg-type]
        certified = await trio.to_thread.run_sync(
            functools.partial(self.worker.certify, state, known=known)
        )
        self.certify(manifest.step, certified.digest)
        self.digest = certified.digest
        self.members = tuple(manifest.members)
        # From here on the state we held is given up.
        self.receivers = receivers = await self.worker.take_in_place(
            state, early.pieces(), layout.spans
        )
        views = await trio.to_thread.run_sync(_bytes_of, receivers)  # torch: not on the loop

        def where(index: int) -> memoryview | None:
            if index not in placement.late:
                return None  # skipped
            name, offset = placement.late[index]
            start, end = manifest.chunk(index)
            return views[name][offset : offset + end - start]

        return where

    async def finish(self) -> tuple[int, str]:
        """Load the state received (StateMismatch: it holds NaN, say); its step and digest."""
        state, receivers = self.state, self.receivers
        assert state is not None and receivers is not None and self.digest is not None
        await self.worker.finish_in_place(state, receivers)
        return state.step, self.digest


def _bytes_of(tensors: dict[str, torch.Tensor]) -> dict[str, memoryview]:
    return {name: states.raw_bytes(tensor) for name, tensor in tensors.items()}


__all__ = ["Certify", "InPlaceCatchUp"]
