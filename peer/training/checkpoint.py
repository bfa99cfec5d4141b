"""Atomic local checkpoints: a SIGKILL or power cut at any moment of a save loses at most that save.

Layout of a checkpoint directory (one per collaboration and task):

    step-140-9.safetensors the state of step 140 (safetensors), written by save number 9
    step-140.json          its commit record: {"format": 2, "file": "step-140-9.safetensors",
                           "step": 140, "serial": 9, "bytes": ..., "crc32": ...[, "extra": {...}]}
    step-120-7.safetensors an older checkpoint (the `keep` newest are kept)
    step-120.json
    .lock                  flock()ed by the process that is saving
    .tmp-*                 a file being written (or left by a writer that was killed)

The payload is opaque here: `save_blob` / `load_latest_blob` store bytes and an optional JSON
object (`extra`, e.g. the keeper's certified digest and signatures) in the record, and
`save_checkpoint` / `load_latest` are those for a `TrainingState`, streamed from its tensors to
the file and mapped back from it (`state.write_file` / `state.from_file`: no whole-state blob). A
record without "extra" is exactly what versions before it wrote, and loads as before.

Theory of operation. A checkpoint exists once its record exists: each checkpoint has its own
record, so there is no single file whose loss loses them all. The newest checkpoint is the intact
one with the highest `serial` (the order of saves, not of steps: a peer that adopts a collaboration's
state may save a lower step than an old checkpoint, and that save is still its newest).
`save_blob`, holding the lock:

 1. deletes temp files;
 2. writes the payload to a temp file, fsyncs it, renames it to step-N-S.safetensors (S: this
    save's serial, so it never replaces a payload a record names), fsyncs the directory;
 3. writes the record step-N.json the same way (this rename is the commit; saving a step again
    replaces its record in one rename, and until then the old record and payload stand);
 4. deletes the records beyond the `keep` newest, then payloads that no record names (theirs,
    a replaced one, or one left by a kill between 2 and 3).

rename(2) replaces a name atomically, so a reader sees the old file or the new one, never half a
file; the fsync before it makes the contents durable before the name points at them, and the
directory fsync makes the rename itself durable. Killed before 3's rename, no record names the new
payload and the old records and payloads are untouched; killed during 4, a record is always gone
before its payload, so no record names a missing file. Hence after a kill `load_latest_blob` finds
the newest committed checkpoint without falling back. It still checks each record's fields and
types, its payload's size and checksum (bit rot, hand edits, a disk that lied about fsync) and what
the caller's `parse` makes of it, and falls back to older checkpoints, with a warning, if the
newest is damaged: a hand-edited file never makes it raise.

The checksum is a CRC-32 (format 2; format 1 records, with a SHA-256, still load). It guards
against accidents (bit rot, a torn or truncated file, a hand edit), as torch.save's own CRC-32s
do; a cryptographic hash would add nothing here, since whoever can rewrite the payload can
rewrite the record beside it, and it cost more than the write itself (SHA-256 runs at about
1 GB/s on the machines of docs/benchmarks.md, CRC-32 at over 2). A state's authenticity is the
certified digest's business (`peer.training.certificate`), checked wherever a state is taken
from another peer.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, overload

from peer.errors import ConfigError, ProtocolError
from peer.files import (
    Sink,
    fsync_directory,
    remove_temps,
    write_atomically,
    write_atomically_with,
)
from peer.training.state import WRITE_PIECE_BYTES, TrainingState, from_file, write_file

log = logging.getLogger("peertrain.checkpoint")

FORMAT = 2
LOCK = ".lock"
_RECORD = re.compile(r"step-(0|[1-9][0-9]*)\.json")
# step-N-S (S: the save's serial); step-N from before serials were in the name.
_PAYLOAD = re.compile(r"step-(0|[1-9][0-9]*)(-[1-9][0-9]*)?\.safetensors")
#: A record's keys by format (besides "extra"), the last its checksum's.
_KEYS = {
    1: frozenset({"format", "file", "step", "serial", "bytes", "sha256"}),
    2: frozenset({"format", "file", "step", "serial", "bytes", "crc32"}),
}
#: Bytes read at a time when a payload is checked.
_PIECE = 16 << 20

T = TypeVar("T")


class _Damaged(ValueError):
    """A payload that does not match its record."""


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint whose payload matched its record (size and checksum) when read."""

    step: int
    path: Path
    """The payload (a safetensors state, for `save_checkpoint`)."""
    extra: dict[str, Any] | None
    """The record's `extra` as given to `save_blob`; None if none was."""
    serial: int
    """The save's number in this directory (newer saves, higher serials)."""

    @property
    def blob(self) -> bytes:
        """The payload's bytes as saved (read from disk at each access)."""
        return self.path.read_bytes()


def save_checkpoint(
    directory: Path,
    state: TrainingState,
    *,
    keep: int = 2,
    cancelled: Callable[[], bool] = lambda: False,
    written: Callable[[str], None] = lambda name: None,
    piece_bytes: int = WRITE_PIECE_BYTES,
) -> Path:
    """Write `state` as the newest checkpoint in `directory` (created if missing), keep the `keep`
    newest, and return the payload's path. The payload is streamed from the state's tensors
    (`state.write_file`, which calls `written(name)` once a tensor is on its way, and writes
    `piece_bytes` at a time). ConfigError if the directory cannot be written; WriteCancelled if
    `cancelled()` turned true before the payload was written (nothing changed on disk but a temp
    file, removed)."""

    def write(file: Sink) -> int:
        return write_file(
            state, file, cancelled=cancelled, written=written, piece_bytes=piece_bytes
        )

    return _save(directory, state.step, write, extra=None, keep=keep)


def save_blob(
    directory: Path,
    step: int,
    blob: bytes,
    *,
    extra: dict[str, Any] | None = None,
    keep: int = 2,
) -> Path:
    """Write `blob` (the state of `step`) as the newest checkpoint in `directory` (created if
    missing), with `extra` (JSON-able) in its record, keep the `keep` newest, and return the
    payload's path. ConfigError if the directory cannot be written."""
    crc32 = zlib.crc32(blob)  # before taking the lock: the slow part

    def write(file: Sink) -> int:
        file.write(blob)
        return crc32

    return _save(directory, step, write, extra=extra, keep=keep)


def _save(
    directory: Path,
    step: int,
    write: Callable[[Sink], int],
    *,
    extra: dict[str, Any] | None,
    keep: int,
) -> Path:
    """The save protocol of the module docstring; `write(file)` writes the payload and returns
    its CRC-32."""
    assert keep >= 1, keep
    assert step >= 0, step
    name = f"step-{step}"
    record: dict[str, Any] = {"format": FORMAT, "step": step}
    if extra is not None:
        record["extra"] = extra

    def payload(file: Sink) -> None:
        record["crc32"] = write(file)
        record["bytes"] = file.tell()

    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _locked(directory, blocking=True):
            remove_temps(directory)
            records = _records(directory)
            record["serial"] = max((r["serial"] for r in records.values()), default=0) + 1
            record["file"] = f"{name}-{record['serial']}.safetensors"
            # Around the page cache: gigabytes written once, read back only to resume.
            write_atomically_with(directory, record["file"], payload, direct=True)
            write_atomically(directory, f"{name}.json", json.dumps(record).encode())
            records[f"{name}.json"] = record
            _prune(directory, records, keep)
    except OSError as error:
        raise ConfigError(
            f"cannot write checkpoints to {str(directory)!r} ({error.strerror or error}): make it "
            "writable, free some space, or set training.checkpoint_dir to another folder"
        ) from error
    return directory / record["file"]


def load_latest(directory: Path) -> TrainingState | None:
    """The newest intact checkpoint in `directory`, or None if there is none.

    Damaged checkpoints are skipped with a warning; this raises only ConfigError, when the
    directory exists but cannot be listed."""
    return load_latest_blob(directory, parse=_training_state)


def _training_state(checkpoint: Checkpoint) -> TrainingState:
    state = from_file(checkpoint.path)
    if state.step != checkpoint.step:
        raise _Damaged(f"holds step {state.step}, the record says {checkpoint.step}")
    return state


@overload
def load_latest_blob(directory: Path) -> Checkpoint | None: ...
@overload
def load_latest_blob(directory: Path, *, parse: Callable[[Checkpoint], T]) -> T | None: ...
def load_latest_blob(
    directory: Path, *, parse: Callable[[Checkpoint], Any] | None = None
) -> Any | None:
    """The newest intact checkpoint in `directory` (`parse` of it, if given), or None if there is
    none.

    `parse` raises ValueError or ProtocolError (e.g. StateMismatch) on a checkpoint it rejects
    (a payload it cannot read, an `extra` of the wrong shape): it is skipped like a damaged one.
    Damaged checkpoints are skipped with a warning; this raises only ConfigError, when the
    directory exists but cannot be listed."""
    if not directory.exists():
        return None
    try:
        with _locked(directory, blocking=False) as locked:
            if locked:  # no save in progress: its temp files are litter
                remove_temps(directory)
    except OSError:
        pass  # a read-only directory: leave the litter for the next save
    try:
        records = _records(directory, warn=True)
    except OSError as error:
        raise ConfigError(
            f"cannot read checkpoints in {str(directory)!r} ({error.strerror or error}): make it "
            "readable or set training.checkpoint_dir to another folder"
        ) from error
    for record_name, record in sorted(records.items(), key=lambda item: -item[1]["serial"]):
        try:
            checkpoint = _load(directory, record)
            return checkpoint if parse is None else parse(checkpoint)
        except (OSError, ValueError, ProtocolError) as error:
            log.warning("checkpoint %s is damaged (%s); trying an older one", record_name, error)
    if records:
        log.warning("no intact checkpoint in %s; starting without one", directory)
    return None


def _load(directory: Path, record: dict[str, Any]) -> Checkpoint:
    """The record's checkpoint, its payload checked piece by piece (no whole-file blob)."""
    path = directory / record["file"]
    sha256 = hashlib.sha256() if record["format"] == 1 else None
    crc32, size = 0, 0
    with path.open("rb") as file:
        while piece := file.read(_PIECE):
            if sha256 is None:
                crc32 = zlib.crc32(piece, crc32)
            else:
                sha256.update(piece)
            size += len(piece)
    if size != record["bytes"]:
        raise _Damaged(f"{size} bytes, the record says {record['bytes']}")
    if sha256 is not None and sha256.hexdigest() != record["sha256"]:
        raise _Damaged("sha256 differs from the record")
    if sha256 is None and crc32 != record["crc32"]:
        raise _Damaged("crc32 differs from the record")
    return Checkpoint(record["step"], path, record.get("extra"), record["serial"])


def _records(directory: Path, *, warn: bool = False) -> dict[str, dict[str, Any]]:
    """{file name: record} of the well-formed records in `directory`."""
    records = {}
    for path in directory.iterdir():
        match = _RECORD.fullmatch(path.name)
        if not match:
            continue
        try:
            record = json.loads(path.read_bytes())
            step = int(match.group(1))
            if not isinstance(record, dict):
                raise ValueError("expected a JSON object")
            version = record.get("format")
            keys = _KEYS.get(version) if type(version) is int else None
            if keys is None:
                raise ValueError(f"unknown format {version!r} (expected one of {sorted(_KEYS)})")
            if set(record) - {"extra"} != keys:
                raise ValueError(f"expected an object with keys {sorted(keys)} (and 'extra')")
            checksum = record.get("crc32", record.get("sha256"))
            if (
                record["step"] != step
                or type(record["serial"]) is not int
                or record["file"]
                not in (f"step-{step}-{record['serial']}.safetensors", f"step-{step}.safetensors")
                or type(record["bytes"]) is not int
                or not (
                    isinstance(checksum, str)
                    if version == 1
                    else type(checksum) is int and 0 <= checksum < 1 << 32
                )
                or not isinstance(record.get("extra", {}), dict)
            ):
                raise ValueError(f"unexpected values {record!r}")
        except (OSError, ValueError) as error:  # JSONDecodeError is a ValueError
            if warn:
                log.warning("checkpoint record %s is damaged (%s); ignoring it", path.name, error)
            continue
        records[path.name] = record
    return records


def _prune(directory: Path, records: dict[str, dict[str, Any]], keep: int) -> None:
    newest = sorted(records, key=lambda name: -records[name]["serial"])
    kept = {records[name]["file"] for name in newest[:keep]}
    for name in newest[keep:]:
        # The record goes first: a record must never name a missing payload.
        (directory / name).unlink(missing_ok=True)
    fsync_directory(directory)  # or a power cut could keep a record and lose its payload
    for path in directory.iterdir():
        is_record = _RECORD.fullmatch(path.name) and path.name not in records  # damaged
        if is_record or (_PAYLOAD.fullmatch(path.name) and path.name not in kept):
            path.unlink(missing_ok=True)
    fsync_directory(directory)


@contextlib.contextmanager
def _locked(directory: Path, *, blocking: bool) -> Iterator[bool]:
    """Hold the directory's flock (True), or yield False if not `blocking` and it is taken.

    The kernel drops the lock when its holder dies, so a killed writer never leaves it held."""
    descriptor = os.open(directory / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(descriptor)
