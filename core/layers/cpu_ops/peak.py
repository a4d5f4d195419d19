"""This machine's arithmetic peak and read bandwidth, measured: the yardstick for GEMM speed.

`peak()` returns a `Peak`: fp32 FMA GFLOP/s (AVX-512 or AVX2 + FMA, whichever /proc/cpuinfo's flags
allow), the bf16 dot-product instruction's GFLOP/s (vdpbf16ps, where AVX512_BF16 exists), AMX bf16
tile GFLOP/s (where amx_bf16 exists and Linux grants the tile state), each on one core and on all the
cores in use, and a streaming read's GB/s with and without transparent huge pages. The loops live in
peak_probe.c, compiled once per machine like the other kernels of this folder (`$CC`, into
`$WORKBENCH_CACHE_DIR/kernels/`), but as a library of its own, so the probe never rebuilds the
model's kernels.

The result is kept in this process and in `$WORKBENCH_CACHE_DIR/peak/` under a key made of the CPU
model and flags and the thread count, for `max_age_s` (default 6 h): the benches of one run reuse
one measurement, and a cache directory shared between machines never hands one machine's figures
to another. Each figure is the best of a few short runs (a shared machine's neighbours only ever
slow a run down); the load average at the time is stored beside it.

This module needs only the standard library and a C compiler (no torch), so it also runs on its own.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
SOURCE = HERE / "peak_probe.c"
KIND_FP32_AVX2, KIND_FP32_AVX512, KIND_BF16_DP, KIND_AMX_BF16 = 0, 1, 2, 3
DEFAULT_MAX_AGE_S = 6 * 3600

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_error: str | None = None
_memo: dict[str, Peak] = {}


def cpu_identity() -> tuple[str, frozenset[str]]:
    """(model name, flags) from /proc/cpuinfo; ("unknown", {}) where there is none."""
    model, flags = "unknown", frozenset()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key == "model name" and model == "unknown":
                model = value.strip()
            elif key == "flags" and not flags:
                flags = frozenset(value.split())
            if model != "unknown" and flags:
                break
    except OSError:
        pass
    return model, flags


def machine_key() -> str:
    """A short hash of the CPU model and flags: results are only reused on a CPU like this one."""
    model, flags = cpu_identity()
    return hashlib.sha256((model + "\n" + " ".join(sorted(flags))).encode()).hexdigest()[:16]


def _cache_dir() -> Path:
    return Path(os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench").expanduser()


def load_library() -> ctypes.CDLL:
    """The compiled probe (built at first use); RuntimeError saying why when it cannot be."""
    global _lib, _lib_error
    with _lock:
        if _lib is None and _lib_error is None:
            try:
                from workbench.core.layers import cpu_ops  # built as the other kernels are, a library of its own

                lib = cpu_ops.load_library([SOURCE], "workbench_peak")
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _lib_error = f"the peak probe cannot be built here: {exc}"
            else:
                lib.wb_peak_flops_per_iter.argtypes = [ctypes.c_int]
                lib.wb_peak_flops_per_iter.restype = ctypes.c_double
                lib.wb_peak_compute.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_void_p]
                lib.wb_peak_compute.restype = ctypes.c_int
                lib.wb_peak_amx_permit.restype = ctypes.c_int
                lib.wb_peak_read_bw.argtypes = [ctypes.c_int64, ctypes.c_int, ctypes.c_int, ctypes.c_int]
                lib.wb_peak_read_bw.argtypes += [ctypes.c_void_p, ctypes.c_void_p]
                lib.wb_peak_read_bw.restype = ctypes.c_int
                _lib = lib
        if _lib is None:
            raise RuntimeError(_lib_error)
        return _lib


@dataclass
class Peak:
    """One machine's measured limits. GFLOP/s and GB/s figures are None where the path does not exist
    here; the matching `*_note` says why ("not on this CPU", "absent", ...)."""

    cpu_model: str
    machine_key: str
    isa: str  # the fp32 path measured: "AVX-512" or "AVX2 + FMA"
    cores: int  # threads of the "all" figures (the cores in use)
    fp32_core: float
    fp32_all: float
    bf16_dp_core: float | None = None
    bf16_dp_all: float | None = None
    bf16_note: str = ""
    amx_core: float | None = None
    amx_all: float | None = None
    amx_note: str = ""
    # streaming read, GB/s: {"huge": ..., "small": ...} per thread count (madvise for / against THP)
    read_core: dict = field(default_factory=dict)
    read_all: dict = field(default_factory=dict)
    read_all_wall: dict = field(default_factory=dict)  # all threads by the wall clock (they may not overlap)
    huge_pages_mib: float | None = None  # huge pages the "huge" buffer got (None: unknown)
    thp_mode: str = ""  # /sys/kernel/mm/transparent_hugepage/enabled's selected mode
    buffer_mib: int = 0
    load_before: float = 0.0  # 1-minute load average when the probe started and ended
    load_after: float = 0.0
    measured_at: float = 0.0  # unix time
    probe_seconds: float = 0.0

    def compute_peak(self, dtype: str = "float32", threads: int | None = None) -> float:
        """The best arithmetic rate, GFLOP/s, a GEMM of `dtype` can use here on `threads` threads
        (default: all the cores in use). float32: the fp32 FMA peak. bfloat16 / float16: the best of
        the fp32 FMA peak (widen the weights, multiply in fp32), the bf16 dot product and AMX."""
        threads = self.cores if threads is None else max(1, int(threads))

        def scaled(core: float | None, all_: float | None) -> float:
            if core is None or all_ is None:
                return 0.0
            if threads >= self.cores:
                return all_
            return min(all_, core * threads) if threads > 1 else core

        best = scaled(self.fp32_core, self.fp32_all)
        if dtype in ("bfloat16", "float16", "bf16", "fp16"):
            best = max(best, scaled(self.bf16_dp_core, self.bf16_dp_all), scaled(self.amx_core, self.amx_all))
        return best

    def where(self) -> str:
        """The CPU and the load the figures were taken under, for printing beside them."""
        return (
            f"{self.cpu_model}, {self.isa}, {self.cores} core(s), load 1m {self.load_before:.2f}→{self.load_after:.2f}"
        )


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    sel = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return sel[0] if sel else text.strip()


def _time_kind(lib: ctypes.CDLL, kind: int, threads: int, run_s: float, runs: int) -> float:
    """GFLOP/s of `kind` on `threads` threads: iterations scaled so one run takes ~run_s, the best of
    `runs` runs, each timed by the slowest thread's own CPU time (see peak_probe.c)."""
    per_iter = lib.wb_peak_flops_per_iter(kind)
    wall, cpu = ctypes.c_double(), ctypes.c_double()
    iters = 1 << 10
    while True:  # calibrate: grow until one run takes a measurable while
        if lib.wb_peak_compute(kind, threads, iters, ctypes.byref(wall), ctypes.byref(cpu)) != 0:
            raise RuntimeError(f"kind {kind} is not in this build")
        if cpu.value >= run_s / 4 or iters >= 1 << 34:
            break
        iters *= 4
    iters = max(1, int(iters * run_s / max(cpu.value, 1e-9)))
    best = float("inf")
    for _ in range(max(1, runs)):
        lib.wb_peak_compute(kind, threads, iters, ctypes.byref(wall), ctypes.byref(cpu))
        best = min(best, cpu.value)
    return per_iter * iters * threads / best / 1e9


def _read_gbs(lib: ctypes.CDLL, nbytes: int, huge: bool, threads: int, passes: int) -> tuple[list[float], int]:
    """GB/s [one thread wall, one thread CPU, all threads wall, all threads CPU] and the huge pages' kB."""
    out, huge_kb = (ctypes.c_double * 4)(), ctypes.c_int64()
    rc = lib.wb_peak_read_bw(nbytes, int(huge), threads, passes, out, ctypes.byref(huge_kb))
    if rc != 0:
        raise RuntimeError(f"could not map a {nbytes >> 20} MiB buffer for the read-bandwidth probe")
    used = (nbytes // threads) // 1024 * 1024 * threads
    return [used / max(t, 1e-12) / 1e9 for t in out], huge_kb.value


def measure(threads: int | None = None, quick: bool = False, progress=None) -> Peak:
    """Run the probe now (about 1-2 s; `quick`: under a second). `threads`: the cores in use
    (default: the CPUs this process may run on). `progress(text)` is told what runs."""
    say = progress or (lambda text: None)
    lib = load_library()
    model, flags = cpu_identity()
    threads = max(1, int(threads or len(os.sched_getaffinity(0))))
    # many short runs, the best kept: a short run is more likely to get a core to itself
    run_s, runs = (0.003, 4) if quick else (0.005, 24)
    load_before, t_start = os.getloadavg()[0], time.perf_counter()

    if "avx512f" in flags:
        isa, kind = "AVX-512", KIND_FP32_AVX512
    elif {"avx2", "fma"} <= flags:
        isa, kind = "AVX2 + FMA", KIND_FP32_AVX2
    else:
        raise RuntimeError(f"the peak probe needs AVX2 + FMA or AVX-512; this CPU ({model}) has neither")
    say(f"fp32 FMA ({isa}) on 1 and {threads} thread(s)")
    result = Peak(model, machine_key(), isa, threads, 0.0, 0.0, thp_mode=_thp_mode())
    result.fp32_core = _time_kind(lib, kind, 1, run_s, runs)
    result.fp32_all = _time_kind(lib, kind, threads, run_s, runs)

    if "avx512_bf16" not in flags:
        result.bf16_note = "not on this CPU (no AVX512_BF16)"
    elif lib.wb_peak_flops_per_iter(KIND_BF16_DP) <= 0:
        result.bf16_note = "the compiler cannot emit vdpbf16ps (gcc >= 10 or clang >= 9 needed)"
    else:
        say("bf16 dot product (vdpbf16ps)")
        result.bf16_dp_core = _time_kind(lib, KIND_BF16_DP, 1, run_s, runs)
        result.bf16_dp_all = _time_kind(lib, KIND_BF16_DP, threads, run_s, runs)

    if not {"amx_tile", "amx_bf16"} <= flags:
        result.amx_note = "absent (no amx_bf16 on this CPU)"
    elif lib.wb_peak_flops_per_iter(KIND_AMX_BF16) <= 0:
        result.amx_note = "the compiler cannot emit AMX (gcc >= 11 or clang >= 12 needed)"
    elif not lib.wb_peak_amx_permit():
        result.amx_note = "the CPU has AMX but the kernel refused the tile state (arch_prctl)"
    else:
        say("AMX bf16 tiles")
        result.amx_core = _time_kind(lib, KIND_AMX_BF16, 1, run_s, runs)
        result.amx_all = _time_kind(lib, KIND_AMX_BF16, threads, run_s, runs)

    nbytes = (64 if quick else 256) << 20
    passes = 2 if quick else 4
    result.buffer_mib = nbytes >> 20
    say(f"streaming read of {nbytes >> 20} MiB on 1 and {threads} thread(s), with and without huge pages")
    for huge in (True, False):
        key = "huge" if huge else "small"
        (_, core, wall, all_), kb = _read_gbs(lib, nbytes, huge, threads, passes)
        result.read_core[key], result.read_all[key], result.read_all_wall[key] = core, all_, wall
        if huge and kb >= 0:
            result.huge_pages_mib = kb / 1024
    result.load_after = os.getloadavg()[0]
    result.load_before = load_before
    result.measured_at = time.time()
    result.probe_seconds = time.perf_counter() - t_start
    return result


def _cache_file(threads: int) -> Path:
    return _cache_dir() / "peak" / f"peak-{machine_key()}-{threads}t.json"


def peak(
    threads: int | None = None,
    fresh: bool = False,
    max_age_s: float = DEFAULT_MAX_AGE_S,
    progress=None,
    quick: bool = False,
) -> Peak:
    """This machine's `Peak` for `threads` cores (default: all this process may use), measured once:
    from this process's memo, else the per-machine cache file younger than `max_age_s`, else now
    (and then stored in both). `fresh`: measure now whatever is cached; `quick`: a shorter measurement
    when one is needed (see `measure`)."""
    threads = max(1, int(threads or len(os.sched_getaffinity(0))))
    key = f"{machine_key()}-{threads}"
    if not fresh:
        if key in _memo and time.time() - _memo[key].measured_at < max_age_s:
            return _memo[key]
        try:
            data = json.loads(_cache_file(threads).read_text())
            cached = Peak(**data)
            if cached.machine_key == machine_key() and time.time() - cached.measured_at < max_age_s:
                _memo[key] = cached
                return cached
        except (OSError, ValueError, TypeError):
            pass
    result = measure(threads, quick=quick, progress=progress)
    _memo[key] = result
    path = _cache_file(threads)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(result), indent=1))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only cache only costs a re-measure next time
    return result
