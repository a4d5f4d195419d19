"""The model's CPU weights on transparent huge pages.

Why: a batch-1 decode step streams every weight once (270 MB for the default model in bfloat16),
and on CPUs one core's stream rate is bound by how many cache misses it keeps in flight. The
hardware prefetchers stop at every 4 KiB page boundary, so on ordinary pages each page starts cold;
on 2 MiB pages they run on. Measured on this project's 2-core AVX-512 EPYC, reading 270 MB: one
thread 18-19 GB/s on 4 KiB pages against 30 GB/s on huge pages, two threads 27 against 35
(docs/design.md). Linux backs anonymous memory with huge pages only where it is advised
(`/sys/kernel/mm/transparent_hugepage/enabled` is `madvise` on most distributions), and torch's
allocator never advises it, so the weights are copied into one mapping that is.

The KV pool's CPU buffers are allocated the same way (`huge_page_tensors`): attention reads each
request's slots, scattered over a pool of hundreds of MB, where every 4 KiB page is a TLB miss.

`rehome_parameters(model)` copies every CPU parameter into one anonymous mapping advised
MADV_HUGEPAGE (2 MiB-aligned) and points the parameter at its copy, so everything that holds the
parameter (the module, the weight loader, update_weights) sees the same tensor; the old storage
is freed. oneDNN's packed copies are opaque tensors and stay where they are. The mapping lives as
long as any tensor in it. WORKBENCH_HUGE_PAGES=0 turns it off.
"""

from __future__ import annotations

import logging
import math
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

HUGE = 2 << 20  # the x86-64 transparent huge page
ALIGN = 64  # each tensor starts on a cache line (the kernels' vector loads)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
ENV = "WORKBENCH_HUGE_PAGES"


@dataclass
class Rehomed:
    """What `rehome_parameters` did: bytes copied, and how many of them the kernel backs with huge
    pages right after the copy (from /proc/self/smaps; None where that cannot be read)."""

    bytes: int = 0
    huge_bytes: int | None = None
    address: int = 0  # where the mapping's first tensor starts
    skipped: str = ""  # why nothing was moved, when nothing was

    def describe(self) -> str:
        if self.skipped:
            return f"weights on ordinary pages ({self.skipped})"
        mb = self.bytes / 2**20
        if self.huge_bytes is None:
            return f"weights ({mb:.0f} MiB) in a mapping advised for huge pages"
        return f"weights on huge pages: {self.huge_bytes / 2**20:.0f} of {mb:.0f} MiB"


def unavailable_reason() -> str:
    """Why huge pages cannot be asked for here ('' when they can)."""
    if os.environ.get(ENV, "1") == "0":
        return f"{ENV}=0"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "this platform has no MADV_HUGEPAGE"
    try:
        setting = THP_SETTING.read_text()
    except OSError:
        return "transparent huge pages are not configured"
    if "[never]" in setting:
        return "transparent huge pages are off on this machine ([never])"
    return ""


def _huge_bytes_of(address: int, length: int) -> int | None:
    """AnonHugePages of the mapping that contains `address` (from /proc/self/smaps)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    inside = False
    for line in text.splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            inside = int(m.group(1), 16) <= address < int(m.group(2), 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1]) * 1024
    return None


def huge_page_tensors(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> tuple[list[torch.Tensor], int]:
    """Zero-filled CPU tensors of the given (shape, dtype)s, all in one anonymous mapping advised
    MADV_HUGEPAGE and starting on a 2 MiB boundary, each on a cache line; and the mapping's address
    of the first. The kernel fills a 2 MiB page at its first touch, so untouched parts cost no memory.
    Callers check `unavailable_reason()` first."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-nbytes // ALIGN) * ALIGN
    size = -(-max(total, 1) // HUGE) * HUGE + HUGE  # room to start on a 2 MiB boundary
    region = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` alive while any view lives
    start = (-whole.data_ptr()) % HUGE
    region.madvise(mmap.MADV_HUGEPAGE, start, size - start)  # before the first touch: faults map 2 MiB
    out = [
        whole[start + off : start + off + nbytes].view(dtype).view(shape)
        for (shape, dtype), off, nbytes in zip(specs, offsets, sizes)
    ]
    return out, whole.data_ptr() + start


def rehome_parameters(model: torch.nn.Module) -> Rehomed:
    """Copy `model`'s CPU parameters into one huge-page mapping (see the module docstring).

    Values, shapes and dtypes are unchanged (each copy is contiguous, as the loaders make them
    anyway); only the storage moves, so pointers taken earlier are stale: callers rebuild any cached
    pointer table afterwards (LlamaForCausalLM.process_weights_after_loading does)."""
    why = unavailable_reason()
    params = [p for p in dict.fromkeys(model.parameters()) if p.device.type == "cpu" and p.numel() > 0]
    if not why and not params:
        why = "no CPU parameters"
    if why:
        return Rehomed(skipped=why)
    homes, address = huge_page_tensors([(tuple(p.shape), p.dtype) for p in params])
    with torch.no_grad():
        for p, new in zip(params, homes):
            new.copy_(p.data)
            p.data = new
    total = sum(p.numel() * p.element_size() for p in params)
    huge = _huge_bytes_of(address, total)
    done = Rehomed(bytes=total, huge_bytes=None if huge is None else min(huge, total), address=address)
    logger.info(done.describe())
    return done
