"""Keep glibc from returning activation memory to the kernel between forward passes (CPU only).

By default glibc serves every allocation above 128 KiB with its own mmap and unmaps it on free.
A forward pass on CPU allocates many such tensors (a bs-32 decode step's MLP activation is
~400 KB, a 512-token prefill's ~3 MB), so every pass maps fresh pages and takes a page fault on
each first touch. Raising the mmap threshold to 32 MiB (glibc's ceiling) and keeping freed
memory in the heap makes later passes reuse warm pages. Measured on the 2-core target with
the default model: prefill of 512 tokens and bs-32 decode ~10-15% faster (docs/benchmarks.md).
jemalloc or tcmalloc via LD_PRELOAD do the same, as CPU serving stacks recommend; this needs no
extra library. The setting is per process, so the scheduler applies it to itself.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3  # from glibc's <malloc.h>
MMAP_THRESHOLD_BYTES = 32 << 20  # the largest value glibc accepts
TRIM_THRESHOLD_BYTES = 1 << 30  # keep up to 1 GiB of freed heap instead of returning it
TOP_PAD_BYTES = 64 << 20  # grow the heap in 64 MiB steps

_applied: bool | None = None


def tune_glibc_malloc() -> bool:
    """Apply the settings above once per process; True if glibc accepted them.

    A no-op (False) off glibc, or with WORKBENCH_MALLOC_TUNING=0 (to measure without it)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("WORKBENCH_MALLOC_TUNING", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc (musl, macOS): leave the allocator alone
    ok = all(
        mallopt(opt, val) == 1
        for opt, val in (
            (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
            (M_TOP_PAD, TOP_PAD_BYTES),
        )
    )
    if not ok:
        logger.info("glibc mallopt refused a setting; allocator left at its defaults")
    _applied = ok
    return ok
