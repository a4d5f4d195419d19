"""KV pool: used / evictable / free gauge and its history."""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static
from workbench.core.trace.palette import EVICTABLE, EVICTED, FREE, LOCKED, RETRACTED
from workbench.tui.fmt import fmt_count, fmt_pct, resample, spark
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel

USED = LOCKED  # "used" in the pool = held (locked) by running requests


def kv_gauge(used: int, evictable: int, free: int, total: int, width: int) -> Text:
    """A bar: █ used (locked by requests), ▓ evictable (cached, reclaimable), ░ free."""
    text = Text()
    total = max(total, used + evictable + free, 1)
    # A non-zero share gets at least one cell: a few held slots of a 1.2M-token pool drew no █ at
    # all beside a radix tree with locked nodes (issue #40 item 11).
    u = max(int(round(used * width / total)), 1 if used > 0 else 0)
    e = max(int(round(evictable * width / total)), 1 if evictable > 0 else 0)
    u = min(u, width)
    e = min(e, width - u)
    text.append("█" * u, style=USED)
    text.append("▓" * e, style=EVICTABLE)
    text.append("░" * (width - u - e), style=FREE)
    return text


def render_kv(model: TuiModel, width: int = 40) -> Text:
    st = model.state
    k = st.kv
    out = Text()
    if k is None:
        out.append("no kv.usage event yet", style="dim")
        return out
    width = max(10, width)
    total = max(k.total, 1)
    evictable = st.evictable  # the one figure the radix tree's title shows too
    out.append_text(kv_gauge(k.used, evictable, k.free, k.total, width))
    out.append("\n")
    out.append("█ held      ", style=USED)
    out.append(f"{fmt_count(k.used):>6} ({fmt_pct(k.used, total)})\n")
    out.append("▓ cached    ", style=EVICTABLE)
    out.append(f"{fmt_count(evictable):>6} ({fmt_pct(evictable, total)})\n")
    out.append("░ free      ", style=FREE)
    out.append(f"{fmt_count(k.free):>6} of {fmt_count(k.total)} tokens\n")
    hist = list(st.kv_history)
    if hist:
        used = resample([p.used / max(p.total, 1) for p in hist], width)
        held = resample([(p.used + p.evictable) / max(p.total, 1) for p in hist], width)
        out.append(spark(used, width, hi=1.0), style=USED)
        out.append("  held\n", style="dim")
        out.append(spark(held, width, hi=1.0), style=EVICTABLE)
        out.append("  held+cached\n", style="dim")
    c = st.counters
    out.append(f"hit rate {100 * st.cache_hit_rate:.0f}% · ", style="dim")
    out.append(f"evicted {fmt_count(c.evicted_tokens_total)} t", style=EVICTED)
    out.append(" · ", style="dim")
    out.append(f"retracted {c.num_retracted}", style=RETRACTED)
    return out


class KVPanel(TracePanel):
    PANEL_NAME = "kv"
    TITLE = "KV pool"
    HELP = (
        "The token KV pool: █ held by requests in flight, ▓ cached (evictable: prefixes nobody "
        "holds; freed on demand), ░ free; the three add up to the pool, and the status line's KV "
        "figure and the step line's `→ N held` use the same words. Below: the history of held and held+cached, the cache "
        "hit rate (prompt tokens served from the cache as requests are admitted), tokens evicted and requests retracted (the pool ran out "
        "during decode)."
    )
    clock_interval_s = 0

    def compose(self) -> ComposeResult:
        yield Static(id="kv-body")

    def update_view(self, model: TuiModel) -> None:
        width = max(10, self.content_region.width - 14) if self.content_region.width else 40
        self.query_one("#kv-body", Static).update(render_kv(model, width))
