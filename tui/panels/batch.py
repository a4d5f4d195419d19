"""Batch composition: one row per scheduler step, newest at the bottom."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable
from workbench.core.trace.palette import CACHED, COMPUTED, DECODE, adapter_colour
from workbench.core.trace.views import StepView
from workbench.tui.history import StepOpened
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import RequestSelected, TracePanel

_MODE_STYLE = {"extend": f"bold {COMPUTED}", "decode": f"bold {DECODE}", "mixed": "bold", "idle": "dim"}
COLUMNS = (
    ("step", "step"),
    ("mode", "mode"),
    ("bs", "bs"),
    ("graph", "cg"),
    ("ms", "ms"),
    ("mix", "tokens"),
    ("comp", "composition"),
)


def token_bar(sv: StepView, width: int = 10) -> Text:
    """Cached / computed / decode tokens of one step as a proportional bar."""
    total = sv.cached_tokens + sv.prefill_tokens + sv.decode_tokens
    text = Text()
    if total <= 0:
        return Text("·" * width, style="dim")
    parts = [(sv.cached_tokens, "░", CACHED), (sv.prefill_tokens, "█", COMPUTED), (sv.decode_tokens, "█", DECODE)]
    cells = [int(round(n * width / total)) if n else 0 for n, _, _ in parts]
    for i, (n, _, _) in enumerate(parts):  # every present kind gets at least one cell
        if n and not cells[i]:
            cells[i] = 1
    while sum(cells) > width:
        cells[cells.index(max(cells))] -= 1
    for (_, ch, style), k in zip(parts, cells):
        text.append(ch * k, style=style)
    text.append(" " * (width - sum(cells)))
    return text


def _rid_style(rid: str, selected: str | None, adapters: dict[str, str] | None, base: str = "") -> str:
    """A rid's style in a row: reversed when selected; under multi-LoRA, in its adapter's colour."""
    style = "reverse bold" if rid == selected else base
    lora = adapters.get(rid) if adapters else None
    return f"{style} {adapter_colour(lora)}".strip() if lora else style


def composition(
    sv: StepView,
    selected: str | None = None,
    max_decode_names: int = 6,
    max_prefill_names: int = 4,
    adapters: dict[str, str] | None = None,
) -> Text:
    """Per-request segments: `rid ░cached+█computed k/n` for prefill chunks (the first
    `max_prefill_names` and the selected one, then `+N more`), then the decode group. With
    `adapters` (rid -> LoRA adapter name), each rid is drawn in its adapter's colour and the row ends
    with the adapters the step ran, each in its colour (the base model's rows stay uncoloured)."""
    text = Text()
    decodes = []
    prefills = [sr for sr in sv.reqs if sr.computed > 0]
    shown = prefills[:max_prefill_names] + [sr for sr in prefills[max_prefill_names:] if sr.rid == selected]
    for sr in sv.reqs:
        if sr.computed > 0:
            if not any(sr is x for x in shown):
                continue
            if text:
                text.append("  ")
            text.append(sr.rid, style=_rid_style(sr.rid, selected, adapters, "bold"))
            text.append(" ")
            if sr.cached:
                text.append(f"░{sr.cached}", style=CACHED)
                text.append("+")
            text.append(f"█{sr.computed}", style=COMPUTED)
            if sr.num_chunks > 1:
                text.append(f" chunk {sr.chunk_index + 1}/{sr.num_chunks}", style="italic")
        elif sr.decode > 0:
            decodes.append(sr.rid)
    if len(prefills) > len(shown):
        text.append(f"  +{len(prefills) - len(shown)} more", style="dim")
    if decodes:
        if text:
            text.append("  ")
        text.append(f"decode×{len(decodes)}", style=DECODE)
        names = decodes[:max_decode_names]
        if selected in decodes and selected not in names:
            names.append(selected)
        for rid in names:
            text.append(" ")
            text.append(rid, style=_rid_style(rid, selected, adapters))
        if len(decodes) > len(names):
            text.append(f" +{len(decodes) - len(names)}", style="dim")
        if sv.spec is not None:  # speculative decoding: the drafts this step kept and threw away
            kept = sum(r.accepted for r in sv.spec.reqs)
            thrown = sum(len(r.drafts) for r in sv.spec.reqs) - kept
            text.append(f"  drafts ✓{kept}", style=f"bold {DECODE}")
            text.append(f" ✗{thrown}", style="dim strike")
            mine = next((r for r in sv.spec.reqs if r.rid == selected), None)
            if mine is not None:
                text.append(f" ({selected} {mine.accepted}/{len(mine.drafts)})", style="reverse")
    if adapters:
        ran = sorted({adapters[sr.rid] for sr in sv.reqs if adapters.get(sr.rid)})
        if ran:
            text.append("  lora ", style="dim")
            for i, name in enumerate(ran):
                text.append(("," if i else "") + name, style=f"bold {adapter_colour(name)}")
    if not text:
        text.append("(empty)", style="dim")
    return text


def step_cells(sv: StepView, selected: str | None = None, adapters: dict[str, str] | None = None) -> tuple:
    badge = Text("CG", style="bold reverse") if sv.cuda_graph else Text("–", style="dim")
    bs = f"{sv.batch_size}/{sv.padded_size}" if sv.padded_size != sv.batch_size else str(sv.batch_size)
    return (
        str(sv.step),
        Text(sv.mode, style=_MODE_STYLE.get(sv.mode, "")),
        bs,
        badge,
        f"{sv.schedule_ms + sv.forward_ms:.0f}",
        token_bar(sv),
        composition(sv, selected, adapters=adapters),
    )


class BatchPanel(TracePanel):
    PANEL_NAME = "batch"
    TITLE = "Batch composition"
    HELP = (
        "One row per scheduler iteration (newest at the bottom). mode: extend (prefill), decode, "
        "mixed. bs: batch size (/padded size when padded to a CUDA-graph bucket); cg: CG when a "
        "CUDA graph replayed, – when eager (the title names the attention backend on GPU); ms: schedule + forward time. tokens: the step's mix — ░ cached = prefix tokens reused from the "
        "cache, █ computed = prompt tokens computed, █ decode = decode tokens (colours: the colour key "
        "above). composition: each prefill "
        "request with cached+computed tokens and its chunk k/n, then the decode group; with speculative "
        "decoding, the step's draft tokens kept (✓) and thrown away (✗); with LoRA adapters, each request in its "
        "adapter's colour and the step's adapters at the end (lora a,b). Enter on a row opens that step's "
        "whole decision (the step history: [ / ] walk the steps)."
    )
    clock_interval_s = 0
    max_rows = 200

    def compose(self) -> ComposeResult:
        table = DataTable(cursor_type="row", id="batch-table", show_cursor=False)
        for key, label in COLUMNS:
            table.add_column(label, key=key)
        yield table

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._keys: list[str] = []
        self._last: tuple[int, int] | None = None  # (ts, step) of the newest row shown
        self._selected: str | None = None
        self._epoch = -1

    def update_view(self, model: TuiModel) -> None:
        table = self.query_one(DataTable)
        steps = model.state.steps
        # Follow the newest step unless the reader browses the table (focused, scrolled up): a
        # table that was hidden (tabs) or resized smaller is never "at the bottom" by scroll_y
        # alone and stopped following (it showed steps 432-436 with the scheduler at 631).
        follow = not table.has_focus or table.scroll_y >= table.max_scroll_y - 1
        rebuild = (
            model.epoch != self._epoch
            or model.selected != self._selected
            or (self._last is not None and (not steps or steps[-1].ts < self._last[0]))
        )
        if rebuild:
            table.clear()
            self._keys, self._last = [], None
            self._epoch, self._selected = model.epoch, model.selected
        new = []
        for sv in reversed(steps):
            if self._last is not None and (sv.ts, sv.step) <= self._last:
                break
            new.append(sv)
            if len(new) >= self.max_rows:
                break
        adapters = (
            {rid: r.lora for rid, r in model.state.requests.items() if r.lora} if model.state.loras_seen else None
        )
        for sv in reversed(new):
            key = f"{sv.proc}:{sv.step}:{sv.ts}"
            table.add_row(*step_cells(sv, model.selected, adapters), key=key)
            self._keys.append(key)
        if new:
            self._last = (new[0].ts, new[0].step)
        while len(self._keys) > self.max_rows:
            table.remove_row(self._keys.pop(0))
        n = len(steps)
        self.border_title = f"Batch composition — {n} steps" + (f" (last {steps[-1].step})" if n else "")
        # The attention backend badge, when it is not a CPU one (a GPU run: flashinfer / triton).
        if n and steps[-1].backend not in ("torch_native", "cpu_paged"):
            self.border_title += f" · {steps[-1].backend}"
        if new and follow:
            table.call_after_refresh(table.scroll_end, animate=False)

    def on_resize(self) -> None:
        table = self.query_one(DataTable)
        if not table.has_focus:
            table.call_after_refresh(table.scroll_end, animate=False)

    def on_descendant_focus(self) -> None:
        self.query_one(DataTable).show_cursor = True

    def on_descendant_blur(self) -> None:
        self.query_one(DataTable).show_cursor = False

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        # Enter on a step opens it in the step history (its whole decision) and selects its first
        # prefill request (or the first decoding one), which Request detail follows.
        event.stop()
        key = event.row_key.value or ""
        for sv in reversed(self.app_model_steps()):
            if f"{sv.proc}:{sv.step}:{sv.ts}" == key:
                if sv.reqs:
                    first = next((r for r in sv.reqs if r.computed > 0), sv.reqs[0])
                    self.post_message(RequestSelected(first.rid))
                self.post_message(StepOpened(sv.proc, sv.step))
                return

    def app_model_steps(self):
        model = getattr(self.app, "model", None)
        return list(model.state.steps) if model is not None else []
