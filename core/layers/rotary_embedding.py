"""Rotary position embedding (the "rotate half" layout HF Llama/Qwen2 checkpoints use).

cos/sin are precomputed for every position once; a forward pass only indexes them.
Supports the default rope and Llama 3's frequency-dependent scaling ("llama3"),
plus plain linear scaling.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_scaled(inv_freq: torch.Tensor, factor: float, low_freq_factor: float,
                   high_freq_factor: float, original_max_pos: int) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = original_max_pos / low_freq_factor
    high_freq_wavelen = original_max_pos / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: Optional[dict] = None):
        super().__init__()
        self.head_dim = head_dim
        # Every layer uses the same table: compute it once per process.
        key = (head_dim, max_position, base, repr(sorted((rope_scaling or {}).items())))
        if key not in _TABLES:
            _TABLES[key] = self._tables(head_dim, max_position, base, rope_scaling)
        cos, sin = _TABLES[key]
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    @staticmethod
    def _tables(head_dim, max_position, base, rope_scaling):
        inv_freq = _inv_freq(head_dim, base)
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_scaled(inv_freq, rope_scaling["factor"], rope_scaling["low_freq_factor"],
                                      rope_scaling["high_freq_factor"],
                                      rope_scaling["original_max_position_embeddings"])
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported (default, linear, llama3 are)")
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated (q, k)."""
        cos = self.cos_cache[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin_cache[positions].unsqueeze(1).to(q.dtype)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos + rotated * sin


def rope_config(config) -> tuple[float, Optional[dict]]:
    """(base, scaling dict) from either transformers 5's `rope_parameters` or the older fields."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return float(base), (params if params.get("rope_type", "default") != "default" else None)
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)
