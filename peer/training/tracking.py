"""Experiment tracking: a peer's training figures, and the user's own metrics, as TensorBoard
scalars (`log.tensorboard_dir`; torch's own `SummaryWriter`, which needs the `tensorboard`
package). Each peer writes under a folder of its own (`peer-<end of its id>`), so TensorBoard
pointed at the directory shows the peers side by side.

    train/loss, train/samples_per_s       this peer's micro-batches (EMA), at each global step
    step/peers, step/global_batch,        the step just applied: its members, its batch, the
    step/allreduce_s, step/averaging_s    all-reduce's seconds and the whole averaging call's
    validation/loss                       at each validation
    user/<name>                           `peertrain.Optimizer.log({name: value})`
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peer.errors import ConfigError

log = logging.getLogger("peertrain.tracking")

#: What a metric's name may be: TensorBoard tags, and JSON log keys.
MAX_NAME = 100


class Tracker:
    """No tracking (the default): every call does nothing."""

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardTracker(Tracker):
    def __init__(self, directory: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard

        # The writer queues events for a thread of its own; the lock keeps two threads' calls
        # (the engine's loop, a user's `log`) from interleaving inside it.
        self._writer = SummaryWriter(log_dir=str(directory), flush_secs=10)
        self._lock = threading.Lock()
        self._closed = False
        self.directory = directory

    def scalars(self, step: int, values: Mapping[str, float | None]) -> None:
        with self._lock:
            if self._closed:  # torch's writer would open a new file that nobody flushes
                log.warning(
                    "TensorBoard scalars after the peer stopped are not written: %s",
                    ", ".join(values),
                )
                return
            for tag, value in values.items():
                if value is not None and math.isfinite(value):
                    self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        with self._lock:
            self._writer.flush()

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._writer.close()


def check_tracking(directory: str) -> None:
    """ConfigError, saying what to do, if `directory` is set and TensorBoard is not installed
    or the directory cannot be made (checked when a peer starts, before it joins)."""
    if not directory:
        return
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it)
    except ImportError:
        raise ConfigError(
            f"log.tensorboard_dir = {directory!r}: TensorBoard is not installed; "
            "pip install tensorboard, or leave log.tensorboard_dir empty"
        ) from None
    try:
        Path(directory).expanduser().mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ConfigError(
            f"log.tensorboard_dir = {directory!r}: cannot create it ({error.strerror}); "
            "choose a directory this user can write"
        ) from None


def open_tracker(directory: str, peer_id: str) -> Tracker:
    """A tracker writing under `directory` (none if empty)."""
    if not directory:
        return Tracker()
    check_tracking(directory)
    return TensorBoardTracker(Path(directory).expanduser() / f"peer-{peer_id[-8:]}")


def user_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The user's metrics as TensorBoard scalars under `user/`; ValueError on a name that is
    not a short string or a value that is not a finite number."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME:
            raise ValueError(f"metric names are strings of 1-{MAX_NAME} characters: {name!r}")
        if hasattr(value, "detach"):  # a 0-d tensor, maybe a loss still in its graph
            value = value.detach()
        try:
            value = float(value)  # also a numpy scalar
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of several
            raise ValueError(f"metric {name!r} = {value!r}: expected a number") from None
        if not math.isfinite(value):
            raise ValueError(f"metric {name!r} = {value!r}: expected a finite number")
        out[f"user/{name}"] = float(value)
    return out


__all__ = ["TensorBoardTracker", "Tracker", "check_tracking", "open_tracker", "user_metrics"]
