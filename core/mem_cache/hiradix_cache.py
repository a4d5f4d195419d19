"""HiCache: a radix cache whose nodes keep their KV on the device, in a host pool (L2), or both.

SGLang's HiRadixCache, as this project models it (docs/hicache.md):

- A node's KV lives in the device pool (`value`, slot indices), in the host pool (`host_value`,
  host slot indices of `MHATokenToKVPoolHost`), or both. `evicted` means the device copy was
  dropped (`value` is then empty); such a node always has a host copy.
- Write policies (`--hicache-write-policy`), when device KV is copied to the host:
  `write_through` as soon as a node enters the tree; `write_through_selective` once a node has
  been hit twice (entering the tree counts one, each match one more: SGLang's threshold); `write_back` only when it is evicted from the device.
- Device eviction (LRU over unlocked nodes whose children are all off the device) drops the device
  copy of a node backed on host and keeps the node; a node not backed (write_back: could not be
  written, host full; write_through*: not written yet) is removed with its host-only subtree.
- Host eviction (when a backup needs host room) removes host-only leaves, LRU.
- `match_prefix` walks device and host nodes alike; when the matched path ends in host-only nodes
  it allocates device slots (evicting if needed, the matched device part locked) and copies their
  KV back, every layer, before returning: the request's prefix then covers them, so the scheduler
  counts them as cached tokens instead of recomputing them. If the device cannot make room, the
  match stops at the device part.

Shape invariant (checked by `host_problems`): the device-resident nodes form a subtree at the root
(a device node's parent is on the device), evicted nodes are never locked and always backed.

Locks, sizes and the KV check: `evictable_size` / `protected_size` / `total_size` / `all_values`
count device tokens only (what the scheduler's budget sees); `host_size` counts host tokens.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

import torch
from workbench.core.mem_cache.base_prefix_cache import MatchResult, ReqLike
from workbench.core.mem_cache.hicache_storage import (
    STORAGE_PAGE_SIZE,
    HiCacheFile,
    SimStorage,
    page_keys,
    storage_namespace,
)
from workbench.core.mem_cache.memory_pool_host import MHATokenToKVPoolHost, host_pool_size
from workbench.core.mem_cache.radix_cache import RadixCache, TreeNode, _as_key, _common_len, _parent
from workbench.core.trace.events import CacheEvict, Event, HiCacheTransfer

__all__ = ["HiRadixCache", "WRITE_POLICIES", "make_hiradix_cache"]

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
# Hits (inserts through a node) before a backup, per policy; write_back backs up on eviction only.
_WRITE_THROUGH_THRESHOLD = {"write_through": 1, "write_through_selective": 2}


def _no_namespaces(extra_key: int | None) -> None:
    if extra_key is not None:
        raise NotImplementedError(
            "HiCache keeps one namespace: --enable-lora cannot run with --enable-hierarchical-cache"
        )


class HiRadixCache(RadixCache):
    """A `RadixCache` with a host tier under the device pool (see the module doc).

    Args:
        req_to_token_pool, token_to_kv_pool_allocator: as for `RadixCache`.
        token_to_kv_pool_host: the host pool (`MHATokenToKVPoolHost`) over the device KV pool.
        write_policy: one of WRITE_POLICIES.
        on_event, decode_text: as for `RadixCache`; `on_event` also gets `HiCacheTransfer` events.
        storage: the L3 tier (`HiCacheFile`; the simulator's `SimStorage`), or None.
    """

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        token_to_kv_pool_host: MHATokenToKVPoolHost,
        write_policy: str = "write_through",
        on_event: Callable[[Event], None] | None = None,
        decode_text: Callable[[list[int]], str] | None = None,
        storage: HiCacheFile | SimStorage | None = None,
    ):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy must be one of {', '.join(WRITE_POLICIES)}, not {write_policy!r}")
        self.token_to_kv_pool_host = token_to_kv_pool_host
        self.write_policy = write_policy
        self.write_through_threshold: int | None = _WRITE_THROUGH_THRESHOLD.get(write_policy)
        # Nodes a load-back in progress reads from host: host eviction must not take them.
        self._pinned: set[int] = set()
        # Totals (for /metrics and the views): tokens served from host, loads, backups.
        self.host_hit_tokens = 0
        self.load_back_count = 0
        self.load_back_ms = 0.0
        self.backup_tokens = 0
        self.host_evicted_tokens = 0
        self.storage = storage
        self.storage_hit_tokens = 0  # tokens prefetched from storage (L3) for matches
        # The scheduler's hook, called before a copy touches device slots (a load-back, a backup):
        # in the overlap loop it waits for a prefill still in flight on the worker thread, which may
        # read or write those slots (Scheduler: `sync_inflight_for_cache_copy`). None: no wait.
        self.sync_before_copy: Callable[[], object] | None = None
        self.copy_waits = 0  # copies that had to wait for an in-flight pass (the hook returned True)
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, False, on_event, decode_text)

    def reset(self) -> None:
        """Drop every node and free the host pool (the device pool is cleared by the caller)."""
        super().reset()
        host = getattr(self, "token_to_kv_pool_host", None)  # None while RadixCache.__init__ runs
        if host is not None:
            host.clear()

    # ---- tiers ------------------------------------------------------------------

    def _tier(self, node: TreeNode) -> str:
        if node.evicted:
            return "host"
        return "device+host" if node.host_value is not None else "device"

    def _transfer(self, what: str, nodes: list[TreeNode], tokens: int, ms: float) -> None:
        event = HiCacheTransfer(
            what=what,
            node_ids=[n.id for n in nodes],
            tokens=tokens,
            bytes=tokens * self.token_to_kv_pool_host.bytes_per_token(),
            ms=round(ms, 3),
        )
        self._emit(event)  # the scheduler narrates it (StepNarrator.on_hicache) and traces it

    def _wait_for_inflight(self) -> bool:
        """Call the scheduler's hook (before any change to the tree: waiting folds the in-flight
        result in, which inserts into the tree); True if it waited."""
        if self.sync_before_copy is not None and self.sync_before_copy():
            self.copy_waits += 1
            return True
        return False

    def _match_copies(self, path: list[TreeNode]) -> bool:
        """Whether matching `path` copies device KV: a load-back, or a selective backup on this hit."""
        threshold = self.write_through_threshold
        for n in path:
            if n.evicted:
                return True
            if threshold is not None and n.host_value is None and n.hit_count + 1 >= threshold:
                return True
        return False

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """As `RadixCache.cache_unfinished_req`; under the write-through policies its insert may back
        up a chunk whose KV a prefill in flight is still writing, so that pass is waited for first."""
        if self.write_through_threshold is not None:
            self._wait_for_inflight()
        super().cache_unfinished_req(req)

    def write_backup(self, node: TreeNode, what: str = "write_through") -> bool:
        """Copy a device node's KV to the host pool (evicting host-only leaves for room); False if
        the host cannot hold it."""
        if node.host_value is not None or node.evicted:
            return True
        host = self.token_to_kv_pool_host
        n = len(node.key)
        if host.available_size() < n:
            self.evict_host(n - host.available_size())
        host_idx = host.alloc(n)
        if host_idx is None:
            return False
        ms = host.backup_from_device(host_idx, node.value)
        node.host_value = host_idx.clone()
        self.backup_tokens += n
        self._transfer(what, [node], n, ms)
        if self.storage is not None:
            self._write_storage(node)
        return True

    def _write_storage(self, node: TreeNode) -> None:
        """Write the whole pages of `node`'s prefix that storage lacks (the path is on the device)."""
        assert self.storage is not None
        path: list[TreeNode] = []
        n: TreeNode | None = node
        while n is not None and n is not self.root_node:
            path.append(n)
            n = n.parent
        path.reverse()
        if any(p.evicted for p in path):
            return  # (not reached: a backed-up node's path is on the device)
        tokens = [t for p in path for t in p.key]
        num_pages = len(tokens) // STORAGE_PAGE_SIZE
        if num_pages == 0:
            return
        t0 = time.perf_counter()
        slots = torch.cat([p.value for p in path])
        pool = self.token_to_kv_pool_host.device_pool
        written = 0
        for page, key in enumerate(page_keys(self.storage.namespace, tokens, num_pages)):
            if self.storage.exists(key):
                continue
            if pool is None:  # the simulator (SimStorage): no K/V, only which pages storage holds
                written += int(self.storage.set(key, torch.empty(0), torch.empty(0)))
                continue
            idx = slots[page * STORAGE_PAGE_SIZE : (page + 1) * STORAGE_PAGE_SIZE]
            k = torch.stack([pool.k_buffer[layer][idx] for layer in range(pool.layer_num)])
            v = torch.stack([pool.v_buffer[layer][idx] for layer in range(pool.layer_num)])
            written += int(self.storage.set(key, k, v))
        if written:
            ms = (time.perf_counter() - t0) * 1000.0
            self._transfer("storage_write", [node], written * STORAGE_PAGE_SIZE, ms)

    def _inc_hit_count(self, node: TreeNode) -> None:
        node.hit_count += 1
        threshold = self.write_through_threshold
        if threshold is not None and node.host_value is None and node.hit_count >= threshold:
            self.write_backup(node, "write_through")

    # ---- matching and inserting ---------------------------------------------

    def _walk(self, key: list[int], count_hit: bool) -> list[TreeNode]:
        """The nodes along the longest cached prefix of `key` (device and host), split to fit."""
        now = self._tick()
        node, path, pos = self.root_node, [], 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if count_hit:
                child.hits += 1
                self._touch("hit", child)
            path.append(child)
            pos += n
            node = child
        return path

    def _match(
        self, key: list[int], count_hit: bool, extra_key: int | None = None
    ) -> tuple[list[torch.Tensor], TreeNode]:
        """The device part of the match (no load-back): what `cache_unfinished_req` re-reads."""
        _no_namespaces(extra_key)
        values: list[torch.Tensor] = []
        last = self.root_node
        for node in self._walk(key, count_hit):
            if node.evicted:
                break
            values.append(node.value)
            last = node
        return values, last

    def match_prefix(self, key: list[int], extra_key: int | None = None) -> MatchResult:
        """Longest cached prefix of `key` in any tier; a host-only tail is loaded back to the device
        first (see the module doc), so `device_indices` covers it when that succeeded."""
        _no_namespaces(extra_key)
        if len(key) == 0:
            return MatchResult(self._empty(), self.root_node)
        key = _as_key(key)
        path = self._walk(key, count_hit=True)
        # Overlap loop: a copy must not run under a prefill in flight (it may read or write the slots
        # a load-back is handed, or a backup reads); the wait changes the tree, so walk again.
        if self._match_copies(path) and self._wait_for_inflight():
            path = self._walk(key, count_hit=False)
        if self.storage is not None:
            self._prefetch(key, path)
        # A backup for a hit may need host room: the host-only tail of this match must stay.
        self._pinned = {n.id for n in path}
        try:
            for node in path:
                if not node.evicted:
                    self._inc_hit_count(node)
        finally:
            self._pinned = set()
        on_device = next((i for i, n in enumerate(path) if n.evicted), len(path))
        if on_device < len(path):
            anchor = path[on_device - 1] if on_device else self.root_node
            if self.load_back(anchor, path[on_device:]):
                on_device = len(path)
        device = path[:on_device]
        values = [n.value for n in device]
        return MatchResult(torch.cat(values) if values else self._empty(), device[-1] if device else self.root_node)

    def _prefetch(self, key: list[int], path: list[TreeNode]) -> None:
        """Storage (L3) -> host: the whole pages of `key` past the tree's match, as one new host-only
        node appended to `path` (the load-back then brings it to the device like any host hit)."""
        assert self.storage is not None
        matched = sum(len(n.key) for n in path)
        first, num_pages = matched // STORAGE_PAGE_SIZE, len(key) // STORAGE_PAGE_SIZE
        if num_pages <= first:
            return
        t0 = time.perf_counter()
        pages = self.storage.prefetch(page_keys(self.storage.namespace, key, num_pages)[first:])
        if not pages:
            return
        skip = matched - first * STORAGE_PAGE_SIZE  # the first page's tokens the tree has already
        host = self.token_to_kv_pool_host
        k: torch.Tensor | None = None
        v: torch.Tensor | None = None
        if host.has_data:
            k = torch.cat([pk for pk, _ in pages], dim=1)[:, skip:]
            v = torch.cat([pv for _, pv in pages], dim=1)[:, skip:]
            n = int(k.shape[1])
        else:  # the simulator's pages (SimStorage): placeholders, the tokens are what count
            n = len(pages) * STORAGE_PAGE_SIZE - skip
        if n <= 0:
            return
        if host.available_size() < n:
            self._pinned = {p.id for p in path}
            try:
                self.evict_host(n - host.available_size())
            finally:
                self._pinned = set()
        host_idx = host.alloc(n)
        if host_idx is None:
            return
        if k is not None and v is not None:
            host.k_buffer[:, host_idx] = k.to(host.dtype)
            host.v_buffer[:, host_idx] = v.to(host.dtype)
        host.bytes_prefetched += n * host.bytes_per_token()
        parent = path[-1] if path else self.root_node
        node = TreeNode(self._new_id(), parent, key[matched : matched + n], self._empty())
        node.evicted, node.host_value, node.last_access = True, host_idx.clone(), self._tick()
        parent.children[node.key[0]] = node
        self._emit_insert(node)
        path.append(node)
        self.storage_hit_tokens += n
        self._transfer("prefetch", [node], n, (time.perf_counter() - t0) * 1000.0)

    def load_back(self, anchor: TreeNode, nodes: list[TreeNode]) -> bool:
        """Copy host-only `nodes` (a chain below the device node `anchor`) back to device slots."""
        need = sum(len(n.key) for n in nodes)
        alloc = self.token_to_kv_pool_allocator
        self.inc_lock_ref(anchor)  # the device part of the match must survive the eviction below
        self._pinned = {n.id for n in nodes}
        try:
            if alloc.available_size() < need:
                self.evict(need - alloc.available_size())
            device_idx = alloc.alloc(need) if alloc.available_size() >= need else None
        finally:
            self._pinned = set()
            self.dec_lock_ref(anchor)
        if device_idx is None:
            return False
        host_idx = torch.cat([n.host_value for n in nodes if n.host_value is not None])
        ms = self.token_to_kv_pool_host.load_to_device(host_idx, device_idx)
        offset = 0
        for n in nodes:
            n.value = device_idx[offset : offset + len(n.key)].to(torch.int64).clone()
            n.evicted = False
            offset += len(n.key)
        self._evictable_size += need  # loaded, unlocked: the caller locks what it uses
        self.host_hit_tokens += need
        self.load_back_count += 1
        self.load_back_ms += ms
        self._transfer("load_back", nodes, need, ms)
        return True

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        host = child.host_value
        head = super()._split(child, n)  # an evicted child's empty `value` splits into two empty ones
        head.evicted = child.evicted
        head.hit_count = child.hit_count
        if host is not None:
            head.host_value, child.host_value = host[:n], host[n:]
        return head

    def insert(self, key: list[int], value: torch.Tensor, extra_key: int | None = None) -> int:
        """As `RadixCache.insert`; host-only nodes on the path take the caller's slots as their
        device copy again (they are not duplicates: the return value stops before the first one),
        and a node that enters the device counts a hit for the write-through policies (a match
        counts the others: SGLang's hit count, so write_through_selective backs up a node that
        was computed once and then hit)."""
        _no_namespaces(extra_key)
        key = _as_key(key)
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        now = self._tick()
        node, pos = self.root_node, 0
        cached: int | None = None  # where the caller's slots stop being duplicates
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                new = TreeNode(self._new_id(), node, key[pos:], value[pos:].to(torch.int64).clone())
                new.last_access = now
                node.children[key[pos]] = new
                self._evictable_size += len(new.key)
                self._emit_insert(new)
                self._inc_hit_count(new)
                cached = pos if cached is None else cached
                break
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            if child.evicted:
                # Never locked (evicted nodes are not), so the revived tokens are evictable.
                child.value = value[pos : pos + n].to(torch.int64).clone()
                child.evicted = False
                self._evictable_size += n
                cached = pos if cached is None else cached
                self._inc_hit_count(child)
            pos += n
            node = child
        return pos if cached is None else cached

    # ---- eviction -----------------------------------------------------------

    def _device_leaves(self) -> list[TreeNode]:
        return [
            n
            for n in self._iter_nodes()
            if not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())
        ]

    def evictable_leaves(self) -> set[TreeNode]:
        """Unlocked device nodes whose children are all off the device (what device eviction takes)."""
        return set(self._device_leaves())

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots, LRU: a node backed on host (written back first
        under write_back) keeps its place in the tree; one that is not is removed."""
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._device_leaves()]
        heapq.heapify(heap)
        evicted, removed_tokens, freed, removed, kept = 0, 0, [], [], []
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = _parent(node)
            if node.host_value is None and self.write_through_threshold is None:
                self.write_backup(node, "write_back")
            freed.append(node.value)
            evicted += len(node.key)
            self._evictable_size -= len(node.key)
            if node.host_value is not None:
                node.value = self._empty()
                node.evicted = True
                kept.append(node)
            else:
                node.value = self._empty()
                removed += self._remove_subtree(node)
                removed_tokens += len(node.key)
            if (
                parent is not self.root_node
                and parent.lock_ref == 0
                and all(c.evicted for c in parent.children.values())
            ):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
        if removed:
            self._emit(CacheEvict(node_ids=removed, tokens=removed_tokens))
        elif kept:
            self._touch("evict", kept[0])  # tiers changed: the next snapshot shows them
        return evicted

    def _remove_subtree(self, node: TreeNode) -> list[int]:
        """Take `node` (no device KV left below it) out of the tree; free the host slots under it."""
        del _parent(node).children[node.key[0]]
        ids, stack = [], [node]
        while stack:
            n = stack.pop()
            ids.append(n.id)
            if n.host_value is not None:
                self.token_to_kv_pool_host.free(n.host_value)
                n.host_value = None
            stack.extend(n.children.values())
            n.parent = None
        return ids

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots by removing host-only leaves, LRU; return tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = [
            (n.last_access, n.id, n)
            for n in self._iter_nodes()
            if n.evicted and not n.children and n.id not in self._pinned
        ]
        heapq.heapify(heap)
        freed, ids = 0, []
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = _parent(node)
            ids += self._remove_subtree(node)
            freed += len(node.key)
            if parent.evicted and not parent.children and parent.id not in self._pinned:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if ids:
            self.host_evicted_tokens += freed
            self._emit(CacheEvict(node_ids=ids, tokens=0))  # no device slots came free
        return freed

    # ---- sizes and checks ---------------------------------------------------

    def internal_state(self) -> dict[str, int | float]:
        """HiCache's figures for get_internal_state: the host pool and the transfer totals."""
        host = self.token_to_kv_pool_host
        bpt = host.bytes_per_token()
        return {
            "host_used_tokens": host.size - host.available_size(),
            "host_total_tokens": host.size,
            "load_back_tokens": self.host_hit_tokens,
            "load_back_count": self.load_back_count,
            "load_back_bytes": host.bytes_loaded,
            "backup_tokens": self.backup_tokens,
            "backup_bytes": host.bytes_written,
            "prefetch_tokens": self.storage_hit_tokens,
            "prefetch_bytes": host.bytes_prefetched,
            "host_evicted_tokens": self.host_evicted_tokens,
            "copy_waits": self.copy_waits,
            "bytes_per_token": bpt,
        }

    def total_size(self) -> int:
        """Device tokens in the tree, counted by walking it."""
        return sum(int(n.value.numel()) for n in self._iter_nodes())

    def host_size(self) -> int:
        """Host tokens held by nodes, counted by walking the tree."""
        return sum(len(n.host_value) for n in self._iter_nodes() if n.host_value is not None)

    def host_problems(self) -> list[str]:
        """What is wrong with the host tier and the tiers' shape (empty: nothing); the KV check adds these."""
        problems: list[str] = []
        host = self.token_to_kv_pool_host
        parts = [host.free_slots]
        for n in self._iter_nodes():
            if n.evicted:
                if n.host_value is None:
                    problems.append(f"node #{n.id} is in no tier (evicted from the device, no host copy)")
                if n.value.numel():
                    problems.append(f"node #{n.id} is evicted but still names {n.value.numel()} device slots")
                if n.lock_ref:
                    problems.append(f"node #{n.id} is evicted but locked ({n.lock_ref})")
            else:
                if len(n.value) != len(n.key):
                    problems.append(f"node #{n.id}: {len(n.key)} tokens but {len(n.value)} device slots")
                if _parent(n).evicted:
                    problems.append(f"node #{n.id} is on the device under host-only node #{_parent(n).id}")
            if n.host_value is not None:
                if len(n.host_value) != len(n.key):
                    problems.append(f"node #{n.id}: {len(n.key)} tokens but {len(n.host_value)} host slots")
                parts.append(n.host_value)
            if len(problems) > 12:
                break
        held = self.host_size()
        if host.available_size() + held != host.size:
            problems.append(f"host pool: free {host.available_size()} + held by nodes {held} != size {host.size}")
        every = torch.cat([p.cpu() for p in parts]) if parts else torch.empty((0,), dtype=torch.int64)
        if every.numel():
            if int(every.min()) < 1 or int(every.max()) > host.size:
                problems.append(f"host slot ids out of range 1..{host.size}")
            else:
                counts = torch.bincount(every, minlength=host.size + 1)[1:]
                dup, missing = int((counts > 1).sum()), int((counts == 0).sum())
                if dup or missing:
                    problems.append(f"host pool: {dup} slots counted twice, {missing} nowhere (leaked)")
        return problems

    def pretty_print(self) -> str:
        """RadixCache's dump, with each node's tier."""
        lines = super().pretty_print().splitlines()
        tiers = {f"#{n.id} ": self._tier(n) for n in self._iter_nodes()}
        out = [lines[0] + f" host={self.host_size()}/{self.token_to_kv_pool_host.size}"]
        for line in lines[1:]:
            key = line.strip().split("[", 1)[0]
            out.append(line + (f" ({tiers[key]})" if key in tiers else ""))
        return "\n".join(out)


def make_hiradix_cache(server_args, runner, on_event=None, decode_text=None) -> HiRadixCache:
    """The scheduler's HiRadixCache over `runner`'s pools, sized by --hicache-ratio / --hicache-size."""
    device_pool = getattr(runner, "token_to_kv_pool", None)
    if device_pool is not None:
        bytes_per_token = 2 * device_pool.layer_num * device_pool.head_num * device_pool.head_dim
        bytes_per_token *= torch.empty((), dtype=device_pool.dtype).element_size()
    else:  # the simulator's pool-only runner: the tiers' bookkeeping without K/V (storage: SimStorage)
        bytes_per_token = int(getattr(runner, "kv_bytes_per_token", 0) or 0)
    size = host_pool_size(
        runner.max_total_num_tokens, bytes_per_token, server_args.hicache_ratio, server_args.hicache_size
    )
    host = MHATokenToKVPoolHost(device_pool, size, bytes_per_token=bytes_per_token)
    # Beside the device pool on the runner, as SGLang's cache controller holds both: the simulated worker
    # reads its copies' bytes there to charge them time (simulation/sim_worker.py).
    runner.token_to_kv_pool_host = host
    storage: HiCacheFile | SimStorage | None = None
    if server_args.hicache_storage_backend == "file":
        prepared = getattr(runner, "prepared", None)
        model = (
            f"{server_args.model_path or 'default'}@{server_args.revision or ''}:{getattr(prepared, 'model_dir', '')}"
        )
        tp = f"tp{getattr(runner, 'tp_rank', 0)}/{getattr(runner, 'tp_size', 1)}"
        if device_pool is None:  # the simulator: storage in memory for the run (page keys only)
            namespace = storage_namespace(f"sim:{model}", torch.float32, 0, 0, 0, f"{tp}|{bytes_per_token}")
            storage = SimStorage(namespace)
        else:
            namespace = storage_namespace(
                model, device_pool.dtype, device_pool.layer_num, device_pool.head_num, device_pool.head_dim, tp
            )
            storage = HiCacheFile(namespace, server_args.hicache_storage_prefetch_policy)
    return HiRadixCache(
        runner.req_to_token_pool,
        runner.token_to_kv_pool_allocator,
        host,
        write_policy=server_args.hicache_write_policy,
        on_event=on_event,
        decode_text=decode_text,
        storage=storage,
    )
