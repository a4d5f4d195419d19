"""What a recording says about its requests, worked out from the scheduler's own events (tests' references)."""

from __future__ import annotations

from workbench.core.trace import events as ev


def expected_chunks(events) -> dict[str, list[tuple[int, int, int]]]:
    """Each chunked prefill's chunks per rid: (chunk index, first token, end token), from the
    req.scheduled events (the prefix hit, then extend_len per chunk; a retraction starts again)."""
    want: dict[str, list[tuple[int, int, int]]] = {}
    nxt: dict[str, int] = {}
    for e in events:
        if isinstance(e, ev.ReqScheduled) and e.num_chunks > 1:
            if e.chunk_index == 0:
                nxt[e.rid] = e.prefix_hit
            a = nxt[e.rid]
            nxt[e.rid] = a + e.extend_len
            want.setdefault(e.rid, []).append((e.chunk_index, a, a + e.extend_len))
    return want
