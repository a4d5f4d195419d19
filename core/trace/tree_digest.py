"""A digest of a radix tree, to check that what a trace rebuilds is the tree the scheduler holds.

The scheduler computes it from its live nodes (`RadixCache.digest`), the reducer from the
`TreeNodeView`s it folded (`digest_of_views`); a test compares the two after every step (the
scheduler emits its own as `cache.digest` when `WORKBENCH_TRACE_TREE_DIGEST=1`, see
docs/trace.md). It covers what the views show of each node: its id, parent, token count, lock
count, hits and tier; not its preview text or last access time (a match moves that without a
`cache.touch`). The root is left out (its hit count is bookkeeping, never drawn).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from typing import Protocol

# The env var that makes the scheduler emit its digest after every step (tests only: it walks the tree).
TREE_DIGEST_ENV = "WORKBENCH_TRACE_TREE_DIGEST"

Row = tuple[int, int, int, int, int, str]  # node_id, parent_id, tokens, lock_ref, hits, tier


class _NodeLike(Protocol):
    node_id: int
    parent_id: int
    tokens: int
    lock_ref: int
    hits: int
    tier: str


def digest_rows(rows: Iterable[Row]) -> str:
    """The digest of a tree given as one row per non-root node, in any order."""
    h = hashlib.blake2b(digest_size=12)
    for row in sorted(rows):
        h.update(repr(row).encode())
    return h.hexdigest()


def digest_of_views(tree: Mapping[int, _NodeLike]) -> str:
    """The digest of a tree as the reducer holds it (`TraceState.trees[proc]`) or as a
    `cache.tree` lists it (`TreeNode`s): nodes with parent -1 (the root) are left out."""
    return digest_rows(
        (n.node_id, n.parent_id, n.tokens, n.lock_ref, n.hits, n.tier) for n in tree.values() if n.parent_id != -1
    )
