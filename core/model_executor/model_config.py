"""The few numbers about a model the engine needs, read from its HF config."""

from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def attention_window(config) -> int | None:
    """The sliding window every layer attends within, when the config turns one on (Mistral v0.1's
    4096; Qwen2/Qwen3 name one but switch it off with use_sliding_window=false), else None."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    context_len: int
    eos_token_ids: list[int]
    hf_config: object

    @classmethod
    def from_hf(
        cls, config, context_length: int | None = None, generation_eos: list[int] | None = None
    ) -> "ModelConfig":
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        eos = config.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        for e in generation_eos or []:
            if e not in eos_ids:
                eos_ids.append(e)
        return cls(
            architecture=(config.architectures or ["LlamaForCausalLM"])[0],
            hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            context_len=_context_len(config, context_length),
            eos_token_ids=eos_ids,
            hf_config=config,
        )


def _context_len(config, asked: int | None) -> int:
    """The context length, capped at the model's attention window: sliding-window attention is not
    implemented (docs/models.md), and within the window full attention is exactly the same thing.
    Longer requests are then refused with the usual context-length error instead of drifting."""
    length = asked or config.max_position_embeddings
    window = attention_window(config)
    if window is not None and window < length:
        logger.warning(
            "context length capped at the model's sliding window (%d tokens, not %d): windowed attention "
            "is not implemented, and within the window full attention gives the same result",
            window,
            length,
        )
        return window
    return length
