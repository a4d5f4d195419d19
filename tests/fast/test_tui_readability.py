"""The TUI's smaller readability fixes (#15, point 8): a labelled status line that fits 100
columns, TTFT always with its unit, whitespace tokens drawn visibly, tree labels as wide as the
panel, the last step's nodes underlined, Events' finish lines with the latencies first and step
numbers. Pure render functions on synthetic events where possible, a real Textual Pilot where
the app's layout is the point."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from synthetic import synthetic_trace
from textual.widgets import DataTable, Static
from tui_helpers import replay_app, show_at, step_ts
from workbench.core.trace import events as ev
from workbench.core.trace.replay import Replay
from workbench.core.trace.state import TraceState
from workbench.core.trace.views import TreeNodeView
from workbench.tui.fmt import fmt_count, fmt_s
from workbench.tui.model import TuiModel

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

    tree = _tree({1: (0, "system prompt"), 2: (1, "first question"), 3: (1, "second question"), 4: (2, "deep leaf")})
    plain, _ = render_tree(tree, NOW)
    assert "cold below" in plain.plain and "deep leaf" not in plain.plain  # cold: folded
    text, _ = render_tree(tree, NOW, touched={4})
    assert "“deep leaf”" in text.plain  # its ancestors (1, 2) unfolded to show it
    assert "underline" in _styles_at(text, "“deep leaf”")
    for other in ("“system prompt”", "“first question”", "“second question”"):
        assert "underline" not in _styles_at(text, other)
    # selected and touched at once: both marks
    both, _ = render_tree(tree, NOW, highlight={4}, touched={4})
    assert {"underline", "reverse"} <= set(_styles_at(both, "“deep leaf”").split())


def test_whitespace_tokens_are_drawn_visibly():
    from workbench.tui.panels.tree import edge_label, render_tree

    assert edge_label("\n", 10) == "⏎"
    assert edge_label("\n\n", 10) == "⏎⏎"
    assert edge_label("  ", 10) == "␣␣"
    assert edge_label("a\tb\r\n", 10) == "a⇥b␍⏎"
    assert edge_label(" the", 10) == " the"  # spaces beside text show between the quotes
    assert edge_label("abcdefghij", 5) == "abcd…"
    text, _ = render_tree(_tree({1: (0, "\n"), 2: (0, " ")}, age_s=1), NOW)
    assert "“⏎”" in text.plain and "“␣”" in text.plain and "“”" not in text.plain


def test_tree_labels_use_the_width_they_are_given():
    from workbench.tui.panels.tree import MIN_PREVIEW, render_tree

    long = "You are a patient teaching assistant for a course on computer systems. " * 2
    tree = _tree({1: (0, long), 2: (1, "What is a page table?"), 3: (1, long)}, age_s=1)
    narrow_default, _ = render_tree(tree, NOW)
    for width in (60, 100, 160):
        text, _ = render_tree(tree, NOW, width=width)
        lines = text.plain.splitlines()
        assert max(cell_len(ln) for ln in lines) == width  # the long edges fill their line
        assert all(cell_len(ln) <= width for ln in lines)
    wide = render_tree(tree, NOW, width=160)[0].plain
    assert long[:100] in wide and long[:40] not in narrow_default
    tiny = render_tree(tree, NOW, width=10)[0].plain  # never below MIN_PREVIEW
    assert f"“{long[: MIN_PREVIEW - 1]}…”" in tiny


async def test_tree_panel_labels_follow_the_panel_width_and_underline_the_last_step():
    from workbench.tui.panels.tree import edge_label, request_path

    app, replay = replay_app(panels=["tree"])
    async with app.run_test(size=(160, 30)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 21))
        body = app.query_one("#tree-body", Static)

        def lines() -> list[str]:
            return body.content.plain.splitlines()

        def labels() -> list[str]:
            return [ln.split("“", 1)[1].split("”", 1)[0] for ln in lines() if "“" in ln]

        # at 160 columns every edge's text is shown as the trace has it (the recorder keeps 40
        # characters), not cut at ~27
        whole = {edge_label(n.text, 10**6) for n in app.model.state.tree.values() if n.text}
        assert set(labels()) <= whole and max(len(x) for x in labels()) > 28
        longest = max(len(x) for x in labels())
        assert "⏎" in body.content.plain  # the chat template's newlines
        assert max(cell_len(ln) for ln in lines()) <= body.size.width
        # the requests step 21 prefilled: their nodes underlined, no other node
        st = app.model.state
        touched = set().union(*(request_path(st.tree, st.requests.get(r)) for r in st.step_rids()))
        assert touched
        underlined = {
            body.content.plain[sp.start : sp.end] for sp in body.content.spans if "underline" in str(sp.style)
        }
        assert underlined and all(u.startswith("“") for u in underlined)
        assert len(underlined) <= len(touched)
        await pilot.resize_terminal(60, 30)  # narrower: the texts give way, the lines fit
        await pilot.pause()
        await pilot.pause()
        assert max(cell_len(ln) for ln in lines()) <= body.size.width <= 58
        assert max(len(x) for x in labels()) < longest


# ---- status line -----------------------------------------------------------------------------


def test_status_line_labels_its_figures_and_breaks_instead_of_cutting():
    from workbench.tui.status import status_line

    st = TraceState()
    st.apply_many(synthetic_trace(n_requests=8))
    now = st.steps[-1].ts
    tp = st.throughput(5.0, now)
    head = "REPLAY a-rather-long-recording-name.jsonl · 12.34/56.78 s · ×1 · paused"
    wide = status_line(head, st, now, ready=True, paused=True, width=300).plain
    assert "\n" not in wide
    assert f"prefill {fmt_count(tp.prefill_tps)} · decode {fmt_count(tp.decode_tps)} tok/s" in wide
    assert f"step {st.steps[-1].step} PAUSED" in wide
    assert f"done {st.counters.num_requests_total} · hit" in wide and "KV " in wide and "wait 0" in wide
    narrow = status_line(head, st, now, ready=True, paused=True, width=98).plain
    first, second = narrow.split("\n")
    assert cell_len(first) <= 98 and cell_len(second) <= 98
    assert first.startswith(head) and second.startswith("wait ")

    # every figure of the one-line form is still there, nothing was cut (the KV figure leaves out
    # its cached share, the rest of the pool: `KV 0% held · 54% free`)
    def figures(line: str) -> list[str]:
        return sorted(f.split(" · ")[0] if f.startswith("KV ") else f for f in line.replace("\n", " │ ").split(" │ "))

    assert figures(wide) == figures(narrow) and " cached · " in wide and " cached · " not in narrow
    # too narrow for the head: its title shrinks, mode and position stay
    tight = status_line(head, st, now, ready=True, paused=False, width=60).plain.split("\n")[0]
    assert cell_len(tight) <= 60 and tight.startswith("REPLAY a-") and "12.34/56.78 s" in tight
    assert "starting…" in status_line("LIVE x", None, 0, ready=False, paused=False, width=100).plain


async def test_status_line_fits_100_columns_in_the_app():
    app, replay = replay_app(layout="tabs")
    async with app.run_test(size=(100, 30)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 21))
        assert app.controller.paused  # PAUSED shown: the longest first line
        app._update_status()
        await pilot.pause()
        status = app.query_one("#status", Static)
        lines = status.content.plain.split("\n")
        assert len(lines) == 2 and status.size.height == 2  # both lines shown
        assert all(cell_len(ln) <= status.content_size.width for ln in lines)
        assert "tok/s" in lines[1] and "prefill " in lines[1] and "decode " in lines[1]
        assert "hit " in lines[1] and "PAUSED" in lines[0]


# ---- queues ----------------------------------------------------------------------------------


def _one_request(first_token_ms: float) -> list[ev.Event]:
    t = NOW
    ms = 10**6
    return [
        ev.ReqArrived(ts=t, proc="tokenizer", rid="a", prompt_preview="hello"),
        ev.ReqTokenized(ts=t + ms // 10, proc="tokenizer", rid="a", prompt_tokens=5, max_new_tokens=4),
        ev.ReqQueued(ts=t + ms // 5, proc="scheduler", step=0, rid="a", prompt_tokens=5, queue_len=1),
        ev.BatchStep(
            ts=t + 5 * ms,
            proc="scheduler",
            step=0,
            mode="extend",
            batch_size=1,
            padded_size=1,
            reqs=[ev.StepReq("a", 0, 5, 1)],
        ),
        ev.QueueState(ts=t + 5 * ms, proc="scheduler", step=0, waiting=[], running=["a"], chunked=[]),
        ev.ReqFirstToken(ts=t + int(first_token_ms * ms), proc="tokenizer", rid="a"),
    ]


async def test_queues_ttft_keeps_its_unit_when_the_first_token_comes():
    from workbench.tui.app import WorkbenchApp
    from workbench.tui.controller import ReplayController

    replay = Replay(_one_request(first_token_ms=12.3))
    app = WorkbenchApp(ReplayController(replay, autoplay=False), panels=["queues"])
    async with app.run_test(size=(120, 30)) as pilot:
        await show_at(app, pilot, replay, NOW + 6 * 10**6)  # running, no first token yet
        table = app.query_one("#queues-table", DataTable)
        assert str(table.get_cell("a", "ttft")).endswith("s…")
        await show_at(app, pilot, replay, NOW + 20 * 10**6)  # same row order, TTFT known
        cell = str(table.get_cell("a", "ttft"))
        assert cell == fmt_s(0.0123) == "12.3 ms"
        assert table.columns["ttft"].content_width >= cell_len(cell)  # drawn whole, unit included
        assert all(
            table.columns[k].content_width >= cell_len(str(table.get_cell("a", k))) for k in ("age", "state", "out")
        )


# ---- events ----------------------------------------------------------------------------------


def test_events_name_their_step_and_finish_lines_lead_with_latency():
    from workbench.tui.panels.events import format_line, line_matches

    events = synthetic_trace(n_requests=6, reorder=True)  # finishes delivered before their step
    m = TuiModel()
    m.apply(events)
    last_step = {}
    for e in events:
        if type(e) is ev.BatchStep:
            for r in e.reqs:
                last_step[r.rid] = e.step
    finishes = [ln for ln in m.log.lines if ln.category == "finish"]
    assert len(finishes) == 6
    for ln in finishes:
        assert ln.step == last_step[ln.rid]  # the step of its last token
        plain = format_line(ln, m).plain
        assert f"step {ln.step} {ln.rid} finished: TTFT " in plain
        assert plain.index("E2E") < plain.index("prompt")  # latencies before the counts
        assert cell_len(plain[: plain.index(" · ", plain.index("E2E"))]) <= 80
        assert line_matches(ln, [f"step {ln.step}"])
    evicts = [e for e in events if type(e) is ev.CacheEvict]
    logged = [ln for ln in m.log.lines if ln.category == "evict"]
    assert [ln.step for ln in logged] == [e.step for e in evicts]
    assert all(ln.step == -1 for ln in m.log.lines if ln.category == "arrive")
    assert "step" not in format_line(next(ln for ln in m.log.lines if ln.category == "arrive"), m).plain


async def test_events_lines_are_drawn_at_the_panels_width():
    from textual.widgets import RichLog

    app, replay = replay_app(panels=["events"])
    async with app.run_test(size=(140, 30)) as pilot:
        await show_at(app, pilot, replay, replay.end_ns)
        log = app.query_one("#events-log", RichLog)
        finishes = [s.text for s in log.lines if " finished: " in s.text]
        assert len(finishes) == 7
        # past the 80 columns RichLog would measure against on its own: the whole line shows
        assert all(s.rstrip().endswith(("· length", "· stop")) for s in finishes)
        await pilot.resize_terminal(90, 30)  # drawn again at the new width, the latencies kept
        await pilot.pause()
        await pilot.pause()
        finishes = [s.text for s in log.lines if " finished: " in s.text]
        assert len(finishes) == 7
        assert all(cell_len(s.rstrip()) <= log.scrollable_content_region.width and "E2E " in s for s in finishes)
