"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral; Qwen2 adds q/k/v biases).

Written for serving: Q/K/V and gate/up are fused projections (fewer ops per
layer), the residual add is fused into RMSNorm, attention goes through
RadixAttention (KV lives in the token-slot pool), and every linear is
tensor-parallel-aware.
"""
from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from workbench.core.layers.activation import SiluAndMul
from workbench.core.layers.layernorm import RMSNorm
from workbench.core.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from workbench.core.layers.radix_attention import RadixAttention
from workbench.core.layers.rotary_embedding import RotaryEmbedding, rope_config
from workbench.core.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        self.qkv_proj = QKVParallelLinear(self.hidden_size, self.head_dim, self.total_num_heads,
                                          self.total_num_kv_heads, bias=qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        o_bias = bool(getattr(config, "attention_bias", False)) and not qkv_bias_only(config)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, self.hidden_size, bias=o_bias)
        base, scaling = rope_config(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, config.max_position_embeddings, base, scaling)
        self.attn = RadixAttention(self.num_heads, self.head_dim, self.head_dim ** -0.5,
                                   self.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, forward_batch) -> torch.Tensor:
        T = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out.reshape(T, self.q_size))


def qkv_bias_only(config) -> bool:
    """Qwen2 has biases on q/k/v but not on o_proj."""
    return getattr(config, "model_type", "") == "qwen2"


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool):
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_id, qkv_bias)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size,
                            bias=bool(getattr(config, "mlp_bias", False)))
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, forward_batch, residual):
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, forward_batch)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, qkv_bias)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(positions, hidden_states, forward_batch, residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    """forward() returns final hidden states; the LogitsProcessor applies `lm_head`."""

    qkv_bias = False
    # HF checkpoint name -> (our parameter, shard id) for the fused projections.
    stacked_params = (("qkv_proj", "q_proj", "q"), ("qkv_proj", "k_proj", "k"), ("qkv_proj", "v_proj", "v"),
                      ("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1))

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.qkv_bias or bool(getattr(config, "attention_bias", False)))
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)

    @torch.no_grad()
    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        return self.model(input_ids, positions, forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused, sharded) parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue   # tied: the embedding is the head
            for fused, part, shard in self.stacked_params:
                if f".{part}." in name:
                    target = name.replace(part, fused)
                    param = params[target]
                    owner = self.get_submodule(target.rsplit(".", 1)[0])
                    owner.weight_loader(param, tensor.to(param.dtype), shard)
                    loaded.add(target)
                    break
            else:
                if name not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[name]
                owner = self.get_submodule(name.rsplit(".", 1)[0])
                loader = getattr(owner, "weight_loader", None)
                if loader is not None:
                    loader(param, tensor.to(param.dtype))
                else:
                    param.data.copy_(tensor.to(param.dtype))
                loaded.add(name)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True
