"""The packed-weight GEMM for batched rows (gemm.c): a weight packed once into the micro-kernel's
panels, float32 or bfloat16 storage, float32 sums, and the start-up choice between it and torch.

Why: at 8-512 rows of input a linear is compute-bound. torch's bfloat16 matmul on a CPU without
bfloat16 arithmetic (AVX2) runs far below its float32 rate, so a bfloat16 model was the slow one;
gemm.c widens bfloat16 weights to float32 in registers and multiplies with the same FMAs, keeping
bfloat16's halved weight traffic. Whether it beats torch (oneDNN's packed GEMM for float32) depends
on the machine, so `choose` measures both on a layer's shape at load and the layer keeps whichever
was faster per row bucket (`ROW_BUCKETS`); WORKBENCH_CPU_GEMM=0 never takes it, =1 always does.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import _GEMV_WEIGHT_CODES, call_linear_kernel, load_library

logger = logging.getLogger(__name__)

# Rows of input up to each bound share one decision, measured at the bound (the last one stands for
# every larger batch: a prefill chunk).
ROW_BUCKETS = (16, 64, 256)
_choices: dict[tuple[int, int, torch.dtype, bool], tuple[bool, ...]] = {}
_timings: dict[tuple[int, int, torch.dtype, bool], list[tuple[int, float, float]]] = {}


# Its own small library beside the main one (cpu_ops.load_library): built at first use, and editing
# it never rebuilds the attention kernels.
SOURCE = Path(__file__).parent / "gemm.c"
_lock = threading.Lock()
_gemm_lib: ctypes.CDLL | None = None
_gemm_error: str | None = None


def _require() -> ctypes.CDLL:
    """gemm.c's library, built once per machine; raises RuntimeError saying why not."""
    global _gemm_lib, _gemm_error
    with _lock:
        if _gemm_lib is None and _gemm_error is None:
            try:
                lib = load_library([SOURCE], "workbench_gemm")
                _argtypes(lib)
                _gemm_lib = lib
            except (OSError, RuntimeError) as exc:
                _gemm_error = f"the packed CPU GEMM is unavailable: {exc}"
    if _gemm_lib is None:
        raise RuntimeError(_gemm_error)
    return _gemm_lib


def unavailable_reason() -> str | None:
    """None when gemm.c is built with its vector path (AVX2 + FMA, or AVX-512) and not switched off
    (WORKBENCH_CPU_GEMM=0), else why not."""
    if os.environ.get("WORKBENCH_CPU_GEMM") == "0":
        return "switched off by WORKBENCH_CPU_GEMM=0"
    try:
        lib = _require()
    except RuntimeError as exc:
        return str(exc)
    return None if lib.wb_gemm_available() else "the CPU has neither AVX2 + FMA nor AVX-512"


def available() -> bool:
    """True when `unavailable_reason()` is None."""
    return unavailable_reason() is None


@dataclass
class PackedGemmWeight:
    """A [N, K] weight in gemm.c's panels: `data` holds them in the weight's dtype."""

    data: torch.Tensor
    n: int
    k: int
    dtype: torch.dtype
    # Per row bucket (ROW_BUCKETS): True where the kernel measured faster than torch at load.
    use: tuple[bool, ...] = field(default=(True,) * len(ROW_BUCKETS))

    def wins(self, rows: int) -> bool:
        """Whether `rows` rows of input should take the kernel."""
        for bound, use in zip(ROW_BUCKETS, self.use):
            if rows <= bound:
                return use
        return self.use[-1]


def pack(weight: torch.Tensor) -> PackedGemmWeight:
    """Pack a float32 or bfloat16 [N, K] weight (unit inner stride) into gemm.c's panels."""
    if weight.dim() != 2 or weight.dtype not in _GEMV_WEIGHT_CODES:
        raise ValueError(f"gemm.pack: a 2-D float32 or bfloat16 weight, not {tuple(weight.shape)} {weight.dtype}")
    lib = _require()
    w = weight.detach()
    if w.stride(1) != 1:
        w = w.contiguous()
    n, k = w.shape
    data = torch.empty(int(lib.wb_gemm_packed_elems(n, k)), dtype=w.dtype)
    lib.wb_gemm_pack(w.data_ptr(), w.stride(0), _GEMV_WEIGHT_CODES[w.dtype], n, k, data.data_ptr())
    return PackedGemmWeight(data, n, k, w.dtype)


class _PackedView:
    """What call_linear_kernel reads of a weight (shape, dtype, stride, data_ptr), for the packed one."""

    def __init__(self, packed: PackedGemmWeight):
        self.shape = (packed.n, packed.k)
        self.dtype = packed.dtype
        self._data = packed.data

    def stride(self, dim: int) -> int:
        return self.shape[1] if dim == 0 else 1

    def data_ptr(self) -> int:
        return self._data.data_ptr()


def gemm(
    x: torch.Tensor, packed: PackedGemmWeight, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) (+ residual) on a weight from `pack`, summed in float32: x [M, K], bias [N],
    residual [M, N] -> a new float32 [M, N] (x, bias and residual are widened to float32 first)."""
    return call_linear_kernel(_require().wb_gemm, "gemm", x, _PackedView(packed), bias, residual)  # type: ignore[arg-type]


def _best(fn, budget_s: float, give_up_above: float = float("inf")) -> float:
    """The fastest of at least three calls in CPU seconds of the calling thread (the machine may be
    shared: the minimum is the least disturbed), more within `budget_s` of wall time; stops at three when the best is still slower than
    `give_up_above` (the other path already won by far)."""
    best, start, n = float("inf"), time.perf_counter(), 0
    while n < 3 or (time.perf_counter() - start < budget_s and n < 50 and best <= give_up_above):
        t0 = time.thread_time()  # this thread's CPU time: on one thread, time other processes took is not counted
        fn()
        best = min(best, time.thread_time() - t0)
        n += 1
    return best


def choose(packed: PackedGemmWeight, torch_linear, budget_s: float = 0.02) -> tuple[bool, ...]:
    """Per row bucket, whether the kernel beat `torch_linear(x)` (the layer's own torch path) on this
    weight's shape and dtype: measured once per (N, K, dtype, path) in this process, on random rows,
    the two timed alternately on one thread (per-core speed: on a shared machine two threads mostly
    measure the neighbours; both paths split the columns over threads alike). WORKBENCH_CPU_GEMM=0/1
    forces never/always."""
    forced = os.environ.get("WORKBENCH_CPU_GEMM", "auto")
    if forced in ("0", "1"):
        return (forced == "1",) * len(ROW_BUCKETS)
    key = (packed.n, packed.k, packed.dtype, getattr(torch_linear, "onednn", False))
    if key not in _choices:
        cached = _load_cached().get(key)  # another start on this machine measured this shape
        if cached is not None:
            _choices[key] = cached
    if key not in _choices:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core each: on a shared machine two threads measure the neighbours
        try:
            _measure(packed, torch_linear, budget_s, key)
        finally:
            torch.set_num_threads(threads)
        _store_cached(key, _choices[key])
    return _choices[key]


# The choices are kept per machine (the CPU model and flags, peak.machine_key) and torch version in
# $WORKBENCH_CACHE_DIR/gemm/, so an engine start measures only the shapes no earlier start on this
# machine measured (~6 s of start-up at load 3 otherwise), and every engine started on one machine
# within CACHE_MAX_AGE_S takes the same path per shape (the same float32 sums: two engines compared
# in a test or side by side in `tui --compare --real` do not differ by the kernel chosen).
CACHE_MAX_AGE_S = 7 * 24 * 3600.0


def _cache_file() -> Path:
    from .peak import _cache_dir, machine_key

    version = torch.__version__.replace("+", "-")
    return _cache_dir() / "gemm" / f"choices-{machine_key()}-torch{version}.json"


def _key_text(key: tuple) -> str:
    n, k, dtype, onednn = key
    return f"{n}x{k}:{str(dtype).replace('torch.', '')}:{'onednn' if onednn else 'plain'}"


def _load_cached() -> dict:
    """The cached choices of this machine (key -> picks); {} when none are younger than CACHE_MAX_AGE_S."""
    import json

    path = _cache_file()
    try:
        if time.time() - path.stat().st_mtime > CACHE_MAX_AGE_S:
            return {}
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out = {}
    for n, k, dtype, onednn in _parse_keys(raw):
        key = (n, k, dtype, onednn)
        picks = raw.get(_key_text(key))
        if isinstance(picks, list) and len(picks) == len(ROW_BUCKETS):
            out[key] = tuple(bool(p) for p in picks)
    return out


def _parse_keys(raw: dict):
    """Parse the cache's "NxK:dtype:path" keys back (unreadable ones are skipped)."""
    for text in raw:
        try:
            shape, dtype, path = text.split(":")
            n, k = (int(v) for v in shape.split("x"))
            yield n, k, getattr(torch, dtype), path == "onednn"
        except (ValueError, AttributeError):
            continue


def _store_cached(key: tuple, picks: tuple[bool, ...]) -> None:
    """Add one measured choice to the machine's cache file (merged, written atomically; best effort)."""
    import json

    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            raw = json.loads(path.read_text())
        except (OSError, ValueError):
            raw = {}
        raw[_key_text(key)] = list(picks)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(raw, indent=0))
        os.replace(tmp, path)
    except OSError as exc:
        logger.debug("gemm choice cache not written: %s", exc)


def _measure(packed: PackedGemmWeight, torch_linear, budget_s: float, key) -> None:
    """choose's measurement, on the calling thread's settings; records into _choices/_timings."""
    picks, times = [], []
    gen = torch.Generator().manual_seed(0)
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, packed.k, generator=gen).to(packed.dtype)
        gemm(x, packed), torch_linear(x)  # first touches
        ours = theirs = float("inf")
        for _ in range(2):  # alternate, so a burst of load hits both
            ours = min(ours, _best(lambda: gemm(x, packed), budget_s, 3 * theirs))
            theirs = min(theirs, _best(lambda: torch_linear(x), budget_s, 3 * ours))
            if max(ours, theirs) > 3 * min(ours, theirs):
                break  # decided by far: spare the start-up the second round
        picks.append(ours < theirs)
        flops = 2.0 * rows * packed.n * packed.k
        times.append((rows, flops / ours / 1e9, flops / theirs / 1e9))
    _choices[key] = tuple(picks)
    _timings[key] = times
    logger.info(
        "CPU linear [%d x %d] %s: %s",
        packed.n,
        packed.k,
        str(packed.dtype).replace("torch.", ""),
        ", ".join(
            f"{r} rows {'gemm.c' if p else 'torch'} ({a:.0f} vs torch {b:.0f} GFLOP/s)"
            for (r, a, b), p in zip(times, picks)
        ),
    )


def summary() -> str:
    """One line on the paths chosen so far in this process (for the engine's log), e.g.
    'gemm.c for 12/15 (shape, rows) pairs: bfloat16 all; float32 rows<=64'."""
    if not _choices:
        return "batched CPU linears: torch (gemm.c not measured)"
    parts = []
    for (n, k, dtype, _), picks in sorted(_choices.items(), key=lambda kv: (str(kv[0][2]), kv[0][0], kv[0][1])):
        rows = [str(b) for b, p in zip(ROW_BUCKETS, picks) if p]
        parts.append(f"{str(dtype).replace('torch.', '')} {n}x{k}: {'/'.join(rows) or 'none'}")
    return "batched CPU linears on gemm.c at rows " + "; ".join(parts)


def ready_text() -> str:
    """A few words for the engine's ready line on what batched CPU linears run on in this process,
    e.g. 'batched linears gemm.c 15/15 (shape x rows)'; '' when nothing was packed or measured."""
    forced = os.environ.get("WORKBENCH_CPU_GEMM", "auto")
    if forced == "0":
        return "batched linears torch (WORKBENCH_CPU_GEMM=0)"
    if forced == "1" and _gemm_lib is not None:
        return "batched linears gemm.c (WORKBENCH_CPU_GEMM=1)"
    if not _choices:
        return f"batched linears torch ({_gemm_error})" if _gemm_error else ""
    wins = sum(sum(p) for p in _choices.values())
    total = sum(len(p) for p in _choices.values())
    rest = ", torch the rest" if 0 < wins < total else ""
    return f"batched linears gemm.c {wins}/{total} (shape x rows){rest}"


def _argtypes(lib: ctypes.CDLL) -> None:
    """Declare gemm.c's entry points on the loaded library."""
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    lib.wb_gemm.argtypes = [ptr, i64, ptr, i64, i32, ptr, ptr, i64, ptr, i64, i32, i64, i64, i32]
    lib.wb_gemm.restype = None
    lib.wb_gemm_pack.argtypes = [ptr, i64, i32, i64, i64, ptr]
    lib.wb_gemm_pack.restype = None
    lib.wb_gemm_packed_elems.argtypes = [i64, i64]
    lib.wb_gemm_packed_elems.restype = i64
    lib.wb_gemm_available.restype = i32
    lib.wb_gemm_panel_width.restype = i32
