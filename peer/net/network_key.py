"""The pre-shared key of a private collaboration (libp2p private network, "pnet").

With `collaboration.network_key = FILE`, every libp2p connection is wrapped in Salsa20 under
this key before the Noise handshake, so a machine without the key cannot complete a handshake
with any member: it can write no DHT record, join no averaging group, call no RPC (state
manifests included) and so get no state-download ticket (docs/SECURITY.md). The file holds 64
hex digits (32 random bytes), mode 0600, like an identity key; `backbone network-key FILE`
makes one, and the owner hands it to every authorised machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from peer.errors import IdentityError
from peer.files import fsync_directory
from peer.net.identity import read_key_file

KEY_BYTES = 32


def create_network_key(path: Path) -> None:
    """Write a fresh key to `path` (mode 0600); refuses to overwrite an existing file."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise IdentityError(
            f"network key {path} exists; every member holds that key, so keep it (or remove it "
            f"first to make a new one, and hand the new one to every member)"
        ) from None
    except OSError as error:
        raise IdentityError(f"cannot create network key {path}: {error.strerror}") from None
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(KEY_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_directory(path.parent)
    except OSError as error:
        with contextlib.suppress(OSError):
            path.unlink()
        raise IdentityError(f"cannot write network key {path}: {error.strerror}") from None


def load_network_key(setting: str) -> str | None:
    """The key (64 hex digits) named by `collaboration.network_key`; None if it is empty."""
    if not setting:
        return None
    path = Path(setting).expanduser()
    fix = "ask the collaboration's owner for the key file, or make one with `backbone network-key FILE`"
    data = read_key_file(path, what="network key", fix=fix)
    try:
        key = bytes.fromhex(data.decode("ascii", errors="replace").strip())
    except ValueError:
        key = b""
    if len(key) != KEY_BYTES:
        raise IdentityError(
            f"network key {path} is malformed (expected {2 * KEY_BYTES} hex digits); {fix}"
        )
    return key.hex()
