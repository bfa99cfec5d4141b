"""The C heap: freed memory given back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import sys
from collections.abc import Callable


@functools.cache
def malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library: macOS, musl)."""
    if sys.platform != "linux":
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CDLL(None).malloc_trim  # type: ignore[no-any-return]
    return None


def return_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's `malloc_trim`; a no-op where
    there is none). glibc keeps blocks under its mmap threshold (up to 32 MB, raised as big
    blocks are freed) in its heaps once freed: a 100 M model's gradients, freed when they are
    taken, stayed in RSS (about 500 MB) through the averaging."""
    trim = malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    if sys.platform != "linux":
        return None
    with contextlib.suppress(OSError, AttributeError):
        return ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)(
            ("madvise", ctypes.CDLL(None))
        )
    return None


MADV_DONTNEED = 4  # Linux
#: The kernel's page: madvise rounds its range to whole ones (64 KiB on some arm64 kernels, where
#: rounding to 4 KiB zeroed up to 60 KiB of the next tensor, not yet loaded).
PAGE_BYTES = mmap.PAGESIZE


def releaser(data: bytes) -> Callable[[int, int], None]:
    """What gives back the pages of (address, size) ranges inside `data`'s own buffer, which
    nothing reads again (`state.restore`'s `release`)."""
    return functools.partial(drop_pages, within=span_of(data))


def span_of(data: bytes) -> tuple[int, int]:
    """Where the bytes of `data` lie in memory: (address, size)."""
    return ctypes.cast(ctypes.c_char_p(data), ctypes.c_void_p).value or 0, len(data)


def drop_pages(
    address: int,
    size: int,
    *,
    within: tuple[int, int],
    page: int = PAGE_BYTES,
    madvise: Callable[[int, int, int], int] | None = None,
) -> None:
    """Give the whole pages of [address, address + size) back to the system (Linux
    `madvise(MADV_DONTNEED)`: they read as zeros afterwards), if the range lies inside
    `within`, a buffer of ours that nothing reads again. Best effort: a no-op elsewhere.
    `page` and `madvise`: the kernel's (tests stand in for another kernel)."""
    start, length = within
    madvise = madvise or _madvise()
    if madvise is None or address < start or address + size > start + length:
        return
    first = -(-address // page) * page
    end = (address + size) // page * page
    if end > first:
        madvise(first, end - first, MADV_DONTNEED)
