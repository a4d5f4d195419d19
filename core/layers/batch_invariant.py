"""Batch-invariant ops: `--enable-deterministic-inference` (SGLang's flag) on CPU.

A request's tokens and logprobs should not depend on which other requests share its batch, on
how much of its prompt was already cached, or on how its prompt was cut into chunks. They do
when a reduction's order depends on those: the engine's fast paths pick a kernel by the number
of rows (a batch-1 GEMV sums a row with two accumulators, a GEMM with one; a batch-1 decode runs
every layer in one compiled call, in float32 even for bfloat16 weights), prefill attends with
another kernel than decode (blocked over query rows and over the cached prefix), and decode
attends once per group over a shared prefix and merges (cascade attention). Each is bit-exact
for itself, but each sums in another order, and in bfloat16 one ulp can flip a greedy token.

Under the flag (`enable_batch_invariant_mode`, called by the ModelRunner after loading):
- every linear, and the LM head, is `bi_linear` (cpu_ops/batch_invariant.c): each output element is
  one FMA chain over K in order, the same instructions whatever M, the tile and the thread;
- RMSNorm is the compiled one-row-at-a-time kernel (rms_norm.c), also for float32;
- attention is `DeterministicCpuAttnBackend`: prefill, extend over a cached prefix, chunked
  prefill and decode all run the decode kernel (paged_attention.c), one query at a time over keys
  0..p in the same order, so a query's result depends on its keys only; no cascade groups;
- the batch-1 fused decode (decode_layers.c) and the torch.compile decode runner are not used.
What was already per row stays: embedding, RoPE, SiLU, the log-softmax and the sampler, whose
seeded requests draw from their own generator (sampler.py). With the flag off nothing here runs:
the patches are installed on the model's instances only when it is on.
"""

from __future__ import annotations

import ctypes
import subprocess
import threading
import types
from pathlib import Path

import torch
from workbench.core.layers import cpu_ops
from workbench.core.layers.attention.cpu_paged_backend import CpuPagedAttnBackend, PagedDecodeMetadata

_WEIGHT_CODES = {torch.float32: 0, torch.bfloat16: 1}
# Its own small library beside cpu_ops' (built the same way, at first use under the flag), so the
# default path's library and its build are untouched by it.
SOURCE = Path(cpu_ops.__file__).parent / "batch_invariant.c"
_lock = threading.Lock()
_bi_lib: ctypes.CDLL | None = None
_bi_error: str | None = None


def _lib() -> ctypes.CDLL:
    """The batch-invariant kernels, built once per machine; raises RuntimeError saying why not."""
    global _bi_lib, _bi_error
    with _lock:
        if _bi_lib is None and _bi_error is None:
            try:
                lib = cpu_ops.load_library([SOURCE], "workbench_batch_invariant")
                ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
                lib.wb_bi_linear.argtypes = [ptr, i64, ptr, i64, i32, ptr, ptr, i64, ptr, i64, i64, i64, i64, i32]
                lib.wb_bi_linear.restype = None
                lib.wb_bi_linear_available.restype = ctypes.c_int
                lib.wb_bi_topk_softmax.argtypes = [ptr, i64, i64, i64, i64, i32, ptr, ptr]
                lib.wb_bi_topk_softmax.restype = None
                _bi_lib = lib
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                _bi_error = f"the batch-invariant kernels are unavailable: {exc}"
    if _bi_lib is None:
        raise RuntimeError(_bi_error)
    return _bi_lib


def unavailable_reason(device: str, dtype: torch.dtype | None = None) -> str | None:
    """None when batch-invariant inference can run on `device` with `dtype`, else why not and what to do."""
    if device != "cpu":
        return (
            "--enable-deterministic-inference is implemented for CPU only here; on CUDA SGLang uses "
            "batch-invariant Triton kernels and FlashInfer/FA3 fixed-split attention (docs/deterministic.md). "
            "Drop the flag or run with --device cpu"
        )
    if dtype is not None and dtype not in _WEIGHT_CODES:
        return f"--enable-deterministic-inference supports float32 and bfloat16 models, not {dtype}; pass --dtype"
    reason = cpu_ops.unavailable_reason()
    if reason:
        return f"--enable-deterministic-inference needs the compiled CPU kernels: {reason}"
    try:
        lib = _lib()
    except RuntimeError as exc:
        return f"--enable-deterministic-inference: {exc}"
    if not lib.wb_bi_linear_available():
        return "--enable-deterministic-inference needs a CPU with AVX2 and FMA (its batch-invariant GEMM uses them)"
    return None


def bi_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias) (+ residual) as a new float32 [M, N]; row m's result depends only on
    x[m] (and residual[m]), never on M or the other rows. x [M, K] any float dtype; weight [N, K]
    float32 or bfloat16 with contiguous rows; bias [N]; residual [M, N]."""
    return cpu_ops.call_linear_kernel(_lib().wb_bi_linear, "bi_linear", x, weight, bias, residual)


def bi_topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's (weights [T, k] float32, ids [T, k] int64) from its logits [T, E], each row by itself
    in one fixed order (cpu_ops/batch_invariant.c): the softmax over the E experts, the top k (ties
    to the lower id), renormalised to sum to 1 when `renormalize`."""
    t, e = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"bi_topk_softmax: top_k={top_k} with {e} experts")
    logits = logits.to(torch.float32)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((t, top_k), dtype=torch.float32)
    ids = torch.empty((t, top_k), dtype=torch.int64)
    if t:
        _lib().wb_bi_topk_softmax(
            logits.data_ptr(), logits.stride(0), t, e, top_k, int(renormalize), weights.data_ptr(), ids.data_ptr()
        )
    return weights, ids


def bi_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """sum_k weight_k * down_e(silu(gate_e(x)) * up_e(x)) over the experts this rank holds, as a new
    float32 [T, H] whose row t depends on x[t] and its routing only.

    w13 [E_local, 2I, H] (gate rows, then up rows), w2 [E_local, H, I]; experts first_expert ..
    first_expert + E_local - 1 (others are another rank's). The tokens are grouped by expert, as
    the plain loop does, but each GEMM is `bi_linear` (a row's bits do not depend on how many
    tokens an expert received), and a token's terms are added in ascending expert id (the loop's
    order, whatever the batch) into float32, each a whole row at once."""
    from workbench.core.layers.activation import silu_and_mul

    t, k = topk_ids.shape
    out = torch.zeros((t, w2.shape[1]), dtype=torch.float32)
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=first_expert + w13.shape[0]).tolist()
    token_of, weight_of = order // k, topk_weights.reshape(-1)[order].to(torch.float32).unsqueeze(1)
    start = sum(counts[:first_expert])
    for local in range(w13.shape[0]):
        n = counts[first_expert + local]
        if n == 0:
            continue
        rows = token_of[start : start + n]
        h = bi_linear(x.index_select(0, rows), w13[local]).to(x.dtype)
        y = bi_linear(silu_and_mul(h), w2[local])
        out.index_add_(0, rows, y * weight_of[start : start + n])  # rows distinct: one add per element
        start += n
    return out


class DeterministicCpuAttnBackend(CpuPagedAttnBackend):
    """Attention whose result for a query depends only on that query and its keys 0..p.

    Every pass (prefill, extend over a cached prefix, a chunk, a decode step, a mixed batch) stores
    its K/V, then runs the decode kernel with one row per query token: row (request, p) reads the
    request's slots 0..p, scores them in order, takes one softmax over them and sums V in order.
    Prefill costs more than the blocked extend kernel (each query reads its keys itself); decode
    costs the same, less the shared-prefix grouping it gives up.
    """

    name = "cpu_paged"  # the kernels are cpu_paged's; the flag is what differs

    def __init__(self, group_size: int = 1):
        super().__init__(group_size)
        self.use_extend_kernel = True  # the model's checks read it; extend never reaches SDPA here
        self._window_tables: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def init_forward_metadata(self, fb) -> None:
        self._window_tables = {}  # built per pass, shared by its layers of one window
        if fb.forward_mode.is_decode():
            fb.attn_metadata = self._decode_metadata(fb.req_pool_indices, fb.seq_lens, fb)
            return
        rows, lens = [], []
        for row, prefix, n in zip(fb.req_pool_indices.tolist(), fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu):
            rows += [row] * n
            lens += range(prefix + 1, prefix + n + 1)
        fb.attn_metadata = PagedDecodeMetadata(
            torch.tensor(rows, dtype=torch.int64), torch.tensor(lens, dtype=torch.int64), torch.empty(0)
        )

    def forward(self, q, k, v, layer, fb) -> torch.Tensor:
        """Every layer one query per row; a sliding-window layer over its window's keys only."""
        if layer.logit_cap:  # model_unsupported_reason refuses such models before this runs
            raise ValueError(f"layer {layer.layer_id}: a logit soft-cap has no batch-invariant attention yet")
        if layer.sliding_window_size:
            return self._forward_window(q, k, v, layer, fb)
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb)
        return self.forward_extend(q, k, v, layer, fb)

    def _forward_window(self, q, k, v, layer, fb) -> torch.Tensor:
        """The query at position p reads keys max(0, p - window + 1) .. p in order, through a table of
        its own (row i: those keys' slots), so its sum is the decode kernel's over the same keys
        whatever the batch, and whether or not anything in the batch is past the window."""
        pool = fb.token_to_kv_pool
        if k.dtype != q.dtype or v.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        window = layer.sliding_window_size
        if window not in self._window_tables:
            self._window_tables[window] = self._window_table(fb, window)
        table, rows, lens = self._window_tables[window]
        return cpu_ops.paged_decode_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            table,
            rows,
            lens,
            layer.scaling,
        )

    @staticmethod
    def _window_table(fb, window: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        meta: PagedDecodeMetadata = fb.attn_metadata  # one row per query, its key count (decode or extend)
        full = meta.seq_lens
        lens = full.clamp(max=window)
        first = full - lens
        cols = first.unsqueeze(1) + torch.arange(int(lens.max()) if len(lens) else 0, dtype=torch.int64)
        cols = torch.minimum(cols, (full - 1).clamp(min=0).unsqueeze(1))  # past a row's keys: never read
        table = fb.req_to_token_pool.req_to_token[meta.req_pool_indices.unsqueeze(1), cols].to(torch.int64)
        rows = torch.arange(len(full), dtype=torch.int64)
        return table.contiguous(), rows, lens.contiguous()

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: PagedDecodeMetadata = fb.attn_metadata
        return cpu_ops.paged_decode_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            fb.req_to_token_pool.req_to_token,
            meta.req_pool_indices,
            meta.seq_lens,
            layer.scaling,
        )

    def init_forward_metadata_replay_cuda_graph(self, bs, req_pool_indices, seq_lens, seq_lens_cpu, fb) -> None:
        self._window_tables = {}
        super().init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_cpu, fb)

    def _decode_metadata(self, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, fb) -> PagedDecodeMetadata:
        def i64(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.int64).contiguous()

        # no shared-prefix groups: merging two partial softmaxes sums in another order
        return PagedDecodeMetadata(i64(req_pool_indices), i64(seq_lens), i64(fb.out_cache_loc))


def model_unsupported_reason(model: torch.nn.Module) -> str | None:
    """None when every layer of `model` has a batch-invariant path, else which one has not."""
    from workbench.core.layers.layernorm import RMSNorm
    from workbench.core.layers.linear import LinearBase
    from workbench.core.layers.moe import FusedMoE, SparseMoeBlock, TopKRouter
    from workbench.core.layers.radix_attention import RadixAttention

    for name, module in model.named_modules():
        if isinstance(module, RadixAttention) and module.logit_cap:
            return f"{name} soft-caps its attention logits, which has no batch-invariant path yet"
        kind = type(module).__name__
        if kind.endswith("Norm") and not isinstance(module, RMSNorm):
            return f"{name} is a {kind}, which has no batch-invariant path yet"
        if hasattr(module, "w13_weight") and not isinstance(module, FusedMoE):
            return f"{name} is a {kind}, whose experts have no batch-invariant path yet"
        if isinstance(module, SparseMoeBlock) and type(module.gate) is not TopKRouter:
            return f"{name} routes with a {type(module.gate).__name__}, which has no batch-invariant path yet"
    if not any(isinstance(m, LinearBase) for m in model.modules()):
        return "the model has no batch-invariant linear layers"
    return None


def enable_batch_invariant_mode(model: torch.nn.Module) -> None:
    """Route `model`'s linears, LM head and RMSNorms through the batch-invariant ops and turn off its
    batch-1 fused decode. Patches the instances (the classes, and any other model, stay as they are)."""
    from workbench.core.distributed.parallel_state import set_batch_invariant_all_reduce
    from workbench.core.layers.layernorm import RMSNorm
    from workbench.core.layers.linear import LinearBase
    from workbench.core.layers.moe import FusedMoE, TopKRouter

    set_batch_invariant_all_reduce(True)  # this process runs this model only; tp 1 never reduces
    for module in model.modules():
        if isinstance(module, TopKRouter):
            module.forward = types.MethodType(_router_forward, module)
        elif isinstance(module, FusedMoE):
            module.forward = types.MethodType(_experts_forward, module)
        elif isinstance(module, LinearBase):
            module.cpu_fast_path = False
            module.packed_weight = None
            module._matmul = types.MethodType(_linear_matmul, module)
        elif isinstance(module, RMSNorm):
            module.forward = types.MethodType(_rms_norm_forward, module)
        if hasattr(module, "_fused_decode_ready"):
            module._fused_decode_ready = types.MethodType(lambda self, hidden_states, fb: False, module)
    if hasattr(model, "compute_logits"):
        model.compute_logits = types.MethodType(_compute_logits, model)
    model.batch_invariant = True


def _linear_matmul(self, x: torch.Tensor, bias, residual=None) -> torch.Tensor:
    return bi_linear(x, self.weight, bias, residual).to(x.dtype)


def _router_forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return bi_topk_softmax(bi_linear(x, self.weight), self.top_k, self.renormalize)


def _experts_forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    from workbench.core.distributed.parallel_state import tensor_model_parallel_all_reduce

    self.last_topk_ids = topk_ids
    self.last_counts = torch.bincount(topk_ids.reshape(-1), minlength=self.num_experts)
    out = bi_experts(x, self.w13_weight, self.w2_weight, topk_weights, topk_ids, self.first_expert)
    if self.tp_size > 1:  # in rank order under the flag (parallel_state.set_batch_invariant_all_reduce)
        out = tensor_model_parallel_all_reduce(out)
    return out.to(x.dtype)


def _rms_norm_forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
    if residual is not None:
        x = x + residual
        residual = x
    shape = x.shape
    out = cpu_ops.rms_norm(x.reshape(-1, shape[-1]), self.weight, self.eps).view(shape)
    return out if residual is None else (out, residual)


def _compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
    from workbench.core.distributed.parallel_state import tensor_model_parallel_all_gather

    head = self.lm_head
    if getattr(head, "tp_size", 1) > 1:  # this rank's vocab shard; the gather concatenates (exact)
        logits = tensor_model_parallel_all_gather(bi_linear(hidden, head.weight), dim=-1)[..., : self.vocab_size]
    else:
        logits = bi_linear(hidden, head.weight[: self.vocab_size])
    cap = getattr(self, "final_logit_softcapping", 0.0)
    return torch.tanh(logits / cap) * cap if cap else logits


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The LogitsProcessor's head under the flag: [T, H] x [V, H] -> [T, V] float32, per row."""
    return bi_linear(hidden.to(weight.dtype), weight)
