"""Attention with explicit scores, for what SDPA and the compiled kernels do not take: a sliding
window (Mistral, Gemma's local layers) and logit soft-capping (Gemma 2).

Every backend sends such a layer here (base_attn_backend.AttentionBackend.forward) only when it
changes the result: a window no shorter than the longest context in the batch is full attention,
so short requests keep the fast kernels. One request at a time, scores in float32:

    score[h, i, j] = scale * q[i, h] . k[j, h // group]          (GQA: `group` query heads per KV head)
    score = cap * tanh(score / cap)                                (logit_cap > 0)
    visible(i, j) = j <= pos(i) and pos(i) - j < window            (causal, then the window)

The KV of every position stays in the pool (nothing outside the window is evicted), so the radix
cache shares prefixes of windowed layers exactly as of full ones; the window is a mask, not a
smaller cache (docs/models.md says what that costs in memory).
"""

from __future__ import annotations

import torch


def needs_masked_path(layer, fb) -> bool:
    """Whether `layer` on this batch needs explicit scores (a cap always; a window only when some
    request's context is longer than it)."""
    if layer.logit_cap > 0:
        return True
    window = layer.sliding_window_size
    return window is not None and max(fb.seq_lens_cpu) > window


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer, fb) -> torch.Tensor:
    """Store this pass's K/V in the pool, then attend request by request.

    q: [T, Hq, D] (decode: one row per request; extend: each request's new tokens in order),
    k/v: [T, Hk, D] -> [T, Hq, D] in q's dtype.
    """
    pool = fb.token_to_kv_pool
    pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
    k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
    req_to_token = fb.req_to_token_pool.req_to_token
    rows = fb.req_pool_indices.tolist()
    if fb.forward_mode.is_decode():
        spans = [(i, 1, seq_len - 1) for i, seq_len in enumerate(fb.seq_lens_cpu)]
    else:
        spans = list(zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu))
    out = torch.empty_like(q)
    for row, seq_len, (start, n_new, first_pos) in zip(rows, fb.seq_lens_cpu, spans):
        slots = req_to_token[row, :seq_len].to(torch.int64)
        out[start : start + n_new] = attend(
            q[start : start + n_new],
            k_buf.index_select(0, slots),
            v_buf.index_select(0, slots),
            first_pos,
            layer.scaling,
            layer.sliding_window_size,
            layer.logit_cap,
        ).to(q.dtype)
    return out


def attend(q, k, v, first_pos: int, scale: float, window, cap: float) -> torch.Tensor:
    """One request: queries at positions first_pos .. first_pos + E - 1 over keys 0 .. S - 1.

    q: [E, Hq, D], k/v: [S, Hk, D] -> [E, Hq, D] float32.
    """
    e, hq, d = q.shape
    s, hk = k.shape[0], k.shape[1]
    group = hq // hk
    qf = q.float().transpose(0, 1)  # [Hq, E, D]
    kf = k.float().transpose(0, 1).repeat_interleave(group, dim=0)  # [Hq, S, D]
    vf = v.float().transpose(0, 1).repeat_interleave(group, dim=0)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scale  # [Hq, E, S]
    if cap > 0:
        scores = torch.tanh(scores / cap) * cap
    q_pos = torch.arange(first_pos, first_pos + e, device=q.device).unsqueeze(1)
    k_pos = torch.arange(s, device=q.device).unsqueeze(0)
    visible = k_pos <= q_pos
    if window is not None:
        visible &= (q_pos - k_pos) < window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), vf).transpose(0, 1)
