"""Extend (prefill) attention in Triton: a cached prefix from the token-slot pool plus new tokens, causal.

Request b brings `extend_seq_lens[b]` new tokens (rows `extend_start_loc[b]...` of
q/k/v_extend) on top of `prefix_lens[b]` tokens whose K/V are already in the pool
(slots `req_to_token[req_pool_indices[b], :prefix_len]`). A new token at extend
position i sees every prefix key and new keys 0..i.

Grid: batch x query heads x blocks of BLOCK_M new tokens. Each program runs one
online softmax over two key streams: the prefix, gathered from the pool through
the request's row (no mask: every query sees all of it), then the new tokens,
read contiguously from k/v_extend with the causal mask. Query head h reads KV
head h // group (GQA). Scores and the accumulator are float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _extend_kernel(
    Q_Extend,
    K_Extend,
    V_Extend,
    O_Extend,
    K_Buffer,
    V_Buffer,
    Req_to_token,
    Req_pool_indices,
    Prefix_lens,
    Extend_lens,
    Extend_start_loc,
    sm_scale,
    stride_qbs,
    stride_qh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_obs,
    stride_oh,
    stride_buf_kbs,
    stride_buf_kh,
    stride_buf_vbs,
    stride_buf_vh,
    stride_req,
    KV_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    cur_seq = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block_m = tl.program_id(2)
    cur_kv_head = cur_head // KV_GROUP

    ext_len = tl.load(Extend_lens + cur_seq)
    ext_start = tl.load(Extend_start_loc + cur_seq)
    prefix_len = tl.load(Prefix_lens + cur_seq)
    req_row = tl.load(Req_pool_indices + cur_seq)

    # The grid is sized for the longest request; shorter ones have nothing in the upper blocks.
    if cur_block_m * BLOCK_M < ext_len:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        offs_m = cur_block_m * BLOCK_M + tl.arange(0, BLOCK_M)
        mask_m = offs_m < ext_len
        q = tl.load(
            Q_Extend + (ext_start + offs_m)[:, None] * stride_qbs + cur_head * stride_qh + offs_d[None, :],
            mask=mask_m[:, None] & mask_d[None, :],
            other=0.0,
        )

        e_max = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        e_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

        # 1) the cached prefix, through the request's slot row
        for start_n in range(0, prefix_len, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < prefix_len
            slots = tl.load(Req_to_token + req_row * stride_req + offs_n, mask=mask_n, other=0)
            k = tl.load(
                K_Buffer + slots[None, :] * stride_buf_kbs + cur_kv_head * stride_buf_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )  # [D, N]
            qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * sm_scale
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            v = tl.load(
                V_Buffer + slots[:, None] * stride_buf_vbs + cur_kv_head * stride_buf_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )  # [N, D]
            acc = acc * re_scale[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max

        # 2) the new tokens, causal: keys past this block's last query are never needed
        end_n = tl.minimum((cur_block_m + 1) * BLOCK_M, ext_len)
        for start_n in range(0, end_n, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < ext_len
            k = tl.load(
                K_Extend + (ext_start + offs_n)[None, :] * stride_kbs + cur_kv_head * stride_kh + offs_d[:, None],
                mask=mask_n[None, :] & mask_d[:, None],
                other=0.0,
            )
            qk = tl.dot(q, k.to(q.dtype), input_precision=PRECISION) * sm_scale
            # Key 0 is always visible, so every row has a finite score in the first block: no NaN.
            visible = (offs_m[:, None] >= offs_n[None, :]) & mask_n[None, :]
            qk = tl.where(visible, qk, float("-inf"))
            n_e_max = tl.maximum(tl.max(qk, 1), e_max)
            re_scale = tl.exp(e_max - n_e_max)
            p = tl.exp(qk - n_e_max[:, None])
            v = tl.load(
                V_Extend + (ext_start + offs_n)[:, None] * stride_vbs + cur_kv_head * stride_vh + offs_d[None, :],
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            )
            acc = acc * re_scale[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
            e_sum = e_sum * re_scale + tl.sum(p, 1)
            e_max = n_e_max

        tl.store(
            O_Extend + (ext_start + offs_m)[:, None] * stride_obs + cur_head * stride_oh + offs_d[None, :],
            (acc / e_sum[:, None]).to(O_Extend.dtype.element_ty),
            mask=mask_m[:, None] & mask_d[None, :],
        )


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
) -> None:
    """Causal attention of every request's new tokens over its prefix (pool) and themselves.

    q/o_extend: [T, Hq, D]; k/v_extend: [T, Hk, D] (this pass's new K/V); k/v_buffer:
    [slots, Hk, D]; req_pool_indices, prefix_lens, extend_seq_lens, extend_start_loc: [B].
    """
    t, hq, d = q_extend.shape
    hk = k_extend.shape[1]
    if hq % hk:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hk})")
    bs = int(req_pool_indices.shape[0])
    block_d = max(16, triton.next_power_of_2(d))
    block_m = 64 if max_extend_len > 32 else 32
    grid = (bs, hq, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        prefix_lens,
        extend_seq_lens,
        extend_start_loc,
        sm_scale,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_extend.stride(0),
        o_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        KV_GROUP=hq // hk,
        HEAD_DIM=d,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=32,
        PRECISION="ieee" if q_extend.dtype == torch.float32 else "tf32",
    )
