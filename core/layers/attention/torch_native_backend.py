"""Attention in plain PyTorch (SDPA) over the token-slot KV pool — the CPU default.

Decode: every request's keys are gathered into one padded [B, L] table once per
pass (metadata), so each layer is a single batched SDPA call with a length mask.
Extend: one SDPA call per request — prefill is compute-bound, so the loop costs
little, and it handles ragged prefixes exactly (causal mask offset by the prefix).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from workbench.core.layers.attention.base_attn_backend import AttentionBackend


@dataclass
class DecodeMetadata:
    kv_indices: torch.Tensor          # [B, L] KV slots (0 = padding)
    mask: Optional[torch.Tensor]      # [B, 1, 1, L] True where a key is valid; None if no padding


@dataclass
class ExtendMetadata:
    kv_indices: list[torch.Tensor]    # per request: all its KV slots (prefix + new)
    masks: list[Optional[torch.Tensor]]  # per request: [E, S] causal mask offset by the prefix, or None


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def init_forward_metadata(self, fb) -> None:
        req_to_token = fb.req_to_token_pool.req_to_token
        if fb.forward_mode.is_decode():
            max_len = max(fb.seq_lens_cpu)
            kv_indices = req_to_token[fb.req_pool_indices, :max_len]
            mask = None
            if min(fb.seq_lens_cpu) != max_len:
                mask = (torch.arange(max_len, device=fb.seq_lens.device) < fb.seq_lens.unsqueeze(1)).view(fb.batch_size, 1, 1, max_len)
            fb.attn_metadata = DecodeMetadata(kv_indices, mask)
            return
        indices, masks = [], []
        for i, (seq_len, ext, prefix) in enumerate(
                zip(fb.seq_lens_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)):
            indices.append(req_to_token[int(fb.req_pool_indices[i]), :seq_len])
            if prefix == 0 or ext == 1:
                masks.append(None)   # plain causal (prefix 0) or a single query that sees all keys
            else:
                q_pos = torch.arange(prefix, prefix + ext).unsqueeze(1)
                masks.append(torch.arange(seq_len).unsqueeze(0) <= q_pos)
        fb.attn_metadata = ExtendMetadata(indices, masks)

    def forward_extend(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        meta: ExtendMetadata = fb.attn_metadata
        out = torch.empty_like(q)
        for i, (start, ext, prefix) in enumerate(
                zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu)):
            qi = q[start:start + ext].transpose(0, 1).unsqueeze(0)          # [1, Hq, E, D]
            idx = meta.kv_indices[i]
            ki = k_buf[idx].to(q.dtype).transpose(0, 1).unsqueeze(0)       # [1, Hk, S, D]
            vi = v_buf[idx].to(q.dtype).transpose(0, 1).unsqueeze(0)
            mask = meta.masks[i]
            o = F.scaled_dot_product_attention(
                qi, ki, vi, attn_mask=mask, is_causal=(prefix == 0 and ext > 1),
                scale=layer.scaling, enable_gqa=True)
            out[start:start + ext] = o.squeeze(0).transpose(0, 1)
        return out

    def forward_decode(self, q, k, v, layer, fb) -> torch.Tensor:
        pool = fb.token_to_kv_pool
        pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        meta: DecodeMetadata = fb.attn_metadata
        kb = pool.get_key_buffer(layer.layer_id)[meta.kv_indices].to(q.dtype)    # [B, L, Hk, D]
        vb = pool.get_value_buffer(layer.layer_id)[meta.kv_indices].to(q.dtype)
        o = F.scaled_dot_product_attention(
            q.unsqueeze(2), kb.transpose(1, 2), vb.transpose(1, 2),            # q: [B, Hq, 1, D]
            attn_mask=meta.mask, scale=layer.scaling, enable_gqa=True)
        return o.squeeze(2)
