"""Arranging panels: all on one screen (grid) or one tab per panel."""

from __future__ import annotations

from textual.containers import Horizontal
from textual.widget import Widget
from textual.widgets import TabbedContent, TabPane

#: the default one-screen arrangement: rows of slots; a slot is a panel name or a tuple side by side
GRID = (("pd",), ("queues", "tree"), ("batch", ("kv", "latency")), ("events", "detail", "experts"))
GRID_HEIGHTS = ("2fr", "3fr", "3fr", "2fr")  # "pd": disaggregated serving only (its first pd.* event)


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
