"""The TUI's smaller readability fixes (#15, point 8): a labelled status line that fits 100
columns, TTFT always with its unit, whitespace tokens drawn visibly, tree labels as wide as the
panel, the last step's nodes underlined, Events' finish lines with the latencies first and step
numbers. Pure render functions on synthetic events where possible, a real Textual Pilot where
the app's layout is the point."""
from __future__ import annotations

from rich.text import Text

from workbench.core.trace import events as ev
from workbench.core.trace.views import TreeNodeView

NOW = 10**12
S = 10**9


def _styles_at(text: Text, needle: str) -> str:
    """The styles of the spans that cover the first occurrence of `needle` in `text`."""
    start = text.plain.index(needle)
    return " ".join(str(sp.style) for sp in text.spans if sp.start <= start < sp.end)


def _tree(texts: dict[int, tuple[int, str]], age_s: float = 120.0) -> dict[int, TreeNodeView]:
    """A tree from {node_id: (parent_id, text)} under root 0, every node `age_s` old (cold)."""
    tree = {0: TreeNodeView(0, -1, 0)}
    for nid, (parent, text) in texts.items():
        tree[nid] = TreeNodeView(nid, parent, 4, text, last_access=NOW - int(age_s * S))
        tree[parent].children.append(nid)
    return tree


# ---- tree ------------------------------------------------------------------------------------

def test_render_tree_underlines_touched_nodes_and_unfolds_their_ancestors():
    from workbench.tui.panels.tree import render_tree
    tree = _tree({1: (0, "system prompt"), 2: (1, "first question"), 3: (1, "second question"),
                  4: (2, "deep leaf")})
    plain, _ = render_tree(tree, NOW)
    assert "cold below" in plain.plain and "deep leaf" not in plain.plain   # cold: folded
    text, _ = render_tree(tree, NOW, touched={4})
    assert "“deep leaf”" in text.plain            # its ancestors (1, 2) unfolded to show it
    assert "underline" in _styles_at(text, "“deep leaf”")
    for other in ("“system prompt”", "“first question”", "“second question”"):
        assert "underline" not in _styles_at(text, other)
    # selected and touched at once: both marks
    both, _ = render_tree(tree, NOW, highlight={4}, touched={4})
    assert {"underline", "reverse"} <= set(_styles_at(both, "“deep leaf”").split())


# ---- status line -----------------------------------------------------------------------------


# ---- queues ----------------------------------------------------------------------------------

def _one_request(first_token_ms: float) -> list[ev.Event]:
    t = NOW
    ms = 10**6
    return [
        ev.ReqArrived(ts=t, proc="tokenizer", rid="a", prompt_preview="hello"),
        ev.ReqTokenized(ts=t + ms // 10, proc="tokenizer", rid="a", prompt_tokens=5, max_new_tokens=4),
        ev.ReqQueued(ts=t + ms // 5, proc="scheduler", step=0, rid="a", prompt_tokens=5, queue_len=1),
        ev.BatchStep(ts=t + 5 * ms, proc="scheduler", step=0, mode="extend", batch_size=1, padded_size=1,
                     reqs=[ev.StepReq("a", 0, 5, 1)]),
        ev.QueueState(ts=t + 5 * ms, proc="scheduler", step=0, waiting=[], running=["a"], chunked=[]),
        ev.ReqFirstToken(ts=t + int(first_token_ms * ms), proc="tokenizer", rid="a"),
    ]


# ---- events ----------------------------------------------------------------------------------
