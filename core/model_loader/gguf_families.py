"""What each GGUF architecture means in transformers' terms: names, layouts and config.

llama.cpp's converter (`convert_hf_to_gguf.py`) writes each family its own way, and its C++ reader
fills in what the file leaves out. Converting back to an HF directory has to undo the first and
supply the second; this module holds both, per family:

- **Names.** `blk.N.attn_q` etc. become transformers' names. `ffn_norm` is the norm before the MLP:
  `post_attention_layernorm` in the Llama family, `pre_feedforward_layernorm` in Gemma (whose
  `post_attention_norm` is its own tensor).
- **Layouts.** Only the `llama` architecture (Llama, Mistral, Mixtral) has its Q/K rows permuted
  (gguf_loader.unpermute_qk); the others use NEOX rotary and are stored in HF order. Gemma's
  norms are stored as 1 + w (its RMSNorm scales by 1 + w). Experts are stacked per layer
  (`ffn_gate_exps` [E, I, H], `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]) and are cut back
  into HF's per-expert checkpoint tensors. Phi-3 keeps its fused `attn_qkv` and `ffn_up`
  (gate then up rows), as its HF checkpoints do.
- **Config the file leaves out**, as llama.cpp's reader assumes it: Qwen3-MoE renormalises its
  top-k weights, OLMoE does not; Gemma's `query_pre_attn_scalar` is the head size except on the
  27B models (46 layers for Gemma 2, 62 for Gemma 3: hidden / heads); Gemma 2 alternates sliding
  and global layers, Gemma 3 has five sliding layers in six unless `sliding_window_pattern` says
  otherwise, with a local rotary base of 10000 unless `rope.freq_base_swa` says otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from workbench.core.model_loader.errors import ModelLoadError

_ATTENTION = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
}
_DENSE_MLP = {"ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_NORMS = {"ffn_norm": "post_attention_layernorm"}
_GEMMA_NORMS = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")


@dataclass(frozen=True)
class GgufFamily:
    """One GGUF architecture as transformers knows it."""

    architecture: str  # transformers' class
    model_type: str  # AutoConfig.for_model's key
    block_names: dict[str, str]  # GGUF block tensor -> HF module under model.layers.N
    qk_permuted: bool = False
    norm_offset: float = 0.0  # subtracted from every stored norm weight (Gemma: 1)
    # Mixtures of experts: the HF module holding the router and experts, and each stacked tensor's
    # per-expert HF name (gate, up, down).
    moe_module: str = ""
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    # (meta, tensors, base kwargs) -> config kwargs of this family. `tensors` maps the file's tensor
    # names to its tensors, except CONFIG_TENSORS, which map to their values as lists of floats.
    config: Callable[..., dict[str, Any]] = field(default=lambda meta, tensors, base: {})
    fused: dict[str, str] = field(default_factory=dict)  # Phi-3: fused tensors kept as HF stores them


def _head_dim_from_key_length(meta, tensors, base) -> dict[str, Any]:
    kl = meta("attention.key_length")
    return {"head_dim": int(kl)} if kl is not None else {}


def _sparse_layers(tensors, n_layers: int) -> list[int]:
    return [i for i in range(n_layers) if f"blk.{i}.ffn_gate_exps.weight" in tensors]


def _qwen3_moe(meta, tensors, base) -> dict[str, Any]:
    n = base["num_hidden_layers"]
    sparse = _sparse_layers(tensors, n)
    used = int(meta("expert_used_count"))
    return {
        **_head_dim_from_key_length(meta, tensors, base),
        "num_experts": int(meta("expert_count")),
        "num_experts_per_tok": used,
        # llama.cpp's own fallback when the per-expert size is missing
        "moe_intermediate_size": int(meta("expert_feed_forward_length", base["intermediate_size"] // used)),
        "norm_topk_prob": True,  # not stored: llama.cpp's Qwen3-MoE graph always renormalises
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(n) if i not in sparse],
    }


def _mixtral(meta, tensors, base) -> dict[str, Any]:
    out = {"num_local_experts": int(meta("expert_count")), "num_experts_per_tok": int(meta("expert_used_count"))}
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None:
        out["head_dim"] = int(rope_dim)
    out["sliding_window"] = int(meta("attention.sliding_window", 0)) or None
    return out


def _olmoe(meta, tensors, base) -> dict[str, Any]:
    return {
        "num_experts": int(meta("expert_count")),
        "num_experts_per_tok": int(meta("expert_used_count")),
        "norm_topk_prob": False,  # llama.cpp's OLMoE graph keeps the softmax weights as they are
        "clip_qkv": None,
    }


def _phi3(meta, tensors, base) -> dict[str, Any]:
    out: dict[str, Any] = {}
    head_dim = base["hidden_size"] // base["num_attention_heads"]
    rope_dim = meta("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        out["partial_rotary_factor"] = int(rope_dim) / head_dim
    window = int(meta("attention.sliding_window", 0))
    out["sliding_window"] = window or None  # transformers applies it; llama.cpp ignores Phi-3's window
    original = meta("rope.scaling.original_context_length")
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        if original is None:
            raise ModelLoadError("a Phi-3 GGUF with LongRoPE factors lacks phi3.rope.scaling.original_context_length")
        out["rope_scaling"] = {"type": "longrope", "long_factor": long, "short_factor": short}
    return out


def _query_pre_attn_scalar(base, head_dim: int, layers_27b: int) -> float:
    if base["num_hidden_layers"] == layers_27b:
        return base["hidden_size"] / base["num_attention_heads"]
    return head_dim


def _gemma2(meta, tensors, base) -> dict[str, Any]:
    head_dim = int(meta("attention.key_length", base["hidden_size"] // base["num_attention_heads"]))
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": _query_pre_attn_scalar(base, head_dim, 46),
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "attn_logit_softcapping": float(meta("attn_logit_softcapping", 50.0)),
        "final_logit_softcapping": float(meta("final_logit_softcapping", 30.0)),
        "rope_theta": float(meta("rope.freq_base", 10000.0)),
        "hidden_activation": "gelu_pytorch_tanh",
    }


def _gemma3(meta, tensors, base) -> dict[str, Any]:
    head_dim = int(meta("attention.key_length", 256))
    n = base["num_hidden_layers"]
    pattern = meta("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # newer files: one flag per layer, True for a sliding layer
        if len(pattern) != n:
            raise ModelLoadError(f"gemma3.attention.sliding_window_pattern has {len(pattern)} flags for {n} layers")
        sliding = [bool(x) for x in pattern]
    else:
        sliding = [(i + 1) % int(pattern) != 0 for i in range(n)]
    full = {"rope_type": "default", "rope_theta": float(meta("rope.freq_base", 1000000.0))}
    if meta("rope.scaling.type") == "linear":  # the global layers only; sliding ones are unscaled
        full = {**full, "rope_type": "linear", "factor": float(meta("rope.scaling.factor"))}
    cap = meta("final_logit_softcapping")
    base.pop("rope_theta", None)
    return {
        "head_dim": head_dim,
        "query_pre_attn_scalar": _query_pre_attn_scalar(base, head_dim, 62),
        "sliding_window": int(meta("attention.sliding_window", 4096)),
        "layer_types": ["sliding_attention" if w else "full_attention" for w in sliding],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": float(meta("rope.freq_base_swa", 10000.0))},
            "full_attention": full,
        },
        "final_logit_softcapping": float(cap) if cap is not None else None,
        "hidden_activation": "gelu_pytorch_tanh",
    }


_LLAMA_BLOCK = {**_ATTENTION, **_LLAMA_NORMS, **_DENSE_MLP}
FAMILIES: dict[str, GgufFamily] = {
    "llama": GgufFamily("LlamaForCausalLM", "llama", _LLAMA_BLOCK, qk_permuted=True),
    # a "llama" GGUF with experts (llama.expert_count > 0): Mixtral
    "mixtral": GgufFamily(
        "MixtralForCausalLM",
        "mixtral",
        _LLAMA_BLOCK,
        qk_permuted=True,
        moe_module="block_sparse_moe",
        expert_names=("w1", "w3", "w2"),
        config=_mixtral,
    ),
    "qwen2": GgufFamily("Qwen2ForCausalLM", "qwen2", _LLAMA_BLOCK),
    "qwen3": GgufFamily("Qwen3ForCausalLM", "qwen3", _LLAMA_BLOCK, config=_head_dim_from_key_length),
    "qwen3moe": GgufFamily("Qwen3MoeForCausalLM", "qwen3_moe", _LLAMA_BLOCK, moe_module="mlp", config=_qwen3_moe),
    "olmoe": GgufFamily("OlmoeForCausalLM", "olmoe", _LLAMA_BLOCK, moe_module="mlp", config=_olmoe),
    "phi3": GgufFamily(
        "Phi3ForCausalLM",
        "phi3",
        {**_ATTENTION, **_LLAMA_NORMS, "ffn_down": "mlp.down_proj"},
        fused={"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
        config=_phi3,
    ),
    "gemma2": GgufFamily(
        "Gemma2ForCausalLM", "gemma2", {**_ATTENTION, **_GEMMA_NORMS, **_DENSE_MLP}, norm_offset=1.0, config=_gemma2
    ),
    "gemma3": GgufFamily(
        "Gemma3ForCausalLM",
        "gemma3_text",
        {**_ATTENTION, **_GEMMA_NORMS, **_DENSE_MLP},
        norm_offset=1.0,
        config=_gemma3,
    ),
}
# Tensors that configure rather than weigh: read into the config (Phi-3 LongRoPE), never saved.
CONFIG_TENSORS = {"rope_factors_long.weight", "rope_factors_short.weight"}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def family_key(arch: str, expert_count: int) -> str:
    """The FAMILIES key of a file's general.architecture (Mixtral says "llama", with experts)."""
    return "mixtral" if arch == "llama" and expert_count > 0 else arch


def hf_tensors(family: GgufFamily, gguf_name: str, weights: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The HF checkpoint tensors one GGUF tensor becomes (several for stacked experts; none for a
    tensor with no HF counterpart). Q/K permutation is the caller's (it needs the head counts)."""
    match = _BLOCK_RE.match(gguf_name)
    if match is None:
        match = _GLOBAL_RE.match(gguf_name)
        if match and match.group(1) in _GLOBAL:
            name = f"{_GLOBAL[match.group(1)]}.{match.group(2)}"
            yield name, _unoffset(family, match.group(1), weights)
        return
    layer, part, kind = match.groups()
    prefix = f"model.layers.{layer}"
    if family.moe_module and part == "ffn_gate_inp":
        yield f"{prefix}.{family.moe_module}.gate.{kind}", weights
    elif family.moe_module and part in EXPERT_TENSORS:
        hf = family.expert_names[EXPERT_TENSORS.index(part)]
        for e in range(weights.shape[0]):
            yield f"{prefix}.{family.moe_module}.experts.{e}.{hf}.{kind}", np.ascontiguousarray(weights[e])
    elif part in family.fused:
        yield f"{prefix}.{family.fused[part]}.{kind}", weights
    elif part in family.block_names:
        yield f"{prefix}.{family.block_names[part]}.{kind}", _unoffset(family, part, weights)


def _unoffset(family: GgufFamily, part: str, weights: np.ndarray) -> np.ndarray:
    if family.norm_offset and part.endswith("norm"):
        return weights - np.float32(family.norm_offset)
    return weights


def expected_tensors(family: GgufFamily, config) -> set[str]:
    """The HF tensors a complete checkpoint of this family and config has."""
    out = {"model.embed_tokens.weight", "model.norm.weight"}
    if not config.tie_word_embeddings:
        out.add("lm_head.weight")
    attention = ["self_attn.o_proj"] + (
        ["self_attn.qkv_proj"] if "attn_qkv" in family.fused else [f"self_attn.{p}_proj" for p in "qkv"]
    )
    if family.model_type in ("qwen3", "qwen3_moe", "olmoe", "gemma3_text"):
        attention += ["self_attn.q_norm", "self_attn.k_norm"]
    layer_norms = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")
    norms = [v for k, v in family.block_names.items() if k in layer_norms]
    dense_only = set(getattr(config, "mlp_only_layers", None) or [])
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None) or 0
    for layer in range(config.num_hidden_layers):
        names = attention + norms
        if family.moe_module and layer not in dense_only:
            m = family.moe_module
            names = (
                names + [f"{m}.gate"] + [f"{m}.experts.{e}.{w}" for e in range(experts) for w in family.expert_names]
            )
        elif "ffn_up" in family.fused:
            names = names + ["mlp.gate_up_proj", "mlp.down_proj"]
        else:
            names = names + ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        out.update(f"model.layers.{layer}.{n}.weight" for n in names)
        if family.model_type == "qwen2":
            out.update(f"model.layers.{layer}.self_attn.{p}_proj.bias" for p in "qkv")
    return out
