"""Check a recording rebuilds the scheduler's radix tree after every step (issue #44).

The recording must have been made with `WORKBENCH_TRACE_TREE_DIGEST=1`, so each scheduler emitted
`cache.digest` (its own tree's digest) at the end of every step. The events are folded by the
reducer in file order, and at each `cache.digest` the tree the reducer holds for that process must
have the same digest.
"""

from __future__ import annotations

from pathlib import Path

from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.core.trace.tree_digest import digest_of_views


def check_recording(path: str | Path) -> dict[str, int]:
    """Fold the recording; at every `cache.digest`, the reducer's tree for its process must match.
    Returns counts (digests checked, cache.tree snapshots, steps that evicted, tree-changing steps)."""
    state = TraceState()
    counts = {"digests": 0, "trees": 0, "evicts": 0, "changed_steps": 0}
    changed: set[tuple[str, int]] = set()
    mismatches: list[str] = []
    with open(path, "rb") as f:
        for line in f:
            if not line.strip():
                continue
            e = ev.decode_json(line)
            state.apply(e)
            t = type(e)
            if t is ev.CacheDigest:
                counts["digests"] += 1
                held = digest_of_views(state.trees.get(e.proc, {}))
                if held != e.digest:
                    mismatches.append(f"{e.proc} step {e.step}")
            elif t is ev.CacheTree:
                counts["trees"] += 1
            elif t in (ev.CacheInsert, ev.CacheEvict, ev.CacheTouch):
                changed.add((e.proc, e.step))
                counts["evicts"] += t is ev.CacheEvict
    counts["changed_steps"] = len(changed)
    assert not mismatches, f"{len(mismatches)} of {counts['digests']} steps: {mismatches[:5]}"
    return counts
