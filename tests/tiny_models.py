"""Tiny, seeded, random-weight models saved as real HF directories (and GGUF files) for tests.

Everything here runs in well under a second and needs no network and no
download: the tokenizer is a byte-level BPE built in code (256 byte tokens
plus the three ChatML specials SmolLM2 uses, no merges), so any text round
trips and multi-byte characters span several tokens, which is what
incremental detokenization tests want.

    from tiny_models import make_tiny_llama, make_tiny_qwen2, make_tiny_llama_sharded
    model_dir = make_tiny_llama(tmp_path / "llama")            # config.json, model.safetensors, tokenizer
    model_dir = make_tiny_qwen2(tmp_path / "qwen", num_hidden_layers=4)
    gguf_file = make_tiny_gguf(tmp_path / "tiny.gguf", arch="qwen2")

Model vocab size equals the tokenizer's length, so any sampled id decodes.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
TINY_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256

# Small enough to build in milliseconds, big enough to have GQA (4 heads over 2 KV heads).
_TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=TINY_VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    bos_token_id=1,  # <|im_start|>, as SmolLM2
    eos_token_id=2,  # <|im_end|>
    pad_token_id=2,
)


def tiny_tokenizer():
    """A byte-level BPE PreTrainedTokenizerFast with ChatML specials and a chat template."""
    from tokenizers import Tokenizer, decoders, models
    from tokenizers.pre_tokenizers import ByteLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for char in sorted(ByteLevel.alphabet()):
        vocab[char] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        pad_token="<|im_end|>",
        unk_token="<|endoftext|>",
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def _build(config_cls_name: str, architecture: str, defaults: dict[str, Any], seed: int, dtype, overrides):
    import transformers
    from transformers import AutoModelForCausalLM

    config = getattr(transformers, config_cls_name)(**{**_TINY_SHAPE, **defaults, **overrides})
    config.architectures = [architecture]
    # fork_rng: seeding must not disturb the caller's global RNG stream.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(dtype).eval()


def _save(model, path: Path, max_shard_size: str | None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    tiny_tokenizer().save_pretrained(str(path))
    return path


def make_tiny_llama(
    path: str | Path, *, seed: int = 0, max_shard_size: str | None = None, dtype=torch.float32, **overrides
) -> Path:
    """A tiny LlamaForCausalLM (tied embeddings, like SmolLM2) saved as an HF directory; returns the path.

    `overrides` are LlamaConfig fields (e.g. num_hidden_layers=4,
    tie_word_embeddings=False). `max_shard_size` (e.g. "100KB") splits the
    weights over several safetensors shards with an index.
    """
    model = _build("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, seed, dtype, overrides)
    return _save(model, path, max_shard_size)


def make_tiny_qwen2(
    path: str | Path, *, seed: int = 0, max_shard_size: str | None = None, dtype=torch.float32, **overrides
) -> Path:
    """A tiny Qwen2ForCausalLM (Q/K/V biases, untied lm_head) saved as an HF directory; returns the path."""
    model = _build("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}, seed, dtype, overrides)
    return _save(model, path, max_shard_size)


def make_tiny_mistral(
    path: str | Path, *, seed: int = 0, max_shard_size: str | None = None, dtype=torch.float32, **overrides
) -> Path:
    """A tiny MistralForCausalLM (no sliding window by default) saved as an HF directory; returns the path."""
    model = _build(
        "MistralConfig",
        "MistralForCausalLM",
        {"tie_word_embeddings": False, "sliding_window": None},
        seed,
        dtype,
        overrides,
    )
    return _save(model, path, max_shard_size)


def make_tiny_llama_sharded(path: str | Path, **kwargs) -> Path:
    """make_tiny_llama split over several safetensors shards (about four)."""
    return make_tiny_llama(path, max_shard_size="100KB", **kwargs)


def make_tiny_qwen2_sharded(path: str | Path, **kwargs) -> Path:
    """make_tiny_qwen2 split over several safetensors shards."""
    return make_tiny_qwen2(path, max_shard_size="100KB", **kwargs)


# ---------------------------------------------------------------- GGUF


def llamacpp_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf Q/K row order (rotary pairs made adjacent), for building test GGUFs."""
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


_GGUF_BLOCK_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_GGUF_BLOCK_NAMES[module]}.{kind}"
    module, kind = hf_name.rsplit(".", 1)
    return {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}[module] + "." + kind


def _add_tiny_tokenizer(writer, cfg) -> None:
    """The tiny byte-level tokenizer and its special ids, as llama.cpp's converter writes a GPT-2 style one."""
    import gguf

    tokenizer = tiny_tokenizer()
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    special = set(SPECIAL_TOKENS)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    writer.add_pad_token_id(cfg.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TINY_CHAT_TEMPLATE)


def make_tiny_gguf(path: str | Path, *, arch: str = "llama", seed: int = 0, **overrides):
    """Write a tiny float32 GGUF the way llama.cpp's converter would; return `(gguf_path, hf_model)`.

    `arch` is "llama" (Q/K rows permuted, as llama.cpp does) or "qwen2" (HF
    order, with biases). The returned transformers model holds the exact
    weights, for comparing a conversion against.
    """
    import gguf

    if arch == "llama":
        model = _build("LlamaConfig", "LlamaForCausalLM", {"tie_word_embeddings": True}, seed, torch.float32, overrides)
    elif arch == "qwen2":
        model = _build(
            "Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": False}, seed, torch.float32, overrides
        )
    elif arch == "qwen3":
        model = _build(
            "Qwen3Config",
            "Qwen3ForCausalLM",
            {"tie_word_embeddings": False, "head_dim": 32},
            seed,
            torch.float32,
            overrides,
        )
    else:
        raise ValueError(f"make_tiny_gguf supports arch 'llama', 'qwen2' or 'qwen3', not {arch!r}")
    cfg = model.config
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _add_tiny_tokenizer(writer, cfg)

    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        weights = tensor.detach().numpy().astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            weights = llamacpp_permute(weights, cfg.num_attention_heads)
        elif arch == "llama" and ".k_proj." in name:
            weights = llamacpp_permute(weights, cfg.num_key_value_heads)
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, model


# Each family's transformers config class, architecture and what differs from the tiny shape: enough
# experts and layers that routing varies and (Qwen3-MoE) a dense layer sits between sparse ones.
FAMILIES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": False, "head_dim": 32}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            tie_word_embeddings=False,
            num_hidden_layers=3,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    ),
    "olmoe": (
        "OlmoeConfig",
        "OlmoeForCausalLM",
        dict(tie_word_embeddings=False, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=4.0),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"tie_word_embeddings": False, "sliding_window": None}),
    # LongRoPE: prompts and outputs stay inside the 128-token pretraining length (short factors)
    "phi3_longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            tie_word_embeddings=False,
            sliding_window=None,
            max_position_embeddings=512,
            original_max_position_embeddings=128,
            rope_scaling={
                "type": "longrope",
                "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.1, 3.8],
                "long_factor": [1.0, 1.5, 2.2, 3.0, 4.0, 5.5, 7.0, 9.0],
            },
        ),
    ),
    # Windows of 8 tokens: the test prompts and their 48 new tokens run well past them.
    "mistral_window": ("MistralConfig", "MistralForCausalLM", {"tie_word_embeddings": False, "sliding_window": 8}),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            tie_word_embeddings=True,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=24,
            sliding_window=8,
            attn_logit_softcapping=5.0,  # small caps, so random weights actually reach them
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            tie_word_embeddings=True,
            num_hidden_layers=4,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
            },
        ),
    ),
}


def make_tiny_family(path: str | Path, family: str, *, seed: int = 0, dtype=torch.float32, **overrides) -> Path:
    """A tiny random-weight model of one of FAMILIES, saved as an HF directory; returns the path."""
    config_cls, architecture, defaults = FAMILIES[family]
    return _save(_build(config_cls, architecture, defaults, seed, dtype, overrides), path, None)


# ---------------------------------------------------------------- GGUF of the newer families

# Each family's general.architecture, and what its tiny model changes so that a GGUF can hold it
# (overrides, then FAMILIES keys dropped for the config class's default): llama.cpp stores no
# clip_qkv (OLMoE) and no dense layer in Qwen3-MoE, derives query_pre_attn_scalar from the head size (Gemma), and fixes Gemma 3's
# pattern at five sliding layers in six.
GGUF_FAMILIES: dict[str, tuple[str, dict[str, Any], tuple[str, ...]]] = {
    "qwen3_moe": ("qwen3moe", {"mlp_only_layers": []}, ()),  # llama.cpp has no dense layers in Qwen3-MoE
    "mixtral": ("llama", {}, ()),
    "olmoe": ("olmoe", {"clip_qkv": None, "rms_norm_eps": 1e-5}, ()),
    "phi3": ("phi3", {}, ()),
    "phi3_longrope": ("phi3", {}, ()),
    "gemma2": ("gemma2", {"query_pre_attn_scalar": 16}, ()),
    "gemma3": ("gemma3", {"num_hidden_layers": 6}, ("layer_types",)),
}


def make_tiny_family_gguf(path: str | Path, family: str, *, seed: int = 0) -> tuple[Path, Path]:
    """A tiny model of `family` saved as an HF directory and written as a float32 GGUF the way
    llama.cpp's converter writes that family; returns `(gguf_path, hf_dir)`.

    Tensor names come from gguf-py's own table (`get_tensor_name_map`, llama.cpp's mapping), the
    layouts from llama.cpp's converter: Q/K rows permuted for the "llama" architecture only, Gemma
    norms stored as 1 + w, experts stacked per layer ([E, I, H] / [E, H, I]), Phi-3's fused tensors
    kept, its LongRoPE factors as rope_factors_long / rope_factors_short tensors.
    """
    import gguf
    from safetensors import safe_open

    arch, gguf_overrides, drop = GGUF_FAMILIES[family]
    config_cls, architecture, defaults = FAMILIES[family]
    overrides = {k: v for k, v in {**defaults, **gguf_overrides}.items() if k not in drop}
    model = _build(config_cls, architecture, {}, seed, torch.float32, overrides)
    path = Path(path)
    hf_dir = _save(model, path.parent / f"{path.stem}-hf", None)
    cfg = model.config
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(n_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    rope = cfg.rope_parameters
    if arch in ("llama", "phi3"):
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3moe", "gemma2", "gemma3"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if arch == "gemma3":
        writer.add_rope_freq_base(float(rope["full_attention"]["rope_theta"]))
        writer.add_rope_freq_base_swa(float(rope["sliding_attention"]["rope_theta"]))
        if rope["full_attention"].get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(float(rope["full_attention"]["factor"]))
        writer.add_sliding_window(cfg.sliding_window)
    elif arch != "gemma2":  # Gemma 2's converter writes no rope base (the reader's default: 10000)
        writer.add_rope_freq_base(float(rope["rope_theta"]))
    if arch == "gemma2":
        writer.add_sliding_window(cfg.sliding_window)
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        writer.add_sliding_window(cfg.sliding_window or 0)
        if rope.get("rope_type") == "longrope":
            writer.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
            writer.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    _add_tiny_tokenizer(writer, cfg)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], n_layers)
    with safe_open(str(hf_dir / "model.safetensors"), "pt") as f:
        checkpoint = {k: f.get_tensor(k).numpy().astype(np.float32) for k in f.keys()}
    stacked: dict[str, list[tuple[int, np.ndarray]]] = {}
    for name, weights in checkpoint.items():
        if name == "lm_head.weight" and (cfg.tie_word_embeddings or arch == "gemma2"):
            continue
        module, kind = name.rsplit(".", 1)
        match = re.match(r"(.*\.experts)\.(\d+)\.(\w+)$", module)
        if match:  # one expert's projection: stacked per layer below
            stacked.setdefault(f"{match.group(1)}.{match.group(3)}.{kind}", []).append((int(match.group(2)), weights))
            continue
        gguf_name = names.get_name(module)
        assert gguf_name is not None, f"gguf-py has no name for {module} in {arch}"
        if arch == "llama" and module.endswith(".q_proj"):
            weights = llamacpp_permute(weights, cfg.num_attention_heads)
        elif arch == "llama" and module.endswith(".k_proj"):
            weights = llamacpp_permute(weights, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and module.endswith("norm"):
            weights = weights + np.float32(1.0)
        writer.add_tensor(f"{gguf_name}.{kind}", np.ascontiguousarray(weights))
    for key, parts in sorted(stacked.items()):
        module, kind = key.rsplit(".", 1)
        gguf_name = names.get_name(module)
        assert gguf_name is not None, f"gguf-py has no name for {module} in {arch}"
        weights = np.stack([w for _, w in sorted(parts, key=lambda p: p[0])])
        writer.add_tensor(f"{gguf_name}.{kind}", np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf_dir
