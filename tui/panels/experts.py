"""Expert load of a mixture-of-experts model: a heatmap of tokens per (layer, expert).

Three maps, each a row per sparse layer and a cell per expert (or per group of experts when
there are more experts than columns): every step so far, the last step, and the selected
request's own tokens. A cell's shade is its count against the busiest cell of its row; the
number at the end of a row is the layer's imbalance (busiest expert over the mean, 1.0 = even).
The panel mounts itself the first time a `moe.routing` event arrives (dense models never show it).
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static
from workbench.core.trace.experts import imbalance
from workbench.core.trace.palette import COMPUTED, DECODE
from workbench.tui.fmt import fmt_count
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel

SHADES = "·░▒▓█"  # zero, then four steps up to the row's busiest cell


def group(row: list[int], columns: int) -> tuple[list[int], int]:
    """`row` summed into at most `columns` cells of `size` consecutive experts; (cells, size)."""
    size = max(1, -(-len(row) // max(1, columns)))
    return [sum(row[i : i + size]) for i in range(0, len(row), size)], size


def shade(n: int, hi: int) -> str:
    if n <= 0 or hi <= 0:
        return SHADES[0]
    return SHADES[min(len(SHADES) - 1, 1 + (n * (len(SHADES) - 1) - 1) // hi)]


def heatmap(rows: list[list[int]], layers: list[int], columns: int, style: str) -> Text:
    """One line per layer: 'L<id> ' + a shaded cell per expert group + the layer's imbalance."""
    out = Text()
    for layer, row in zip(layers, rows):
        cells, _ = group(row, columns)
        hi = max(cells, default=0)
        out.append(f"L{layer:<3}", style="dim")
        for n in cells:
            ch = shade(n, hi)
            out.append(ch, style="dim" if ch == SHADES[0] else style)
        ratio = imbalance(row)
        out.append(f" {ratio:4.1f}×\n" if ratio else "    –\n", style="dim")
    return out


def render_experts(model: TuiModel, width: int = 60, rid: str | None = None) -> Text:
    load = model.state.experts
    out = Text()
    if not load.present:
        out.append("no moe.routing event yet (a dense model has no experts)", style="dim")
        return out
    columns = max(4, width - 10)
    _, size = group([0] * load.num_experts, columns)
    per = f", {size} experts a cell" if size > 1 else ""
    out.append(f"{load.num_experts} experts, top {load.top_k}{per}; shade: tokens against the row's busiest\n")
    out.append(f"all {fmt_count(load.steps)} steps\n", style="bold")
    out.append_text(heatmap(load.total, load.layers, columns, COMPUTED))
    if load.last:
        out.append(f"last step (#{load.last_step})\n", style="bold")
        out.append_text(heatmap(load.last, load.layers, columns, DECODE))
    rid = rid or model.selected
    if rid:
        mine = load.request(rid)
        out.append(f"{rid}'s tokens\n", style="bold")
        if mine is None:
            out.append("  no routing seen for it\n", style="dim")
        else:
            out.append_text(heatmap(mine, load.layers, columns, COMPUTED))
    return out


class ExpertsPanel(TracePanel):
    PANEL_NAME = "experts"
    TITLE = "Experts"
    HELP = (
        "Mixture-of-experts models only: how many tokens each sparse layer sent to each expert, as a "
        "heatmap (a row per layer, a cell per expert; the darker, the closer to the row's busiest), over "
        "every step, the last step, and the selected request's own tokens. The number after a row is "
        "its imbalance: the busiest expert's tokens over the mean (1.0 is even)."
    )
    clock_interval_s = 0

    def compose(self) -> ComposeResult:
        yield Static(id="experts-body")

    def update_view(self, model: TuiModel) -> None:
        width = self.content_region.width or 60
        self.query_one("#experts-body", Static).update(render_experts(model, width))
