"""The experts of a MoE layer on CUDA: one grouped GEMM per projection in Triton, no host sync.

The CPU path (moe.py) loops over the experts that were hit, which needs the per-expert counts on
the host. Here everything stays on the device, with shapes fixed by the token count alone:

1. `align_by_expert`: the T x k (token, expert) assignments sorted by expert, each expert's run
   padded to a multiple of BLOCK_M with a sentinel, so every BLOCK_M-row block belongs to one expert
   (`expert_of_block`, -1 for blocks past the end or of experts this rank does not hold). The buffers
   have their worst-case size, T*k + E*(BLOCK_M - 1) rows, so nothing depends on the counts.
2. `_grouped_gemm_kernel` (grid: blocks x output tiles): C[a] = A[row(a)] @ B[e]^T for the
   assignments a of the block, optionally times a's routing weight. Run twice: gate/up from the
   token rows (row(a) = a // k) into [T*k, 2I], SiLU-and-mul in torch, then down from those rows
   into [T*k, H], weighted; the k rows of each token are summed at the end.

Expert parallelism: assignments to experts held by another rank go to a bucket whose blocks are
skipped, and their rows stay zero. The kernel runs under Triton's interpreter on CPU
(TRITON_INTERPRET=1), which is how the tests check it against the CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 32


def align_by_expert(
    topk_ids: torch.Tensor, first_expert: int, num_local: int, block_m: int = BLOCK_M
) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [P] int32: assignment indices grouped by local expert and padded with T*k;
    expert_of_block [P / block_m] int32: each block's local expert or -1). Device ops only."""
    dev = topk_ids.device
    n = topk_ids.numel()
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert
    bucket = torch.where((local >= 0) & (local < num_local), local, torch.full_like(local, num_local))
    buckets = num_local + 1  # the last one: experts another rank holds
    # scatter_add, not bincount: bincount sizes its output from the largest id, a host sync that a
    # CUDA graph cannot capture.
    counts = torch.zeros(buckets, dtype=torch.int64, device=dev).scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded  # where each bucket's run begins in sorted_ids
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    first_in_sorted = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - first_in_sorted[sorted_bucket]
    capacity = n + buckets * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=dev)
    sorted_ids[starts[sorted_bucket] + rank] = order.to(torch.int32)
    block_starts = torch.arange(0, capacity, block_m, device=dev)
    ends = torch.cumsum(padded, 0)
    expert_of_block = torch.searchsorted(ends, block_starts, right=True).to(torch.int32)
    expert_of_block = torch.where(expert_of_block < num_local, expert_of_block, torch.full_like(expert_of_block, -1))
    return sorted_ids, expert_of_block


@triton.jit
def _grouped_gemm_kernel(
    A,
    B,
    C,
    Sorted_ids,
    Expert_of_block,
    Weights,
    num_valid,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    TOP_K: tl.constexpr,
    A_ROW_IS_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(Expert_of_block + pid_m)
    if expert < 0:
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(Sorted_ids + offs_m)
    valid = rows < num_valid
    a_rows = rows // TOP_K if A_ROW_IS_TOKEN else rows
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(
            A + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & (offs_k[None, :] < K), other=0.0
        )
        b = tl.load(
            B + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None],
            mask=(offs_n[None, :] < N) & (offs_k[:, None] < K),
            other=0.0,
        )
        acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
    if MUL_WEIGHT:
        w = tl.load(Weights + rows, mask=valid, other=0.0)
        acc = acc * w[:, None]
    tl.store(
        C + rows[:, None] * stride_cm + offs_n[None, :],
        acc.to(C.dtype.element_ty),
        mask=valid[:, None] & (offs_n[None, :] < N),
    )


def _grouped_gemm(a, b, c, sorted_ids, expert_of_block, weights, top_k: int, a_row_is_token: bool) -> None:
    n, k = b.shape[1], b.shape[2]
    grid = (expert_of_block.numel(), triton.cdiv(n, BLOCK_N))
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        sorted_ids,
        expert_of_block,
        weights,
        c.shape[0],
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        TOP_K=top_k,
        A_ROW_IS_TOKEN=a_row_is_token,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    first_expert: int = 0,
) -> torch.Tensor:
    """x [T, H], w13 [E_local, 2I, H], w2 [E_local, H, I], topk_* [T, k] -> [T, H] in x's dtype: this
    rank's experts' weighted sum for every token (the caller all-reduces under TP)."""
    t, k = topk_ids.shape
    x = x.contiguous()
    inter = w2.shape[2]
    sorted_ids, expert_of_block = align_by_expert(topk_ids, first_expert, w13.shape[0])
    gate_up = torch.zeros(t * k, 2 * inter, dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, expert_of_block, None, k, True)
    act = (torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]).contiguous()
    out = torch.zeros(t * k, x.shape[1], dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, out, sorted_ids, expert_of_block, weights, 1, False)
    return out.view(t, k, -1).sum(dim=1)
