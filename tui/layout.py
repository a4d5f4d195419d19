"""Arranging panels: all on one screen (grid) or one tab per panel."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import TabbedContent, TabPane

#: the default one-screen arrangement: rows of slots; a slot is a panel name or a tuple side by side
GRID = (("pd",), ("queues", "tree"), ("batch", ("kv", "latency")), ("events", "detail", "experts"))
GRID_HEIGHTS = ("2fr", "3fr", "3fr", "2fr")  # "pd": disaggregated serving only (its first pd.* event)
#: widths in the grid beside the 1fr default: Queues' nine columns need about 85 cells, so at
#: 150 columns it takes 3/5 of its row (the tree folds long branches and reads fine narrower)
GRID_WIDTHS = {"queues": "3fr", "tree": "2fr"}
#: the smallest terminal that gets the grid in the "auto" layout (smaller: one tab per panel)
GRID_MIN_SIZE = (150, 36)


async def mount_layout(main: Widget, panels: dict[str, Widget], titles: dict[str, str], mode: str) -> None:
    """Mount `panels` (name -> widget, in order) into `main`. Panels the grid does not place
    (plugins) get a row of their own at the bottom; one panel alone fills the screen."""
    if len(panels) == 1:
        await main.mount(*panels.values())
    elif mode == "tabs":
        # Panes are composed in before mounting (as `with TabbedContent(): yield TabPane(...)` does):
        # add_pane on a TabbedContent whose children are not composed yet fails.
        tabs = TabbedContent(id="tabs")
        for i, (name, widget) in enumerate(panels.items(), 1):
            tabs.compose_add_child(TabPane(f"{i} {titles[name]}", widget, id=f"tab-{name}"))
        await main.mount(tabs)
    else:
        placed: set[str] = set()
        for row, height in zip(GRID, GRID_HEIGHTS):
            cells = []
            for slot in row:
                names = [slot] if isinstance(slot, str) else list(slot)
                present = [panels[n] for n in names if n in panels]
                for n in names:
                    if n in panels and n in GRID_WIDTHS:
                        panels[n].styles.width = GRID_WIDTHS[n]
                placed.update(n for n in names if n in panels)
                if len(present) == 1:
                    cells.append(present[0])
                elif present:
                    cells.append(Horizontal(*present))
            if cells:
                r = Horizontal(*cells, classes="grid-row")
                r.styles.height = height
                await main.mount(r)
        extra = [w for n, w in panels.items() if n not in placed]
        if extra:
            r = Horizontal(*extra, classes="grid-row")
            r.styles.height = "2fr"
            await main.mount(r)
