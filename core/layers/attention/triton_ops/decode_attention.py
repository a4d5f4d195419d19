"""Decode attention in Triton: split-KV (flash-decoding) with a reduction stage.

One query token per request attends to its `seq_len` keys, which live anywhere in
the token-slot pool: key j of request b is slot `req_to_token[req_pool_indices[b], j]`.

Stage 1 (grid: batch x KV heads x splits): each program takes one KV head and all
the query heads that share it (GQA: a [BLOCK_H, D] tile of queries against one
K/V stream, so the KV is read once per group, not once per query head), and one
contiguous split of the sequence. It writes the split's own attention output
(normalised by the split's softmax sum) and the split's log-sum-exp.
Stage 2 (grid: batch x query heads) merges the splits by their log-sum-exps.

Splitting matters for small batches with long sequences, where batch x heads
programs alone would leave most of a GPU idle. The split count is fixed (a
constexpr), and every length is read on device, so one launch configuration
serves any batch: the kernels are CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_grouped_split_kernel(
    Q,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Seq_lens,
    Att_Out,
    Att_Lse,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_req,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    KV_GROUP: tl.constexpr,
    Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_kv_head = tl.program_id(1)
    split_id = tl.program_id(2)

    offs_g = tl.arange(0, BLOCK_H)
    cur_head = cur_kv_head * KV_GROUP + offs_g
    mask_h = (offs_g < KV_GROUP) & (cur_head < Q_HEADS)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    seq_len = tl.load(Seq_lens + cur_batch)
    req_row = tl.load(Req_pool_indices + cur_batch)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    split_start = split_len * split_id
    split_end = tl.minimum(split_start + split_len, seq_len)

    # Padded query heads load zeros: their scores are finite, so no NaN enters the max/sum.
    q = tl.load(
        Q + cur_batch * stride_qb + cur_head[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )

    e_max = tl.zeros([BLOCK_H], dtype=tl.float32) - float("inf")
    e_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    if split_end > split_start:
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            slots = tl.load(Req_to_token + req_row * stride_req + offs_n, mask=mask_n, other=0)
            k = tl.load(
                K_Buffer + slots[None, :] * stride_kbs + cur_kv_head * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )  # [D, N]
            qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * sm_scale  # [H, N]
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            v = tl.load(
                V_Buffer + slots[:, None] * stride_vbs + cur_kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )  # [N, D]
            acc = acc * re_scale[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max

        out_ptr = (
            Att_Out + cur_batch * stride_ob + cur_head[:, None] * stride_oh + split_id * stride_os + offs_d[None, :]
        )
        tl.store(out_ptr, acc / e_sum[:, None], mask=mask_h[:, None] & mask_d[None, :])
        lse_ptr = Att_Lse + cur_batch * stride_lb + cur_head * stride_lh + split_id
        tl.store(lse_ptr, e_max + tl.log(e_sum), mask=mask_h)


@triton.jit
def _decode_reduce_kernel(
    Att_Out,
    Att_Lse,
    O,
    Seq_lens,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_b,
    stride_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_KV_SPLITS: tl.constexpr,
):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    seq_len = tl.load(Seq_lens + cur_batch)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    e_sum = 0.0
    e_max = -float("inf")
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    split_len = tl.cdiv(seq_len, NUM_KV_SPLITS)
    for split_id in range(0, NUM_KV_SPLITS):
        split_start = split_len * split_id
        split_end = tl.minimum(split_start + split_len, seq_len)
        # Empty splits (short sequences) wrote nothing: skip them, never read their garbage.
        if split_end > split_start:
            tv = tl.load(
                Att_Out + cur_batch * stride_ob + cur_head * stride_oh + split_id * stride_os + offs_d,
                mask=mask_d,
                other=0.0,
            )
            tlse = tl.load(Att_Lse + cur_batch * stride_lb + cur_head * stride_lh + split_id)
            n_e_max = tl.maximum(tlse, e_max)
            old_scale = tl.exp(e_max - n_e_max)
            w = tl.exp(tlse - n_e_max)
            acc = acc * old_scale + w * tv
            e_sum = e_sum * old_scale + w
            e_max = n_e_max

    tl.store(O + cur_batch * stride_b + cur_head * stride_h + offs_d, (acc / e_sum).to(O.dtype.element_ty), mask=mask_d)


def _precision(dtype: torch.dtype) -> str:
    # float32 models get exact float32 products (TF32 would make greedy tokens drift from the reference).
    return "ieee" if dtype == torch.float32 else "tf32"


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    att_out: torch.Tensor,
    att_lse: torch.Tensor,
    num_kv_splits: int,
    sm_scale: float,
) -> None:
    """o[b] = softmax(q[b] K_b^T * sm_scale) V_b over request b's pooled keys.

    q, o: [B, Hq, D]; k_buffer, v_buffer: [slots, Hk, D]; req_to_token: [rows, max_len];
    req_pool_indices, seq_lens: [B]; att_out: [>=B, Hq, num_kv_splits, D] float32 and
    att_lse: [>=B, Hq, num_kv_splits] float32 scratch (preallocated for CUDA graphs).
    """
    bs, hq, d = q.shape
    hk = k_buffer.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    group = hq // hk
    block_d = max(16, triton.next_power_of_2(d))
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs tiles of at least 16
    _decode_grouped_split_kernel[(bs, hk, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        att_out,
        att_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        KV_GROUP=group,
        Q_HEADS=hq,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_N=32,
        NUM_KV_SPLITS=num_kv_splits,
        PRECISION=_precision(q.dtype),
    )
    _decode_reduce_kernel[(bs, hq)](
        att_out,
        att_lse,
        o,
        seq_lens,
        att_out.stride(0),
        att_out.stride(1),
        att_out.stride(2),
        att_lse.stride(0),
        att_lse.stride(1),
        o.stride(0),
        o.stride(1),
        HEAD_DIM=d,
        BLOCK_D=block_d,
        NUM_KV_SPLITS=num_kv_splits,
    )
