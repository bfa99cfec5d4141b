"""Durable writes (`peer.files`): a payload written around the page cache (`DirectFile`) reads
back byte for byte, whatever the sizes of the writes, and falls back to ordinary writes where the
file system refuses O_DIRECT."""

from __future__ import annotations

import errno
import fcntl
import os
import random

import pytest

from peer import files
from peer.files import DIRECT_ALIGN, DirectFile, write_atomically_with


def _direct_supported(directory) -> bool:
    if not getattr(os, "O_DIRECT", 0):
        return False
    probe = directory / "probe"
    probe.touch()
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        probe.unlink()


def _pieces(seed: int) -> list[bytes]:
    """Writes of awkward sizes: empty, one byte, block-sized, crossing a 2-block stage."""
    rng = random.Random(seed)
    sizes = [0, 1, DIRECT_ALIGN, DIRECT_ALIGN - 1, 3 * DIRECT_ALIGN + 5, 17, 2 * DIRECT_ALIGN, 9]
    return [rng.randbytes(size) for size in sizes]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_direct_file_reads_back_exactly_what_was_written(tmp_path, seed):
    pieces = _pieces(seed)
    path = tmp_path / "out"
    path.touch()
    with DirectFile(path, stage_bytes=2 * DIRECT_ALIGN) as file:
        for piece in pieces:
            assert file.write(memoryview(piece)) == len(piece)
        assert file.tell() == sum(map(len, pieces))
    assert path.read_bytes() == b"".join(pieces)  # no padding left at the end


def test_a_direct_write_goes_around_the_page_cache_where_the_system_allows(tmp_path):
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    seen = []

    def write(file) -> None:
        seen.append(fcntl.fcntl(file.fileno(), fcntl.F_GETFL) & os.O_DIRECT)
        file.write(b"x" * 10_000)

    write_atomically_with(tmp_path, "payload", write, direct=True)
    assert seen == [os.O_DIRECT]
    assert (tmp_path / "payload").read_bytes() == b"x" * 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["payload"]  # no temp file left


def test_a_file_system_that_refuses_o_direct_at_open_gets_ordinary_writes(tmp_path, monkeypatch):
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(files.os, "open", no_direct)
    data = random.Random(2).randbytes(5 * DIRECT_ALIGN + 123)
    write_atomically_with(tmp_path, "payload", lambda file: file.write(data), direct=True)
    assert (tmp_path / "payload").read_bytes() == data


def test_a_file_system_that_refuses_o_direct_writes_gets_ordinary_ones(tmp_path, monkeypatch):
    if not _direct_supported(tmp_path):
        pytest.skip("this file system refuses O_DIRECT")
    real_write = os.write
    refused = []

    def picky(descriptor, data):
        if fcntl.fcntl(descriptor, fcntl.F_GETFL) & os.O_DIRECT:
            refused.append(len(data))
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_write(descriptor, data)

    monkeypatch.setattr(files.os, "write", picky)
    pieces = _pieces(3)
    path = tmp_path / "out"
    path.touch()
    with DirectFile(path, stage_bytes=2 * DIRECT_ALIGN) as file:
        for piece in pieces:
            file.write(piece)
    assert refused == [2 * DIRECT_ALIGN]  # once: the descriptor is ordinary from then on
    assert path.read_bytes() == b"".join(pieces)


def test_a_failed_direct_write_leaves_no_file(tmp_path):
    def write(file) -> None:
        file.write(b"y" * (3 * DIRECT_ALIGN))
        raise RuntimeError("the writer failed")

    with pytest.raises(RuntimeError):
        write_atomically_with(tmp_path, "payload", write, direct=True)
    assert list(tmp_path.iterdir()) == []
