"""Mixtral: the Llama block with its MLP replaced by `num_local_experts` experts (w1 gate, w3 up,
w2 down), each token sent to its top `num_experts_per_tok`, their weights renormalised to sum to 1.
HF calls the block `block_sparse_moe`; here it is the layer's `mlp` like every other family's."""

from __future__ import annotations

from torch import nn
from workbench.core.layers.moe import SparseMoeBlock
from workbench.core.models.llama import LlamaDecoderLayer, LlamaForCausalLM


class MixtralDecoderLayer(LlamaDecoderLayer):
    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return SparseMoeBlock(
            config.hidden_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.intermediate_size,
            renormalize=True,
        )


class MixtralForCausalLM(LlamaForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_params = (("w1", "w1"), ("w3", "w3"), ("w2", "w2"))
    renames = ((".block_sparse_moe.", ".mlp."),)
