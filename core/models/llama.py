"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral; Qwen2 adds q/k/v biases).

Written for serving on a small CPU, where per-op overhead rivals the GEMMs at
batch 1: Q/K/V and gate/up are fused projections, the residual add rides in
the output projections (o_proj, down_proj), RoPE cos/sin are gathered once per
pass and q and k rotate in one go, attention goes through RadixAttention (KV
lives in the token-slot pool), and every linear is tensor-parallel-aware.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.distributed.parallel_state import tensor_model_parallel_all_gather
from workbench.core.layers import cpu_ops
from workbench.core.layers.activation import SiluAndMul, silu_and_mul
from workbench.core.layers.cpu_ops import gemm as cpu_gemm
from workbench.core.layers.layernorm import RMSNorm
from workbench.core.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    gemm_ready,
    pack_gemm_weight,
    pack_linear_weight,
    packed_linear,
)
from workbench.core.layers.radix_attention import RadixAttention
from workbench.core.layers.rotary_embedding import RotaryEmbedding, apply_rotary, rope_config
from workbench.core.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

_EXPERT_TENSOR = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate) * up) (+ residual, added inside the down projection)."""
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)), residual)


class LlamaAttention(nn.Module):
    def __init__(self, config, layer_id: int, qkv_bias: bool):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.total_num_heads = config.num_attention_heads
        self.total_num_kv_heads = getattr(config, "num_key_value_heads", None) or self.total_num_heads
        self.head_dim = getattr(config, "head_dim", None) or self.hidden_size // self.total_num_heads
        self.qkv_proj = QKVParallelLinear(
            self.hidden_size, self.head_dim, self.total_num_heads, self.total_num_kv_heads, bias=qkv_bias
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        o_bias = bool(getattr(config, "attention_bias", False)) and not qkv_bias_only(config)
        self.o_proj = RowParallelLinear(self.total_num_heads * self.head_dim, self.hidden_size, bias=o_bias)
        self.attn = RadixAttention(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            layer_id,
            sliding_window_size=layer_window(config, layer_id),
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        forward_batch,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """rope: (cos, signed sin) from RotaryEmbedding.get_cos_sin, gathered once per pass."""
        T = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        qk_size = self.q_size + self.kv_size
        # Rotate q and k together: they are adjacent heads of the fused projection. On CPU one
        # compiled call rotates them in place (bit-identical to apply_rotary).
        qk = qkv[:, :qk_size].view(T, self.num_heads + self.num_kv_heads, self.head_dim)
        qk = cpu_ops.rope_inplace(qk, *rope) if cpu_ops.fused_ready(qkv) else apply_rotary(qk, *rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_size:].view(T, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, forward_batch)
        return self.o_proj(out.reshape(T, self.q_size), residual)


def layer_window(config, layer_id: int) -> int | None:
    """The sliding window layer `layer_id` attends within, or None for full attention.

    A config turns a window on with `sliding_window` (Mistral v0.1's 4096; Qwen2/Qwen3 name one but
    switch it off with use_sliding_window=false); `layer_types` (transformers 5) then says which
    layers use it ("sliding_attention": Gemma's local layers), else every layer does.
    """
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types and types[layer_id] != "sliding_attention":
        return None
    return int(window)


def qkv_bias_only(config) -> bool:
    """Qwen2 has biases on q/k/v but not on o_proj."""
    return getattr(config, "model_type", "") == "qwen2"


class LlamaDecoderLayer(nn.Module):
    """Attention then MLP, each behind an RMSNorm and added into the residual stream. Other families
    (qwen3.py, moe models) subclass it and override `make_attention` / `make_mlp`."""

    def __init__(self, config, layer_id: int, qkv_bias: bool):
        super().__init__()
        self.self_attn = self.make_attention(config, layer_id, qkv_bias)
        self.mlp = self.make_mlp(config, layer_id)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_attention(self, config, layer_id: int, qkv_bias: bool) -> nn.Module:
        return LlamaAttention(config, layer_id, qkv_bias)

    def make_mlp(self, config, layer_id: int) -> nn.Module:
        return LlamaMLP(config.hidden_size, config.intermediate_size, bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, hidden_states: torch.Tensor, rope, forward_batch) -> torch.Tensor:
        """hidden_states is the residual stream; each block adds into it inside its output projection."""
        h = self.self_attn(self.input_layernorm(hidden_states), rope, forward_batch, residual=hidden_states)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


class LlamaModel(nn.Module):
    def __init__(self, config, qkv_bias: bool, layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layer_cls(config, i, qkv_bias) for i in range(config.num_hidden_layers))
        # decode_layers.c knows the plain Llama block only (no q/k norms, no experts, no window)
        self._plain_blocks = all(
            type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP
            and layer.self_attn.attn.sliding_window_size is None
            for layer in self.layers
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base, scaling = rope_config(config)
        # One table for all layers; cos/sin are gathered once per forward pass.
        self.rotary_emb = RotaryEmbedding(head_dim, config.max_position_embeddings, base, scaling)
        # Batch-1 float32 decode on CPU runs every layer in one compiled call (cpu_ops/decode_layers.c)
        # over this table of weight and pool pointers, built at its first use (see _decode_table).
        self._decode_table: tuple[tuple[int, ...], torch.Tensor, list[torch.Tensor]] | None = None

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)
        if self._fused_decode_ready(hidden_states, forward_batch):
            # float32 arithmetic whatever the weights' dtype: rope rows in float32 too
            rope = self.rotary_emb.get_cos_sin(positions, torch.float32)
            x = self._fused_decode(hidden_states, rope, forward_batch)
            return self.norm(x.to(hidden_states.dtype))
        rope = self.rotary_emb.get_cos_sin(positions, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, rope, forward_batch)
        return self.norm(hidden_states)

    def drop_derived_tables(self) -> None:
        """Forget the fused decode's pointer table (after a weight update: a bfloat16 model's table
        holds float32 copies of its norm weights and biases)."""
        self._decode_table = None

    def _fused_decode_ready(self, hidden_states: torch.Tensor, fb) -> bool:
        """One request's decode token, or up to FUSED_MAX_TOKENS of its tokens (a speculative verify
        pass, a short prompt piece), float32 or bfloat16 weights on the CPU paged backend, one rank,
        the CPU fast paths on: where Python's per-op overhead is a quarter of the step and, for
        bfloat16 on AVX2, torch's bfloat16 GEMM is slower than streaming the weights (decode_layers.c)."""
        t = hidden_states.shape[0]
        if torch.compiler.is_compiling() or not self._plain_blocks or not 1 <= t <= cpu_ops.FUSED_MAX_TOKENS:
            return False  # (torch.compile traces the op-by-op path: it cannot trace a ctypes call)
        if getattr(fb, "batch_size", 0) != 1 or getattr(fb, "lora_paths", None):
            return False  # (a LoRA adapter's deltas ride on the linears, which the fused call skips)
        backend = fb.attn_backend
        if getattr(backend, "name", "") != "cpu_paged" or not cpu_ops.gemv_ready(hidden_states[:1], self.norm.weight):
            return False
        if not (fb.forward_mode.is_decode() or (fb.forward_mode.is_extend() and backend.use_extend_kernel)):
            return False
        first = self.layers[0]
        if not first.self_attn.qkv_proj.cpu_fast_path or first.self_attn.qkv_proj.tp_size != 1:
            return False
        return cpu_ops.fused_decode_enabled()

    def _decode_table_for(self, pool) -> torch.Tensor:
        """[L, 12] int64: each layer's weight, bias and KV-buffer addresses, in decode_layers.c's order.
        Cached against the addresses it was built from: weight updates copy into the same storage
        (and drop the table: drop_derived_tables), and a rebuilt pool or re-made parameter changes
        the key, so a stale table is never used. The projections are passed as they are (float32 or
        bfloat16); norm weights and biases as float32, copied once for a bfloat16 model and kept
        alive beside the table."""
        key = tuple(
            t.data_ptr()
            for t in (pool.get_key_buffer(0), pool.get_value_buffer(0), self.layers[0].self_attn.qkv_proj.weight)
        ) + (id(pool), len(self.layers))
        if self._decode_table is not None and self._decode_table[0] == key:
            return self._decode_table[1]
        keep: list[torch.Tensor] = []

        def f32(t: torch.Tensor | None) -> int:
            if t is None:
                return 0
            if t.dtype != torch.float32 or not t.is_contiguous():
                t = t.detach().to(torch.float32).contiguous()
                keep.append(t)
            return t.data_ptr()

        def weight(t: torch.Tensor) -> int:
            if t.dtype not in (torch.float32, torch.bfloat16) or not t.is_contiguous():
                raise ValueError("the fused decode path needs contiguous float32 or bfloat16 weights")
            return t.data_ptr()

        rows = []
        for i, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            o_bias = attn.o_proj.bias if attn.o_proj.tp_rank == 0 else None
            down_bias = mlp.down_proj.bias if mlp.down_proj.tp_rank == 0 else None
            rows.append(
                [
                    f32(layer.input_layernorm.weight),
                    weight(attn.qkv_proj.weight),
                    f32(attn.qkv_proj.bias),
                    weight(attn.o_proj.weight),
                    f32(o_bias),
                    f32(layer.post_attention_layernorm.weight),
                    weight(mlp.gate_up_proj.weight),
                    f32(mlp.gate_up_proj.bias),
                    weight(mlp.down_proj.weight),
                    f32(down_bias),
                    pool.get_key_buffer(i).data_ptr(),
                    pool.get_value_buffer(i).data_ptr(),
                ]
            )
        table = torch.tensor(rows, dtype=torch.int64)
        self._decode_table = (key, table, keep)
        return table

    def _fused_decode(self, hidden_states: torch.Tensor, rope, fb) -> torch.Tensor:
        """The decoder layers for this pass's tokens in one compiled call; returns the residual streams."""
        attn = self.layers[0].self_attn
        pool = fb.token_to_kv_pool
        # float32, updated in place (a copy: the embedding row is not ours)
        x = hidden_states.to(torch.float32, copy=True).contiguous()
        return cpu_ops.decode_layers_f32(
            x,
            self._decode_table_for(pool),
            weight_dtype=attn.qkv_proj.weight.dtype,
            hidden=x.shape[1],
            num_q_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            intermediate=self.layers[0].mlp.down_proj.weight.shape[1],
            eps=self.layers[0].input_layernorm.eps,
            scale=attn.attn.scaling,
            cos=rope[0],
            sin=rope[1],
            kv_dtype=pool.get_key_buffer(0).dtype,
            out_cache_loc=fb.out_cache_loc,
            req_to_token=fb.req_to_token_pool.req_to_token,
            req_pool_indices=fb.req_pool_indices,
            seq_lens=fb.seq_lens,
        )


class LlamaForCausalLM(nn.Module):
    """forward() returns final hidden states; `compute_logits` (or the LogitsProcessor) applies `lm_head`."""

    qkv_bias = False
    model_cls: type[nn.Module] = LlamaModel  # Gemma brings its own (gemma.py)
    layer_cls = LlamaDecoderLayer
    # HF checkpoint name -> (our parameter, shard id) for the fused projections.
    stacked_params = (
        ("qkv_proj", "q_proj", "q"),
        ("qkv_proj", "k_proj", "k"),
        ("qkv_proj", "v_proj", "v"),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    )
    # Mixtures of experts: HF's per-expert tensor name -> the stacked FusedMoE shard it fills, and
    # prefixes renamed to ours (Mixtral's block_sparse_moe is our mlp).
    expert_params: tuple[tuple[str, str], ...] = ()
    renames: tuple[tuple[str, str], ...] = ()
    lm_head: VocabParallelEmbedding  # a ParallelLMHead, or the input embedding when the two are tied

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = self.model_cls(
            config, self.qkv_bias or bool(getattr(config, "attention_bias", False)), self.layer_cls
        )
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size)
        self.vocab_size = config.vocab_size
        self._packed_head: torch.Tensor | None = None
        self._gemm_head: cpu_gemm.PackedGemmWeight | None = None
        self._head_fast_path = False  # the batch-1 GEMV may compute the head (process_weights_after_loading)

    def forward(self, input_ids, positions, forward_batch) -> torch.Tensor:
        return self.model(input_ids, positions, forward_batch)

    def process_weights_after_loading(self, pack: bool = True) -> None:
        """Derive the CPU packed-GEMM copies of every projection and of the LM head."""
        self.model._decode_table = None  # rebuilt from the (possibly new) parameters at next use
        for module in self.modules():
            if isinstance(module, LinearBase):
                module.process_weights_after_loading(pack)
        head = self.lm_head.weight
        self._head_fast_path = pack and self.lm_head.tp_size == 1 and head.device.type == "cpu"
        if self._head_fast_path:
            self._packed_head = pack_linear_weight(head[: self.vocab_size])
        else:
            self._packed_head = None
        # gemm.c for batched rows where it measured faster (layers/linear.py); oneDNN's copy goes when unused
        self._gemm_head = pack_gemm_weight(head[: self.vocab_size], self._packed_head) if self._head_fast_path else None
        if self._gemm_head is not None and all(self._gemm_head.use):
            self._packed_head = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] final hidden states -> [N, vocab] float32 logits (the sampler's input)."""
        head = self.lm_head
        if self._head_fast_path and cpu_ops.gemv_ready(hidden, head.weight):
            return cpu_ops.gemv(hidden, head.weight[: self.vocab_size])
        if self._head_fast_path and gemm_ready(hidden, self._gemm_head):
            return cpu_gemm.gemm(hidden, self._gemm_head)
        if self._packed_head is not None and hidden.dtype == head.weight.dtype and not torch.compiler.is_compiling():
            return packed_linear(hidden, self._packed_head, None).float()
        out = F.linear(hidden.to(head.weight.dtype), head.weight)
        if head.tp_size > 1:
            out = tensor_model_parallel_all_gather(out, dim=-1)
        return out[..., : self.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into our (fused, sharded) parameters; returns the names loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if self.tie_word_embeddings and name == "lm_head.weight":
                continue  # tied: the embedding is the head
            for theirs, ours in self.renames:
                name = name.replace(theirs, ours)
            expert = _EXPERT_TENSOR.search(name) if self.expert_params else None
            if expert is not None:
                shard = dict(self.expert_params).get(expert.group(2))
                target = name[: expert.start()] + (".experts.w2_weight" if shard == "w2" else ".experts.w13_weight")
                if shard is None or target not in params:
                    raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
                param = params[target]
                self.get_submodule(target.rsplit(".", 1)[0]).weight_loader(
                    param, tensor.to(param.dtype), int(expert.group(1)), shard
                )
                loaded.add(target)
                continue
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
