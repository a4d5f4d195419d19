"""OLMoE: RMSNorm over the whole query and key vectors (not per head, unlike Qwen3) between the
projection and the rotation, optional clipping of q/k/v (`clip_qkv`), and a mixture of experts
on every layer whose top-k weights are renormalised only when `norm_topk_prob` (off in OLMoE)."""

from __future__ import annotations

from torch import nn
from workbench.core.layers.moe import SparseMoeBlock
from workbench.core.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from workbench.core.models.qwen3 import QKNormAttention
from workbench.core.models.qwen3_moe import HF_EXPERT_PARAMS


class OlmoeAttention(QKNormAttention):
    def __init__(self, config, layer_id: int, qkv_bias: bool):
        super().__init__(config, layer_id, qkv_bias, per_head=False)
        self.clip_qkv = getattr(config, "clip_qkv", None)


class OlmoeDecoderLayer(LlamaDecoderLayer):
    def make_attention(self, config, layer_id: int, qkv_bias: bool) -> nn.Module:
        return OlmoeAttention(config, layer_id, qkv_bias)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
        )


class OlmoeForCausalLM(LlamaForCausalLM):
    layer_cls = OlmoeDecoderLayer
    expert_params = HF_EXPERT_PARAMS
