"""Models without weights: the shapes the cost model and the KV pool need, from a config.

`model_spec("llama-3.1-70b")` takes a named entry of KNOWN (the public configs' numbers);
`model_spec("path/config.json")` (or a directory holding one) reads a Hugging Face config;
`model_spec("ORG/NAME")` reads a Hub model's config.json, fetched alone (never the weights) into
the Hugging Face cache on first use (core/model_loader/hub.py).
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width (per expert for MoE: moe_intermediate)
    vocab: int
    experts: int = 0  # 0: dense
    top_k: int = 0
    tied_embeddings: bool = False
    context_len: int = 131072
    sparse_layers: int | None = None  # MoE: layers with experts (None: all); the rest are dense
    dense_intermediate: int = 0  # MoE: the dense layers' MLP width

    # ---- sizes (parameters, not bytes) --------------------------------------------------------
    def attn_params(self) -> int:
        """One layer's q, k, v and o projections."""
        return self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)

    def n_sparse(self) -> int:
        return 0 if not self.experts else (self.layers if self.sparse_layers is None else self.sparse_layers)

    def dense_mlp_params(self) -> int:
        """All layers' dense MLPs (gate, up, down)."""
        width = self.dense_intermediate or self.intermediate
        return (self.layers - self.n_sparse()) * 3 * self.hidden * width

    def expert_params(self, experts: float) -> float:
        """`experts` experts (and the router) in every sparse layer."""
        return self.n_sparse() * (3 * self.hidden * self.intermediate * experts + self.hidden * self.experts)

    def mlp_params(self) -> int:
        return self.dense_mlp_params() + int(self.expert_params(self.experts))

    def active_mlp_params(self) -> float:
        """What one token's MLPs compute with, over all layers: top_k experts where sparse."""
        return self.dense_mlp_params() + self.expert_params(self.top_k)

    def embed_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def total_params(self) -> int:
        return self.layers * self.attn_params() + self.mlp_params() + self.embed_params()

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes


KNOWN: dict[str, ModelSpec] = {
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 4096, 32, 32, 8, 128, 14336, 128256),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 8192, 80, 64, 8, 128, 28672, 128256),
    "qwen3-32b": ModelSpec("qwen3-32b", 5120, 64, 64, 8, 128, 25600, 151936, context_len=40960),
    "qwen3-30b-a3b": ModelSpec(
        "qwen3-30b-a3b", 2048, 48, 32, 4, 128, 768, 151936, experts=128, top_k=8, context_len=40960
    ),
    "mixtral-8x7b": ModelSpec(
        "mixtral-8x7b", 4096, 32, 32, 8, 128, 14336, 32000, experts=8, top_k=2, context_len=32768
    ),
    # the default model, for the simulator's accuracy check against the real engine here
    "smollm2-135m": ModelSpec("smollm2-135m", 576, 30, 9, 3, 64, 1536, 49152, tied_embeddings=True, context_len=8192),
}


def model_spec(name_or_path: str, *, revision: str | None = None, download_dir: str | None = None) -> ModelSpec:
    """A named entry of KNOWN, an HF config.json (the file or its directory), or a Hub id ORG/NAME
    whose config.json alone is fetched (cached: the simulated engine's processes each ask).

    `revision` and `download_dir` apply to a Hub id (see hub.download_config).
    """
    if name_or_path.lower() in KNOWN:
        return KNOWN[name_or_path.lower()]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        from workbench.core.model_loader.hub import looks_like_repo_id

        if looks_like_repo_id(name_or_path):
            return _hub_spec(name_or_path, revision, download_dir)
        raise ValueError(
            f"{name_or_path!r} is neither a known model ({', '.join(KNOWN)}) nor an HF config.json "
            "(or a directory holding one) nor a Hugging Face Hub id ORG/NAME"
        )
    return spec_from_config(json.loads(path.read_text()), name=path.parent.name or path.name)


def _hub_spec(repo_id: str, revision: str | None, download_dir: str | None) -> ModelSpec:
    from workbench.core.model_loader.errors import ModelLoadError
    from workbench.core.model_loader.hub import download_config

    try:
        config_path = download_config(repo_id, revision=revision, download_dir=download_dir)
    except ModelLoadError as exc:
        close = difflib.get_close_matches(repo_id.split("/")[-1].lower(), list(KNOWN), n=1, cutoff=0.6)
        hint = f" Without the Hub: --model {close[0]} (a known model's shapes)." if close else ""
        raise ValueError(f"{exc}{hint}") from None
    try:
        return spec_from_config(json.loads(config_path.read_text()), name=repo_id)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{repo_id}'s config.json ({config_path}) lacks what a simulated model needs ({exc!r}); "
            "pass a decoder-only language model."
        ) from None


def spec_from_config(cfg: dict, name: str | None = None) -> ModelSpec:
    cfg = cfg.get("text_config", cfg)  # multimodal wrappers keep the LM's config inside
    heads = cfg["num_attention_heads"]
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    inter = (
        cfg.get("moe_intermediate_size") if experts and cfg.get("moe_intermediate_size") else cfg["intermediate_size"]
    )
    layers = cfg["num_hidden_layers"]
    sparse = None
    if experts and ("mlp_only_layers" in cfg or "decoder_sparse_step" in cfg):  # Qwen-MoE's dense layers
        dense_only, step = set(cfg.get("mlp_only_layers") or []), int(cfg.get("decoder_sparse_step") or 1)
        sparse = sum(1 for i in range(layers) if i not in dense_only and (i + 1) % step == 0)
    return ModelSpec(
        name=name or cfg.get("model_type", "model"),
        hidden=cfg["hidden_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        intermediate=inter,
        vocab=cfg["vocab_size"],
        experts=int(experts),
        top_k=int(cfg.get("num_experts_per_tok") or 0),
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        context_len=int(cfg.get("max_position_embeddings") or 131072),
        sparse_layers=sparse,
        dense_intermediate=int(cfg["intermediate_size"]) if experts else 0,
    )
