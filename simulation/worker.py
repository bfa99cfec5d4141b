"""A stand-in for `peer.training.worker.TorchWorker`: the trainer's executor without torch.

Its "model" is a short float32 vector; a micro-batch takes the time the peer's speed says,
varied as the scenario's `ComputeNoise` says (jitter, slow spells, pauses), and adds a
pseudo-gradient drawn from the peer's own seed; a step moves the parameters by the average it is
given, so peers that applied the same averages hold the same bits and the same digest (the
simulation checks exactness at every size, as the real digests do). The sizes that set times
and deadlines are the simulated model's, not the vector's (`Collaboration.factor`).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import trio

from peer.errors import RemoteError
from peer.training.statesync import Snapshot
from peer.training.steprule import average_digest
from peer.training.worker import Computed
from simulation import cpu

LEARNING_RATE = 0.01


@dataclass(frozen=True)
class SimState:
    step: int
    parameters: np.ndarray


@dataclass(frozen=True)
class SimFingerprint:
    digest: str
    description: str


@dataclass(frozen=True)
class ComputeNoise:
    """How a volunteer's speed varies (the scenario's, the same for every peer): each
    micro-batch's time drawn around its mean (`jitter`, the sigma of a log-normal factor of mean
    1); slow spells (another job on the machine: `spells_per_hour`, each 30-300 s long, speed
    divided by `spell_slowdown`); and pauses (the machine busy or asleep: `pauses_per_hour`,
    10-120 s without a micro-batch; the peer still answers the network)."""

    jitter: float = 0.2
    spells_per_hour: float = 2.0
    spell_slowdown: float = 4.0
    pauses_per_hour: float = 1.0

    def mean_slowdown(self) -> float:
        """A micro-batch's mean time over its nominal one, over a long run: the share of time
        paused, and of the rest in slow spells (each spell or pause followed by an exponential
        wait for the next)."""

        def share(per_hour: float, low: float, high: float) -> float:
            length = (high - low) / math.log(high / low)  # a log-uniform draw's mean
            return length / (length + 3600 / per_hour) if per_hour > 0 else 0.0

        paused, slow = share(self.pauses_per_hour, 10, 120), share(self.spells_per_hour, 30, 300)
        return 1 / ((1 - paused) * (1 - slow + slow / self.spell_slowdown))


QUIET = ComputeNoise(jitter=0, spells_per_hour=0, pauses_per_hour=0)
"""Every micro-batch takes exactly its mean (a worker built without a scenario's noise)."""


class Variation:
    """One peer's draws of `ComputeNoise`, from its own seed."""

    def __init__(self, noise: ComputeNoise, rng: np.random.Generator) -> None:
        self.noise = noise
        self.rng = rng
        self.slow_until = -math.inf
        self.next_spell = self._after(noise.spells_per_hour)
        self.next_pause = self._after(noise.pauses_per_hour)

    def _after(self, per_hour: float) -> float:
        return self.rng.exponential(3600 / per_hour) if per_hour > 0 else math.inf

    def _length(self, low: float, high: float) -> float:
        return float(low * (high / low) ** self.rng.random())

    def seconds(self, mean: float, now: float) -> float:
        """How long a micro-batch of `mean` seconds starting at `now` takes, pauses included."""
        noise, extra = self.noise, 0.0
        if now >= self.next_pause:
            extra = self._length(10, 120)
            self.next_pause = now + extra + self._after(noise.pauses_per_hour)
        if now >= self.next_spell:
            self.slow_until = now + self._length(30, 300)
            self.next_spell = self.slow_until + self._after(noise.spells_per_hour)
        factor = noise.spell_slowdown if now < self.slow_until else 1.0
        if noise.jitter > 0:
            sigma = noise.jitter
            factor *= float(self.rng.lognormal(-sigma * sigma / 2, sigma))
        return extra + mean * factor


class Taken:
    """`TorchWorker.take_soon`'s pending result, already there."""

    def __init__(self, value: tuple[np.ndarray, int]) -> None:
        self.value = value

    async def result(self) -> tuple[np.ndarray, int]:
        return self.value


class SimWorker:
    def __init__(
        self,
        *,
        vector_size: int,
        samples_per_second: float,
        micro_batch: int,
        seed: int,
        on_hold: Callable[[int, str], None] = lambda step, digest: None,
        noise: ComputeNoise | None = None,
        model_bytes: float = 0.0,
        state_bytes: float = 0.0,
    ) -> None:
        """`on_hold(step, digest)`: told of every state this peer takes as a step (applied or
        downloaded), before it signs it (the simulation's safety check)."""
        self.on_hold = on_hold
        # What hashing the simulated model takes (`simulation.cpu`): a step's digest, and a
        # downloaded state's check.
        self.digest_seconds = model_bytes / cpu.HASH_BYTES_PER_SECOND
        self.check_seconds = cpu.download_check_seconds(state_bytes)
        self.candidate_seconds = model_bytes / cpu.CHUNK_HASH_BYTES_PER_SECOND  # BLAKE3
        self.vector_size = vector_size
        self.samples_per_second = samples_per_second
        self.micro_batch = micro_batch
        self.rng = np.random.default_rng(seed)
        self.variation = Variation(noise or QUIET, np.random.default_rng(seed + 1))
        self.parameters = np.zeros(vector_size, dtype=np.float32)
        self.gradient = np.zeros(vector_size, dtype=np.float64)
        self._samples = 0
        self.held_step = 0
        self.fingerprint = "sim"
        self.task_fingerprint = SimFingerprint("sim", "the simulated task")
        self.stopping = threading.Event()
        self.torn = False

    @property
    def samples(self) -> int:
        return self._samples

    async def compute(self) -> Computed:
        mean = self.micro_batch / self.samples_per_second
        seconds = self.variation.seconds(mean, trio.current_time())
        await trio.sleep(seconds)
        self.gradient += self.rng.standard_normal(self.vector_size) * self.micro_batch
        self._samples += self.micro_batch
        return Computed(samples=self.micro_batch, loss=1.0, seconds=seconds)

    async def start_take(self) -> tuple[int, Taken]:
        return self._samples, self.take_soon()

    def take_soon(self) -> Taken:
        samples = self._samples
        mean = self.gradient / samples if samples else self.gradient
        taken = (mean.astype(np.float32), samples)
        self.gradient = np.zeros(self.vector_size, dtype=np.float64)
        self._samples = 0
        return Taken(taken)

    async def give_back(self, vector: np.ndarray, samples: int) -> None:
        self.gradient += vector.astype(np.float64) * samples
        self._samples += samples

    async def average_digest(self, average: np.ndarray, weight: float) -> str:
        await trio.sleep(self.candidate_seconds)
        return average_digest(average, weight)

    async def apply(self, average: np.ndarray) -> None:
        self.parameters = (self.parameters - np.float32(LEARNING_RATE) * average).astype(np.float32)

    def digest_of(self, step: int, parameters: np.ndarray) -> str:
        return hashlib.sha256(step.to_bytes(8, "little") + parameters.tobytes()).hexdigest()

    async def hold(self, step: int, *, digest: str | None = None) -> str | None:
        self.held_step = step
        await trio.sleep(self.digest_seconds)
        digest = self.digest_of(step, self.parameters)
        self.on_hold(step, digest)
        return digest

    async def serialize(self) -> Snapshot | None:
        return Snapshot(self.held_step, self.parameters.tobytes())

    async def before_download(self) -> None:
        pass

    async def parse(self, snapshot: Snapshot) -> tuple[SimState, str]:
        await trio.sleep(self.check_seconds)
        blob = snapshot.blob
        assert isinstance(blob, bytes)
        parameters = np.frombuffer(blob, dtype=np.float32)
        if parameters.shape != (self.vector_size,):
            raise RemoteError(f"a state of {parameters.size} values, expected {self.vector_size}")
        return SimState(snapshot.step, parameters.copy()), self.digest_of(snapshot.step, parameters)

    async def restore(self, state: SimState, **_: Any) -> None:
        self.parameters = state.parameters.copy()

    async def validation_loss(self) -> float:
        return 1.0

    async def load_checkpoint(self, directory: Path) -> None:
        return None

    async def save_checkpoint(self, directory: Path, **_: Any) -> None:
        pass
