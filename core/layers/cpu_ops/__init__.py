"""Compiled CPU kernels, built at first use: attention over the token-slot KV pool (decode and
extend), the rotary embedding in place, RMSNorm for 16-bit models, the linear for
one row of input on float32 or bfloat16 weights (decode at batch 1; gemv.c), and all of a
Llama-family model's decoder layers for one decode token in one call (decode_layers.c).

The C files of this folder are compiled once per machine with the system C compiler
(`$CC`, default `cc`) into `$WORKBENCH_CACHE_DIR/kernels/` (default
~/.cache/workbench) and loaded with ctypes: no torch headers, so a build takes
a few seconds. The file name carries a hash of the source, the flags and the
CPU, so an edited kernel or a different machine gets its own build. The library
is linked with -fopenmp after torch has loaded its own libgomp, so both share
one OpenMP thread pool.

Where no compiler works, `unavailable_reason()` says why and what to do; the CPU
default attention backend is then torch_native, and the model rotates and normalizes
with torch ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from workbench.core.trace.startup import phase

HERE = Path(__file__).parent
SOURCES = [
    HERE / name
    for name in (
        "paged_attention.c",
        "prefix_attention.c",
        "paged_extend.c",
        "rope.c",
        "rms_norm.c",
        "gemv.c",
        "decode_layers.c",
    )
]
HEADERS = [HERE / "common.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11"]
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
logger = logging.getLogger(__name__)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_error: str | None = None
_tried = False
_gemv_ok = False  # the library has gemv.c's AVX2 + FMA path and WORKBENCH_CPU_GEMV is not 0


def _cpu_signature() -> str:
    """The CPU model and flags: -march=native code is only valid on a CPU like the one it was built on."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [ln for ln in lines if ln.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted)
    except OSError:
        return platform.processor() or platform.machine()


def extend_kernel_preferred() -> bool:
    """Whether prefill attention should use `paged_extend_attention` rather than torch's SDPA.

    The kernel has two vector paths: AVX2 + FMA + F16C (8-float vectors blocked for 16 registers;
    common.h's WB_HAVE_AVX2), also taken on AVX-512 CPUs, where it measured faster than the 16-float
    code (Zen 4: a 544-token prompt 2.5 against 3.2 ms per layer), and 16-float vectors for the rest.
    On an AVX2-only AMD EPYC znver3 the AVX2 path takes a 512-token prompt in ~6-8 ms per layer
    against ~10-13 ms for torch's flash kernel (float32 and bfloat16, one thread; before it
    existed the AVX-512-shaped code spilled and took 90 ms). Elsewhere (older x86, other
    architectures) the kernel is the generic 16-float code, never measured against SDPA there,
    so those CPUs keep prefilling through SDPA.
    """
    flags = set(_cpu_signature().split())
    return "avx512f" in flags or {"avx2", "fma", "f16c"} <= flags


def library_path(sources: list[Path] | None = None, stem: str = "workbench_cpu_ops") -> Path:
    """Where this source (or `sources`, a library of its own named `stem`), built with these flags
    for this CPU, lives in the cache."""
    digest = hashlib.sha256(b"".join(src.read_bytes() for src in (sources or SOURCES) + HEADERS))
    digest.update(" ".join([os.environ.get("CC", "cc")] + CFLAGS).encode())
    digest.update(_cpu_signature().encode())
    base = Path(os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench").expanduser()
    return base / "kernels" / f"{stem}-{digest.hexdigest()[:16]}.so"


def load_library(sources: list[Path], stem: str) -> ctypes.CDLL:
    """Build (once per machine, as the main library is) and load a library of its own from `sources`:
    kernels kept apart so that editing them never rebuilds the main library. Raises RuntimeError
    (or OSError) saying why not."""
    if os.environ.get("WORKBENCH_DISABLE_CPU_KERNELS") == "1":
        raise RuntimeError("disabled by WORKBENCH_DISABLE_CPU_KERNELS=1")
    target = library_path(sources, stem)
    if not target.exists():
        _build(target, sources)
    return ctypes.CDLL(str(target))


def _build(target: Path, sources: list[Path] | None = None) -> None:
    sources = sources or SOURCES
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler {compiler!r} on PATH; install one (apt install gcc) or set CC")
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("compiling the CPU kernels once for this machine (a few seconds) into %s", target.parent)
    # Build beside the target and rename: processes building at once never load half a file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        with phase("kernels", f"{compiler} {' '.join(CFLAGS[:2])}, {len(sources)} C files into {target.parent}"):
            proc = subprocess.run(
                [compiler, *CFLAGS, *map(str, sources), "-o", tmp, "-lm"], capture_output=True, text=True, timeout=600
            )
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["(no output)"])[0]
            raise RuntimeError(f"{compiler} failed to build {', '.join(s.name for s in sources)}: {first}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _load() -> None:
    global _lib, _error, _tried, _gemv_ok
    with _lock:
        if _tried:
            return
        _tried = True
        if os.environ.get("WORKBENCH_DISABLE_CPU_KERNELS") == "1":
            _error = "disabled by WORKBENCH_DISABLE_CPU_KERNELS=1"
            return
        try:
            target = library_path()
            if not target.exists():
                _build(target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            _error = f"the compiled CPU kernels are unavailable: {exc}"
            return
        fn = lib.paged_decode_attention
        fn.restype = ctypes.c_int
        ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        fn.argtypes = [
            ptr,
            i32,
            i64,
            ptr,
            i64,
            ptr,
            i64,
            ptr,  # q, this step's k/v, their slots
            ptr,
            ptr,
            i32,
            ptr,
            i64,
            ptr,
            ptr,  # the pool and its tables
            i32,
            i32,
            i32,
            i32,
            ctypes.c_float,
            ptr,
            i32,
        ]  # B, Hq, Hk, D, scale, out, threads
        lib.paged_decode_attention_grouped.restype = ctypes.c_int
        lib.paged_decode_attention_grouped.argtypes = fn.argtypes[:-1] + [ptr, ptr, i32, i32]
        lib.wb_decode_prefix_groups.restype = ctypes.c_int
        lib.wb_decode_prefix_groups.argtypes = [ptr, i64, ptr, ptr, i32, i64, i32, ptr, ptr]
        lib.paged_extend_attention.restype = ctypes.c_int
        lib.paged_extend_attention.argtypes = [
            ptr,
            i32,
            i64,
            ptr,
            ptr,
            i32,
            ptr,
            i64,  # q, the pool, its table
            ptr,
            ptr,
            ptr,
            ptr,  # per-request rows and lengths
            i32,
            i32,
            i32,
            i32,
            ctypes.c_float,
            ptr,
            i32,
        ]
        lib.wb_rope_inplace.argtypes = [ptr, i64, ptr, ptr, i64, i32, i32, i32, i32, i32]
        lib.wb_rope_inplace.restype = None
        lib.wb_rms_norm.argtypes = [ptr, i64, ptr, ptr, i32, i32, ctypes.c_float, i32, i32]
        lib.wb_rms_norm.restype = None
        lib.wb_gemv.argtypes = [ptr, i64, ptr, i64, i32, ptr, ptr, i64, ptr, i64, i32, i64, i64, i32]
        lib.wb_gemv.restype = None
        lib.wb_gemv_f32_available.restype = ctypes.c_int
        lib.wb_gemv_bf16_rounds_x.restype = ctypes.c_int
        f32 = ctypes.c_float
        lib.wb_decode_layers.argtypes = [ptr, i32, ptr, i32, i32, i32, i32, i32, i32, i64, f32, ptr, ptr, i32]
        lib.wb_decode_layers.argtypes += [ptr, ptr, i64, ptr, ptr, f32, i32]
        lib.wb_decode_layers.restype = ctypes.c_int
        _gemv_ok = bool(lib.wb_gemv_f32_available()) and os.environ.get("WORKBENCH_CPU_GEMV", "1") != "0"
        _lib = lib


def unavailable_reason() -> str | None:
    """None once the kernel library is built and loaded (building it if needed), else why not."""
    _load()
    return _error


def supports(dtype: torch.dtype) -> bool:
    """True for the element types the kernel reads and writes."""
    return dtype in _DTYPE_CODES


MAX_HEAD_DIM = 256  # MAX_D in common.h


def shape_unsupported_reason(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str | None:
    """None when the attention kernels handle these heads (see their C files), else why not."""
    if head_dim % 16 or head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} is not a multiple of 16 up to {MAX_HEAD_DIM}"
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        return f"{num_q_heads} query heads do not divide into {num_kv_heads} KV heads"
    return None


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """x ([B, H, D], heads and D contiguous, any batch stride) and its batch stride in rows of D."""
    d = x.shape[2]
    if x.stride(2) != 1 or x.stride(1) != d or x.stride(0) % d:
        x = x.contiguous()
    return x, x.stride(0) // d


@dataclass
class PrefixGroups:
    """Requests of one decode batch that share the first slots of their KV rows (a radix-cache
    prefix): `paged_decode_attention` attends over those slots once per group."""

    group_of: torch.Tensor  # [B] int32: the request's group, -1 for none
    skip: torch.Tensor  # [B] int64: how many leading slots its group shares (0: none)
    count: int  # groups


def decode_prefix_groups(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    min_prefix: int = 64,
    min_members: int = 2,
) -> PrefixGroups | None:
    """The shared-prefix groups of a decode batch (prefix_attention.c's wb_decode_prefix_groups):
    requests whose slot rows start alike, each group's shared length at least `min_prefix` with at
    least `min_members` requests; None when there are none. req_pool_indices/seq_lens: [B] int64
    contiguous, seq_lens counting this step's token."""
    lib = _require()
    bs = int(req_pool_indices.numel())
    group_of = torch.empty(bs, dtype=torch.int32)
    skip = torch.empty(bs, dtype=torch.int64)
    n = lib.wb_decode_prefix_groups(
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        req_pool_indices.data_ptr(),
        seq_lens.data_ptr(),
        bs,
        int(min_prefix),
        int(min_members),
        group_of.data_ptr(),
        skip.data_ptr(),
    )
    return PrefixGroups(group_of, skip, n) if n > 0 else None


def paged_decode_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    out_cache_loc: torch.Tensor | None = None,
    groups: PrefixGroups | None = None,
) -> torch.Tensor:
    """Decode attention reading K/V in place from the pool.

    q: [B, Hq, D] (any batch stride; heads and D contiguous), k_buf/v_buf: [slots, Hk, D],
    req_to_token: [rows, max_context] int64, req_pool_indices/seq_lens: [B] int64 contiguous
    -> [B, Hq, D] in q's dtype. With k_new/v_new ([B, Hk, D], q's dtype) and out_cache_loc
    ([B] int64, each request's last slot), this step's K/V are stored into the pool first.
    With `groups` (decode_prefix_groups of the same batch), each group's shared slots are
    attended once for all its requests and merged with their own slots' part.
    """
    lib = _require()
    bs, hq, d = q.shape
    hk = k_buf.shape[1]
    q, q_stride = _rows(q)
    if not (k_buf.is_contiguous() and v_buf.is_contiguous() and req_to_token.stride(1) == 1):
        raise ValueError("the KV pool buffers and req_to_token must be contiguous")
    store = k_new is not None
    if store:
        if v_new is None or out_cache_loc is None or k_new.dtype != q.dtype or v_new.dtype != q.dtype:
            raise ValueError("k_new, v_new and out_cache_loc go together, k_new/v_new in q's dtype")
        k_new, k_stride = _rows(k_new)
        v_new, v_stride = _rows(v_new)
        out_cache_loc = out_cache_loc.to(torch.int64).contiguous()
    out = torch.empty((bs, hq, d), dtype=q.dtype)
    rc = lib.paged_decode_attention_grouped(
        q.data_ptr(),
        _DTYPE_CODES[q.dtype],
        q_stride,
        k_new.data_ptr() if store else None,
        k_stride if store else 0,
        v_new.data_ptr() if store else None,
        v_stride if store else 0,
        out_cache_loc.data_ptr() if store else None,
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        _DTYPE_CODES[k_buf.dtype],
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        req_pool_indices.data_ptr(),
        seq_lens.data_ptr(),
        bs,
        hq,
        hk,
        d,
        float(scale),
        out.data_ptr(),
        groups.group_of.data_ptr() if groups is not None else None,
        groups.skip.data_ptr() if groups is not None else None,
        groups.count if groups is not None else 0,
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged_decode_attention failed (code {rc}) for Hq={hq}, Hk={hk}, D={d}")
    return out


def paged_extend_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal prefill attention, every key (cached prefix and this pass's, already stored) read
    from the pool. q: [T, Hq, D] (the batch's new tokens, request after request; any token
    stride), per-request [B] int64 contiguous tensors -> [T, Hq, D] in q's dtype."""
    lib = _require()
    t, hq, d = q.shape
    q, q_stride = _rows(q)
    if not (k_buf.is_contiguous() and v_buf.is_contiguous() and req_to_token.stride(1) == 1):
        raise ValueError("the KV pool buffers and req_to_token must be contiguous")
    out = torch.empty((t, hq, d), dtype=q.dtype)
    rc = lib.paged_extend_attention(
        q.data_ptr(),
        _DTYPE_CODES[q.dtype],
        q_stride,
        k_buf.data_ptr(),
        v_buf.data_ptr(),
        _DTYPE_CODES[k_buf.dtype],
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        req_pool_indices.data_ptr(),
        prefix_lens.data_ptr(),
        extend_lens.data_ptr(),
        extend_starts.data_ptr(),
        int(req_pool_indices.numel()),
        hq,
        k_buf.shape[1],
        d,
        float(scale),
        out.data_ptr(),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"paged_extend_attention failed (code {rc}) for Hq={hq}, Hk={k_buf.shape[1]}, D={d}")
    return out


# ---- rotary embedding (rope.c) ------------------------------------------------------
def fused_ready(x: torch.Tensor) -> bool:
    """True when the fused C ops can take `x`: built, a CPU tensor of a supported dtype, not under
    torch.compile (which cannot trace a ctypes call). Callers fall back to torch ops otherwise."""
    if x.device.type != "cpu" or x.dtype not in _DTYPE_CODES or torch.compiler.is_compiling():
        return False
    if _lib is None and not _tried:
        _load()
    return _lib is not None


def _require() -> ctypes.CDLL:
    if _lib is None and unavailable_reason():
        raise RuntimeError(unavailable_reason())
    return _lib


def rope_inplace(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x[t, h] = x * cos[t] + flip_halves(x) * sin[t] in place (the signed-sin layout of
    rotary_embedding.apply_rotary) for x [T, H, D] with heads and D contiguous, any row stride;
    cos/sin [T, 1, D] rows with a common stride, x's dtype. Returns x."""
    t, h, d = x.shape
    if (
        x.stride(2) != 1
        or x.stride(1) != d
        or cos.stride(-1) != 1
        or sin.stride(-1) != 1
        or cos.stride(0) != sin.stride(0)
        or cos.dtype != x.dtype
        or sin.dtype != x.dtype
        or d > 512
        or d % 2
    ):
        raise ValueError("rope_inplace: unsupported layout or dtype")
    _require().wb_rope_inplace(
        x.data_ptr(),
        x.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        cos.stride(0),
        t,
        h,
        d,
        _DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    return x


# ---- RMSNorm (rms_norm.c) -------------------------------------------------------------------
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """(x * rsqrt(mean(x^2) + eps)) * weight for x [T, H] with unit inner stride (rows may be
    strided), summed in double and rounded once; see rms_norm.c for how it compares to ATen."""
    if x.dim() != 2 or x.stride(1) != 1:
        x = x.contiguous().view(-1, x.shape[-1])
    t, h = x.shape
    weight = weight.to(x.dtype).contiguous()
    out = torch.empty((t, h), dtype=x.dtype)
    _require().wb_rms_norm(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        out.data_ptr(),
        t,
        h,
        float(eps),
        _DTYPE_CODES[x.dtype],
        torch.get_num_threads(),
    )
    return out


# ---- linear for a few input rows, float32 or bfloat16 weights (gemv.c) -----------------------
# Rows of x up to which `gemv` replaces oneDNN's packed GEMM. Measured on the 2-core AVX2 target
# (docs/design.md): at one row it streams the weights ~1.4-2x faster than oneDNN on the layers'
# shapes and as fast on the LM head; at 2-4 rows the two trade places shape by shape (the LM head
# and gate_up slower), so only a batch of one takes it.
GEMV_MAX_ROWS = 1
_GEMV_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1}


def gemv_bf16_rounds_x() -> bool:
    """Whether `gemv` on bfloat16 weights rounds x to bfloat16 and multiplies with AVX512_BF16's
    dot-product instruction (float32 sums, as oneDNN's bfloat16 GEMM does), rather than widening
    the weights to float32 (then the result equals float32 on the same values, bit for bit)."""
    return bool(_require().wb_gemv_bf16_rounds_x())


def gemv_ready(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when `gemv` should compute x @ weight.T: a float32 or bfloat16 weight, x of the weight's
    dtype or float32, on the CPU, x 2-D with at most GEMV_MAX_ROWS rows, the kernel built with its
    AVX2 + FMA path and not switched off (WORKBENCH_CPU_GEMV=0), and not under torch.compile (which
    cannot trace a ctypes call)."""
    if (
        weight.dtype not in _GEMV_WEIGHT_CODES
        or x.dtype not in (torch.float32, weight.dtype)
        or x.dim() != 2
        or x.shape[0] > GEMV_MAX_ROWS
        or x.device.type != "cpu"
        or torch.compiler.is_compiling()
    ):
        return False
    if _lib is None and not _tried:
        _load()
    return _gemv_ok


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) (+ residual), summed in float32: x [M, K], weight [N, K] float32 or
    bfloat16 (rows may be strided, elements contiguous), bias [N], residual [M, N] -> a new
    float32 [M, N] (x, bias and residual are widened to float32 first). Any M is correct; it is
    fast for a few rows (see GEMV_MAX_ROWS)."""
    return call_linear_kernel(_require().wb_gemv, "gemv", x, weight, bias, residual)


def call_linear_kernel(
    fn, name: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None
) -> torch.Tensor:
    """Check and widen the operands of a C linear kernel with gemv's signature (wb_gemv, and
    batch_invariant's wb_bi_linear), call `fn` and return its new float32 [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype not in _GEMV_WEIGHT_CODES or not x.dtype.is_floating_point:
        raise ValueError(f"{name}: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}")
    x = x.to(torch.float32)
    if x.stride(1) != 1:
        x = x.contiguous()
    if weight.stride(1) != 1:
        weight = weight.contiguous()
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    if residual is not None:
        if residual.shape != (m, n):
            raise ValueError(f"{name}: residual {tuple(residual.shape)} is not [{m}, {n}]")
        residual = residual.to(torch.float32)
        if residual.stride(1) != 1:
            residual = residual.contiguous()
    out = torch.empty((m, n), dtype=torch.float32)
    if m == 0:
        return out
    fn(
        x.data_ptr(),
        x.stride(0),
        weight.data_ptr(),
        weight.stride(0),
        _GEMV_WEIGHT_CODES[weight.dtype],
        bias.data_ptr() if bias is not None else None,
        residual.data_ptr() if residual is not None else None,
        residual.stride(0) if residual is not None else 0,
        out.data_ptr(),
        n,
        m,
        n,
        k,
        torch.get_num_threads(),
    )
    return out


# ---- every decoder layer for one decode token (decode_layers.c) -------------------------------
# Per layer: w_in, w_qkv, b_qkv, w_o, b_o, w_post, w_gu, b_gu, w_down, b_down, k_buf, v_buf (the
# order of decode_layers.c's enum); 0 stands for no bias.
DECODE_LAYER_FIELDS = 12
# Tokens of one request one call takes: a decode step (1), a speculative verify pass (1 + drafts) or a
# short prompt piece. Beyond a few rows the GEMV's advantage over oneDNN's GEMM is gone (gemv.c).
FUSED_MAX_TOKENS = 8


def fused_decode_enabled() -> bool:
    """Whether batch-1 decode may run its decoder layers in one call (decode_layers.c):
    the library has its GEMV path (gemv_ready's conditions) and WORKBENCH_CPU_FUSED_DECODE is
    not 0 (set it to 0 to compare with, or profile, the op-by-op path)."""
    if _lib is None and not _tried:
        _load()
    return _gemv_ok and os.environ.get("WORKBENCH_CPU_FUSED_DECODE", "1") != "0"


def decode_layers_f32(
    x: torch.Tensor,
    table: torch.Tensor,
    *,
    hidden: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate: int,
    eps: float,
    scale: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv_dtype: torch.dtype,
    out_cache_loc: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    weight_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Run every layer of `table` ([L, DECODE_LAYER_FIELDS] int64 pointers, see above) on the
    residual streams x ([T, hidden] float32, T consecutive tokens of one request, at most
    FUSED_MAX_TOKENS; updated in place and returned). The table's four projection weights are of
    `weight_dtype` (float32 or bfloat16); its norm weights and biases are float32. cos/sin: their rope rows ([T, 1, head_dim]
    float32); out_cache_loc [T], req_pool_indices and seq_lens [1] int64 (seq_lens counts these T
    tokens); req_to_token: the pool's table (unit inner stride)."""
    t = x.shape[0] if x.dim() == 2 else 0
    if not 1 <= t <= FUSED_MAX_TOKENS or x.shape[1] != hidden or x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(
            f"decode_layers_f32: x must be [T <= {FUSED_MAX_TOKENS}, {hidden}] contiguous float32, not {tuple(x.shape)}"
        )
    if out_cache_loc.numel() != t or cos.shape[0] != t or sin.shape[0] != t:
        raise ValueError("decode_layers_f32: one KV slot and one rope row per token")
    if table.dtype != torch.int64 or table.dim() != 2 or table.shape[1] != DECODE_LAYER_FIELDS:
        raise ValueError("decode_layers_f32: the layer table must be [L, DECODE_LAYER_FIELDS] int64")
    if cos.dtype != torch.float32 or sin.dtype != torch.float32 or kv_dtype not in _DTYPE_CODES:
        raise ValueError("decode_layers_f32: rope rows must be float32 and the pool a supported dtype")
    if weight_dtype not in _GEMV_WEIGHT_CODES:
        raise ValueError(f"decode_layers_f32: projection weights must be float32 or bfloat16, not {weight_dtype}")
    if req_to_token.stride(1) != 1:
        raise ValueError("decode_layers_f32: req_to_token must have a unit inner stride")
    cos, sin = cos.contiguous(), sin.contiguous()
    loc, rows, lens = (t.to(torch.int64).contiguous() for t in (out_cache_loc, req_pool_indices, seq_lens))
    rc = _require().wb_decode_layers(
        x.data_ptr(),
        t,
        table.data_ptr(),
        table.shape[0],
        _GEMV_WEIGHT_CODES[weight_dtype],
        hidden,
        num_q_heads,
        num_kv_heads,
        head_dim,
        intermediate,
        float(eps),
        cos.data_ptr(),
        sin.data_ptr(),
        _DTYPE_CODES[kv_dtype],
        loc.data_ptr(),
        req_to_token.data_ptr(),
        req_to_token.stride(0),
        rows.data_ptr(),
        lens.data_ptr(),
        float(scale),
        torch.get_num_threads(),
    )
    if rc != 0:
        raise RuntimeError(f"wb_decode_layers failed (code {rc}) for Hq={num_q_heads}, Hk={num_kv_heads}")
    return x
