"""KV memory: request -> token-slot map, the token-slot allocator, and per-layer K/V buffers.

Three pieces, as in SGLang:
- `ReqToTokenPool` maps a running request (a row) to the KV slots of its tokens.
- `TokenToKVPoolAllocator` hands out and takes back token slots (a free list).
- `MHATokenToKVPool` owns the K and V tensors of every layer, indexed by slot.

Slot 0 is never handed out: it is the scratch slot padded (dummy) requests write to.
"""

from __future__ import annotations

import torch
from workbench.core.mem_cache import huge_pages


class ReqToTokenPool:
    """Rows of token-slot indices, one row per running request."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self.free_slots: list[int] = list(range(size))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int = 1) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        out, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return out

    def free(self, idx: int | list[int]) -> None:
        if isinstance(idx, int):
            self.free_slots.append(idx)
        else:
            self.free_slots.extend(idx)

    def clear(self) -> None:
        self.free_slots = list(range(self.size))

    def reserve_padding_row(self) -> int:
        """Append one all-zero row beyond the rows the pool hands out and return its index.

        Padded (dummy) requests of a CUDA-graph batch point at it, so they read and write only
        KV slot 0, which the allocator never hands out. `size` and the free list are unchanged.
        """
        row = torch.zeros((1, self.req_to_token.shape[1]), dtype=self.req_to_token.dtype, device=self.device)
        self.req_to_token = torch.cat((self.req_to_token, row))
        return self.req_to_token.shape[0] - 1


class TokenToKVPoolAllocator:
    """Free list of KV token slots 1..size (slot 0 is reserved for padding)."""

    free_slots: torch.Tensor  # int64, in the order they are handed out (set by `clear`)

    def __init__(self, size: int, device: str = "cpu"):
        self.size = size
        self.device = device
        # Slots ever handed out / taken back (never reset): the trace's per-step KV +/- figures.
        self.num_allocated = 0
        self.num_freed = 0
        self.clear()

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > self.free_slots.numel():
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        self.num_allocated += need_size
        return out

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel() == 0:
            return
        self.num_freed += int(free_index.numel())
        self.free_slots = torch.cat((self.free_slots, free_index.to(self.free_slots.device, torch.int64)))

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)


class MHATokenToKVPool:
    """Per-layer K and V buffers of shape [size + 1, num_kv_heads, head_dim]."""

    def __init__(
        self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int, device: str = "cpu"
    ):
        self.size = size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = device
        shape = (size + 1, head_num, head_dim)
        if str(device) == "cpu" and not huge_pages.unavailable_reason():
            # attention reads each request's slots scattered over the pool: on 2 MiB pages, far fewer TLB misses
            bufs, _ = huge_pages.huge_page_tensors([(shape, dtype)] * (2 * layer_num))
            self.k_buffer, self.v_buffer = bufs[:layer_num], bufs[layer_num:]
        else:
            self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]
            self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layer_num)]

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k_buffer[layer_id][loc] = k.to(self.dtype)
        self.v_buffer[layer_id][loc] = v.to(self.dtype)

    def bytes_per_token(self) -> int:
        return 2 * self.layer_num * self.head_num * self.head_dim * torch.finfo(self.dtype).bits // 8
