"""The default task's text: every Python install's own standard library, read at run time.

No download, and the same bytes on every machine with the same Python: the `.py` sources and
`.txt` documents under the standard library (tests and site-packages left out), in path order.
A file belongs to the validation split when a hash of its relative path falls in the last 5 %,
so the split is stable and no text is in both.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np

SKIP_PARTS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
VALIDATION_PERCENT = 5


@dataclass(frozen=True)
class Corpus:
    train: np.ndarray
    """uint8 bytes of the training split."""
    validation: np.ndarray
    fingerprint: str
    """Hash of both splits: peers whose corpora differ train on different data."""


def _files(root: Path) -> list[Path]:
    return sorted(
        p
        for pattern in ("*.py", "*.txt")
        for p in root.rglob(pattern)
        if p.is_file() and not SKIP_PARTS & set(p.relative_to(root).parts)
    )


def _in_validation(relative: str) -> bool:
    digest = hashlib.blake2b(relative.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") % 100 < VALIDATION_PERCENT


def load_corpus(root: Path | None = None, *, max_bytes: int = 16 << 20) -> Corpus:
    """The standard library's text (at most `max_bytes`), split into train and validation."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    train, validation, total = bytearray(), bytearray(), 0
    for path in _files(root):
        data = path.read_bytes()
        if total + len(data) > max_bytes:
            break
        total += len(data)
        relative = path.relative_to(root).as_posix()
        (validation if _in_validation(relative) else train).extend(data + b"\n")
    if not train or not validation:
        raise FileNotFoundError(f"no usable text under {root} for the default task")
    digest = hashlib.blake2b(bytes(train), digest_size=12)
    digest.update(bytes(validation))
    return Corpus(
        np.frombuffer(bytes(train), dtype=np.uint8),
        np.frombuffer(bytes(validation), dtype=np.uint8),
        digest.hexdigest(),
    )
