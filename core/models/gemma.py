"""Gemma 2 and Gemma 3 (text): the Llama block with four changes a serving engine has to know.

- Norms are `x / rms(x) * (1 + w)` in float32 (the weight is an offset from one), and each block
  is normalised after as well as before: attention and MLP outputs pass a norm of their own
  before they join the residual stream (four norms per layer).
- The embedding is scaled by sqrt(hidden_size); queries by query_pre_attn_scalar ** -0.5.
- Layers alternate local and global attention (`config.layer_types`): local layers see a sliding
  window of `sliding_window` tokens (Gemma 2: every other layer; Gemma 3: five of every six), and
  Gemma 3 gives them their own rotary base (`rope_parameters["sliding_attention"]`).
- Gemma 2 soft-caps scores, cap * tanh(x / cap): attention logits (attn_logit_softcapping) and
  the final logits (final_logit_softcapping). Gemma 3 drops both and adds a per-head q/k norm.

The window and the attention cap are RadixAttention's `sliding_window_size` and `logit_cap`
(attention/masked_attention.py computes them); the final cap is applied in `compute_logits`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from workbench.core.layers.radix_attention import RadixAttention
from workbench.core.layers.rotary_embedding import RotaryEmbedding, rope_config
from workbench.core.layers.vocab_parallel_embedding import VocabParallelEmbedding
from workbench.core.models.llama import LlamaAttention, LlamaForCausalLM, layer_window
from workbench.core.models.qwen3 import QKNormAttention

FULL, LOCAL = "full_attention", "sliding_attention"


class GemmaRMSNorm(nn.Module):
    """RMSNorm with the weight as an offset from one, computed in float32 and cast back once."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (out * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=False)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)  # gelu_pytorch_tanh


def _gemma_radix(attn: LlamaAttention, config, layer_id: int) -> RadixAttention:
    """The layer's attention with Gemma's query scale, its window (local layers) and Gemma 2's cap."""
    return RadixAttention(
        attn.num_heads,
        attn.head_dim,
        float(getattr(config, "query_pre_attn_scalar", None) or attn.head_dim) ** -0.5,
        attn.num_kv_heads,
        layer_id,
        sliding_window_size=layer_window(config, layer_id),
        logit_cap=getattr(config, "attn_logit_softcapping", None) or 0.0,
    )


class Gemma2Attention(LlamaAttention):
    def __init__(self, config, layer_id: int):
        super().__init__(config, layer_id, qkv_bias=False)
        self.attn = _gemma_radix(self, config, layer_id)


class Gemma3Attention(QKNormAttention):
    """Gemma 2's attention with a Gemma norm on every query and key head before the rotation."""

    def __init__(self, config, layer_id: int):
        super().__init__(config, layer_id, qkv_bias=False, per_head=True)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = _gemma_radix(self, config, layer_id)


class GemmaDecoderLayer(nn.Module):
    attention_cls: type[nn.Module] = Gemma2Attention

    def __init__(self, config, layer_id: int, qkv_bias: bool = False):
        super().__init__()
        types = getattr(config, "layer_types", None)
        self.layer_type = types[layer_id] if types else FULL
        self.self_attn = self.attention_cls(config, layer_id)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        h, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, hidden_states: torch.Tensor, rope, forward_batch) -> torch.Tensor:
        """Each block's output is normalised before it is added to the residual stream."""
        attn = self.self_attn(self.input_layernorm(hidden_states), rope, forward_batch)
        hidden_states = hidden_states + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden_states))
        return hidden_states + self.post_feedforward_layernorm(mlp)


class Gemma3DecoderLayer(GemmaDecoderLayer):
    attention_cls = Gemma3Attention


def _rope_of(config, layer_type: str) -> tuple[float, dict | None]:
    """(base, scaling) for one kind of layer: Gemma 3 keeps one rope_parameters entry per layer type."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        sub = params[layer_type]
        return float(sub.get("rope_theta", 10000.0)), (sub if sub.get("rope_type", "default") != "default" else None)
    if layer_type == LOCAL and getattr(config, "rope_local_base_freq", None):  # older Gemma 3 configs
        return float(config.rope_local_base_freq), None
    return rope_config(config)


class GemmaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, layer_cls: type[GemmaDecoderLayer]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.embed_scale = float(config.hidden_size) ** 0.5
        self.layers = nn.ModuleList(layer_cls(config, i, qkv_bias) for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        # One rotary table per kind of layer present (cos/sin gathered once per pass for each).
        self.rotary = nn.ModuleDict(
            {
                kind: RotaryEmbedding(head_dim, config.max_position_embeddings, *_rope_of(config, kind))
                for kind in sorted({layer.layer_type for layer in self.layers})
            }
        )

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.embed_scale, dtype=h.dtype)  # rounded to the model's dtype first, as HF does
        ropes = {kind: emb.get_cos_sin(positions, h.dtype) for kind, emb in self.rotary.items()}
        for layer in self.layers:
            h = layer(h, ropes[layer.layer_type], forward_batch)
        return self.norm(h)


class Gemma2ForCausalLM(LlamaForCausalLM):
    model_cls = GemmaModel
    layer_cls = GemmaDecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.final_logit_softcapping = float(getattr(config, "final_logit_softcapping", None) or 0.0)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(super().compute_logits(hidden), self.final_logit_softcapping)


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    layer_cls = Gemma3DecoderLayer


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    """cap * tanh(logits / cap); unchanged when cap is 0."""
    return torch.tanh(logits / cap) * cap if cap > 0 else logits
