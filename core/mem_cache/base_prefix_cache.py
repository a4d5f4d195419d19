"""The interface every prefix cache offers the scheduler (RadixCache, ChunkCache).

The scheduler only talks to a cache through these methods, so
`--disable-radix-cache` is a matter of constructing a different class.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from workbench.core.trace.events import TreeNode as TreeNodeInfo


@dataclass
class MatchResult:
    """What `match_prefix` found.

    device_indices: int64 tensor of the KV slots holding the matched prefix
        (length == number of matched tokens; empty when nothing matched).
    last_node: the cache node where the match ended; lock it with
        `inc_lock_ref` while a request relies on `device_indices`.
    """

    device_indices: torch.Tensor
    last_node: Any


class ReqLike(Protocol):
    """The attributes of the scheduler's `Req` that a prefix cache reads and writes."""

    req_pool_idx: int | None  # None until the scheduler gives it a row; set whenever a cache sees it
    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    prefix_indices: torch.Tensor
    last_node: Any


class BasePrefixCache(abc.ABC):
    """Shared API of the prefix caches (SGLang names)."""

    @abc.abstractmethod
    def reset(self) -> None:
        """Forget every cached prefix (slots are not freed: the caller clears the pools)."""

    @abc.abstractmethod
    def match_prefix(self, key: list[int], extra_key: int | None = None) -> MatchResult:
        """Longest cached prefix of `key` (within namespace `extra_key`: a LoRA adapter's load)."""

    @abc.abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, extra_key: int | None = None) -> int:
        """Store `key` -> `value` slots; return how many leading tokens were already cached."""

    @abc.abstractmethod
    def cache_finished_req(self, req: ReqLike, kv_len: int | None = None) -> None:
        """Hand a finished request's KV to the cache and release its row and lock."""

    @abc.abstractmethod
    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Publish the KV a still-running request computed so far (chunked prefill)."""

    @abc.abstractmethod
    def inc_lock_ref(self, node: Any) -> int:
        """Protect `node` and its ancestors from eviction; return the change in evictable size."""

    @abc.abstractmethod
    def dec_lock_ref(self, node: Any) -> int:
        """Undo one `inc_lock_ref`; return the change in evictable size."""

    @abc.abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked cached tokens if possible; return tokens freed."""

    @abc.abstractmethod
    def evictable_size(self) -> int:
        """Cached tokens that no running request holds (can be evicted)."""

    @abc.abstractmethod
    def protected_size(self) -> int:
        """Cached tokens locked by running requests."""

    @abc.abstractmethod
    def total_size(self) -> int:
        """All cached tokens."""

    @abc.abstractmethod
    def pretty_print(self) -> str:
        """Human-readable dump of the cache."""

    @abc.abstractmethod
    def snapshot(self) -> list[TreeNodeInfo]:
        """Every node as a trace `TreeNode`, parents before children; root has parent_id -1."""


def default_kv_len(req: ReqLike) -> int:
    """Tokens of a finished request that have KV: all but the last sampled token."""
    return max(len(req.origin_input_ids) + len(req.output_ids) - 1, 0)


def free_req_without_caching(req_to_token_pool: Any, allocator: Any, req: ReqLike, kv_len: int | None = None) -> None:
    """Give back every KV slot and the row of a finished request (no reuse).

    Used by ChunkCache and by RadixCache(disable=True).
    """
    if kv_len is None:
        kv_len = default_kv_len(req)
    row = req.req_pool_idx
    assert row is not None, f"request {getattr(req, 'rid', '?')} holds no request row"
    # Clone: the row is handed back below and may be rewritten by the next request.
    kv = req_to_token_pool.req_to_token[row, :kv_len].clone()
    allocator.free(kv)
    req_to_token_pool.free(row)


def record_unfinished_req_without_caching(req_to_token_pool: Any, req: ReqLike) -> None:
    """A chunked request keeps its own slots: the next chunk starts after them."""
    row = req.req_pool_idx
    assert row is not None, f"request {getattr(req, 'rid', '?')} holds no request row"
    req.prefix_indices = req_to_token_pool.req_to_token[row, : len(req.fill_ids)].clone()
