"""Chaos (c): peers SIGKILLed while they write checkpoints, many times, and restarted on the same
checkpoint folder, while a backbone and 4 peers train the default task.

Injected: two victim peers (2 and 3) checkpoint every CHECKPOINT_INTERVAL seconds (the others
every 2 s). Each victim, in its own thread, is killed KILLS_PER_VICTIM times, each time once its
incarnation has caught up and saved the state it caught up to: every other kill is aimed (the
folder is polled every millisecond and the peer is killed the moment a temp file of a checkpoint
being written appears), the others land at a seeded-random moment 0-2 s later. Each kill is
followed by a restart.

Checked after every kill, before the restart:
- every record in the folder is judged by an independent loader (own JSON parsing, size,
  SHA-256, safetensors parse, the payload's step, finite tensors; `invariants.verify_checkpoints`)
  and `checkpoint.load_latest`, run on a copy of the folder, returns exactly the newest
  checkpoint that loader accepts, or None when it accepts none: never a damaged one;
- the kill lost no committed checkpoint: the newest intact checkpoint is at least as new (by
  serial) as the newest record seen in the folder before the kill (the checkpoint module's
  promise: a kill at any moment of a save loses at most that save);
and after the restart: the new incarnation logs `resumed from the checkpoint of step N` with N
the step of that checkpoint, or no resume at all when there was none.
Then the invariants every scenario checks (tests/chaos/invariants.py). Reported: kills, how many
landed mid-write (a temp file or a payload without its record left behind), the resume steps.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import threading
import time
from pathlib import Path

import pytest

from peer.files import TEMP_PREFIX
from tests.chaos.harness import GPT_ENV, ChaosCollaboration, free_port
from tests.chaos.invariants import (
    check_all,
    check_checkpoint_folder,
    regressions,
    verify_checkpoints,
)
from tests.collab_processes import Proc

pytestmark = pytest.mark.chaos

SEED = 77
MAX_STEPS = 70
MARGIN_STEPS = 12
VICTIMS = (2, 3)
KILLS_PER_VICTIM = 6
CHECKPOINT_INTERVAL = 0.25
#: As in test_peer_churn: ~10 s per step at worst, times 6 for a shared 2-core machine.
WINDOW = 60.0
_RESUMED = re.compile(r"^resumed from the checkpoint of step (\d+)$")
_PAYLOAD = re.compile(r"step-(\d+)(?:-\d+)?\.safetensors")  # step-N-S (S: the save)
_RECORD = re.compile(r"step-(\d+)\.json")


def newest_record(folder: Path) -> tuple[int, int] | None:
    """(serial, step) of the folder's newest checkpoint record, read cheaply (the JSON only):
    a record exists only once its payload was committed."""
    newest = None
    with contextlib.suppress(OSError):
        for path in folder.iterdir():
            if not _RECORD.fullmatch(path.name):
                continue
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                record = json.loads(path.read_bytes())
                found = (int(record["serial"]), int(record["step"]))
                newest = found if newest is None else max(newest, found)
    return newest


def litter(folder: Path) -> dict[str, list[str]]:
    """What a kill mid-save leaves: temp files, and payloads that no record names."""
    if not folder.exists():
        return {"temps": [], "orphans": []}
    names = {p.name for p in folder.iterdir()}
    recorded = set()
    for name in names:  # the payloads the records name
        if _RECORD.fullmatch(name):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                recorded.add(str(json.loads((folder / name).read_bytes())["file"]))
    return {
        "temps": sorted(n for n in names if n.startswith(TEMP_PREFIX)),
        "orphans": sorted(n for n in names if _PAYLOAD.fullmatch(n) and n not in recorded),
    }


def resume_of(collab: ChaosCollaboration, proc: Proc, timeout: float) -> tuple[str, int | None]:
    """What this incarnation did with its checkpoints: ("resumed", step), or ("none", None)
    once its trainer logs any other line first; ("unknown", None) if it logged neither within
    `timeout` seconds or exited."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for record in collab.own_records(proc):
            if record.get("logger") != "peertrain.trainer":
                continue
            match = _RESUMED.match(record.get("msg", ""))
            return ("resumed", int(match.group(1))) if match else ("none", None)
        if proc.popen.poll() is not None:
            break
        time.sleep(0.2)
    return ("unknown", None)


def test_sigkill_during_checkpoint_writes(tmp_path):
    rng = random.Random(SEED)
    collab = ChaosCollaboration(
        tmp_path, {**GPT_ENV, "PEERTRAIN_TRAINING_MAX_STEPS": str(MAX_STEPS)}
    )
    victim_env = {"PEERTRAIN_TRAINING_CHECKPOINT_INTERVAL": str(CHECKPOINT_INTERVAL)}
    kills: list[dict] = []
    problems: list[str] = []
    figures: dict = {}
    failures = ["the run ended before its checks"]
    lock = threading.Lock()
    stop = threading.Event()

    def torment(index: int, seed: int) -> None:
        """Kill and restart one victim KILLS_PER_VICTIM times (runs in its own thread)."""
        rng = random.Random(seed)
        folder = collab.checkpoint_dir(index)
        started_at_step, found = 0, newest_record(folder)
        for n in range(KILLS_PER_VICTIM):
            if stop.is_set() or collab.global_step() >= MAX_STEPS - MARGIN_STEPS:
                return
            # Let this incarnation catch up and save the state it caught up to (a kill before
            # it would only ever hit re-saves of the state it resumed from).
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and not stop.is_set():
                newest = newest_record(folder)
                if newest and newest != found and newest[1] >= started_at_step:
                    break
                time.sleep(0.05)
            # Kill, watching the newest committed record until the kill (1 ms polls).
            committed = newest_record(folder)
            aimed = n % 2 == 0
            deadline = time.monotonic() + (20 if aimed else rng.uniform(0.0, 2.0))
            while time.monotonic() < deadline:
                now = newest_record(folder)
                committed = max(filter(None, (committed, now)), default=None)
                if aimed and litter(folder)["temps"]:
                    break  # a checkpoint is being written: kill now (a payload takes ~30 ms)
                time.sleep(0.001)
            collab.kill(peers[index])
            left = litter(folder)
            verdicts, expected = verify_checkpoints(folder)
            copy = tmp_path / f"after-kill-{index}-{n}"
            if folder.exists():
                shutil.copytree(folder, copy)
            else:
                copy.mkdir()
            try:
                loader = check_checkpoint_folder(copy)
            except AssertionError as error:
                with lock:
                    problems.append(f"peer{index} kill {n}: {error}")
                loader = None
            listing = sorted(p.name for p in copy.iterdir())
            shutil.rmtree(copy)  # ~20 MB a kill
            if committed and (expected is None or expected.serial < committed[0]):
                with lock:
                    problems.append(
                        f"peer{index} kill {n}: the kill lost the committed checkpoint of step "
                        f"{committed[1]} (serial {committed[0]}); left: "
                        f"{listing}, newest intact: {expected}"
                    )
            started_at_step = collab.global_step()
            with lock:
                peers[index] = collab.start_peer(index, victim_env)
            found = newest_record(folder)
            outcome = resume_of(collab, peers[index], timeout=120)
            want = ("resumed", expected.step) if expected else ("none", None)
            if outcome != want:
                with lock:
                    problems.append(
                        f"peer{index} kill {n}: expected {want}, the peer did {outcome}"
                    )
            with lock:
                kills.append(
                    {
                        "peer": index,
                        "aimed": aimed,
                        "global_step": started_at_step,
                        "committed_before": committed,
                        "mid_write": bool(left["temps"] or left["orphans"]),
                        "left": left,
                        "records": len(verdicts),
                        "rejected": [v.why for v in verdicts if not v.valid],
                        "expected_resume": expected.step if expected else None,
                        "resumed": outcome,
                        "loader": loader,
                    }
                )

    try:
        backbone = collab.start_backbone_on(free_port())
        peers = {i: collab.start_peer(i, victim_env if i in VICTIMS else None) for i in range(4)}
        collab.watch_global_step()
        assert collab.wait_for_step(1, timeout=180), "training never reached step 1"
        collab.note("step 1 reached")
        threads = [
            threading.Thread(target=torment, args=(i, rng.randrange(2**32)), daemon=True)
            for i in VICTIMS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        stop.set()
        assert not any(t.is_alive() for t in threads), "a victim's thread did not finish"
        figures, failures = check_all(collab, peers, backbone, max_steps=MAX_STEPS, window=WINDOW)
        failures += problems
        if len(kills) < len(VICTIMS) * KILLS_PER_VICTIM // 2:
            failures.append(f"only {len(kills)} kills before the end")
    finally:
        stop.set()
        collab.close()
        collab.report(
            "c: kills during checkpoint writes",
            seed=SEED,
            kills=len(kills),
            kills_mid_write=sum(k["mid_write"] for k in kills),
            resumed_from_a_checkpoint=sum(k["resumed"][0] == "resumed" for k in kills),
            failures=failures,
            kill_details=kills,
            regressions=regressions(collab),
            **figures,
        )
    assert not failures, failures
