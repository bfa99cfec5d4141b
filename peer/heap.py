"""The C heap: freed memory given back to the system."""

from __future__ import annotations

import contextlib
import ctypes
import functools
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
