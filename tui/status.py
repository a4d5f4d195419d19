"""The status line at the top of the TUI, as a pure function of the controller's status and the
TraceState (no Textual import), so its wording and its fit to a width are testable alone.

Every figure has a label (a learner reads `prefill 27 · decode 0 tok/s`, not `27+0`). When the
whole line does not fit the terminal it breaks into two lines at a segment boundary (what the
source is doing / where the scheduler is, then the figures) instead of cutting figures off; only
a terminal too narrow for either line cuts, and then the source's title shrinks first.
"""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from workbench.core.trace.state import TraceState
from workbench.tui.fmt import fmt_count, fmt_pct

SEP = " │ "

#: What the status line says, for the help screen.
STATUS_HELP = (
    "  The source (LIVE model · workload, or REPLAY file · position/length in s from the first "
    "request · speed) │ step N: the last scheduler step (PAUSED: it waits; s runs one step) │ "
    "wait · new · run: requests queued for prefill, arrived but not queued yet, in the decode "
    "batch │ KV: the KV pool's slots held by requests, cached (evictable: prefixes nobody holds, "
    "freed on demand by evicting them) and free; they add up to the pool (a narrow terminal leaves "
    "cached out) │ prefill · decode tok/s: tokens computed per second over the last 5 s │ done: finished requests · hit: share of prefilled prompt tokens served "
    "from the radix cache. On a narrow terminal the figures move to a second line.\n"
)

Segment = tuple[str, str, str]  # (separator before it, text, style)


_pct = fmt_pct  # the KV pool panel uses the same wording


def status_segments(
    st: TraceState, now_ns: int, paused: bool, compact: bool = False
) -> tuple[list[Segment], list[Segment]]:
    """(where, figures): `where` says where the scheduler is (last step, PAUSED); `figures` are
    the labelled counts and rates. `compact`: the KV figure leaves out the cached share (the rest
    of the pool), for a narrow terminal."""
    last = st.steps[-1].step if st.steps else -1
    where = [(SEP, f"step {last}", "")]
    if paused:  # glued to the step: "step 12 PAUSED" reads (and is searched for) as one unit
        where.append(("", " PAUSED ", "bold reverse"))
    q = st.queue_counts()
    figures = [(SEP, f"wait {q['waiting']} · new {q['new']} · run {q['running']}", "")]
    k = st.kv
    if k is not None and k.total:
        # held + cached + free = the pool: cached (evictable) slots are neither held nor free, so
        # a pool full of cache never reads as room (`KV 28% used` with 10 of 640 slots free).
        held, cached, free = _pct(k.used, k.total), _pct(k.evictable, k.total), _pct(k.free, k.total)
        kv = f"KV {held} held · {free} free" if compact else f"KV {held} held · {cached} cached · {free} free"
        figures.append((SEP, kv, ""))
    tp = st.throughput(5.0, now_ns)
    figures.append((SEP, f"prefill {fmt_count(tp.prefill_tps)} · decode {fmt_count(tp.decode_tps)} tok/s", ""))
    c = st.counters
    figures.append((SEP, f"done {c.num_requests_total} · hit {100 * st.cache_hit_rate:.0f}%", ""))
    if c.dropped_events:
        figures.append((SEP, f"dropped {c.dropped_events}", "bold red"))
    return where, figures


def _shrink_head(head: str, room: int) -> str:
    """The controller's status in at most `room` cells: its title (the words between the mode and
    the first ' · ', e.g. a file or model name) is cut first, the mode and position are kept."""
    if cell_len(head) <= room:
        return head
    mode, _, rest = head.partition(" ")
    title, dot, tail = rest.partition(" · ")
    over = cell_len(head) - room
    if title and cell_len(title) - over >= 4:
        keep = cell_len(title) - over - 1
        return f"{mode} {title[:keep]}…{dot}{tail}"
    return head  # the Text's own ellipsis cuts it at the edge


def _length(segments: list[Segment]) -> int:
    return sum(cell_len(sep) + cell_len(text) for sep, text, _ in segments)


def _join(out: Text, segments: list[Segment], lead: bool = True) -> None:
    """Append the segments; lead=False: no separator before the first (it starts a line)."""
    for i, (sep, text, style) in enumerate(segments):
        if i or lead:
            out.append(sep)
        out.append(text, style=style)


def status_line(head: str, st: TraceState | None, now_ns: int, *, ready: bool, paused: bool, width: int) -> Text:
    """The status line for a terminal `width` cells wide (the widget's content width): one line
    when it fits, else two (head and step, then the figures)."""
    out = Text(no_wrap=True, overflow="ellipsis")
    if not ready or st is None:
        out.append(head, style="bold")
        out.append(SEP + "starting…", style="dim")
        return out
    where, figures = status_segments(st, now_ns, paused)
    if cell_len(head) + _length(where) + _length(figures) <= width:
        out.append(head, style="bold")
        _join(out, where + figures)
        return out
    if _length(figures) > width:  # the figures' own line: the KV figure without the cached share
        where, figures = status_segments(st, now_ns, paused, compact=True)
    out.append(_shrink_head(head, width - _length(where)), style="bold")
    _join(out, where)
    out.append("\n")
    _join(out, figures, lead=False)
    return out
