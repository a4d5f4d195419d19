"""ForwardMode and ForwardBatch: what one model forward pass needs to know.

A ForwardBatch is built by the ModelRunner from a ModelWorkerBatch (scheduler
side) and carries the flattened token layout plus the KV-slot bookkeeping the
attention backend reads. Every request's new tokens are contiguous in
`input_ids`; `extend_start_loc[i]` says where request i's tokens start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from workbench.core.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool


class ForwardMode(IntEnum):
    EXTEND = auto()  # prefill: new prompt tokens (possibly on top of a cached prefix)
    DECODE = auto()  # one new token per request
    MIXED = auto()  # a chunk of prefill and decode requests in one pass
    IDLE = auto()  # nothing to run (a data-parallel rank with no work)
    # Speculative verify: each request's last token and its drafts, causal over its cached prefix,
    # logits at every position. An extend to the attention backends; its own name so that the CUDA
    # graph runner can replay it from graphs captured with a fixed number of rows per request.
    TARGET_VERIFY = auto()

    def is_extend(self) -> bool:
        """EXTEND, MIXED and TARGET_VERIFY take the general (ragged, causal) attention path."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T] new tokens of all requests, concatenated
    positions: torch.Tensor  # [T] absolute position of each new token
    req_pool_indices: torch.Tensor  # [B] rows in ReqToTokenPool
    seq_lens: torch.Tensor  # [B] length after this pass (prefix + new)
    out_cache_loc: torch.Tensor  # [T] KV slot where each new token's K/V is written
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]  # [B] new tokens per request (1 for decode)
    extend_prefix_lens_cpu: list[int]  # [B] tokens already in the pool per request
    return_all_logits: bool = False
    # which requests' rows return_all_logits covers (None: all); see ModelWorkerBatch.all_logits_reqs
    all_logits_reqs: list[bool] | None = None
    req_to_token_pool: ReqToTokenPool | None = None
    token_to_kv_pool: MHATokenToKVPool | None = None
    attn_backend: Any = None
    # Filled by the attention backend's init_forward_metadata.
    attn_metadata: Any = None
    extend_start_loc_cpu: list[int] = field(default_factory=list)
    # Multi-LoRA: per request, the adapter it runs under (None: the base model); None when none has one.
    lora_paths: list[str | None] | None = None

    def __post_init__(self):
        if not self.extend_start_loc_cpu:
            start, locs = 0, []
            for n in self.extend_seq_lens_cpu:
                locs.append(start)
                start += n
            self.extend_start_loc_cpu = locs

    def to(self, device) -> ForwardBatch:
        """Move the per-token / per-request tensors to `device` in place (the scheduler and the
        offline harness build them on the host). Returns self."""
        device = torch.device(device)
        for name in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc"):
            t = getattr(self, name)
            if t.device.type != device.type:  # each rank's process has one current GPU
                setattr(self, name, t.to(device, non_blocking=True))
        return self

    @property
    def last_token_index(self) -> torch.Tensor:
        """Index into the T new tokens of each request's last one (whose logits we sample)."""
        return torch.tensor(
            [s + n - 1 for s, n in zip(self.extend_start_loc_cpu, self.extend_seq_lens_cpu)], dtype=torch.int64
        )
