"""Durable file writes: a reader (or a restart after SIGKILL) sees the old file or the new one,
never half of one."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TypeVar

T = TypeVar("T")

TEMP_PREFIX = ".tmp-"


def write_atomically(directory: Path, name: str, data: bytes) -> None:
    """Write `data` to directory/name: temp file, fsync, rename, fsync the directory."""
    write_atomically_with(directory, name, lambda file: file.write(data))


def write_atomically_with(directory: Path, name: str, write: Callable[[BinaryIO], T]) -> T:
    """`write_atomically`, the contents written by `write(file)`; returns what it returns."""
    descriptor, temp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=directory)
    try:
        with os.fdopen(descriptor, "wb") as file:
            result = write(file)
            file.flush()
            os.fsync(file.fileno())  # contents on disk before the name points at them
        os.replace(temp, directory / name)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    fsync_directory(directory)  # the rename itself on disk
    return result


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def remove_temps(directory: Path) -> None:
    """Delete temp files a killed writer left behind."""
    for path in directory.glob(f"{TEMP_PREFIX}*"):
        path.unlink(missing_ok=True)


def state_folder(root: str, collaboration: str, name: str) -> Path:
    """root/<collaboration>-<name>: one folder per collaboration and task, so the states of
    different models never mix."""
    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{collaboration}-{name}")
    return Path(root).expanduser() / safe
