"""Phi-3 (`Phi3ForCausalLM`): the Llama block, with the checkpoint's Q/K/V and gate/up already fused
(`qkv_proj`, `gate_up_proj`, in the order our fused projections use) and LongRoPE scaling
(rotary_embedding.py). The fused tensors are split on loading, so each rank still takes its own
heads and its share of the MLP under tensor parallelism."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from workbench.core.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        if factor not in (None, 1.0):
            raise ValueError(
                f"partial_rotary_factor {factor} (Phi-4-mini style) is not supported: rotary embeddings here cover "
                "the whole head"
            )
        params = getattr(config, "rope_parameters", None)
        if isinstance(params, dict) and params.get("rope_type") == "longrope":
            params.setdefault("original_max_position_embeddings", config.original_max_position_embeddings)
        super().__init__(config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        c = self.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        q = c.num_attention_heads * head_dim
        kv = (getattr(c, "num_key_value_heads", None) or c.num_attention_heads) * head_dim

        def unfused():
            for name, t in weights:
                if name.endswith("self_attn.qkv_proj.weight"):
                    for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                        yield name.replace("qkv_proj", part), piece
                elif name.endswith("mlp.gate_up_proj.weight"):
                    gate, up = t.chunk(2)
                    yield name.replace("gate_up_proj", "gate_proj"), gate
                    yield name.replace("gate_up_proj", "up_proj"), up
                else:
                    yield name, t

        return super().load_weights(unfused())
