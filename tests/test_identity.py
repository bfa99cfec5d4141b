"""Identity key file: creation, permissions, stable peer id, and the single-daemon lock."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from libp2p.crypto.ed25519 import Ed25519PrivateKey

from peer.errors import IdentityError, UserError
from peer.net.identity import (
    Identity,
    IdentityLock,
    hold_identity,
    load_or_create_identity,
)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_run_creates_private_key_and_dir(tmp_path: Path) -> None:
    path = tmp_path / "new" / "peer.key"
    identity = load_or_create_identity(path)
    assert identity.path == path
    assert mode(path) == 0o600
    assert mode(path.parent) & 0o077 == 0
    assert len(path.read_bytes()) == 32
    assert [p.name for p in path.parent.iterdir()] == ["peer.key"]  # no temp file left


def test_peer_id_is_stable_across_loads(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    first = load_or_create_identity(path)
    second = load_or_create_identity(path)
    assert first.peer_id == second.peer_id
    assert first.key_pair.public_key.to_bytes() == second.key_pair.public_key.to_bytes()
    assert second.peer_id.to_base58().startswith("12D3KooW")  # Ed25519 ids, inlined pubkey


def test_key_signs_and_matches_file(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    identity = load_or_create_identity(path)
    private = Ed25519PrivateKey.from_bytes(path.read_bytes())
    signature = private.sign(b"hello")
    assert identity.key_pair.public_key.verify(b"hello", signature)


def test_different_files_give_different_ids(tmp_path: Path) -> None:
    a = load_or_create_identity(tmp_path / "a.key")
    b = load_or_create_identity(tmp_path / "b.key")
    assert a.peer_id != b.peer_id


def test_malformed_key(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    path.write_bytes(b"short")
    path.chmod(0o600)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(path)
    message = str(info.value)
    assert str(path) in message and "5 bytes" in message and "32-byte" in message
    assert "\n" not in message and isinstance(info.value, UserError)


def test_key_readable_by_others(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    load_or_create_identity(path)
    path.chmod(0o644)
    with pytest.raises(IdentityError) as info:
        load_or_create_identity(path)
    assert f"chmod 600 {path}" in str(info.value)
    assert "0644" in str(info.value)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_key(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    load_or_create_identity(path)
    path.chmod(0o000)
    with pytest.raises(IdentityError, match="cannot read identity key"):
        load_or_create_identity(path)


def test_key_path_is_a_directory(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="not a regular file"):
        load_or_create_identity(tmp_path)


def test_lock_conflicts_within_one_process(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path / "peer.key")
    with hold_identity(identity):
        assert (tmp_path / "peer.key.lock").read_text().strip() == str(os.getpid())
        with pytest.raises(IdentityError) as info, hold_identity(identity):
            pass
        assert str(info.value) == (
            f"identity key {identity.path} is already used by a running daemon "
            f"(pid {os.getpid()}); stop it or pass --identity with another key file"
        )
    # Released on exit: a new holder gets it.
    with IdentityLock(tmp_path / "peer.key"):
        pass


def test_lock_released_after_error_in_body(tmp_path: Path) -> None:
    identity = load_or_create_identity(tmp_path / "peer.key")
    with pytest.raises(RuntimeError), hold_identity(identity):
        raise RuntimeError("daemon crashed")
    with hold_identity(identity):
        pass


def test_lock_conflicts_across_processes(tmp_path: Path) -> None:
    path = tmp_path / "peer.key"
    identity = load_or_create_identity(path)
    child_code = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from peer.net.identity import IdentityLock
        with IdentityLock(Path({str(path)!r})):
            print("held", flush=True)
            sys.stdin.readline()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", child_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "held"
        with pytest.raises(IdentityError) as info, hold_identity(identity):
            pass
        assert f"(pid {child.pid})" in str(info.value)
        assert str(path) in str(info.value)
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(timeout=30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    with hold_identity(identity):  # the child's exit released it
        pass


def test_throwaway_identity_cannot_be_locked(tmp_path: Path) -> None:
    real = load_or_create_identity(tmp_path / "peer.key")
    throwaway = Identity(key_pair=real.key_pair, peer_id=real.peer_id, path=None)
    with pytest.raises(ValueError):
        hold_identity(throwaway)
