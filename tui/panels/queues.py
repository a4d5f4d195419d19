"""Queues: the scheduler's waiting, running and chunked requests as one keyed table."""

from __future__ import annotations

from rich.cells import cell_len
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable
from workbench.core.trace.palette import COMPUTED, DECODE, WAITING
from workbench.core.trace.views import RequestView, format_priority
from workbench.tui.fmt import fmt_age, fmt_s
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import RequestSelected, TracePanel

COLUMNS = (
    ("queue", "queue"),
    ("rid", "rid"),
    ("state", "state"),
    ("prompt", "prompt"),
    ("cached", "cached"),
    ("computed", "comp"),
    ("out", "out"),
    ("age", "age/E2E"),  # a finished request's row: its E2E
    ("ttft", "TTFT"),
)
_QUEUE_STYLE = {
    "chunked": f"bold {COMPUTED}",
    "running": f"bold {DECODE}",
    "waiting": WAITING,
    "new": f"italic {WAITING}",
    "done": "dim",
}


# A constrained request's badge beside its rid (structured outputs: the grammar masks its tokens).
CONSTRAINT_BADGE = {"json_schema": "{json}", "json_object": "{json}", "regex": "/re/", "ebnf": "ebnf"}

# Why a request waits (TraceState.wait_reason), short enough for the state column.
_WAIT_SHORT = {"budget": "budget", "kv": "KV room", "running": "run limit", "finishing": "run limit*", "held": "held"}


def queue_rows(model: TuiModel, max_rows: int = 300, recent_done: int = 8) -> list[tuple[str, tuple]]:
    """(rid, cells) for the table: waiting, new (arrived, not queued yet), chunked, running, then
    the most recently finished. Waiting and new come first: a long running list must not push
    the requests that wait off-screen."""
    st = model.state
    now = model.now_ns
    rows: list[tuple[str, tuple]] = []
    seen: set[str] = set()
    touched = st.step_rids()  # prefilled or retracted by the last step: highlighted

    def add(queue: str, rid: str, r) -> None:
        seen.add(rid)
        rows.append(
            (
                rid,
                _cells(
                    queue,
                    r or RequestView(rid),
                    now,
                    st.req_replica.get(rid),
                    rid in touched,
                    st.wait_reason(rid) if queue == "waiting" else None,
                ),
            )
        )

    for rid in st.waiting:
        if rid not in seen:
            add("waiting", rid, st.requests.get(rid))
    # Requests the scheduler has not listed yet (queue.state comes once per step, and not at
    # all while the scheduler is paused): show them from their own events.
    unlisted = [r for r in st.unlisted() if r.rid not in seen]
    for r in unlisted:
        if r.state == "queued":
            add("waiting", r.rid, r)
    for r in unlisted:
        if r.state == "arrived":
            add("new", r.rid, r)
    for queue, rids in (("chunked", st.chunked), ("running", st.running)):
        for rid in rids:
            if rid not in seen:
                add(queue, rid, st.requests.get(rid))
    if recent_done:
        done = [r for r in st.requests.values() if r.done and r.rid not in seen and r.finish_ts is not None]
        done.sort(key=lambda r: r.finish_ts)
        for r in done[-recent_done:]:
            rows.append((r.rid, _cells("done", r, now, st.req_replica.get(r.rid), r.rid in touched)))
    return rows[:max_rows]


def _cells(
    queue: str,
    r: RequestView,
    now: int,
    replica: str | None = None,
    touched: bool = False,
    wait_reason: str | None = None,
) -> tuple:
    """One row; under data parallelism the queue names the replica (`running@dp1`); the rid is
    highlighted when the last step prefilled or retracted the request; a waiting request's state
    says why the last step left it waiting (TraceState.wait_reason)."""
    state = r.state
    if state == "prefilling" and r.num_chunks > 1:
        state = f"prefill {r.chunk_index + 1}/{r.num_chunks}"
    if state == "retracted" and r.preempted:  # priority scheduling: preempted for a more urgent request
        state = "preempted for " + r.preempted.split(" for ", 1)[-1].split(" ", 1)[0]
    if wait_reason:
        state = f"{state}: {_WAIT_SHORT.get(wait_reason, wait_reason)}"
    start = r.arrival_ts if r.arrival_ts is not None else r.queued_ts
    if r.done:
        age = fmt_s(r.e2e) if r.e2e is not None else "–"
    else:
        age = fmt_age(now - start) if start is not None else "–"
    if r.ttft is not None:
        ttft = Text(fmt_s(r.ttft))
    elif start is not None and not r.done:
        ttft = Text(f"{fmt_age(now - start)}…", style="italic dim")  # waiting for its first token
    else:
        ttft = Text("–")
    label = f"{queue}@{replica.rsplit('.', 1)[-1]}" if replica else queue
    rid = Text(r.rid, style="reverse" if touched else "")
    if r.constraint:
        rid.append(" " + CONSTRAINT_BADGE.get(r.constraint, r.constraint), style="dim")
    if r.priority is not None:  # priority scheduling is on: each request's priority
        rid.append(f" p{format_priority(r.priority)}", style="dim")
    return (
        Text(label, style=_QUEUE_STYLE.get(queue, "")),
        rid,
        state,
        str(r.prompt_tokens),
        str(r.cached_tokens),
        # a retracted request's second prefill is not its prompt's: counted apart (↻), so cached + comp = prompt
        str(r.computed_tokens) + (f" ↻{r.recomputed_tokens}" if r.recomputed_tokens else ""),
        str(r.output_tokens),
        age,
        ttft,
    )


_CAPPED = {"queue": 8, "rid": 10, "state": 14}


class QueuesPanel(TracePanel):
    PANEL_NAME = "queues"
    TITLE = "Queues"
    HELP = (
        "Every request the scheduler holds, those that wait first: `waiting` (queued for prefill), "
        "`new` (arrived, not queued yet; both count in the title and the status line's wait/new), "
        "`chunked` (its prompt is being prefilled in chunks), `running` (in the decode batch), "
        "then the last few "
        "finished. prompt/cached/comp/out are token counts: cached = reused from the radix tree, "
        "comp = prompt tokens actually computed (cached + comp = prompt); `↻N` after it: tokens prefilled again after a "
        "retraction (prompt and output so far). TTFT shows the time so far (italic) until the "
        "first token. The rids the last step prefilled (admitted, or a chunk) or retracted are "
        "shown reversed, as named on the `last step` line. A badge after the rid marks a "
        "constrained request (structured outputs): `{json}` a JSON Schema or any JSON, `/re/` a regex, "
        "`ebnf` a grammar; the `last step` line says how long the scheduler spent on their grammars (masks and matchers). A waiting request's state says why that "
        "step left it waiting: `budget` (the step's prefill token budget was spent), `KV room`, `run limit` "
        "(running-request limit; `run limit*`: it counted requests that finished in the last step, not filtered out yet, as SGLang does) or `held` (it waits for a shared prefix being computed). "
        "With priority scheduling (--enable-priority-scheduling) each rid shows its priority (`p10`; `punset` "
        "sent without one) and a request a more urgent one preempted says `preempted for` whom (the `last step` "
        "line gives both priorities). "
        "Click or Enter on a row to select the request."
    )
    clock_interval_s = 0.5

    def compose(self) -> ComposeResult:
        table = DataTable(cursor_type="row", zebra_stripes=False, id="queues-table")
        for key, label in COLUMNS:
            # state and rid grow with what they say ("queued: run limit*"): capped, so TTFT, the last
            # column, is never the one cut at the panel's edge
            table.add_column(label, key=key, width=_CAPPED.get(key))
        yield table

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self._order: list[str] = []
        self._cells: dict[str, tuple] = {}

    def update_view(self, model: TuiModel) -> None:
        st = model.state
        q = st.queue_counts()
        title = f"Queues — waiting {q['waiting']} · new {q['new']} · running {q['running']} · chunked {q['chunked']}"
        replicas = st.replicas()
        if replicas:  # data parallel: each replica's own queues, side by side
            # a disaggregated pair's servers say their role (dp0 prefill, dp1 decode)
            title += "  |  " + "  ".join(
                f"dp{v.dp_rank}{(' ' + st.pd.role_label(v.proc)).rstrip()} {len(v.waiting)}w/{len(v.running)}r"
                for v in replicas
            )
        self.border_title = title
        table = self.query_one(DataTable)
        rows = queue_rows(model)
        order = [rid for rid, _ in rows]
        if order != self._order:
            cursor_rid = self._order[table.cursor_row] if 0 <= table.cursor_row < len(self._order) else None
            table.clear()
            for rid, cells in rows:
                table.add_row(*cells, key=rid)
            self._order, self._cells = order, dict(rows)
            # The cursor follows its request only while the reader browses the table (focused): else
            # it followed a request from waiting down to running and scrolled the waiting rows away.
            want = model.selected if model.selected in order else (cursor_rid if table.has_focus else None)
            if want in order:
                table.move_cursor(row=order.index(want), animate=False, scroll=True)
            else:
                table.move_cursor(row=0, animate=False, scroll=False)
                table.scroll_home(animate=False)  # waiting rows come first: keep them in view
        else:
            keys = [k for k, _ in COLUMNS]
            for rid, cells in rows:
                old = self._cells.get(rid)
                for i, (a, b) in enumerate(zip(old, cells)):
                    if str(a) != str(b) or (isinstance(a, Text) and a.style != b.style):
                        # A column is as wide as its widest cell so far and update_cell does not
                        # widen it: a TTFT of '12.3 ms' in a column sized for '0.0s…' lost its
                        # unit. Widen when the new cell is wider (cheap: never shrinks, so the
                        # table does not re-measure the whole column).
                        col = table.columns.get(keys[i])
                        wider = col is not None and cell_len(str(b)) > col.content_width
                        table.update_cell(rid, keys[i], b, update_width=wider)
                self._cells[rid] = cells

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        event.stop()
        if event.row_key.value:
            self.post_message(RequestSelected(event.row_key.value))
