"""`peertrain.Optimizer`: a training loop of one's own as a peer (`peer.embed`)."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.request

import numpy as np
import pytest
import torch

import peertrain
from peer.config import PeerConfig, TrainingConfig
from peer.embed.rendezvous import Rendezvous
from peer.embed.worker import LoopTask, LoopWorker, Pacer
from peer.training import state as states
from peer.training.strategies import LargeBatch
from peer.training.task import TinyTask
from peer.training.worker import Computed
from tests.collab_processes import BASE_ENV, ROOT, Collaboration
from tests.test_tracking import scalars

# ---------------------------------------------------------------- the pieces


def test_the_rendezvous_runs_queued_work_in_the_stepping_thread_in_order():
    rendezvous = Rendezvous()
    ran: list[tuple[str, int]] = []
    first = rendezvous.submit(lambda: ran.append((threading.current_thread().name, 1)) or 1)
    failing = rendezvous.submit(lambda: 1 / 0)
    last = rendezvous.submit(lambda: ran.append((threading.current_thread().name, 3)) or 3)
    assert not first.done()  # nothing runs until the loop steps
    worker = threading.Thread(target=rendezvous.run_pending, name="the-loop")
    worker.start()
    worker.join(5)
    assert ran == [("the-loop", 1), ("the-loop", 3)]
    assert first.result() == 1 and last.result() == 3
    with pytest.raises(ZeroDivisionError):
        failing.result()
    rendezvous.shutdown(cancel_futures=True)
    with pytest.raises(RuntimeError):
        rendezvous.submit(lambda: None)


def test_gradients_of_a_loop_of_its_own_add_up_as_the_daemon_s_sums():
    """Two micro-batches through `add_gradients` (the loop's mean-loss backward, then its
    sample count) hand over the same vector as the daemon's own accumulation."""
    task = TinyTask()
    generator = torch.Generator().manual_seed(3)
    batches = [(task.sample_batch(n, generator), n) for n in (8, 24)]
    daemon = LargeBatch(task, task.build_model())
    loop = LargeBatch(task, task.build_model(), own_sums=True)
    assert daemon.in_grad and not loop.in_grad
    for batch, n in batches:
        daemon.accumulate(batch, n)
        task.loss(loop.model, batch).backward()  # what the user's loop does
        loop.add_gradients(n)
        assert all(p.grad is None for p in loop.model.parameters())
    (ours, samples), (theirs, expected) = loop.take(), daemon.take()
    assert samples == expected == 32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"training.precision": "fp16"}, "torch.autocast in your loop"),
        ({"training.delayed_updates": True}, "not supported"),
        ({"training.validation_interval": 5}, "validate in your loop"),
        ({"task.target_batch": -1}, "task.target_batch"),
    ],
)
def test_settings_the_loop_cannot_honour_are_one_line_errors_before_joining(config, says):
    model = TinyTask().build_model()
    with pytest.raises(peertrain.ConfigError, match=says) as caught:
        peertrain.Optimizer(model, torch.optim.SGD(model.parameters()), backbones=[], config=config)
    assert "\n" not in str(caught.value)


def test_the_loop_computes_only_what_the_engine_asks_for():
    """`Pacer`: the loop's step returns once the engine asks for the next micro-batch, and the
    engine's ask returns with the loop's samples once it has stepped."""
    pacer = Pacer()
    assert not pacer.may_compute()  # nothing asked yet: the loop waits
    asked: list[Computed] = []
    engine = threading.Thread(target=lambda: asked.append(pacer.compute()))
    engine.start()
    while not pacer.may_compute():  # the ask arrives
        pacer.wait(1.0)
    pacer.step(16, 2.5, computed_at=time.perf_counter())
    engine.join(10)
    assert [(c.samples, c.loss) for c in asked] == [(16, 2.5)]
    assert not pacer.may_compute()  # stepped; no new ask: the loop's next micro-batch waits
    pacer.close()
    assert pacer.may_compute()  # an ended engine holds nothing back
    assert pacer.compute().samples == 0


def loop_worker() -> tuple[LoopWorker, TinyTask]:
    task = TinyTask()
    model = task.build_model()
    loop_task = LoopTask("tiny", model, task.make_optimizer(model.parameters()))
    worker = LoopWorker(
        loop_task, PeerConfig(), device=torch.device("cpu"), peer_id="p", rendezvous=Rendezvous()
    )
    worker.pacer.close()  # no engine here to ask for micro-batches: nothing holds the loop
    return worker, task


def test_a_step_applied_in_the_loop_s_step_leaves_its_gradient_to_add():
    """The engine's step is applied through .grad, inside `opt.step()` after the loop's
    backward: the loop's gradient must survive it (it was consumed, its samples counted)."""
    worker, task = loop_worker()
    batch = task.sample_batch(8, torch.Generator().manual_seed(1))
    task.loss(worker.model, batch).backward()
    expected = [p.grad.clone() * 8 for p in worker.model.parameters()]
    worker.rendezvous.submit(worker._apply, np.zeros(worker.vector_size, np.float32))
    worker.step(8, None)
    assert worker.samples == 8
    for total, want in zip(worker.strategy.sums, expected, strict=True):
        torch.testing.assert_close(total, want)


def test_an_amp_scaled_gradient_counts_unscaled_and_an_overflow_not_at_all():
    worker, task = loop_worker()
    reference = task.build_model()
    reference.load_state_dict(worker.model.state_dict())
    batch = task.sample_batch(8, torch.Generator().manual_seed(1))
    task.loss(reference, batch).backward()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(task.loss(worker.model, batch)).backward()
    worker.step(8, None, scaler=scaler)
    assert worker.samples == 8
    for total, p in zip(worker.strategy.sums, reference.parameters(), strict=True):
        torch.testing.assert_close(total, p.grad * 8)
    # An overflow: nothing of it counts, and the scaler backs off.
    scaler.scale(task.loss(worker.model, batch)).backward()
    next(worker.model.parameters()).grad[0, 0] = float("inf")
    worker.step(8, None, scaler=scaler)
    assert worker.samples == 8
    assert scaler.get_scale() == 512.0
    assert all(p.grad is None for p in worker.model.parameters())
    # The usual recipe for clipping: the loop unscales first; counted once, not unscaled twice.
    scaler.scale(task.loss(worker.model, batch)).backward()
    scaler.unscale_(worker.strategy.optimizer)
    worker.step(8, None, scaler=scaler)
    assert worker.samples == 16


def test_a_diloco_inner_step_that_overflowed_is_skipped_and_not_counted():
    task = TinyTask()
    model = task.build_model()
    config = PeerConfig(training=TrainingConfig(mode="diloco", inner_steps=4))
    loop_task = LoopTask("tiny", model, task.make_optimizer(model.parameters()))
    worker = LoopWorker(
        loop_task, config, device=torch.device("cpu"), peer_id="p", rendezvous=Rendezvous()
    )
    worker.pacer.close()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    batch = task.sample_batch(8, torch.Generator().manual_seed(1))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(task.loss(model, batch)).backward()
    next(model.parameters()).grad[0, 0] = float("nan")
    worker.step(8, None, scaler=scaler)
    assert worker.samples == 0  # not one of the H inner steps
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    scaler.scale(task.loss(model, batch)).backward()
    worker.step(8, None, scaler=scaler)
    assert worker.samples == 8
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_gradient_computed_before_a_state_load_is_dropped():
    worker, task = loop_worker()
    task.loss(worker.model, task.sample_batch(8, torch.Generator().manual_seed(1))).backward()
    # A state loaded (the one we hold, restored as a resume restores a checkpoint).
    state = states.capture(
        0,
        worker.model,
        worker.strategy.optimizers(),
        scheduler_state=worker.strategy.schedule.state(),
    )
    worker.rendezvous.submit(worker._load, state, False, None)
    worker.step(8, None)
    assert worker.samples == 0
    assert all(float(total.abs().sum()) == 0 for total in worker.strategy.sums)
    assert all(p.grad is None for p in worker.model.parameters())


# ---------------------------------------------------------------- with a `peer join`

ENV = {
    "PEERTRAIN_TASK_NAME": "tiny",
    "PEERTRAIN_TASK_MICRO_BATCH": "16",
    "PEERTRAIN_TASK_TARGET_BATCH": "128",
    "PEERTRAIN_TRAINING_GATHER_WINDOW": "1.0",
    "PEERTRAIN_TRAINING_PROGRESS_INTERVAL": "0.5",
    "PEERTRAIN_TRAINING_VALIDATION_INTERVAL": "0",
}
STEPS = 3


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.parametrize("mode", ["dedloc", pytest.param("diloco", marks=pytest.mark.slow)])
def test_a_plain_loop_and_a_peer_join_train_together(tmp_path, monkeypatch, caplog, mode):
    """The issue's bar: a plain PyTorch loop with `peertrain.Optimizer` and a `peer join` of the
    same task take the same collaborative steps on loopback."""
    caplog.set_level(logging.INFO, logger="peertrain")
    env = {
        **ENV,
        "PEERTRAIN_TRAINING_MODE": mode,
        "PEERTRAIN_TRAINING_INNER_STEPS": "4",
        "PEERTRAIN_LOG_COLLABORATION_INTERVAL": "0.5",
        "PEERTRAIN_DASHBOARD_PORT": str(free_port()),
        "PEERTRAIN_DASHBOARD_INTERVAL": "0.5",
    }
    for key, value in {**BASE_ENV, **env}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    collab = Collaboration(tmp_path, env)
    opt = None
    try:
        backbone = collab.start_backbone()
        peer = collab.start_peer(0)
        task = TinyTask()
        model = task.build_model()
        opt = peertrain.Optimizer(
            model,
            task.make_optimizer(model.parameters()),
            backbones=[collab.backbone_addr],
            name=task.name,  # the same task as `peer join --task tiny`
            mode=mode,
            inner_steps=4,
            batch_size=16,
            target_batch=128,
            config={
                "identity.path": str(tmp_path / "loop.key"),
                "training.checkpoint_dir": str(tmp_path / "loop-checkpoints"),
                "log.tensorboard_dir": str(tmp_path / "tensorboard"),
            },
            startup_timeout=90,
        )
        generator = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
        deadline = time.monotonic() + 120
        while opt.global_step < STEPS and time.monotonic() < deadline:
            batch = task.sample_batch(16, generator)
            loss = task.loss(model, batch)
            loss.backward()
            opt.step(batch_size=16, loss=loss)
            opt.zero_grad()
            opt.log({"loss_seen_by_the_loop": loss})
            time.sleep(0.01)  # a micro-batch's worth of time, as a real loop spends
        reached = opt.global_step
        # The backbone's dashboard, live from the records: a point per step, both trainers.
        port = env["PEERTRAIN_DASHBOARD_PORT"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/state", timeout=10) as reply:
            dashboard = json.load(reply)
    finally:
        if opt is not None:
            opt.shutdown()
        collab.close()
    log = peer.log.read_text(errors="replace")
    # The backbone's log follows the collaboration: both trainers, their loss, the pace.
    seen = [r["collaboration"] for r in backbone.records() if "collaboration" in r]
    assert any(c["trainers"] == 2 and c["step_s"] and c["loss"] is not None for c in seen), seen
    assert reached >= STEPS, log[-3000:]
    steps = [r for r in peer.records() if "applied" in r]
    together = [r["applied"]["step"] for r in steps if r["applied"]["peers"] == 2]
    assert len(together) >= STEPS - 1, log[-3000:]  # the first may have been the peer's alone
    # The loop's side of the same steps: its engine applied them with both peers' samples.
    ours = [r.applied for r in caplog.records if hasattr(r, "applied")]
    assert {a["step"] for a in ours if a["peers"] == 2} & set(together), (ours, together)
    steps_drawn = [step for step, _ in dashboard["loss"]]
    assert steps_drawn[-1] >= STEPS - 1 and steps_drawn == list(range(1, steps_drawn[-1] + 1))
    assert sum(row["progress_role"] == "trainer" for row in dashboard["peers"]) == 2
    # Its TensorBoard scalars: the engine's figures at each step, and the loop's own metric.
    written = scalars(tmp_path / "tensorboard")
    assert {"train/loss", "step/peers", "step/global_batch"} <= written.keys(), written.keys()
    assert max(step for step, _ in written["step/peers"]) >= STEPS
    assert written["user/loss_seen_by_the_loop"]
    # The loop's own samples in them (a step the other peer's samples filled alone may have
    # none of ours: the engine asked the loop for no micro-batch then).
    assert sum(a["samples"] for a in ours if a["peers"] == 2) > 0, ours


def test_no_backbone_is_a_one_line_error_from_the_engine(tmp_path):
    model = TinyTask().build_model()
    with pytest.raises(peertrain.RemoteError, match="no backbone given") as caught:
        peertrain.Optimizer(
            model,
            torch.optim.SGD(model.parameters()),
            backbones=[],
            config={"identity.path": str(tmp_path / "k")},
            startup_timeout=30,
        )
    assert "\n" not in str(caught.value)


@pytest.mark.slow  # 45 s: three engines in one process
def test_loops_train_on_a_schedule_and_a_late_loop_downloads_their_state(
    tmp_path, monkeypatch, caplog
):
    """Two loops (each an Optimizer in this process, its loop in a thread of its own) train on
    a learning-rate schedule; a third joins late: its constructor returns holding their step
    (a certified state download), and it then trains with them."""
    caplog.set_level(logging.INFO, logger="peertrain")
    for key, value in {**BASE_ENV, **ENV}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(ROOT)
    collab = Collaboration(tmp_path, ENV)
    task = TinyTask()
    opts: list[peertrain.Optimizer] = []
    stop = threading.Event()

    def join(name: str) -> tuple[peertrain.Optimizer, torch.nn.Module]:
        model = task.build_model()
        opt = peertrain.Optimizer(
            model,
            task.make_optimizer(model.parameters()),
            backbones=[collab.backbone_addr],
            name="tiny-loop",
            batch_size=16,
            target_batch=64,
            scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
            config={
                "identity.path": str(tmp_path / f"{name}.key"),
                "training.checkpoint_dir": str(tmp_path / f"{name}-checkpoints"),
            },
            startup_timeout=90,
        )
        opts.append(opt)
        return opt, model

    def train(opt: peertrain.Optimizer, model: torch.nn.Module, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        deadline = time.monotonic() + 150
        while not stop.is_set() and not opt.finished and time.monotonic() < deadline:
            task.loss(model, task.sample_batch(16, generator)).backward()
            opt.step(batch_size=16)
            opt.zero_grad()

    loops: list[threading.Thread] = []

    def start(opt_and_model: tuple[peertrain.Optimizer, torch.nn.Module], seed: int) -> None:
        loops.append(threading.Thread(target=train, args=(*opt_and_model, seed)))
        loops[-1].start()

    try:
        collab.start_backbone()
        first, second = join("a"), join("b")
        start(first, 1)
        start(second, 2)
        deadline = time.monotonic() + 120
        while first[0].global_step < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        late = join("c")  # returns once it holds the collaboration's state
        joined_at = late[0].global_step
        assert joined_at >= 2
        assert any("downloaded the state of step" in r.getMessage() for r in caplog.records)
        start(late, 3)
        while late[0].global_step < joined_at + 1 and time.monotonic() < deadline + 60:
            time.sleep(0.2)
        stop.set()
        for loop in loops:
            loop.join(30)
        together = [
            r.applied for r in caplog.records if hasattr(r, "applied") and r.applied["peers"] == 3
        ]
        assert together, "the late loop never averaged with the other two"
        # The schedule stepped once per global step on every peer, the late one included.
        base = task.make_optimizer(task.build_model().parameters()).param_groups[0]["lr"]
        for opt in opts:
            lr = opt.optimizer.param_groups[0]["lr"]
            assert lr == pytest.approx(base / (1 + opt.global_step)), (lr, opt.global_step)
    finally:
        stop.set()
        for opt in opts:
            opt.shutdown()
        collab.close()
