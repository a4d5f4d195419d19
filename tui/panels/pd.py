"""Prefill | Decode: a disaggregated pair's two servers side by side, and the selected request's journey.

Each pane is one server (its scheduler process, labelled with the role its pd.* events say): its
queues, its KV pool, the rooms in each stage of the handover (prefill: KV held for a pull; decode:
the prealloc queue, pulls in flight) and its latest transfers. Beside them, the selected request's
journey across the pair (decode queue, prefill queue, prefill, transfer, decode), joined by
bootstrap room (core/trace/pd.py). The panel joins the layout with the first pd.* event.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Static
from workbench.core.trace.palette import COMPUTED, DECODE, TRANSFER, WAITING
from workbench.core.trace.pd import fmt_bytes, journey
from workbench.core.trace.state import TraceState
from workbench.core.trace.ttft import fmt_dur
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel

ROLES = ("prefill", "decode")
_STAGE_STYLE = {
    "decode queue": WAITING,
    "prefill queue": WAITING,
    "prefill": COMPUTED,
    "transfer": f"bold {TRANSFER}",
    "decode": DECODE,
}


def server_procs(state: TraceState) -> dict[str, str]:
    """role -> the scheduler process serving it (the first seen of each role)."""
    out: dict[str, str] = {}
    for proc, role in state.pd.role_of_proc.items():
        out.setdefault(role, proc)
    return out


def render_server(state: TraceState, role: str, proc: str | None, max_transfers: int = 4) -> Text:
    """One server's pane: queues, KV, rooms by stage, latest transfers."""
    out = Text()
    out.append(f"{role.upper()}", style="bold reverse")
    out.append(" ")
    out.append(f"{proc or 'no events yet'}\n", style="dim")
    if proc is None:
        return out
    q = state.queues_by_proc.get(proc)
    if q is not None:
        out.append(f"waiting {len(q.waiting)} · running {len(q.running)}\n")
    kv = state.kv_by_proc.get(proc)
    if kv is not None and kv.total:
        out.append(f"KV {kv.used}/{kv.total} used ({kv.used / kv.total:.0%}), {kv.evictable} evictable\n")
    rooms = list(state.pd.rooms.values())
    if role == "decode":
        pre = [r for r in rooms if r.decode_rid and r.reserved_ts is None and not _done(state, r.decode_rid)]
        pulling = [r for r in rooms if r.reserved_ts is not None and "decode" not in r.transfers]
        out.append(f"prealloc queue {len(pre)} · pulling {len(pulling)}\n", style="bold")
    else:
        held = [r for r in rooms if r.prefill_rid and "prefill" not in r.transfers and _done(state, r.prefill_rid)]
        out.append(f"KV held for a pull {len(held)}\n", style="bold")
    done = [r.transfers[role] for r in rooms if role in r.transfers]
    moved = sum(t.nbytes for t in done if t.ok)
    failed = sum(1 for t in done if not t.ok)
    out.append(
        f"{len(done)} transfers, {fmt_bytes(moved)}" + (f", {failed} failed" if failed else "") + "\n", style="dim"
    )
    for t in done[-max_transfers:][::-1]:
        what = f"{t.tokens} t {fmt_bytes(t.nbytes)} {t.ms:.1f} ms" if t.ok else f"failed: {t.error[:40]}"
        out.append(f"  {t.rid:<14.14} ", style="bold" if t.ok else "red")
        out.append(what + "\n")
    return out


def _done(state: TraceState, rid: str) -> bool:
    r = state.requests.get(rid)
    return r is not None and r.done


def render_journey(state: TraceState, rid: str | None) -> Text:
    """The selected request's journey across both servers, one stage a line, then its TTFT's parts."""
    out = Text()
    stages = journey(state, rid) if rid else []
    if not stages:
        out.append(
            "Select a request (click it in Queues, or [ and ]) to see its journey: "
            "prefill queue → prefill → transfer → decode queue → decode.",
            style="dim",
        )
        return out
    room = state.pd.room_of(rid or "")
    assert room is not None
    out.append(f"journey of {room.decode_rid} (prefill: {room.prefill_rid}, room {room.room})\n", style="bold")
    t0 = stages[0][1]
    for stage, s, e, detail in stages:
        out.append(f"{(s - t0) / 1e9:+7.3f}s ", style="dim")
        out.append(f"{stage:<14}", style=_STAGE_STYLE.get(stage, ""))
        out.append(f"{fmt_dur(max(0, e - s)):>9}  ")
        out.append(detail + "\n", style="dim")
    b = state.ttft_parts(room.decode_rid or "")
    if b is not None:
        out.append(b.summary(), style="bold")
    return out


class PDPanel(TracePanel):
    PANEL_NAME = "pd"
    TITLE = "Prefill | Decode"
    HELP = (
        "Disaggregated serving (a prefill server and a decode server): each server's queues, KV pool, "
        "rooms in each stage of the KV handover and latest transfers, side by side; beside them, the selected "
        "request's journey across the pair (prefill queue, prefill, transfer with bytes and ms, decode "
        "queue, decode), joined by bootstrap room. Request detail splits its TTFT into those parts."
    )
    # one row (the panel's grid row is short): prefill | decode | the selected request's journey
    DEFAULT_CSS = """
    PDPanel #pd-row { height: 1fr; }
    PDPanel .pd-server { width: 1fr; height: auto; padding: 0 1 0 0; }
    PDPanel #pd-journey-box { width: 2fr; }
    """

    def compose(self) -> ComposeResult:
        with Horizontal(id="pd-row"):
            for role in ROLES:
                yield Static(id=f"pd-{role}", classes="pd-server")
            with VerticalScroll(id="pd-journey-box"):
                yield Static(id="pd-journey")

    def update_view(self, model: TuiModel) -> None:
        st = model.state
        procs = server_procs(st)
        for role in ROLES:
            self.query_one(f"#pd-{role}", Static).update(render_server(st, role, procs.get(role)))
        self.query_one("#pd-journey", Static).update(render_journey(st, model.selected))
