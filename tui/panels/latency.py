"""Latency: TTFT / TPOT / E2E percentiles over 5, 15 and 60 s, a TTFT sparkline, throughput."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static
from workbench.core.trace.palette import COMPUTED, DECODE, METRIC_COLORS
from workbench.core.trace.views import LATENCY_METRICS
from workbench.tui.fmt import fmt_count, fmt_s, spark
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel

WINDOWS = (5, 15, 60)
_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "e2e": "E2E"}


def latency_table(model: TuiModel) -> Table:
    """Rows: metric × window; columns p50 / p90 / p99 — straight from TraceState.latency_percentiles."""
    t = Table(box=None, padding=(0, 1), show_edge=False, header_style="bold")
    t.add_column("", no_wrap=True)
    t.add_column("", justify="right", no_wrap=True)
    for p in ("p50", "p90", "p99"):
        t.add_column(p, justify="right", no_wrap=True)
    for w in WINDOWS:
        pct = model.state.latency_percentiles(w, model.now_ns)
        for m in LATENCY_METRICS:
            v = pct.get(m)
            cells = [fmt_s(x, compact=True) for x in v] if v else ["–", "–", "–"]
            t.add_row(_NAMES[m], f"{w}s", *cells, end_section=(m == LATENCY_METRICS[-1] and w != WINDOWS[-1]))
    return t


def throughput_series(model: TuiModel, span_s: float = 60.0, bins: int = 30) -> tuple[list[float], list[float]]:
    """Prefill and decode tokens/s in `bins` equal buckets over the last `span_s` seconds."""
    now = model.now_ns
    width_ns = int(span_s * 1e9 / bins)
    start = now - bins * width_ns
    pre, dec = [0.0] * bins, [0.0] * bins
    for s in reversed(model.state.steps):
        if s.ts <= start:
            break
        if s.ts > now:
            continue
        i = min(bins - 1, (s.ts - start) // width_ns)
        pre[i] += s.prefill_tokens
        dec[i] += s.decode_tokens
    sec = width_ns / 1e9
    return [x / sec for x in pre], [x / sec for x in dec]


def ttft_series(model: TuiModel, n: int = 30) -> list[float]:
    done = [
        r
        for r in model.state.requests.values()
        if r.ttft is not None and r.finish_ts is not None and r.state == "finished"
    ]
    done.sort(key=lambda r: r.finish_ts)
    return [r.ttft for r in done[-n:]]


def render_latency(model: TuiModel, spark_width: int = 30) -> Group:
    tt = ttft_series(model, spark_width)
    pre, dec = throughput_series(model, bins=spark_width)
    tp = model.state.throughput(5.0, model.now_ns)
    lines = Text()
    lines.append("TTFT      ", style="bold")
    lines.append(spark(tt, spark_width) or "·", style=METRIC_COLORS["ttft"])
    lines.append(f"  last {fmt_s(tt[-1])}\n" if tt else "\n", style="dim")
    lines.append("prefill/s ", style="bold")
    lines.append(spark(pre, spark_width), style=COMPUTED)
    lines.append(f"  {fmt_count(tp.prefill_tps)} tok/s\n", style="dim")
    lines.append("decode/s  ", style="bold")
    lines.append(spark(dec, spark_width), style=DECODE)
    lines.append(f"  {fmt_count(tp.decode_tps)} tok/s", style="dim")
    spec = model.state.spec
    if spec.present:  # speculative decoding: tokens a request gains per verify step
        lines.append("\nspec      ", style="bold")
        lines.append(f"{spec.algorithm} accept length {spec.accept_length:.2f}", style=DECODE)
        lines.append(f"  {fmt_count(spec.accepted)}/{fmt_count(spec.proposed)} drafts kept", style="dim")
        rid = model.selected
        mine = spec.request(rid) if rid else None
        if mine is not None:
            v, p, a = mine
            lines.append(f"\n  {rid}: {(a + v) / v:.2f} ({a}/{p} kept over {v} steps)", style="dim")
    return Group(latency_table(model), lines)


class LatencyPanel(TracePanel):
    PANEL_NAME = "latency"
    TITLE = "Latency"
    HELP = (
        "Percentiles (p50/p90/p99) of TTFT (time to first token), TPOT (time per output token "
        "after the first) and E2E (whole request) over requests that finished in the last 5, 15 "
        "and 60 s. Below: TTFT of the last finished requests, and prefill / decode tokens per "
        "second over the last minute (the number is the 5 s average). With speculative decoding: the "
        "accept length (tokens a request gains per verify step, 1 + drafts kept, on average), overall "
        "and for the selected request."
    )
    min_interval_s = 0.25
    clock_interval_s = 1.0

    def compose(self) -> ComposeResult:
        yield Static(id="latency-body")

    def update_view(self, model: TuiModel) -> None:
        w = self.content_region.width
        width = max(8, min(60, w - 22)) if w else 30
        self.query_one("#latency-body", Static).update(render_latency(model, width))
