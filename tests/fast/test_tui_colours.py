"""One colour language (#15): cached, computed, decode, waiting, locked, evictable, free, evicted and
retracted are defined once (workbench.core.trace.palette) and both front ends draw with it.

The TUI is checked on what it really draws (the SVG Textual exports, help screen included, whose
swatches must be the palette's), the widgets on their plotly figures, and the sources of both on
not keeping a colour of their own for any of those meanings.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from tui_helpers import replay_app, show_at, step_ts
from workbench.core.trace.palette import MEANINGS, PALETTE

ROOT = pathlib.Path(__file__).resolve().parents[2]
# Colours with no meaning of the palette's: chrome (white, greys, black) and the error red of a banner.
NEUTRAL = {"#ffffff", "#333333", "#999999", "#333", "#555", "#666", "#999", "#bbb", "#c00"}
# Named terminal colours the panels used for these meanings before; none may come back.
NAMED = ("green", "yellow", "blue", "magenta", "orange", "purple", "cyan")


def test_every_meaning_has_one_distinct_colour():
    assert (
        set(PALETTE)
        == {
            "cached",
            "computed",
            "decode",
            "waiting",
            "locked",
            "evictable",
            "free",
            "evicted",
            "retracted",
            "transfer",
        }
        == set(MEANINGS)
    )
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in PALETTE.values())
    assert len(set(PALETTE.values())) == len(PALETTE), "two meanings share a colour"


async def test_tui_draws_every_meaning_in_its_palette_colour():
    app, replay = replay_app(layout="grid", select="long-1")
    async with app.run_test(size=(160, 48)) as pilot:
        await show_at(app, pilot, replay, step_ts(replay, 21))
        screen = app.export_screenshot().lower()
        # the batch bars, the KV pool, the tree's locks, the queues and the events, on the real screen
        for meaning in (
            "cached",
            "computed",
            "decode",
            "waiting",
            "locked",
            "evictable",
            "free",
            "evicted",
            "retracted",
        ):
            assert PALETTE[meaning] in screen, f"{meaning} ({PALETTE[meaning]}) is not drawn"
        # the theme speaks the language too: $wb-<meaning> for CSS (a plugin panel's included)
        css = app.get_css_variables()
        assert {m: css[f"wb-{m}"] for m in PALETTE} == PALETTE
        await pilot.press("question_mark")
        await pilot.pause()
        help_svg = app.export_screenshot().lower()
        body = app.screen.query_one("#help-body").render()
        help_text = str(body)
    # the help shows a swatch of the real colour next to each meaning's name
    for meaning, hex_ in PALETTE.items():
        assert hex_ in help_svg, f"help: no {meaning} swatch"
        assert re.search(rf"███ {meaning}\b", help_text), f"help: {meaning} is not named next to a swatch"


def test_widgets_take_their_colours_from_the_palette():
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from synthetic import synthetic_trace
    from workbench.widgets import BatchView, GanttView, KVPoolView, QueueView, RadixTreeView
    from workbench.widgets.views import NODE_COLORS

    events = synthetic_trace(n_requests=8, seed=3, chunk_size=24, max_running=3, kv_total=300)
    batch = BatchView(events)
    assert [t.marker.color for t in batch.figure.data[:3]] == [
        PALETTE["cached"],
        PALETTE["computed"],
        PALETTE["decode"],
    ]
    gantt = GanttView(events)
    assert [t.marker.color for t in gantt.figure.data[:3]] == [
        PALETTE["waiting"],
        PALETTE["computed"],
        PALETTE["decode"],
    ]
    kv = KVPoolView(events)
    assert [t.line.color for t in kv.figure.data] == [PALETTE["locked"], PALETTE["evictable"], PALETTE["free"]]
    q = QueueView(events)
    assert [t.line.color for t in q.figure.data] == [PALETTE["waiting"], PALETTE["decode"], PALETTE["waiting"]]
    tree = RadixTreeView(events)
    assert {k: v for k, v in NODE_COLORS.items() if k != "root"} == {
        "evicted": PALETTE["evicted"],
        "locked": PALETTE["locked"],
        "new": PALETTE["computed"],
        "hit": PALETTE["cached"],
        "cached": PALETTE["evictable"],
    }
    assert set(tree.figure.data[0].marker.colors) <= set(NODE_COLORS.values())
    legend = tree.caption.value.lower()
    for meaning in ("evicted", "locked", "computed", "cached", "evictable"):
        assert meaning in legend
    # retractions are marked in the retracted colour on the Gantt
    marks = gantt.figure.data[3]
    kinds = [c[1] for c in marks.customdata]
    if "retracted" in kinds:
        assert marks.marker.color[kinds.index("retracted")] == PALETTE["retracted"]
    for v in (batch, gantt, kv, q, tree):
        v.close()


def _sources():
    files = sorted((ROOT / "tui").rglob("*.py")) + sorted((ROOT / "widgets").rglob("*.py"))
    assert files
    return files


def test_no_front_end_keeps_a_colour_of_its_own():
    """Every hex colour in tui/ and widgets/ is the palette's or a neutral one, and no panel styles
    text with a named colour (they meant cached/computed/decode/waiting/... before)."""
    palette = {c.lower() for c in PALETTE.values()}
    for path in _sources():
        src = path.read_text()
        for hex_ in re.findall(r"""["'\s:(]#([0-9a-fA-F]{6}|[0-9a-fA-F]{3})\b""", src):
            h = f"#{hex_.lower()}"
            assert h in NEUTRAL, f"{path.relative_to(ROOT)}: hard-coded {h}" + (
                " (a palette colour: import it from workbench.core.trace.palette)" if h in palette else ""
            )
        for lit in re.findall(r"""(?:style=|: )f?["']([^"'\n]*)["']""", src):
            words = set(re.findall(r"[a-z]+", lit.lower()))
            named = words & set(NAMED)
            assert not named, f"{path.relative_to(ROOT)}: named colour {named} in style {lit!r}"
