"""Radix tree: the live KV-cache prefix tree, cold subtrees collapsed."""

from __future__ import annotations

from dataclasses import dataclass

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static
from workbench.core.trace.palette import CACHED, COMPUTED, EVICTABLE, EVICTED, LOCKED
from workbench.core.trace.views import RequestView, TreeNodeView
from workbench.tui.fmt import fmt_age, fmt_count
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel


@dataclass
class _Sub:
    nodes: int = 0
    tokens: int = 0
    locked: bool = False
    last_access: int = 0


def subtree_stats(tree: dict[int, TreeNodeView]) -> dict[int, _Sub]:
    """Per node: nodes and tokens below (itself included), any lock, newest access (iterative)."""
    out: dict[int, _Sub] = {}
    order: list[int] = []
    stack = [n.node_id for n in tree.values() if n.parent_id not in tree]
    while stack:
        nid = stack.pop()
        order.append(nid)
        stack.extend(c for c in tree[nid].children if c in tree)
    for nid in reversed(order):
        n = tree[nid]
        s = out[nid] = _Sub(1, n.tokens, n.lock_ref > 0, n.last_access)
        for c in n.children:
            cs = out.get(c)
            if cs is not None:
                s.nodes += cs.nodes
                s.tokens += cs.tokens
                s.locked |= cs.locked
                s.last_access = max(s.last_access, cs.last_access)
    return out


def request_path(tree: dict[int, TreeNodeView], r: RequestView | None) -> set[int]:
    """The nodes that hold the request's tokens, matched by text (edge previews may be cut
    short with '…', so the walk stops at the first cut edge)."""
    if r is None or not tree:
        return set()
    text = (r.prompt_preview or "") + (r.text or "")
    roots = [n for n in tree.values() if n.parent_id not in tree]
    if not roots or not text:
        return set()
    path: set[int] = set()
    node, rest = roots[0], text
    while rest:
        best = None
        for c in node.children:
            child = tree.get(c)
            if child is None or not child.text:
                continue
            edge = child.text.rstrip("…")
            if edge and (rest.startswith(edge) or (child.text.endswith("…") and edge.startswith(rest[: len(edge)]))):
                if best is None or len(edge) > len(best.text):
                    best = child
        if best is None:
            break
        path.add(best.node_id)
        if best.text.endswith("…"):
            break
        rest = rest[len(best.text) :]
        node = best
    return path


# Whitespace a token may be made of, drawn visibly: a newline token must not look like an empty node.
_VISIBLE = str.maketrans({"\n": "⏎", "\t": "⇥", "\r": "␍"})
MIN_PREVIEW = 8  # the fewest characters of an edge's text shown, however narrow the panel


def edge_label(text: str, n: int) -> str:
    """An edge's text for one line of at most n characters: newlines, tabs and carriage returns
    as ⏎ ⇥ ␍, an edge of nothing but spaces as ␣ (one per space), an ellipsis when cut."""
    text = text.translate(_VISIBLE)
    if text and not text.strip(" "):
        text = "␣" * len(text)
    return text if len(text) <= n else text[: max(0, n - 1)] + "…"


def render_tree(
    tree: dict[int, TreeNodeView],
    now_ns: int,
    highlight: set[int] = frozenset(),
    cold_s: float = 30.0,
    max_lines: int = 400,
    max_children: int = 12,
    preview_chars: int = 28,
    touched: set[int] = frozenset(),
    width: int | None = None,
) -> tuple[Text, int]:
    """The tree as indented lines; returns (text, lines). A subtree with no locked node whose
    newest access is older than `cold_s` (and that is not highlighted or touched) is folded into
    one line; beyond `max_children` children the coldest are summarized. `highlight` (the selected
    request's nodes) is drawn reversed, `touched` (the last step's requests' nodes) underlined.
    With `width` (the panel's, in cells) each node's text gets the room its line has left
    (at least MIN_PREVIEW characters); without, `preview_chars`."""
    out = Text(no_wrap=True, overflow="ellipsis")
    if not tree:
        out.append("(empty: nothing cached yet)", style="dim")
        return out, 1
    stats = subtree_stats(tree)
    cold_ns = int(cold_s * 1e9)
    hot_path = set(highlight) | set(touched)
    for nid in set(highlight) | set(touched):  # keep the ancestors of highlighted nodes unfolded
        p = tree.get(nid)
        while p is not None and p.parent_id in tree:
            hot_path.add(p.parent_id)
            p = tree.get(p.parent_id)
    roots = sorted((n for n in tree.values() if n.parent_id not in tree), key=lambda n: n.node_id)
    # items: ("node", node_id, line prefix, children's prefix) | ("summary", label, line prefix, "")
    stack: list[tuple] = [("node", r.node_id, "", "") for r in reversed(roots)]
    lines = 0
    while stack:
        if lines >= max_lines:
            rest = sum(stats[it[1]].nodes for it in stack if it[0] == "node")
            out.append(f"… {rest} more nodes not shown\n", style="dim")
            lines += 1
            break
        kind, payload, pre, child_pre = stack.pop()
        out.append(pre, style="dim")
        lines += 1
        if kind == "summary":
            out.append(f"… {payload}\n", style="dim italic")
            continue
        n = tree[payload]
        s = stats[payload]
        if n.parent_id not in tree:
            out.append("● root", style="bold")
            out.append(f"  {fmt_count(s.tokens)} tokens in {s.nodes - 1} nodes\n", style="dim")
        else:
            folded = n.children and not s.locked and now_ns - s.last_access > cold_ns and payload not in hot_path
            if folded:
                tail = (f"  ▸ {s.nodes - 1} cold below ({fmt_count(s.tokens - n.tokens)} t)", "dim italic")
            elif len(n.children) > 1:
                tail = (f"  [{len(n.children)} children]", "bold")
            else:
                tail = ("", "")
            room = None if width is None else width - cell_len(pre) - cell_len(tail[0])
            _node_line(out, n, now_ns, payload in highlight, preview_chars, payload in touched, room)
            out.append(*tail)
            out.append("\n")
            if folded:
                continue
        kids = [tree[c] for c in n.children if c in tree]
        # hot first: locked subtrees, then the most recently used
        kids.sort(key=lambda k: (not stats[k.node_id].locked, -stats[k.node_id].last_access, k.node_id))
        shown = kids[:max_children] + [k for k in kids[max_children:] if k.node_id in hot_path]
        hidden = [k for k in kids[max_children:] if k.node_id not in hot_path]
        items: list[tuple] = [("node", k.node_id) for k in shown]
        if hidden:
            toks = sum(stats[k.node_id].tokens for k in hidden)
            items.append(
                (
                    "summary",
                    f"{len(hidden)} colder subtrees: "
                    f"{sum(stats[k.node_id].nodes for k in hidden)} nodes, {fmt_count(toks)} t",
                )
            )
        for i in range(len(items) - 1, -1, -1):
            last = i == len(items) - 1
            branch, cont = ("└─ " if last else "├─ "), ("   " if last else "│  ")
            stack.append((items[i][0], items[i][1], child_pre + branch, child_pre + cont))
    return out, lines


def _node_line(
    out: Text,
    n: TreeNodeView,
    now_ns: int,
    selected: bool,
    preview_chars: int,
    touched: bool = False,
    room: int | None = None,
) -> None:
    """One node: “text” Nt [lock N] [hits N] age. With `room` (cells left on its line) the text
    takes what the figures after it leave; else `preview_chars`."""
    figures: list[tuple[str, str]] = [(f" {n.tokens}t", "")]
    if n.lock_ref > 0:
        figures.append((f" lock {n.lock_ref}", f"bold {LOCKED}"))
    if n.hits:
        figures.append((f" hits {n.hits}", CACHED))
    if n.tier != "device":  # HiCache: where the node's KV lives besides (or instead of) the device
        figures.append((f" {n.tier}", "dim italic" if n.tier == "device+host" else "italic"))
    if n.just_evicted and n.evicted_step >= 0:  # a ghost: gone from the cache, kept on show a few steps
        figures.append((f" evicted at step {n.evicted_step}", EVICTED))
    elif n.just_evicted:
        figures.append((" evicted", EVICTED))
    elif n.last_access:
        figures.append((f" {fmt_age(now_ns - n.last_access)}", "dim"))
    if room is not None:  # 2: the quotes
        preview_chars = max(MIN_PREVIEW, room - 2 - sum(cell_len(t) for t, _ in figures))
    label = edge_label(n.text, preview_chars) if n.text else f"#{n.node_id}"
    if n.just_evicted:
        style = f"strike {EVICTED}"
    elif n.lock_ref > 0:
        style = f"bold {LOCKED}"
    elif n.tier in ("host", "storage"):
        style = "dim"  # off the device: a match loads it back before using it
    elif n.just_inserted:
        style = COMPUTED  # just computed and inserted
    else:
        style = EVICTABLE  # unlocked: the cache may drop it
    if selected:
        style = (style + " reverse").strip()
    if touched:
        style = (style + " underline").strip()
    out.append(f"“{label}”", style=style)
    for text, fig_style in figures:
        out.append(text, style=fig_style)


class TreePanel(TracePanel):
    PANEL_NAME = "tree"
    TITLE = "Radix tree"
    HELP = (
        "The KV cache as a prefix tree: each node is an edge of token ids, shown as decoded text "
        "(⏎ a newline, ⇥ a tab, ␣ a space-only token; as much as the panel's width allows) "
        "with its token count, lock count (lock N = in use by N running requests, cannot be evicted), "
        "hits and age. Colours (the colour key above): locked (bold), evictable, computed = "
        "just inserted, evicted (struck through: an evicted node stays a few steps as a ghost, `evicted at step N`); hits in the cached colour; reversed = the "
        "selected request's nodes; underlined = the nodes of the requests the last step prefilled "
        "(as named on the `last step` line). 'N children' marks a prefix "
        "shared by N continuations. Cold subtrees (unlocked, idle > 30 s) fold into one line."
    )
    min_interval_s = 0.25
    clock_interval_s = 1.0
    DEFAULT_CSS = """
    #tree-body { text-wrap: nowrap; text-overflow: ellipsis; }
    """

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._model: TuiModel | None = None

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="tree-body")

    def on_resize(self) -> None:
        # The node texts are as long as the width allows: redraw now, not at the next clock tick.
        if self._model is not None and self.panel_ready:
            self.update_view(self._model)

    def update_view(self, model: TuiModel) -> None:
        self._model = model
        st = model.state
        tree = st.display_tree()  # the cache plus the nodes evicted a few steps ago (ghosts)
        sel = st.requests.get(model.selected) if model.selected else None
        touched: set[int] = set()
        for rid in st.step_rids():  # the requests the last step prefilled: their nodes underlined
            touched |= request_path(tree, st.requests.get(rid))
        # the scroll view's content width (0 before the first layout: then the default preview)
        width = self.query_one(VerticalScroll).scrollable_content_region.width or None
        text, _ = render_tree(tree, model.now_ns, request_path(tree, sel), touched=touched, width=width)
        self.query_one("#tree-body", Static).update(text)
        self.border_title = (
            f"Radix tree — {max(0, len(st.tree) - 1)} nodes · evictable "
            f"{fmt_count(st.evictable)} · protected {fmt_count(st.tree_protected_size)} t"
        )
