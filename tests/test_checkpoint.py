"""Atomic checkpoints: round trips, pruning, falling back past damage, and SIGKILL at random moments."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import random
import re
import signal
import stat
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from peer.errors import ConfigError
from peer.training.checkpoint import (
    Checkpoint,
    load_latest,
    load_latest_blob,
    save_blob,
    save_checkpoint,
)
from peer.training.state import TrainingState, WriteCancelled, capture, restore, to_bytes

ROOT = Path(__file__).resolve().parent.parent


def state_of(step: int) -> TrainingState:
    model = nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.fill_(step)
    return capture(step, model, {"sgd": optimizer}, extra={"step": step})


def files(directory: Path) -> list[str]:
    """The checkpoint files, payload names without their save serial (step-3-7 -> step-3)."""
    return sorted(
        re.sub(r"-[0-9]+\.safetensors$", ".safetensors", p.name)
        for p in directory.iterdir()
        if p.name != ".lock"
    )


def payload(directory: Path, step: int) -> Path:
    """The payload file the record of `step` names."""
    return directory / json.loads((directory / f"step-{step}.json").read_text())["file"]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "peertrain.checkpoint"]


def test_round_trip(tmp_path):
    directory = tmp_path / "a" / "b"
    assert load_latest(directory) is None
    path = save_checkpoint(directory, state_of(3))
    assert path == directory / "step-3-1.safetensors"  # step 3, the first save
    assert files(directory) == ["step-3.json", "step-3.safetensors"]
    loaded = load_latest(directory)
    assert loaded is not None and loaded.step == 3 and loaded.extra == {"step": 3}
    assert to_bytes(loaded) == to_bytes(state_of(3))


def test_keeps_the_newest_and_prunes_the_rest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, state_of(step), keep=2)
    assert files(tmp_path) == [f"step-{s}.{e}" for s in (4, 5) for e in ("json", "safetensors")]
    save_checkpoint(tmp_path, state_of(6), keep=1)
    assert files(tmp_path) == ["step-6.json", "step-6.safetensors"]


def test_the_newest_save_wins_even_with_a_lower_step(tmp_path):
    save_checkpoint(tmp_path, state_of(9))
    save_checkpoint(tmp_path, state_of(4))  # e.g. adopted a younger collaboration's state
    assert load_latest(tmp_path).step == 4
    save_checkpoint(tmp_path, state_of(5))
    assert files(tmp_path) == [f"step-{s}.{e}" for s in (4, 5) for e in ("json", "safetensors")]


def test_saving_a_step_again_replaces_it(tmp_path):
    save_checkpoint(tmp_path, state_of(2))
    save_checkpoint(tmp_path, state_of(3))
    changed = state_of(3)
    changed.metadata["extra"] = {"again": True}
    save_checkpoint(tmp_path, changed)
    assert load_latest(tmp_path).extra == {"again": True}
    assert files(tmp_path) == [f"step-{s}.{e}" for s in (2, 3) for e in ("json", "safetensors")]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:10])


@pytest.mark.parametrize(
    ("damage", "file", "message"),
    [
        (_flip_a_byte, "payload", "crc32"),
        (_truncate, "payload", "bytes"),
        (Path.unlink, "payload", "No such file"),
        (_truncate, "step-3.json", "record step-3.json is damaged"),
    ],
)
def test_damage_to_the_newest_falls_back_to_the_older(tmp_path, caplog, damage, file, message):
    save_checkpoint(tmp_path, state_of(2))
    save_checkpoint(tmp_path, state_of(3))
    damage(payload(tmp_path, 3) if file == "payload" else tmp_path / file)
    with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
        loaded = load_latest(tmp_path)
    assert loaded is not None and loaded.step == 2
    assert any(message in w for w in warnings(caplog)), warnings(caplog)


def test_nothing_intact_gives_none(tmp_path, caplog):
    save_checkpoint(tmp_path, state_of(2))
    _flip_a_byte(payload(tmp_path, 2))
    with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
        assert load_latest(tmp_path) is None
    assert any("no intact checkpoint" in w for w in warnings(caplog))


def test_litter_of_a_killed_writer_is_cleaned_up(tmp_path):
    save_checkpoint(tmp_path, state_of(1))
    (tmp_path / ".tmp-abc").write_bytes(b"half a checkpoint")
    assert load_latest(tmp_path).step == 1
    assert files(tmp_path) == ["step-1.json", "step-1.safetensors"]
    (tmp_path / ".tmp-def").write_bytes(b"half a checkpoint")
    (tmp_path / "step-2.safetensors").write_bytes(b"committed payload, no record yet")
    save_checkpoint(tmp_path, state_of(3))
    assert files(tmp_path) == [f"step-{s}.{e}" for s in (1, 3) for e in ("json", "safetensors")]


class Crash(BaseException):
    """The writer died (a BaseException: nothing on the way up handles it)."""


@contextlib.contextmanager
def crashing_at(point: int) -> Iterator[list[str]]:
    """Die at the `point`-th durable step of a save (fsync, rename, unlink; -1: never) and
    yield the steps seen. Dying at an fsync first cuts that file to half: it was only partly
    written. Once dead, every later step raises too: a killed process runs no cleanup."""
    seen: list[str] = []
    real_fsync, real_replace, real_unlink = os.fsync, os.replace, os.unlink

    def step(what: str) -> None:
        seen.append(what)
        if 0 <= point < len(seen):
            raise Crash(what)

    def fsync(descriptor: int) -> None:
        if len(seen) == point and stat.S_ISREG(os.fstat(descriptor).st_mode):
            os.ftruncate(descriptor, os.fstat(descriptor).st_size // 2)
        step("fsync")
        real_fsync(descriptor)

    def replace(source: Any, target: Any) -> None:
        step(f"rename to {Path(target).name}")
        real_replace(source, target)

    def unlink(path: Any) -> None:  # Path.unlink calls os.unlink
        step(f"unlink {Path(path).name}")
        real_unlink(path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "fsync", fsync)
        patch.setattr(os, "replace", replace)
        patch.setattr(os, "unlink", unlink)
        yield seen


def _changed(state: TrainingState) -> TrainingState:
    state.metadata["extra"] = {"again": True}
    return state


@pytest.mark.parametrize(
    ("saving", "acceptable"),
    [
        pytest.param(state_of(3), (state_of(2), state_of(3)), id="a new step"),
        # Saving step 2 again: the old step 2 stands until the new record replaces it.
        pytest.param(
            _changed(state_of(2)), (state_of(2), _changed(state_of(2))), id="a step again"
        ),
    ],
)
def test_a_crash_at_any_point_of_a_save_keeps_the_old_or_the_new_checkpoint(
    tmp_path, caplog, saving, acceptable
):
    """The deterministic twin of the SIGKILL test below: a crash at each point of a save in turn,
    including while a file is half written."""
    with crashing_at(-1) as steps:  # count the points of a save that also prunes
        save_checkpoint(tmp_path / "count", state_of(1))
        save_checkpoint(tmp_path / "count", state_of(2))
        steps.clear()
        save_checkpoint(tmp_path / "count", saving)
    assert len(steps) >= 8, steps  # two writes (fsync, rename, fsync dir), an unlink, an fsync
    for point, where in enumerate(steps):
        directory = tmp_path / f"crash-{point}"
        save_checkpoint(directory, state_of(1))
        save_checkpoint(directory, state_of(2))
        with pytest.raises(Crash), crashing_at(point):
            save_checkpoint(directory, saving)

        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
            loaded = load_latest(directory)
        assert warnings(caplog) == [], f"crash at {where}"
        assert loaded is not None, f"crash at {where}"
        assert to_bytes(loaded) in {to_bytes(s) for s in acceptable}, f"crash at {where}"
        for record in directory.glob("step-*.json"):  # not even an older record is dangling
            assert (directory / json.loads(record.read_text())["file"]).exists(), where
        save_checkpoint(directory, state_of(4))  # and the next save cleans up after the crash
        kept = [f"step-{s}.{e}" for s in sorted({loaded.step, 4}) for e in ("json", "safetensors")]
        assert files(directory) == kept, f"crash at {where}"


def test_a_crash_while_saving_the_only_checkpoint_again_keeps_it(tmp_path):
    """Found by the chaos suite: the old design deleted step N's record before writing step N
    again, so a kill in between lost the only checkpoint a peer had."""
    with crashing_at(-1) as steps:
        save_checkpoint(tmp_path / "count", state_of(1))
        steps.clear()
        save_checkpoint(tmp_path / "count", _changed(state_of(1)))
    for point, where in enumerate(steps):
        directory = tmp_path / f"crash-{point}"
        save_checkpoint(directory, state_of(1))
        with pytest.raises(Crash), crashing_at(point):
            save_checkpoint(directory, _changed(state_of(1)))
        loaded = load_latest(directory)
        assert loaded is not None, f"crash at {where}"
        assert to_bytes(loaded) in {to_bytes(state_of(1)), to_bytes(_changed(state_of(1)))}


def test_checkpoints_named_before_serials_still_load(tmp_path):
    save_checkpoint(tmp_path, state_of(5))
    record = json.loads((tmp_path / "step-5.json").read_text())
    (tmp_path / record["file"]).rename(tmp_path / "step-5.safetensors")
    record["file"] = "step-5.safetensors"
    (tmp_path / "step-5.json").write_text(json.dumps(record))
    assert load_latest(tmp_path).step == 5
    save_checkpoint(tmp_path, state_of(6), keep=1)  # prunes the old-style payload too
    assert files(tmp_path) == ["step-6.json", "step-6.safetensors"]


def test_a_blob_round_trips_with_its_extra_metadata(tmp_path):
    extra = {"digest": "d7", "signatures": [["signer", "00ff"]], "nested": {"n": [1, 2.5, None]}}
    path = save_blob(tmp_path, 7, b"opaque bytes", extra=extra)
    assert path == tmp_path / "step-7-1.safetensors"
    assert path.read_bytes() == b"opaque bytes"  # as given: nothing parses it on the way
    loaded = load_latest_blob(tmp_path)
    assert loaded == Checkpoint(7, path, extra, serial=1)
    assert loaded.blob == b"opaque bytes"
    assert json.loads((tmp_path / "step-7.json").read_text())["extra"] == extra
    path = save_blob(tmp_path, 8, b"more bytes")
    assert load_latest_blob(tmp_path) == Checkpoint(8, path, None, serial=2)
    assert path.read_bytes() == b"more bytes"


def test_records_of_format_1_with_a_sha256_still_load(tmp_path):
    """Format 2 records a CRC-32 (the SHA-256 took longer than writing the payload); format 1
    records, exactly as written before (no `extra`, a SHA-256), load from users' disks and are
    checked against their SHA-256."""
    save_checkpoint(tmp_path, state_of(5))
    record = json.loads((tmp_path / "step-5.json").read_text())
    assert set(record) == {"format", "file", "step", "serial", "bytes", "crc32"}
    data = payload(tmp_path, 5).read_bytes()
    assert record["format"] == 2 and record["crc32"] == zlib.crc32(data)
    old = {
        "format": 1,
        "file": "step-6-4.safetensors",
        "step": 6,
        "serial": 4,
        "bytes": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
    }
    (tmp_path / "step-6-4.safetensors").write_bytes(data)
    (tmp_path / "step-6.json").write_text(json.dumps(old))
    loaded = load_latest_blob(tmp_path)
    assert loaded == Checkpoint(6, tmp_path / "step-6-4.safetensors", None, serial=4)
    assert loaded.blob == data
    # The payload holds step 5, the record says 6: the blob API does not look inside, but
    # load_latest does, and falls back to step 5.
    assert load_latest(tmp_path).step == 5
    # A format 1 payload that does not match its SHA-256 is damaged.
    _flip_a_byte(tmp_path / "step-6-4.safetensors")
    assert load_latest_blob(tmp_path) == Checkpoint(5, payload(tmp_path, 5), None, serial=1)


def _set(key: str, value: Any) -> Callable[[Path], None]:
    """An edit of a record by hand: `key` set to `value`."""

    def edit(path: Path) -> None:
        record = json.loads(path.read_text())
        record[key] = value
        path.write_text(json.dumps(record))

    return edit


def _add_a_key(path: Path) -> None:
    record = json.loads(path.read_text())
    record["comment"] = "hand edited"
    path.write_text(json.dumps(record))


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (_set("extra", "a string"), "unexpected values"),
        (_set("extra", [1, 2]), "unexpected values"),
        (_set("extra", None), "unexpected values"),
        (_add_a_key, "expected an object with keys"),
        (_flip_a_byte, "crc32"),
        (_set("format", [1]), "unknown format [1]"),
        (_set("format", 3), "unknown format 3"),
        (_set("format", 1), "expected an object with keys"),  # a format 2 record's keys
    ],
)
def test_a_damaged_blob_record_falls_back_to_the_older(tmp_path, caplog, damage, message):
    save_blob(tmp_path, 2, b"state 2", extra={"digest": "d2"})
    save_blob(tmp_path, 3, b"state 3", extra={"digest": "d3"})
    damage(payload(tmp_path, 3) if damage is _flip_a_byte else tmp_path / "step-3.json")
    with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
        loaded = load_latest_blob(tmp_path)
    assert loaded == Checkpoint(2, payload(tmp_path, 2), {"digest": "d2"}, serial=1)
    assert loaded.blob == b"state 2"
    assert any(message in w for w in warnings(caplog)), warnings(caplog)


def test_a_checkpoint_that_parse_rejects_falls_back_to_the_older(tmp_path, caplog):
    save_blob(tmp_path, 2, b"state 2", extra={"digest": "d2"})
    save_blob(tmp_path, 3, b"state 3", extra={"digest": 3})  # e.g. a hand edit

    def digest_of(checkpoint: Checkpoint) -> str:
        digest = (checkpoint.extra or {}).get("digest")
        if not isinstance(digest, str):
            raise ValueError(f"digest {digest!r}, expected a string")
        return digest

    with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
        assert load_latest_blob(tmp_path, parse=digest_of) == "d2"
    assert any("step-3.json is damaged (digest 3" in w for w in warnings(caplog))
    save_blob(tmp_path, 4, b"not a state")  # what load_latest cannot parse
    assert load_latest(tmp_path) is None  # StateMismatch for each: skipped, never raised


def test_an_unwritable_directory_is_a_config_error(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match=r"training\.checkpoint_dir") as raised:
        save_checkpoint(tmp_path / "file" / "checkpoints", state_of(1))
    assert "\n" not in str(raised.value)


# A writer that saves checkpoints of growing steps as fast as it can, resuming from the newest.
# It imports torch (seconds) before waiting for "go", so the next writer starts up while the test
# works with the current one. 8 MB of parameters: a save takes long enough to be killed mid-write.
WRITER = """
import sys
from pathlib import Path

import torch
from torch import nn

from peer.training.checkpoint import load_latest, save_checkpoint
from peer.training.state import capture

directory, report = Path(sys.argv[1]), open(sys.argv[2], "w", buffering=1)
model = nn.Linear(1024, 2048, bias=False)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sys.stdin.readline()
latest = load_latest(directory)
step = 0 if latest is None else latest.step
print("ready", step, file=report)
while True:
    step += 1
    with torch.no_grad():
        model.weight.fill_(step)
    state = capture(step, model, {"sgd": optimizer})
    print("saving", step, file=report)
    save_checkpoint(directory, state, keep=2)
    print("saved", step, file=report)
"""


def _start_writer(directory: Path, report: Path) -> subprocess.Popen[bytes]:
    with report.with_suffix(".err").open("wb") as errors:  # the child keeps its own copy
        return subprocess.Popen(
            [sys.executable, "-c", WRITER, str(directory), str(report)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=errors,
        )


def _wait_for_ready(process: subprocess.Popen[bytes], report: Path) -> None:
    limit = time.monotonic() + 120  # a bound, not a timing assertion: startup is ~2 s
    while not (report.exists() and report.read_text().startswith("ready")):
        if process.poll() is not None or time.monotonic() > limit:
            error = report.with_suffix(".err").read_text()
            pytest.fail(f"writer did not start (exit {process.returncode}): {error}")
        time.sleep(0.01)


def test_sigkill_at_random_moments_never_leaves_a_corrupt_newest_checkpoint(tmp_path, caplog):
    directory = tmp_path / "checkpoints"
    rng = random.Random(1)
    last_saved = 0  # the highest step any writer reported saved
    kills_mid_save = 0
    rounds = 8
    processes: list[subprocess.Popen[bytes]] = []
    try:
        processes.append(_start_writer(directory, tmp_path / "report-0"))
        for round_ in range(rounds):
            writer, report = processes[round_], tmp_path / f"report-{round_}"
            if round_ + 1 < rounds:
                processes.append(_start_writer(directory, tmp_path / f"report-{round_ + 1}"))
            assert writer.stdin is not None
            writer.stdin.write(b"go\n")
            writer.stdin.flush()
            _wait_for_ready(writer, report)
            time.sleep(rng.uniform(0, 0.3))
            os.kill(writer.pid, signal.SIGKILL)
            writer.wait()

            lines = [line.split() for line in report.read_text().splitlines()]
            saved = [int(step) for word, step in lines if word == "saved"]
            started = [int(step) for word, step in lines if word == "saving"]
            in_progress = started[-1] if started and started[-1] not in saved else None
            kills_mid_save += in_progress is not None
            last_saved = max([last_saved, *saved])

            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="peertrain.checkpoint"):
                state = load_latest(directory)
            # A kill never damages a committed checkpoint, so there is nothing to fall back from.
            assert warnings(caplog) == []
            if state is None:
                assert last_saved == 0, f"round {round_}: step {last_saved} was saved, got None"
                continue
            assert state.step in {last_saved, in_progress}, (round_, state.step, lines[-3:])
            model = nn.Linear(1024, 2048, bias=False)
            restore(state, model, {"sgd": torch.optim.SGD(model.parameters(), lr=0.1)})
            assert torch.all(model.weight == state.step)
            last_saved = state.step
            assert not list(directory.glob(".tmp-*")), "load_latest leaves no litter"
    finally:
        for process in processes:
            if process.poll() is None:
                os.kill(process.pid, signal.SIGKILL)
            process.wait()
            if process.stdin is not None:
                process.stdin.close()
    assert last_saved > 0, "no writer ever finished a save"
    print(f"{kills_mid_save} of {rounds} kills landed mid-save")


def test_a_save_cancelled_midway_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, state_of(1))
    asked = []

    def cancelled() -> bool:
        asked.append(1)
        return len(asked) > 3  # three pieces written, then given up

    with pytest.raises(WriteCancelled, match="cut short after"):
        save_checkpoint(tmp_path, state_of(2), cancelled=cancelled, piece_bytes=256)
    assert load_latest(tmp_path).step == 1
    assert files(tmp_path) == ["step-1.json", "step-1.safetensors"]  # no temp file left
