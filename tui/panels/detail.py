"""Request detail: the selected request's timeline, who it shared steps with, its text."""

from __future__ import annotations

from collections import Counter

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static
from workbench.core.trace.palette import COMPUTED, DECODE, RETRACTED, TRANSFER, WAITING
from workbench.core.trace.pd import journey_line
from workbench.core.trace.ttft import StepIndex, TtftBreakdown, step_start
from workbench.core.trace.views import RequestView
from workbench.tui.fmt import fmt_s, shorten
from workbench.tui.model import TuiModel
from workbench.tui.panels.base import TracePanel

_KIND_STYLE = {
    "arrived": f"italic {WAITING}",
    "queued": WAITING,
    "prefill": COMPUTED,
    "first_token": f"bold {DECODE}",
    "decode": DECODE,
    "retracted": f"bold {RETRACTED}",
    "finished": "bold",
    "aborted": "bold red",
    # disaggregated: the decode side reserved its slots, each side's end of the KV handover, the install
    "reserved": WAITING,
    "transfer": TRANSFER,
    "installed": COMPUTED,
}


def shared_steps(model: TuiModel, r: RequestView) -> tuple[dict[int, list[str]], Counter]:
    """For the request's steps still in the step ring: step -> the other rids in it; and a count
    of steps shared per other rid."""
    mine = set(r.steps)
    per_step: dict[int, list[str]] = {}
    counts: Counter = Counter()
    for sv in model.state.steps:
        if sv.step in mine and any(x.rid == r.rid for x in sv.reqs):
            others = [x.rid for x in sv.reqs if x.rid != r.rid]
            per_step[sv.step] = others
            counts.update(others)
    return per_step, counts


# TTFT parts: waiting colours until the scheduler admits it, then prefill, then the token.
# A disaggregated request's decode side adds its decode queue, the prefill server's queue and the transfer.
_PART_STYLE = {
    "arrived": f"italic {WAITING}",
    "queued": WAITING,
    "decode_queue": WAITING,
    "prefill_queue": f"italic {WAITING}",
    "prefill": COMPUTED,
    "transfer": TRANSFER,
    "first_token": DECODE,
    "paused": "dim",
}
_PART_BAR = {
    "arrived": "░",
    "queued": "▒",
    "decode_queue": "▒",
    "prefill_queue": "░",
    "prefill": "█",
    "transfer": "≈",
    "first_token": "▌",
    "paused": "·",
}


def ttft_bar(b: TtftBreakdown, width: int = 40) -> Text:
    """The parts as one bar, each part as wide as its share of the TTFT (rounded cumulatively, so
    the bar is exactly `width` cells; a part too short for a cell gets none)."""
    out = Text()
    total = b.ttft_ns or 1
    acc = done = chunk = 0
    for p in b.parts:
        acc += p.ns
        cells = round(acc * width / total) - done
        done += cells
        bar = _PART_BAR[p.kind]
        if p.kind == "prefill":  # alternate shades, so each chunk shows where it ends
            bar, chunk = ("█" if chunk % 2 == 0 else "▓"), chunk + 1
        out.append(bar * cells, style=_PART_STYLE[p.kind])
    return out


def render_ttft(b: TtftBreakdown) -> Text:
    """Where the time to first token went: one line per part (duration, what, why), then the bar."""
    out = Text()
    out.append(("TTFT so far" if b.partial else "TTFT") + f" {fmt_s(b.ttft)} = the parts below\n", style="underline")
    label_w = max(len(p.label) for p in b.parts)
    for p in b.parts:
        out.append(f"{fmt_s(p.seconds):>9} ", style="bold")
        out.append(f"{p.label:<{label_w}} ", style=_PART_STYLE[p.kind])
        out.append(p.detail + "\n", style="dim" if not p.ns else "")
    out.append(ttft_bar(b))
    out.append("\n")
    return out


def decode_time(index: StepIndex, first: int, last: int, span_ns: int) -> str:
    """A decode run's time: the steps' own time (start to end, from the step ring), and apart from
    it the time between them (the scheduler paused, or busy with other work), so a paused
    scheduler's minutes are not read as decoding. `, 12273 ms` alone when the steps are gone."""
    steps = [index.get(k) for k in range(first, last + 1)]
    if any(sv is None for sv in steps):
        return f", {span_ns / 1e6:.0f} ms"
    # the first step's own time is before the run's first ts (stamped at the end of that step)
    busy = sum(max(sv.ts - step_start(sv), 0) for sv in steps if sv is not None)
    between = max(span_ns - (busy - max(steps[0].ts - step_start(steps[0]), 0)), 0)  # type: ignore[union-attr]
    out = f", {busy / 1e6:.0f} ms in steps"
    if between >= 1e6:
        out += f" + {between / 1e6:.0f} ms between them (paused or other work)"
    return out


def render_detail(model: TuiModel, rid: str | None, text_chars: int = 1200) -> Text:
    out = Text()
    r = model.state.requests.get(rid) if rid else None
    if r is None:
        out.append("No request selected.\n", style="bold")
        out.append(
            "Click a row in Queues (or Batch composition), or press [ and ] to walk through "
            "the requests; chat prompts are selected automatically.",
            style="dim",
        )
        return out
    out.append(f"{r.rid}", style="bold reverse")
    out.append(f"  {r.state}", style=_KIND_STYLE.get(r.state, "bold"))
    if r.finish_reason:
        out.append(f" ({r.finish_reason})")
    out.append("\n")
    out.append(
        f"prompt {r.prompt_tokens} t = {r.cached_tokens} cached + {r.computed_tokens} computed · "
        + (f"recomputed {r.recomputed_tokens} (after retraction) · " if r.recomputed_tokens else "")
        + f"out {r.output_tokens}"
        + (f"/{r.max_new_tokens}" if r.max_new_tokens else "")
        + (f" · retracted {r.retractions}×" if r.retractions else "")
        + (f" · constrained by {r.constraint.replace('_', ' ')}" if r.constraint else "")
        + "\n"
    )
    out.append(f"TTFT {fmt_s(r.ttft)} · TPOT {fmt_s(r.tpot)} · E2E {fmt_s(r.e2e)}\n", style="bold")
    role = model.state.pd.role(r.rid)
    if role is not None:  # disaggregated: its peer on the other server and the journey across both
        peer = model.state.pd.peer(r.rid)
        out.append(
            f"{role} side of room {model.state.pd.room_of(r.rid).room}; {'prefill' if role == 'decode' else 'decode'}: {peer or '(not seen)'}\n"
        )
        line = journey_line(model.state, r.rid)
        if line:
            out.append("journey ", style="bold")
            out.append(line + "\n")
    index = StepIndex(model.state)
    # TTFT so far runs to now, as in Queues; a paused scheduler's stretch is its own part.
    breakdown = model.state.ttft_parts(r.rid, index, now_ns=model.now_ns or None, paused=model.paused)
    if breakdown is not None and breakdown.parts:
        out.append_text(render_ttft(breakdown))
    per_step, counts = shared_steps(model, r)
    base = r.arrival_ts if r.arrival_ts is not None else (r.timeline[0].ts if r.timeline else None)
    out.append("timeline\n", style="underline")
    for e in r.timeline:
        dt = (e.ts - base) / 1e9 if base is not None else 0.0
        out.append(f"{dt:+8.3f}s ", style="dim")
        out.append(f"{e.kind:<11}", style=_KIND_STYLE.get(e.kind, ""))
        detail = e.detail
        if e.kind == "decode":
            first = e.step - e.count + 1
            detail = f"{e.count} steps (steps {first}–{e.step})" if e.count > 1 else f"1 step (step {e.step})"
            if e.end_ts > e.ts:
                detail += decode_time(index, e.step - e.count + 1, e.step, e.end_ts - e.ts)
        elif e.step >= 0:
            detail += f" [step {e.step}]"
        out.append(detail)
        if e.kind == "prefill" and e.step in per_step:
            others = per_step[e.step]
            out.append(
                f"  with {', '.join(others[:6])}{' …' if len(others) > 6 else ''}" if others else "  alone", style="dim"
            )
        out.append("\n")
    if counts:
        n = len(per_step)
        out.append(f"shared {sum(1 for o in per_step.values() if o)} of {n} steps with: ", style="underline")
        out.append(", ".join(f"{o} ×{c}" for o, c in counts.most_common(8)))
        if len(counts) > 8:
            out.append(f" (+{len(counts) - 8} more)", style="dim")
        out.append("\n")
    if r.prompt_preview:
        out.append("prompt: ", style="bold")
        out.append(shorten(r.prompt_preview, 200) + "\n", style="dim")
    out.append("output: ", style="bold")
    body = r.text if len(r.text) <= text_chars else "…" + r.text[-text_chars:]
    out.append(body if body else "(nothing yet)", style="" if body else "dim")
    if not r.done and r.output_tokens:
        out.append("▌", style="blink")
    return out


class DetailPanel(TracePanel):
    PANEL_NAME = "detail"
    TITLE = "Request detail"
    HELP = (
        "The selected request: token counts, TTFT/TPOT/E2E, and where its TTFT went — arrived → queued "
        "(and the step the scheduler was busy in), queued (passed over by which steps, why, who got the "
        "prefill), each prefill chunk (who shared the step), first token: parts that add up to the TTFT. "
        "Then its timeline — arrival, queueing, "
        "each prefill chunk (cached + computed tokens, the step, who shared that step), decode runs "
        "(consecutive steps; a gap means it sat out), finish — and the requests it shared "
        "scheduler steps with. Its text streams in at the bottom."
    )
    clock_interval_s = 0

    def compose(self) -> ComposeResult:
        with VerticalScroll():
            yield Static(id="detail-body")

    def update_view(self, model: TuiModel) -> None:
        self.query_one("#detail-body", Static).update(render_detail(model, model.selected))
        self.border_title = "Request detail" + (f" — {model.selected}" if model.selected else "")
