"""ChunkCache: the prefix cache that reuses nothing (`--disable-radix-cache`).

It keeps the RadixCache interface so the scheduler does not care which one it
has: matches are always empty, a finished request gives all of its KV slots
and its row back, and a chunked request simply remembers the slots of the
chunks it has computed so the next chunk continues after them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from workbench.core.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    ReqLike,
    free_req_without_caching,
    record_unfinished_req_without_caching,
)
from workbench.core.mem_cache.radix_cache import TreeNode
from workbench.core.trace.events import Event
from workbench.core.trace.events import TreeNode as TreeNodeInfo

__all__ = ["ChunkCache"]


class ChunkCache(BasePrefixCache):
    """No-reuse prefix cache; constructor mirrors `RadixCache` so either can be built the same way."""

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        disable: bool = True,
        on_event: Callable[[Event], None] | None = None,
        decode_text: Callable[[list[int]], str] | None = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.disable = True
        self.on_event = on_event
        self.decode_text = decode_text
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self.reset()

    def reset(self) -> None:
        """Nothing is stored; only the sentinel root is rebuilt."""
        # A root node so `req.last_node` has the same type as with RadixCache.
        self.root_node = TreeNode(0)
        self.root_node.value = torch.empty((0,), dtype=torch.int64, device=self.device)

    def match_prefix(self, key: list[int], extra_key: int | None = None) -> MatchResult:
        """Always an empty match ending at the root."""
        return MatchResult(torch.empty((0,), dtype=torch.int64, device=self.device), self.root_node)

    def insert(self, key: list[int], value: torch.Tensor, extra_key: int | None = None) -> int:
        """Stores nothing; the caller keeps ownership of `value`."""
        return 0

    def cache_finished_req(self, req: ReqLike, kv_len: int | None = None) -> None:
        """Free every KV slot of the request (first `kv_len`, default all but the last token) and its row."""
        free_req_without_caching(self.req_to_token_pool, self.token_to_kv_pool_allocator, req, kv_len)

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """`req.prefix_indices` becomes the slots of `req.fill_ids` (its own, nothing shared)."""
        record_unfinished_req_without_caching(self.req_to_token_pool, req)

    def inc_lock_ref(self, node) -> int:
        return 0

    def dec_lock_ref(self, node) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        """Nothing to evict."""
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def all_values(self) -> torch.Tensor:
        """No slots are held by the cache."""
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    def pretty_print(self) -> str:
        return "ChunkCache (prefix caching disabled)"

    def snapshot(self) -> list[TreeNodeInfo]:
        """Just the root."""
        return [TreeNodeInfo(node_id=0, parent_id=-1, tokens=0, text="", lock_ref=0, hits=0, last_access=0)]
