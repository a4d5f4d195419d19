"""Static-shape decode steps: batch-size buckets, padding, and the compiled CPU runner.

A captured CUDA graph and a `torch.compile(dynamic=False)` graph share one
constraint: the batch size is baked in. Both therefore keep one graph per bucket
(1, 2, 4, 8, 16, 24, 32, then every 16) and pad a decode batch up to the
smallest bucket that holds it. Padded rows are harmless by construction: they
read token 0 at position 0, write their K/V to the pool's scratch slot 0 (never
handed out), and attend to that one slot only; their logits are dropped.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

import torch

BASE_BUCKETS = (1, 2, 4, 8, 16, 24, 32)
BUCKET_STEP_ABOVE_32 = 16


def get_batch_size_buckets(max_bs: int) -> list[int]:
    """Bucket sizes up to `max_bs` (which is always the last bucket)."""
    if max_bs < 1:
        raise ValueError(f"max batch size must be at least 1, got {max_bs}")
    sizes = {b for b in BASE_BUCKETS if b <= max_bs}
    b = BASE_BUCKETS[-1] + BUCKET_STEP_ABOVE_32
    while b < max_bs:
        sizes.add(b)
        b += BUCKET_STEP_ABOVE_32
    sizes.add(max_bs)
    return sorted(sizes)


def pick_bucket(bs: int, buckets: list[int]) -> Optional[int]:
    """The smallest bucket >= bs, or None when bs is larger than every bucket (run eagerly)."""
    if bs < 1:
        raise ValueError(f"batch size must be at least 1, got {bs}")
    i = bisect.bisect_left(buckets, bs)
    return buckets[i] if i < len(buckets) else None


@dataclass
class PaddedDecodeInputs:
    """A decode batch's per-request tensors, padded to a bucket (rows >= real_bs are padding)."""

    bucket: int
    real_bs: int
    input_ids: torch.Tensor        # [bucket]
    positions: torch.Tensor        # [bucket]
    out_cache_loc: torch.Tensor    # [bucket]; padding writes to scratch slot 0
    seq_lens: torch.Tensor         # [bucket]; padding has length 1
    seq_lens_cpu: list[int]
    slot_table: torch.Tensor       # [bucket, L] KV slots per row; padding rows are all slot 0


def pad_decode_batch(bucket: int, input_ids: torch.Tensor, positions: torch.Tensor,
                     out_cache_loc: torch.Tensor, seq_lens_cpu: list[int],
                     slot_table: torch.Tensor) -> PaddedDecodeInputs:
    """Pad a decode batch of len(seq_lens_cpu) rows up to `bucket` rows."""
    bs = len(seq_lens_cpu)
    if bucket < bs:
        raise ValueError(f"bucket {bucket} is smaller than the batch ({bs})")
    pad = bucket - bs
    device = input_ids.device

    def padded(t: torch.Tensor, value: int) -> torch.Tensor:
        if pad == 0:
            return t
        return torch.cat((t, torch.full((pad,) + tuple(t.shape[1:]), value, dtype=t.dtype, device=device)))

    lens = list(seq_lens_cpu) + [1] * pad
    return PaddedDecodeInputs(
        bucket=bucket, real_bs=bs, input_ids=padded(input_ids, 0), positions=padded(positions, 0),
        out_cache_loc=padded(out_cache_loc, 0), seq_lens=torch.tensor(lens, dtype=torch.int64, device=device),
        seq_lens_cpu=lens, slot_table=padded(slot_table, 0))
