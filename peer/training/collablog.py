"""The collaboration's training in a backbone's log: a line each time the global step moves,
read from the public progress records (the figures `peer status` shows): the step, the
trainers at it, their mean loss, the collaboration's samples/s and the time per step. JSON
logs carry them as `collaboration` (for a log shipper or a plot); nothing here is trusted:
they are the records' claims, summarised as `peer status` summarises them."""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import trio

from peer.config import PeerConfig
from peer.dht.node import DHT
from peer.errors import RemoteError
from peer.status import TrainingSummary, summarise_training
from peer.training.progress import published_quorum
from peer.training.publisher import ProgressReader

log = logging.getLogger("peertrain.collaboration")


#: Reads in a row below the highest step seen after which the collaboration is taken to have
#: gone back (restarted from an older checkpoint, or a forged high step has expired).
GONE_BACK_READS = 3


@dataclass
class StepClock:
    """Seconds per global step, from when each new step was first seen (pure)."""

    step: int | None = None
    at: float | None = None
    lower_reads: int = 0

    def observe(self, step: int, now: float) -> tuple[bool, float | None]:
        """Whether `step` is new, and the seconds per step since the last new one (None: the
        first seen, or the collaboration went back)."""
        if self.step is not None and step < self.step:
            self.lower_reads += 1
            if self.lower_reads < GONE_BACK_READS:
                return False, None  # a stale read, most likely
            self.step, self.at, self.lower_reads = step, now, 0
            return True, None
        self.lower_reads = 0
        if self.step is not None and step == self.step:
            return False, None
        per_step = None
        if self.step is not None and self.at is not None:
            per_step = (now - self.at) / (step - self.step)
        self.step, self.at = step, now
        return True, per_step


def summary_fields(summary: TrainingSummary, step_seconds: float | None) -> dict[str, object]:
    # Other peers' claims; the JSON formatter writes a non-finite one as null (`logs.finite`).
    return {
        "step": summary.global_step,
        "trainers": summary.trainers,
        "trainers_behind": summary.trainers_behind,
        "loss": summary.loss,
        "samples_per_s": round(summary.samples_per_s, 1),
        "step_s": None if step_seconds is None else round(step_seconds, 2),
        "validation": list(summary.validation) if summary.validation else None,
    }


def summary_line(name: str, fields: dict[str, object]) -> str:
    loss = fields["loss"]
    step_s = fields["step_s"]
    return (
        f"collaboration {name!r}: step {fields['step']}, {fields['trainers']} trainers at it "
        f"({fields['trainers_behind']} behind), loss "
        + (f"{loss:.4f}" if isinstance(loss, float) and math.isfinite(loss) else "-")
        + f", {fields['samples_per_s']} samples/s, "
        + (f"{step_s} s per step" if step_s is not None else "first step seen")
    )


async def log_collaboration(
    dht: DHT,
    config: PeerConfig,
    *,
    clock: Callable[[], float] = trio.current_time,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Every `log.collaboration_interval` seconds, read the progress records; log a line when
    the global step has moved."""
    name = config.collaboration.name
    seen = StepClock()
    reader = ProgressReader(dht, name, hot=False)
    task_status.started()
    while True:
        with contextlib.suppress(RemoteError):  # no answer this time: the next read
            progress = (await reader.read()).records
            quorum = published_quorum(progress, config.averaging.min_group_size)
            summary = summarise_training(progress, None, quorum=quorum)
            if summary is not None and summary.global_step > 0:
                new, per_step = seen.observe(summary.global_step, clock())
                if new:
                    fields = summary_fields(summary, per_step)
                    log.info(summary_line(name, fields), extra={"collaboration": fields})
        await trio.sleep(config.log.collaboration_interval)


__all__ = ["StepClock", "log_collaboration", "summary_fields", "summary_line"]
