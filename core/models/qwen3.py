"""Qwen3 and the attention with RMSNorm on q and k that Qwen3, Qwen3-MoE and OLMoE share.

Qwen3 normalises every query and key head on its own (`q_norm`/`k_norm` of head_dim
elements) before the rotary embedding; OLMoE normalises the whole query and the whole key
vector (hidden_size and kv_heads * head_dim elements). Either way the norm comes between
the projection and the rotation, which is all that differs from the Llama block.
"""

from __future__ import annotations

import torch
from torch import nn
from workbench.core.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_model_parallel_all_reduce
from workbench.core.layers import cpu_ops
from workbench.core.layers.layernorm import RMSNorm
from workbench.core.layers.rotary_embedding import apply_rotary
from workbench.core.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class ShardedVectorNorm(nn.Module):
    """RMSNorm over a whole vector that tensor parallelism splits across ranks (OLMoE's q/k norm):
    each rank holds `local` of the `total` elements and their weights; the mean square is summed
    over ranks before scaling, so every rank normalises by the full vector's norm."""

    def __init__(self, total: int, local: int, eps: float):
        super().__init__()
        self.total, self.local, self.eps = total, local, eps
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.weight = nn.Parameter(torch.ones(local), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.local, self.local))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return torch.nn.functional.rms_norm(x, (self.local,), self.weight, self.eps)
        xf = x.float()
        ss = tensor_model_parallel_all_reduce(xf.pow(2).sum(-1, keepdim=True))
        return (xf * torch.rsqrt(ss / self.total + self.eps)).to(x.dtype) * self.weight


class QKNormAttention(LlamaAttention):
    """Llama attention with q and k normalised after the projection: per head (`per_head=True`,
    Qwen3) or over the whole vectors (OLMoE)."""

    def __init__(self, config, layer_id: int, qkv_bias: bool, per_head: bool = True):
        super().__init__(config, layer_id, qkv_bias)
        eps = config.rms_norm_eps
        self.per_head = per_head
        self.clip_qkv = None  # OLMoE sets its clip_qkv
        if per_head:
            self.q_norm, self.k_norm = RMSNorm(self.head_dim, eps), RMSNorm(self.head_dim, eps)
            return
        tp = get_tp_size()
        if self.total_num_kv_heads % tp:
            raise ValueError(
                f"a whole-vector k norm needs the {self.total_num_kv_heads} KV heads to split evenly over {tp} ranks"
            )
        self.q_norm = ShardedVectorNorm(self.total_num_heads * self.head_dim, self.q_size, eps)
        self.k_norm = ShardedVectorNorm(self.total_num_kv_heads * self.head_dim, self.kv_size, eps)

    def forward(self, hidden_states, rope, forward_batch, residual=None) -> torch.Tensor:
        T, D = hidden_states.shape[0], self.head_dim
        qkv = self.qkv_proj(hidden_states)
        q, k = qkv[:, : self.q_size], qkv[:, self.q_size : self.q_size + self.kv_size]
        v = qkv[:, self.q_size + self.kv_size :].view(T, self.num_kv_heads, D)
        if self.per_head:
            q, k = self.q_norm(q.reshape(T, self.num_heads, D)), self.k_norm(k.reshape(T, self.num_kv_heads, D))
        else:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:  # OLMoE: after the norms, as transformers does
            c = float(self.clip_qkv)
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        # q and k side by side, as the fused rotation wants them (one pass over both).
        qk = torch.cat([q.reshape(T, self.num_heads, D), k.reshape(T, self.num_kv_heads, D)], dim=1)
        qk = cpu_ops.rope_inplace(qk, *rope) if cpu_ops.fused_ready(qk) else apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out.reshape(T, self.q_size), residual)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config, layer_id: int, qkv_bias: bool) -> nn.Module:
        return QKNormAttention(config, layer_id, qkv_bias, per_head=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
