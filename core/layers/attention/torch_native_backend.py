"""Attention in plain PyTorch (SDPA) over the token-slot KV pool — the CPU default.

Decode: every request's key slots are laid out in one padded [B, L] table once per
pass (metadata, flattened for `index_select`, the cheapest gather), so each layer
is two gathers and a single batched SDPA call with a length mask.
Extend: one SDPA call per request — prefill is compute-bound, so the loop costs
little, and it handles ragged prefixes exactly (causal mask offset by the prefix).
A request with no cached prefix attends to its own new K/V directly (no gather).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from workbench.core.layers.attention.base_attn_backend import AttentionBackend

# Below this many K elements per layer, low-precision decode attention upcasts and
# uses the float32 SDPA kernel (measured crossover on the 2-core target: ~B*L = 200).
SMALL_DECODE_KV_ELEMENTS = 32768


@dataclass
class DecodeMetadata:
    kv_indices: torch.Tensor  # [B * Hk * L] rows of the pool viewed as [slots * Hk, D] (slot 0 = padding)
    max_len: int  # L
    mask: torch.Tensor | None  # [B, 1, 1, L] True where a key is valid; None if no padding
    invalid: torch.Tensor | None = None  # ~mask, for the low-precision path's masked_fill


@dataclass
class ExtendMetadata:
    kv_indices: list[torch.Tensor | None]  # per request: all its KV slots; None = use the new K/V
    masks: list[torch.Tensor | None]  # per request: [E, S] causal mask offset by the prefix, or None


def build_decode_metadata(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    seq_lens_cpu: list[int],
    num_kv_heads: int,
) -> DecodeMetadata:
    """The padded, head-major gather index and length mask of a decode batch."""
    slots = req_to_token.index_select(0, req_pool_indices)[:, : max(seq_lens_cpu)]
    return decode_metadata_from_slots(slots, seq_lens, seq_lens_cpu, num_kv_heads)


def decode_metadata_from_slots(
    slots: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int], num_kv_heads: int
) -> DecodeMetadata:
    """Metadata from a [B, L] table of KV slots (entries past a row's length are ignored).

    The pool is [slots, Hk, D]; viewed as [slots * Hk, D], row slot * Hk + h is head h
    of a slot. Gathering in (request, head, position) order yields K/V already laid
    out [B, Hk, L, D], which SDPA and the batched GEMMs take without another copy.
    """
    bs, max_len = len(seq_lens_cpu), max(seq_lens_cpu)
    slots = slots[:, :max_len]
    heads = torch.arange(num_kv_heads, device=slots.device).view(1, num_kv_heads, 1)
    kv_indices = (slots.unsqueeze(1) * num_kv_heads + heads).reshape(-1)
    if min(seq_lens_cpu) == max_len:
        return DecodeMetadata(kv_indices, max_len, None)
    mask = (torch.arange(max_len, device=seq_lens.device) < seq_lens.unsqueeze(1)).view(bs, 1, 1, max_len)
    return DecodeMetadata(kv_indices, max_len, mask, ~mask)


def decode_attention(
    q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, meta: DecodeMetadata, scaling: float
) -> torch.Tensor:
    """Attend over each request's slots (this step's K/V already written to the pool).

    q: [B, Hq, D], k_buf/v_buf: [slots, Hk, D] -> [B, Hq, D].
    """
    bs, hq, d = q.shape
    hk = k_buf.shape[1]
    kb = k_buf.view(-1, d).index_select(0, meta.kv_indices).view(bs, hk, meta.max_len, d)
    vb = v_buf.view(-1, d).index_select(0, meta.kv_indices).view(bs, hk, meta.max_len, d)
    out_dtype = q.dtype
    if q.device.type == "cpu" and out_dtype != torch.float32:
        if kb.numel() > SMALL_DECODE_KV_ELEMENTS:
            return _decode_attention_lowp(q, kb.to(out_dtype), vb.to(out_dtype), meta.invalid, scaling)
        # Small: ATen's float32 flash kernel beats two tiny bf16 GEMMs (~20 us fixed cost each).
        q, kb, vb = q.float(), kb.float(), vb.float()
    elif kb.dtype != q.dtype:
        kb, vb = kb.to(q.dtype), vb.to(q.dtype)
    o = F.scaled_dot_product_attention(
        q.unsqueeze(2), kb, vb, attn_mask=meta.mask, scale=scaling, enable_gqa=True
    )  # q: [B, Hq, 1, D]
    return o.view(bs, hq, d).to(out_dtype)


def _decode_attention_lowp(
    q: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor, invalid: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """bf16/fp16 decode attention as two batched GEMMs with a float32 softmax.

    ATen's CPU flash kernel is 5-7x slower in bf16 than in fp32 for one query row
    (measured: B=32, L=128); two small bf16 GEMMs are not. Scores are rounded to
    bf16 once (the same relative error as the bf16 K they come from), the softmax
    runs in float32. q: [B, Hq, D], kb/vb: [B, Hk, L, D] -> [B, Hq, D].
    """
    bs, hq, d = q.shape
    hk, length = kb.shape[1], kb.shape[2]
    g = hq // hk  # query head h uses KV head h // G
    qg = (q * scaling).view(bs * hk, g, d)
    scores = torch.bmm(qg, kb.view(bs * hk, length, d).transpose(1, 2)).view(bs, hk, g, length)
    if invalid is not None:
        scores = scores.masked_fill(invalid, float("-inf"))
    probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype).view(bs * hk, g, length)
    return torch.bmm(probs, vb.view(bs * hk, length, d)).view(bs, hq, d)


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def init_forward_metadata(self, fb) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            fb.attn_metadata = build_decode_metadata(
                req_to_token, fb.req_pool_indices, fb.seq_lens, fb.seq_lens_cpu, fb.token_to_kv_pool.head_num
            )
            return
        indices, masks = [], []
        for i, (seq_len, ext, prefix) in enumerate(
            zip(fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
        ):
            indices.append(None if prefix == 0 else req_to_token[int(fb.req_pool_indices[i]), :seq_len])
            if prefix == 0 or ext == 1:
                masks.append(None)  # plain causal (prefix 0) or a single query that sees all keys
            else:
                dev = req_to_token.device
                q_pos = torch.arange(prefix, prefix + ext, device=dev).unsqueeze(1)
                masks.append(torch.arange(seq_len, device=dev).unsqueeze(0) <= q_pos)
        fb.attn_metadata = ExtendMetadata(indices, masks)

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        meta: ExtendMetadata = fb.attn_metadata
        if len(meta.kv_indices) == 1 and meta.kv_indices[0] is None:
            return self._attend(q, k, v, None, True, layer.scaling)  # one fresh prompt: no copies
        out = q.new_empty(q.shape)
        for i, (start, ext, prefix) in enumerate(
            zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)
        ):
            idx = meta.kv_indices[i]
            if idx is None:
                ki, vi = k[start : start + ext], v[start : start + ext]
            else:
                ki, vi = k_buf.index_select(0, idx), v_buf.index_select(0, idx)
                if ki.dtype != q.dtype:
                    ki, vi = ki.to(q.dtype), vi.to(q.dtype)
            out[start : start + ext] = self._attend(
                q[start : start + ext], ki, vi, meta.masks[i], prefix == 0 and ext > 1, layer.scaling
            )
        return out

    @staticmethod
    def _attend(q, k, v, mask, causal: bool, scaling: float) -> torch.Tensor:
        """q: [E, Hq, D], k/v: [S, Hk, D] -> [E, Hq, D]."""
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scaling,
            enable_gqa=True,
        )
        return o.squeeze(0).transpose(0, 1)

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        return decode_attention(
            q,
            pool.get_key_buffer(layer.layer_id),
            pool.get_value_buffer(layer.layer_id),
            fb.attn_metadata,
            layer.scaling,
        )

    # ---- CUDA-graph hooks ---------------------------------------------------------------
    # The decode metadata here has a host-dependent shape (the longest row), so these hooks
    # rebuild it at every replay: right for the CPU stand-in graph, which re-runs the captured
    # Python, but not capturable by a real CUDA graph (cuda_graph_capturable stays False).
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self._graph_max_bs = max_bs

    def init_forward_metadata_capture_cuda_graph(self, bs, req_pool_indices, seq_lens, forward_batch) -> None:
        self.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, [1] * bs, forward_batch)

    def init_forward_metadata_replay_cuda_graph(
        self, bs, req_pool_indices, seq_lens, seq_lens_cpu, forward_batch
    ) -> None:
        forward_batch.attn_metadata = build_decode_metadata(
            forward_batch.req_to_token_pool.req_to_token,
            req_pool_indices,
            seq_lens,
            seq_lens_cpu,
            forward_batch.token_to_kv_pool.head_num,
        )
