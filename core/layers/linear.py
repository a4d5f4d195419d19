"""Tensor-parallel-aware linear layers (Megatron style), with a CPU fast path.

Each layer holds only its rank's shard and knows how to cut that shard out of a
full checkpoint tensor (`weight_loader`). With tp_size 1 they are plain linears.
- ColumnParallelLinear: output features split across ranks (no communication).
- RowParallelLinear: input features split; partial outputs all-reduced. It can
  add the residual stream in the same call (one op fewer per block).
- QKVParallelLinear / MergedColumnParallelLinear: several column-parallel
  projections fused into one matmul (fewer ops per layer matters on CPU).

CPU fast path: after loading, `process_weights_after_loading(pack=True)` reorders
each weight into oneDNN's blocked layout once. Measured on the 2-core target,
a decode-sized GEMM (M=1) on packed weights streams ~2x the bandwidth of
`F.linear` on the plain row-major weight (which goes through MKL's gemv), and
the residual add rides along as a oneDNN post-op. The plain `weight` parameter
stays (named-parameter lookups, weight updates); the packed copy is derived.

At one row of input (decode at batch 1) the compiled GEMV (cpu_ops.gemv, gemv.c) on the plain
float32 or bfloat16 weight replaces oneDNN, which streams the weights well below the memory
bandwidth at M=1 (docs/design.md); it also serves bfloat16 weights where oneDNN has no bfloat16
GEMM (AVX2 CPUs, where they stay unpacked). WORKBENCH_CPU_GEMV=0 turns it off.

At more rows (batched decode, prefill chunks) each weight also gets gemm.c's packed copy
(cpu_ops/gemm.py), used for the row counts where it measured faster than the path above at load
(float32: oneDNN; bfloat16 on AVX2: torch's slow bfloat16 GEMM, which widening beats many times
over). Where it wins at every row count, oneDNN's copy is dropped. WORKBENCH_CPU_GEMM=0/1 forces.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from workbench.core.layers import cpu_ops
from workbench.core.layers.cpu_ops import gemm as cpu_gemm

_PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
_GEMM_PROBE_MAX_N = 4096  # output columns pack_gemm_weight measures at most


def _divide(a: int, b: int, what: str) -> int:
    if a % b:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor-parallel size ({b})")
    return a // b


def can_pack_for_cpu(weight: torch.Tensor) -> bool:
    """True if `weight` can take the oneDNN packed-GEMM path (CPU, fp32/bf16, oneDNN built in).

    bfloat16 also needs oneDNN's bf16 kernels, which need AVX-512 (BW/VL/DQ) or AVX-NE-CONVERT:
    on an AVX2-only CPU packing raises, so bf16 weights there stay unpacked (torch's own GEMM).
    """
    if not (
        weight.device.type == "cpu"
        and weight.dtype in _PACKABLE_DTYPES
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    ):
        return False
    return weight.dtype != torch.bfloat16 or _mkldnn_bf16_supported()


def _mkldnn_bf16_supported() -> bool:
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    try:
        return bool(check()) if check is not None else True
    except RuntimeError:
        return False


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN-blocked copy of a [out, in] weight, or None where that path is unavailable."""
    if not can_pack_for_cpu(weight):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ W.T (+ bias) (+ residual) on a weight from `pack_linear_weight`."""
    if residual is not None:
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_gemm_weight(weight: torch.Tensor, onednn: torch.Tensor | None) -> cpu_gemm.PackedGemmWeight | None:
    """gemm.c's packed copy of a CPU [out, in] weight, with the row buckets where it measured faster
    than the path this weight takes otherwise (`onednn`, pack_linear_weight's copy, else F.linear);
    None where it is unavailable (no AVX2, WORKBENCH_CPU_GEMM=0) or never faster."""
    if weight.device.type != "cpu" or weight.dtype not in _PACKABLE_DTYPES or weight.dim() != 2:
        return None
    if not cpu_gemm.available():
        return None
    packed = cpu_gemm.pack(weight)
    # A big weight (the LM head) is measured on its first rows: time per output column is what counts,
    # and a whole vocabulary at 256 rows would take seconds of start-up on torch's bfloat16 path.
    probe = weight[:_GEMM_PROBE_MAX_N]
    probe_packed = packed if probe.shape[0] == weight.shape[0] else cpu_gemm.pack(probe)
    probe_onednn = onednn if probe_packed is packed or onednn is None else pack_linear_weight(probe)

    def torch_linear(x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, probe_onednn, None) if probe_onednn is not None else F.linear(x, probe)

    torch_linear.onednn = probe_onednn is not None  # type: ignore[attr-defined]  # part of the measurement's key
    packed.use = cpu_gemm.choose(probe_packed, torch_linear)
    return packed if any(packed.use) else None


def gemm_ready(x: torch.Tensor, packed: cpu_gemm.PackedGemmWeight | None) -> bool:
    """True when gemm.c should compute x @ W.T: a packed copy that won at this many rows, x 2-D on
    the CPU with more rows than the GEMV takes, and not under torch.compile."""
    return (
        packed is not None
        and x.dim() == 2
        and x.shape[0] > cpu_ops.GEMV_MAX_ROWS
        and packed.wins(x.shape[0])
        and x.device.type == "cpu"
        and x.dtype.is_floating_point
        and not torch.compiler.is_compiling()
    )


class LinearBase(nn.Module):
    """Holds `weight`/`bias` and the optional packed copy; subclasses define the sharding."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def __init__(self):
        super().__init__()
        self.packed_weight: torch.Tensor | None = None
        # The CPU fast paths were asked for (packing, the batch-1 GEMV). Kept apart from
        # packed_weight, which stays None where oneDNN cannot pack this dtype.
        self.cpu_fast_path = False
        # gemm.c's packed copy (cpu_ops/gemm.py) where it measured faster than torch at load, else None.
        self.gemm_weight: cpu_gemm.PackedGemmWeight | None = None
        # Multi-LoRA (core/lora/): adds the running batch's adapter deltas to this layer's output.
        self.lora_hook = None

    def process_weights_after_loading(self, pack: bool = True) -> None:
        """Derive the packed copies (call again after any weight update)."""
        self.cpu_fast_path = pack and self.weight.device.type == "cpu"
        self.packed_weight = pack_linear_weight(self.weight) if pack else None
        self.gemm_weight = pack_gemm_weight(self.weight, self.packed_weight) if self.cpu_fast_path else None
        if self.gemm_weight is not None and all(self.gemm_weight.use):
            self.packed_weight = None  # batch 1 takes the GEMV and every batch gemm.c: oneDNN's copy is unused

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None = None) -> torch.Tensor:
        # Under torch.compile the plain weight is traced (inductor does its own packing).
        if self.cpu_fast_path and cpu_ops.gemv_ready(x, self.weight):
            return cpu_ops.gemv(x, self.weight, bias, residual).to(x.dtype)
        if self.cpu_fast_path and gemm_ready(x, self.gemm_weight):
            return cpu_gemm.gemm(x, self.gemm_weight, bias, residual).to(x.dtype)
        if self.packed_weight is not None and x.dtype == self.weight.dtype and not torch.compiler.is_compiling():
            return packed_linear(x, self.packed_weight, bias, residual)
        out = F.linear(x, self.weight, bias)
        return out if residual is None else out + residual


class ColumnParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.output_size_per_partition = _divide(output_size, self.tp_size, "output size")
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(self.output_size_per_partition), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = param.shape[0]
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._matmul(x, self.bias)
        return out if self.lora_hook is None else self.lora_hook(x, out)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stacked in one weight (e.g. gate_proj + up_proj)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = output_sizes

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int = 0) -> None:
        sizes = [s // self.tp_size for s in self.output_sizes]
        offset = sum(sizes[:shard_id])
        n = sizes[shard_id]
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """Q, K and V projections fused; heads split across ranks (KV heads must divide too)."""

    def __init__(
        self, hidden_size: int, head_dim: int, total_num_heads: int, total_num_kv_heads: int, bias: bool = False
    ):
        tp = get_tp_size()
        self.num_heads = _divide(total_num_heads, tp, "number of attention heads")
        self.num_kv_heads = _divide(total_num_kv_heads, tp, "number of key/value heads")
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str = "q") -> None:
        q = self.num_heads * self.head_dim
        kv = self.num_kv_heads * self.head_dim
        offset, n = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard_id]
        param.data.narrow(0, offset, n).copy_(loaded.narrow(0, self.tp_rank * n, n))


class RowParallelLinear(LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.input_size_per_partition = _divide(input_size, self.tp_size, "input size")
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if param.dim() == 1:  # the bias is not split; only rank 0 adds it (see forward)
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T (+ bias), all-reduced across ranks, then + residual if given."""
        bias: torch.Tensor | None = self.bias if self.tp_rank == 0 else None
        if self.tp_size == 1:
            out = self._matmul(x, bias, residual)
            return out if self.lora_hook is None else self.lora_hook(x, out)
        # Partial sums must be reduced before the residual joins (it is not split). A LoRA delta
        # of this rank's input shard is a partial sum too: it joins before the reduce.
        out = self._matmul(x, bias)
        if self.lora_hook is not None:
            out = self.lora_hook(x, out)
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out if residual is None else out + residual
