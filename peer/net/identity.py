"""Persistent Ed25519 identity: the key file that makes a peer id stable across restarts.

The file holds the raw 32-byte Ed25519 seed (`Ed25519PrivateKey.to_bytes()`), mode 0600. A
second daemon on the same key would announce the same peer id from two places and confuse every
routing table, so the daemon holds an exclusive `flock` on `<key>.lock` while it runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from libp2p.crypto.ed25519 import Ed25519PrivateKey, create_new_key_pair
from libp2p.crypto.keys import KeyPair
from libp2p.peer.id import ID

from peer.errors import IdentityError
from peer.files import fsync_directory

__all__ = [
    "KEY_BYTES",
    "Identity",
    "IdentityLock",
    "ephemeral_identity",
    "hold_identity",
    "load_or_create_identity",
    "read_key_file",
]

KEY_BYTES = 32


@dataclass(frozen=True, kw_only=True)
class Identity:
    key_pair: KeyPair
    """Signs noise handshakes and records."""
    peer_id: ID
    """Derived from the public key; what other peers know us by."""
    path: Path | None
    """Key file it was loaded from; None for a throw-away identity (e.g. `peer status`)."""


def ephemeral_identity() -> Identity:
    """A throw-away identity with no key file (`peer status`, a backbone's dial-back host)."""
    key_pair = create_new_key_pair()
    return Identity(key_pair=key_pair, peer_id=ID.from_pubkey(key_pair.public_key), path=None)


def load_or_create_identity(path: Path) -> Identity:
    """Load the key at `path`, creating it (and its directory, 0700) on first run."""
    path = Path(path)
    if not path.exists():
        _create_key_file(path)
    return _load_key_file(path)


def read_key_file(path: Path, *, what: str, fix: str) -> bytes:
    """The bytes of a secret key file, which must be a regular file only its owner can read;
    else an IdentityError naming `what` and saying `fix`."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):
            raise IdentityError(f"{what} {path} is not a regular file; {fix}")
        if st.st_mode & 0o077:
            raise IdentityError(
                f"{what} {path} is accessible by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); run `chmod 600 {path}`"
            )
        return path.read_bytes()
    except OSError as error:
        raise IdentityError(f"cannot read {what} {path}: {error.strerror}; {fix}") from error


def _load_key_file(path: Path) -> Identity:
    data = read_key_file(
        path,
        what="identity key",
        fix="fix its permissions or pass --identity with another key file",
    )
    if len(data) != KEY_BYTES:
        raise IdentityError(
            f"identity key {path} is malformed ({len(data)} bytes, expected a {KEY_BYTES}-byte "
            f"Ed25519 key); restore it from a backup, or move it away to create a new identity"
        )
    private = Ed25519PrivateKey.from_bytes(data)
    key_pair = KeyPair(private, private.get_public_key())
    return Identity(key_pair=key_pair, peer_id=ID.from_pubkey(key_pair.public_key), path=path)


def _create_key_file(path: Path) -> None:
    """Write a fresh key atomically: no reader ever sees a partial file, and a concurrent first
    run by another process keeps whichever key landed first (link() never overwrites)."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        seed = create_new_key_pair().private_key.to_bytes()
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(seed)
                f.flush()
                os.fsync(f.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_directory(path.parent)  # a crash must not lose the key
    except OSError as error:
        raise IdentityError(
            f"cannot create identity key {path}: {error.strerror}; pass --identity with a "
            f"writable location"
        ) from error


class IdentityLock:
    """Exclusive hold of a key file for a daemon's lifetime (`flock` on `<key>.lock`).

    `flock` locks belong to the open file description, so a second `IdentityLock` on the same key
    conflicts even within one process; the kernel drops the lock if the process dies.
    """

    def __init__(self, key_path: Path) -> None:
        self.key_path = Path(key_path)
        self.lock_path = self.key_path.with_name(f"{self.key_path.name}.lock")
        self._fd: int | None = None

    def __enter__(self) -> IdentityLock:
        assert self._fd is None, "IdentityLock is not reentrant"
        try:
            fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o600)
        except OSError as error:
            raise IdentityError(
                f"cannot open lock file {self.lock_path}: {error.strerror}; pass --identity with "
                f"a key file in a writable directory"
            ) from error
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_pid(fd)
            os.close(fd)
            raise IdentityError(
                f"identity key {self.key_path} is already used by a running daemon "
                f"(pid {holder}); stop it or pass --identity with another key file"
            ) from None
        # The file keeps the holder's pid only so the error above can name it.
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        # Not unlinked: another process may already have the same inode open and be waiting.
        os.ftruncate(fd, 0)
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def hold_identity(identity: Identity) -> IdentityLock:
    """The lock on `identity`'s key file, to use as `with hold_identity(identity): ...`."""
    if identity.path is None:
        raise ValueError("a throw-away identity has no key file to lock")
    return IdentityLock(identity.path)


def _read_pid(fd: int) -> str:
    # The holder writes its pid right after locking; an empty file means it is mid-way.
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return text if text.isdigit() else "unknown"
