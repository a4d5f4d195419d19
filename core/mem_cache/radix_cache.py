"""Radix prefix cache: token-id prefixes -> KV slots, shared between requests.

Each edge of the tree holds a run of token ids (`key`) and the KV slots that
hold those tokens' keys/values (`value`, int64). A request whose prompt starts
with a cached path reuses those slots instead of recomputing them.

Ownership of KV slots: a slot is either free in the allocator, stored in
exactly one tree node, or privately held by one running request (its
`req_to_token` row beyond `len(req.prefix_indices)`). `insert` takes ownership
of the slots of the tokens it adds; for the leading tokens that were already
cached it keeps the tree's slots and the caller frees its duplicates.

Locking: a running request locks the node its prefix ends at; `lock_ref`
counts locks on a node and on every descendant, so a locked node's whole path
is protected. Only unlocked leaves are evicted, least recently used first.

Node ids (for the trace views): the root is always 0; every other node gets a
fresh id that is never reused. When a match or insert ends inside an edge the
node is split: a NEW node (new id) takes the leading part and becomes the
parent; the ORIGINAL node keeps its id, its children, its locks and the
trailing part. So a node object (and its id) always denotes the same full
prefix from the root, and a request's `last_node` stays valid across splits.
A split emits two `CacheInsert` events: one for the new parent and one
re-announcing the original node under its new parent with its shorter edge
(viewers treat `CacheInsert` as an upsert by node_id).

Staleness: besides inserts and evictions, lock and hit changes alter what a
snapshot shows. The first such change after a `snapshot()` emits one
`CacheTouch` through `on_event` (later ones stay silent until the next
snapshot), so an owner that re-publishes the tree when it hears from the cache
never shows stale lock counts or hits, at no more than one event per snapshot.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator

import torch
from workbench.core.mem_cache.base_prefix_cache import (
    BasePrefixCache,
    MatchResult,
    ReqLike,
    default_kv_len,
    free_req_without_caching,
    record_unfinished_req_without_caching,
)
from workbench.core.trace import clock as trace_clock
from workbench.core.trace.events import CacheEvict, CacheInsert, CacheTouch, Event
from workbench.core.trace.events import TreeNode as TreeNodeInfo
from workbench.core.trace.tree_digest import digest_rows

__all__ = ["RadixCache", "TreeNode", "MatchResult"]

# Text previews: decode this many tokens of an edge, show at most this many chars.
_PREVIEW_TOKENS = 24
_PREVIEW_CHARS = 40
# Prefix comparison walks in slices of this many tokens (C-speed list compare).
_CMP_CHUNK = 64


class TreeNode:
    """One edge of the radix tree (internal; the trace form is events.TreeNode)."""

    __slots__ = (
        "id",
        "parent",
        "children",
        "key",
        "value",
        "lock_ref",
        "hits",
        "last_access",
        "_text",
        "host_value",
        "evicted",
        "hit_count",
    )

    def __init__(
        self,
        node_id: int,
        parent: TreeNode | None = None,
        key: list[int] | None = None,
        value: torch.Tensor | None = None,
    ):
        self.id = node_id
        self.parent = parent
        # Keyed by the first token id of the child's edge: edges of siblings
        # never share a first token, so this is a complete index.
        self.children: dict[int, TreeNode] = {}
        self.key: list[int] = key if key is not None else []
        # KV slot indices of `key`'s tokens (int64); the root's is empty.
        self.value: torch.Tensor = value if value is not None else torch.empty((0,), dtype=torch.int64)
        self.lock_ref = 0
        self.hits = 0
        self.last_access = 0
        self._text: str | None = None
        # HiCache (hiradix_cache.py): the node's host-pool slots (None: not backed up), whether its
        # device slots were dropped (`value` is then empty), and the hits that decide a selective backup.
        self.host_value: torch.Tensor | None = None
        self.evicted = False
        self.hit_count = 0

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens={len(self.key)}, lock_ref={self.lock_ref})"


def _common_len(edge: list[int], key: list[int], start: int) -> int:
    """Length of the common prefix of `edge` and `key[start:]`."""
    n = min(len(edge), len(key) - start)
    if edge[:n] == key[start : start + n]:
        return n
    # Find the first differing chunk with slice compares, then scan inside it.
    i = 0
    while i < n:
        j = min(i + _CMP_CHUNK, n)
        if edge[i:j] != key[start + i : start + j]:
            break
        i = j
    while i < n and edge[i] == key[start + i]:
        i += 1
    return i


def _parent(node: TreeNode) -> TreeNode:
    """The parent of a node in the tree (only the root, and an evicted node, have none)."""
    parent = node.parent
    if parent is None:
        raise RuntimeError(f"{node!r} is the root or no longer in the tree")
    return parent


def _namespace(req) -> dict:
    """The extra_key argument for a request's adapter (multi-LoRA), or none (HiRadixCache takes none)."""
    uid = getattr(req, "lora_uid", None)
    return {} if uid is None else {"extra_key": uid}


def _as_key(key) -> list[int]:
    if isinstance(key, list):
        return key
    if isinstance(key, torch.Tensor):
        return key.tolist()
    return list(key)


class RadixCache(BasePrefixCache):
    """SGLang-style radix tree over token ids whose values are KV slot indices.

    Args:
        req_to_token_pool: `ReqToTokenPool` (rows of slot indices per request).
        token_to_kv_pool_allocator: `TokenToKVPoolAllocator` (free list of slots).
        disable: reuse nothing (behaves like `ChunkCache`).
        on_event: receives `CacheInsert` / `CacheEvict` events when given, and one
            `CacheTouch` per snapshot when locks or hits changed (see the module doc).
        decode_text: token ids -> text, used only for previews in events,
            `snapshot` and `pretty_print`.
    """

    def __init__(
        self,
        req_to_token_pool,
        token_to_kv_pool_allocator,
        disable: bool = False,
        on_event: Callable[[Event], None] | None = None,
        decode_text: Callable[[list[int]], str] | None = None,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.disable = disable
        self.on_event = on_event
        self.decode_text = decode_text
        self.device = getattr(token_to_kv_pool_allocator, "device", "cpu")
        self._next_id = 1
        self._clock = 0
        self.reset()

    # ---- bookkeeping --------------------------------------------------------

    def reset(self) -> None:
        """Drop every node. Slots are NOT freed: pair with clearing both pools (flush)."""
        self.root_node = TreeNode(0)
        self.root_node.key = []
        self.root_node.value = torch.empty((0,), dtype=torch.int64, device=self.device)
        # The root is never evicted nor counted; a permanent lock keeps it out of leaf scans.
        self.root_node.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0
        # Unlocked nodes without children: what eviction takes from, kept as the tree changes so an
        # eviction does not walk the whole tree (a full pool evicts at every prefill step).
        self._evictable_leaves: set[TreeNode] = set()
        self._touched = False  # a CacheTouch went out since the last snapshot()

    def _new_id(self) -> int:
        nid = self._next_id
        self._next_id += 1
        return nid

    def _tick(self) -> int:
        # Strictly increasing stamps so LRU order is total even within one ns; on the trace's clock,
        # as the views show a node's age against the events' times.
        now = trace_clock.now_ns()
        if now <= self._clock:
            now = self._clock + 1
        self._clock = now
        return now

    def _emit(self, event: Event) -> None:
        if self.on_event is not None:
            self.on_event(event)

    def _touch(self, what: str, node: TreeNode) -> None:
        """Locks or hits changed: say so once until the next `snapshot()`."""
        if not self._touched and self.on_event is not None:
            self._touched = True
            self._emit(CacheTouch(what=what, node_id=node.id))

    def _text(self, node: TreeNode) -> str:
        if not node.key:  # the root, or an adapter's namespace (its label)
            return node._text or ""
        if self.decode_text is None:
            return ""
        if node._text is None:
            text = self.decode_text(node.key[:_PREVIEW_TOKENS])
            if len(text) > _PREVIEW_CHARS or len(node.key) > _PREVIEW_TOKENS:
                text = text[:_PREVIEW_CHARS] + "…"
            node._text = text
        return node._text

    def _emit_insert(self, node: TreeNode) -> None:
        if self.on_event is not None:
            self._emit(
                CacheInsert(node_id=node.id, parent_id=_parent(node).id, tokens=len(node.key), text=self._text(node))
            )

    def _empty(self) -> torch.Tensor:
        return torch.empty((0,), dtype=torch.int64, device=self.device)

    # ---- matching and inserting ---------------------------------------------

    def match_prefix(self, key: list[int], extra_key: int | None = None) -> MatchResult:
        """Longest cached prefix of `key` (within namespace `extra_key`: see `namespace_root`).

        Splits a node when the match ends inside its edge, so `last_node`
        covers exactly the matched tokens. Refreshes last-access time and bumps
        the hit counter of every node on the matched path.
        """
        if self.disable or len(key) == 0:
            return MatchResult(self._empty(), self.root_node)
        values, node = self._match(_as_key(key), count_hit=True, extra_key=extra_key)
        return MatchResult(torch.cat(values) if values else self._empty(), node)

    def namespace_root(self, extra_key: int | None, label: str = "") -> TreeNode:
        """Where the prefixes of namespace `extra_key` hang: the root for None, else a keyless node
        under the root (multi-LoRA: one per adapter load, so KV computed under one adapter never
        serves another). Locked permanently like the root: never evicted, holds no KV."""
        if extra_key is None:
            return self.root_node
        slot = -1 - int(extra_key)  # token ids are >= 0: a negative child key never meets one
        node = self.root_node.children.get(slot)
        if node is None:
            node = TreeNode(self._new_id(), self.root_node, [], self._empty())
            node.lock_ref = 1
            node._text = label or f"[adapter #{extra_key}]"
            self.root_node.children[slot] = node
            self._emit_insert(node)
        elif label:
            node._text = label
        return node

    def _match(
        self, key: list[int], count_hit: bool, extra_key: int | None = None
    ) -> tuple[list[torch.Tensor], TreeNode]:
        now = self._tick()
        node = self.namespace_root(extra_key)
        values: list[torch.Tensor] = []
        pos = 0
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
            values.append(child.value)
            pos += n
            node = child
            # After a split the next token differs from the head's only child, so the loop ends.
        return values, node

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut `child`'s edge after `n` tokens; return the new parent holding the head."""
        parent = _parent(child)
        head = TreeNode(self._new_id(), parent, child.key[:n], child.value[:n])
        # The head lies on every path through `child`, so it inherits its locks,
        # statistics and access time; sizes are unchanged.
        head.lock_ref = child.lock_ref
        head.hits = child.hits
        head.last_access = child.last_access
        child.key = child.key[n:]
        child.value = child.value[n:]
        child.parent = head
        child._text = None
        head.children[child.key[0]] = child
        parent.children[head.key[0]] = head
        self._emit_insert(head)
        self._emit_insert(child)
        return head

    def insert(self, key: list[int], value: torch.Tensor, extra_key: int | None = None) -> int:
        """Store `key` with KV slots `value` (same length).

        Returns the length of the prefix that was already cached; the tree
        keeps its own slots for those tokens, so the caller must free
        `value[:returned]` unless they are the tree's slots already. Slots of
        the tokens beyond that are owned by the tree from now on.
        With `disable=True` nothing is stored and 0 is returned.
        """
        if self.disable:
            return 0
        key = _as_key(key)
        if len(value) != len(key):
            raise ValueError(f"insert: {len(key)} tokens but {len(value)} slots")
        now = self._tick()
        node = self.namespace_root(extra_key)
        pos = 0
        while pos < len(key):
            child = node.children.get(key[pos])
            if child is None:
                # Copy: `value` is usually a view of a req_to_token row that is reused later.
                new = TreeNode(self._new_id(), node, key[pos:], value[pos:].to(torch.int64).clone())
                new.last_access = now
                node.children[key[pos]] = new
                self._evictable_leaves.discard(node)
                self._evictable_leaves.add(new)
                self._evictable_size += len(new.key)
                self._emit_insert(new)
                return pos
            n = _common_len(child.key, key, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = now
            pos += n
            node = child
        return pos

    # ---- requests -----------------------------------------------------------

    def cache_finished_req(self, req: ReqLike, kv_len: int | None = None) -> None:
        """Move a finished request's KV into the tree and release its row and lock.

        `kv_len` is the number of leading tokens of `origin_input_ids +
        output_ids` whose KV sits in the request's row; by default all but the
        last sampled token. Slots that duplicate an already-cached prefix are
        freed; the rest become cache entries.
        """
        if self.disable:
            free_req_without_caching(self.req_to_token_pool, self.token_to_kv_pool_allocator, req, kv_len)
            return
        if kv_len is None:
            kv_len = default_kv_len(req)
        token_ids = (list(req.origin_input_ids) + list(req.output_ids))[:kv_len]
        row = req.req_pool_idx
        assert row is not None, f"request {getattr(req, 'rid', '?')} holds no request row"
        kv = self.req_to_token_pool.req_to_token[row, : len(token_ids)].clone()
        already = len(req.prefix_indices)
        new_prefix_len = self.insert(token_ids, kv, **_namespace(req))
        if new_prefix_len > already:
            # Someone else cached these tokens while we computed them.
            self.token_to_kv_pool_allocator.free(kv[already:new_prefix_len])
        self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: ReqLike) -> None:
        """Publish the KV of `req.fill_ids` and re-point the request at the tree's copy.

        Afterwards `req.prefix_indices` covers all of `fill_ids`, the row holds
        the tree's slots for them, and the lock moves to the new last node.
        """
        if self.disable:
            record_unfinished_req_without_caching(self.req_to_token_pool, req)
            return
        token_ids = _as_key(req.fill_ids)
        row = req.req_pool_idx
        assert row is not None, f"request {getattr(req, 'rid', '?')} holds no request row"
        table = self.req_to_token_pool.req_to_token
        kv = table[row, : len(token_ids)].clone()
        already = len(req.prefix_indices)
        new_prefix_len = self.insert(token_ids, kv, **_namespace(req))
        if new_prefix_len > already:
            self.token_to_kv_pool_allocator.free(kv[already:new_prefix_len])
        values, new_node = self._match(token_ids, count_hit=False, **_namespace(req))
        new_indices = torch.cat(values) if values else self._empty()
        # Freed duplicates above must no longer be referenced by the row.
        table[row, already : len(new_indices)] = new_indices[already:]
        self.dec_lock_ref(req.last_node)
        self.inc_lock_ref(new_node)
        req.prefix_indices = new_indices
        req.last_node = new_node

    # ---- locking and eviction -----------------------------------------------

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock `node` and its ancestors; return the change in evictable size (<= 0)."""
        if self.disable or node is None:
            return 0
        if node is not self.root_node:
            self._touch("lock", node)
        delta = 0
        while node is not self.root_node and node is not None:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one `inc_lock_ref(node)`; return the change in evictable size (>= 0)."""
        if self.disable or node is None:
            return 0
        if node is not self.root_node:
            self._touch("lock", node)
        delta = 0
        while node is not self.root_node and node is not None:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked {node!r}")
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
                if not node.children:
                    self._evictable_leaves.add(node)
            node.lock_ref -= 1
            node = node.parent
        return delta

    def evict(self, num_tokens: int) -> int:
        """Evict least-recently-used unlocked leaves until `num_tokens` are freed.

        Frees their slots through the allocator and emits one `CacheEvict`.
        Returns the number of tokens evicted (less than asked only when
        nothing evictable is left; may exceed it by part of the last leaf).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        evicted = 0
        freed: list[torch.Tensor] = []
        ids: list[int] = []
        while evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = _parent(node)
            del parent.children[node.key[0]]
            self._evictable_leaves.discard(node)
            node.parent = None
            freed.append(node.value)
            ids.append(node.id)
            evicted += len(node.key)
            self._evictable_size -= len(node.key)
            # The root is locked permanently, so it is never pushed here.
            if not parent.children and parent.lock_ref == 0:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            self.token_to_kv_pool_allocator.free(torch.cat(freed))
            self._emit(CacheEvict(node_ids=ids, tokens=evicted))
        return evicted

    # ---- sizes and views ----------------------------------------------------

    def evictable_size(self) -> int:
        """Tokens in nodes with lock_ref == 0."""
        return self._evictable_size

    def evictable_leaves(self) -> set[TreeNode]:
        """The unlocked nodes without children, as kept (the KV invariant check walks the tree for them)."""
        return set(self._evictable_leaves)

    def protected_size(self) -> int:
        """Tokens in locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens in the tree, counted by walking it (independent of the counters)."""
        return sum(len(n.key) for n in self._iter_nodes())

    def _iter_nodes(self) -> Iterator[TreeNode]:
        """Non-root nodes, parents before children."""
        stack = list(reversed(self.root_node.children.values()))
        while stack:
            node = stack.pop()
            yield node
            stack.extend(reversed(node.children.values()))

    def all_values(self) -> torch.Tensor:
        """Every slot stored in the tree (for leak checks)."""
        vals = [n.value for n in self._iter_nodes()]
        return torch.cat(vals) if vals else self._empty()

    def snapshot(self) -> list[TreeNodeInfo]:
        """The whole tree as trace `TreeNode`s, root first (parent_id -1), parents before children.
        The next lock or hit change after it emits a `CacheTouch` again."""
        self._touched = False
        root = self.root_node
        out = [
            TreeNodeInfo(
                node_id=root.id,
                parent_id=-1,
                tokens=0,
                text="",
                lock_ref=0,
                hits=root.hits,
                last_access=root.last_access,
            )
        ]
        for n in self._iter_nodes():
            out.append(
                TreeNodeInfo(
                    node_id=n.id,
                    parent_id=_parent(n).id,
                    tokens=len(n.key),
                    text=self._text(n),
                    lock_ref=n.lock_ref,
                    hits=n.hits,
                    last_access=n.last_access,
                    tier=self._tier(n),
                )
            )
        return out

    def digest(self) -> str:
        """The tree's digest (core/trace/tree_digest.py), from the live nodes; unlike `snapshot` it
        leaves the `CacheTouch` bookkeeping alone, so a test may call it after any step."""
        return digest_rows(
            (n.id, _parent(n).id, len(n.key), n.lock_ref, n.hits, self._tier(n)) for n in self._iter_nodes()
        )

    def _tier(self, node: TreeNode) -> str:
        """Where a node's KV lives, for the views: "device" here; HiRadixCache adds "host" tiers."""
        return "device"

    def pretty_print(self) -> str:
        """Indented dump: one line per node with id, tokens, locks, hits and a preview."""
        lines = [
            f"RadixCache total={self.total_size()} evictable={self._evictable_size} protected={self._protected_size}",
            "#0 root",
        ]
        stack = [(c, 1) for c in reversed(self.root_node.children.values())]
        while stack:
            node, depth = stack.pop()
            preview = (
                self._text(node)
                if self.decode_text is not None
                else (str(node.key[:8])[:-1] + (", …]" if len(node.key) > 8 else "]"))
            )
            lines.append(
                f"{'  ' * depth}#{node.id} [{len(node.key)} tok] lock={node.lock_ref} hits={node.hits} {preview!r}"
            )
            stack.extend((c, depth + 1) for c in reversed(node.children.values()))
        return "\n".join(lines)
