"""Rotary position embedding (the "rotate half" layout HF Llama/Qwen2 checkpoints use).

cos/sin are precomputed for every position once; a forward pass only indexes them.
Supports the default rope and Llama 3's frequency-dependent scaling ("llama3"),
plain linear scaling and Phi-3's LongRoPE ("longrope").
"""

from __future__ import annotations

import math

import torch
from torch import nn


def _inv_freq(head_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3_scaled(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original_max_pos: int
) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    low_freq_wavelen = original_max_pos / low_freq_factor
    high_freq_wavelen = original_max_pos / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_pos / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _longrope_table(head_dim: int, max_position: int, base: float, scaling: dict) -> torch.Tensor:
    """Phi-3's LongRoPE: each frequency divided by its own factor, `short_factor` for positions within
    the pretraining length and `long_factor` past it, and cos/sin scaled by the attention factor.
    transformers switches the whole sequence to the long factors once it grows past that length;
    a KV cache cannot re-rotate the keys it holds, so here (as in vLLM) each position keeps the
    factors of where it sits. Within the pretraining length the two agree exactly."""
    orig = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or max_position / orig
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    pos = torch.arange(max_position, dtype=torch.float32)
    halves = []
    for key, rows in (("short_factor", pos[:orig]), ("long_factor", pos[orig:])):
        inv_freq = 1.0 / (torch.tensor(scaling[key], dtype=torch.float32) * base**shape)
        halves.append(torch.outer(rows, inv_freq))
    freqs = torch.cat(halves)
    cos, sin = freqs.cos() * attention, freqs.sin() * attention
    return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)


_TABLES: dict[tuple, torch.Tensor] = {}


class RotaryEmbedding(nn.Module):
    """Rotary tables for one (head_dim, base, scaling) set; shared by every layer of a model.

    The model gathers `get_cos_sin(positions)` once per forward pass and every layer
    applies it with `apply_rotary` (3 tensor ops for q and k together), instead of
    each layer indexing the table and rotating q and k separately.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, rope_scaling: dict | None = None):
        super().__init__()
        self.head_dim = head_dim
        # Every model instance with this config uses the same table: compute it once per process.
        key = (head_dim, max_position, base, repr(sorted((rope_scaling or {}).items())))
        if key not in _TABLES:
            _TABLES[key] = self._table(head_dim, max_position, base, rope_scaling)
        # [max_position, 2, D]: cos, and sin with the first half negated (see apply_rotary).
        self.register_buffer("cos_sin_cache", _TABLES[key], persistent=False)
        self._cast: dict[torch.dtype, torch.Tensor] = {}

    @staticmethod
    def _table(head_dim, max_position, base, rope_scaling) -> torch.Tensor:
        inv_freq = _inv_freq(head_dim, base)
        rope_type = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_scaled(
                inv_freq,
                rope_scaling["factor"],
                rope_scaling["low_freq_factor"],
                rope_scaling["high_freq_factor"],
                rope_scaling["original_max_position_embeddings"],
            )
        elif rope_type == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif rope_type == "longrope":
            return _longrope_table(head_dim, max_position, base, rope_scaling)
        elif rope_type not in ("default", None):
            raise ValueError(
                f"rope scaling type {rope_type!r} is not supported (default, linear, llama3, longrope are)"
            )
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)), dim=1)

    def table(self, dtype: torch.dtype) -> torch.Tensor:
        """The [max_position, 2, D] table in `dtype` (cast once, like the reference casts per call)."""
        base = self.cos_sin_cache
        if dtype == base.dtype:
            return base
        cached = self._cast.get(dtype)
        if cached is None or cached.device != base.device:
            cached = self._cast[dtype] = base.to(dtype)
        return cached

    def get_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin), each [T, 1, D], for `apply_rotary`."""
        cs = self.table(dtype).index_select(0, positions)
        return cs[:, 0:1], cs[:, 1:2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q: [T, Hq, D], k: [T, Hk, D] -> rotated (q, k)."""
        cos, sin = self.get_cos_sin(positions, q.dtype)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin for x [T, H, D] (any row stride), cos/sin [T, 1, D].

    rotate_half(x) = cat(-x2, x1); here the sign lives in `sin` (its first half is
    negated), so the rotation is one flip of the two halves. Same products and sums
    as the reference, so float32 results match it bit for bit (tested).
    """
    T, H, D = x.shape
    swapped = x.reshape(T, H, 2, D // 2).flip(2).view(T, H, D)  # a fresh tensor: safe to scale in place
    # Not addcmul: its fused multiply-add rounds differently from the reference.
    return (x * cos).add_(swapped.mul_(sin))


def rope_config(config) -> tuple[float, dict | None]:
    """(base, scaling dict) from either transformers 5's `rope_parameters` or the older fields."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and params:
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return float(base), (params if params.get("rope_type", "default") != "default" else None)
    return float(getattr(config, "rope_theta", 10000.0)), getattr(config, "rope_scaling", None)
