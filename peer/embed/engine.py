"""The peer daemon in a background thread of its own, for a training loop of the user's own.

`peer join` runs `run_daemon` under trio in the main thread; `peertrain.Optimizer` runs the
same `run_daemon` here, in a thread, so that a plain synchronous loop can train: one
implementation, two faces. The loop and the engine meet only through the worker
(`LoopWorker`): its steps feed the engine, and the engine's work on the model runs in them.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time

import torch
import trio

from peer.config import PeerConfig
from peer.daemon import OwnLoop, run_daemon
from peer.embed.rendezvous import Rendezvous
from peer.embed.worker import SERVE_INTERVAL, LoopTask, LoopWorker
from peer.errors import PeertrainError, UserError, find_error
from peer.training.trainer import Trainer

log = logging.getLogger("peertrain.engine")


class EngineStopped(UserError):
    """The engine ended (its error, if any, is the cause): the loop cannot step any more."""


class Engine:
    def __init__(self, config: PeerConfig, task: LoopTask, device: torch.device) -> None:
        self.config = config
        self.rendezvous = Rendezvous()
        self.worker: LoopWorker | None = None
        self.trainer: Trainer | None = None
        self.error: BaseException | None = None
        self._own_loop = OwnLoop(task, device, self._make_worker)
        self._token: trio.lowlevel.TrioToken | None = None
        self._stop: trio.Event | None = None
        self._thread = threading.Thread(target=self._main, name="peertrain-engine", daemon=True)
        self._built = threading.Event()  # the worker exists

    def _make_worker(
        self, task: LoopTask, config: PeerConfig, *, device: torch.device, peer_id: str
    ) -> LoopWorker:
        self.worker = LoopWorker(
            task, config, device=device, peer_id=peer_id, rendezvous=self.rendezvous
        )
        self._built.set()
        return self.worker

    def _on_trainer(self, trainer: Trainer) -> None:
        self.trainer = trainer

    def start(self, timeout: float) -> None:
        """Join the collaboration; return once the engine asks for the loop's first
        micro-batch (after its first read and any state download, loaded in this thread
        meanwhile). Raises the engine's error (a PeertrainError: one line that says what to
        do) or TimeoutError."""
        self._thread.start()
        deadline = time.monotonic() + timeout

        def given_up() -> bool:
            return not self._thread.is_alive() or time.monotonic() > deadline

        # Joining, building the worker (this is the loop's thread, not the engine's loop).
        while not self._built.wait(SERVE_INTERVAL) and not given_up():
            pass
        if self.worker is not None:
            self.worker.wait_turn(until=given_up)
            if self.worker.pacer.closed:  # the engine is ending: its error, not a timeout
                self._thread.join(SERVE_INTERVAL * 100)
        if not self._thread.is_alive():
            raise self._ended()
        if self.worker is None or not self.worker.pacer.asked:
            self.stop()
            raise TimeoutError(
                f"not training within {timeout:g} s: check the backbone addresses and that "
                "a backbone is running (or give a longer startup_timeout)"
            )

    @property
    def finished(self) -> bool:
        """The collaboration's training is done here (max_steps or the target reached)."""
        return self.trainer is not None and self.trainer.finished.is_set()

    def _ended(self) -> PeertrainError:
        if isinstance(self.error, PeertrainError):
            return self.error
        if self.error is None:
            return EngineStopped(
                "the collaboration's training is finished (or this peer was stopped): "
                "create a new Optimizer to train again"
            )
        stopped = EngineStopped(
            f"peertrain's engine failed ({type(self.error).__name__}: {self.error}); "
            "create a new Optimizer to join again"
        )
        stopped.__cause__ = self.error
        return stopped

    def check(self) -> None:
        """Raise if the engine has ended (training done, stopped, or failed)."""
        if self._thread.ident is not None and not self._thread.is_alive():
            raise self._ended()

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as error:  # handed to the loop's thread, and said now
            self.error = find_error(error) or error
            if isinstance(self.error, PeertrainError):
                log.error("%s", self.error)
            else:
                log.error("peertrain's engine failed", exc_info=self.error)
        finally:
            if self.worker is not None:
                self.worker.pacer.close()

    async def _run(self) -> None:
        self._token = trio.lowlevel.current_trio_token()
        self._stop = trio.Event()
        await run_daemon(
            self.config,
            self._stop,
            role="peer",
            on_trainer=self._on_trainer,
            own_loop=self._own_loop,
        )

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine (its final checkpoint too), serving the work it still queues for
        the model meanwhile; idempotent."""
        if self._token is not None and self._stop is not None and self._thread.is_alive():
            with contextlib.suppress(trio.RunFinishedError):  # it ended meanwhile
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        deadline = time.monotonic() + timeout
        while self._thread.is_alive() and time.monotonic() < deadline:
            if self.worker is not None:
                self.worker.serve()  # under the step lock: never beside the loop's own step
            else:
                self.rendezvous.run_pending()
            self._thread.join(SERVE_INTERVAL)
        if self._thread.is_alive():
            log.warning(
                "peertrain's engine did not stop within %g s; it ends with the process", timeout
            )
        self.rendezvous.shutdown(cancel_futures=True)


__all__ = ["Engine", "EngineStopped"]
