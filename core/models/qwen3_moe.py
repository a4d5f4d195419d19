"""Qwen3-MoE: Qwen3's attention (per-head q/k norm) with a sparse mixture of experts in place of
the MLP on every `decoder_sparse_step`-th layer not listed in `mlp_only_layers` (those keep a
dense MLP of `intermediate_size`). Experts: `moe_intermediate_size` each, top `num_experts_per_tok`
of `num_experts`, renormalised when `norm_topk_prob`."""

from __future__ import annotations

from torch import nn
from workbench.core.layers.moe import SparseMoeBlock
from workbench.core.models.llama import LlamaForCausalLM
from workbench.core.models.qwen3 import Qwen3DecoderLayer

HF_EXPERT_PARAMS = (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2"))


def is_sparse_layer(config, layer_id: int) -> bool:
    step = getattr(config, "decoder_sparse_step", 1) or 1
    only_dense = getattr(config, "mlp_only_layers", None) or []
    return config.num_experts > 0 and layer_id not in only_dense and (layer_id + 1) % step == 0


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        if not is_sparse_layer(config, layer_id):
            return super().make_mlp(config, layer_id)
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.moe_intermediate_size,
            renormalize=bool(config.norm_topk_prob),
        )


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    expert_params = HF_EXPERT_PARAMS
