"""The few numbers about a model the engine needs, read from its HF config."""

from __future__ import annotations

from dataclasses import dataclass


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
    def from_hf(cls, config, context_length: int | None = None, generation_eos: list[int] | None = None) -> ModelConfig:
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
    """The context length: asked for, else the model's. A sliding window does not shorten it: windowed
    layers attend within their window through the backends' masked path (attention/masked_attention.py)."""
    return asked or config.max_position_embeddings
