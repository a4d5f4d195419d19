"""TuiModel: what every panel reads: one TraceState, a log of notable events, the clock, the selection.

The app drains its event source, folds the events here (`apply`) and hands the
model to each visible panel. Nothing in here knows about the engine or about
Textual, so it is testable on its own and a third-party panel gets the same
picture as the built-in ones.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.tui.fmt import fmt_s

#: Categories of the events log (the Events panel can filter on them).
LOG_CATEGORIES = ("arrive", "finish", "abort", "retract", "evict", "drop", "proc", "weights", "error", "info")


@dataclass(frozen=True)
class LogLine:
    """One line of the events log. `ts` is trace time (monotonic ns); `step` the scheduler step
    the event belongs to (-1: none, e.g. an arrival)."""

    seq: int
    ts: int
    category: str
    text: str
    rid: str | None = None
    step: int = -1


class EventLog:
    """A bounded log of the events a person wants to read about (not every batch step), in time
    order: events from different processes arrive out of order (a scheduler's eviction may come
    after a later arrival from the tokenizer), and each line is put where its `ts` belongs. `seq`
    numbers lines as they were added, so a panel knows which it has not shown yet."""

    def __init__(self, maxlen: int = 2000):
        self.lines: deque[LogLine] = deque(maxlen=maxlen)
        self.seq = 0  # lines ever added; panels remember the last one they showed

    def clear(self) -> None:
        self.lines.clear()

    def add(self, ts: int, category: str, text: str, rid: str | None = None, step: int = -1) -> LogLine:
        self.seq += 1
        line = LogLine(self.seq, ts, category, text, rid, step)
        lines = self.lines
        if not lines or ts >= lines[-1].ts:
            lines.append(line)
            return line
        i = len(lines) - 1  # late: walk back to its place (a few lines at most, usually)
        while i > 0 and lines[i - 1].ts > ts:
            i -= 1
        if len(lines) == lines.maxlen:
            if i == 0:
                return line  # older than everything kept: it would be dropped first anyway
            lines.popleft()
            i -= 1
        lines.insert(i, line)
        return line

    def restamp(self, ts: int) -> None:
        """Lines logged before any event (ts 0: no clock yet) take `ts`, the first event's."""
        for i, line in enumerate(self.lines):
            if line.ts == 0:
                self.lines[i] = replace(line, ts=ts)

    def observe(self, e: ev.Event) -> None:
        """Log `e` if it is one of the notable kinds. A scheduler's event carries its step; a
        finish (from the tokenizer, step -1) gets its request's last step from TuiModel.apply."""
        t = type(e)
        if t is ev.ReqArrived:
            preview = " ".join(e.prompt_preview.split())[:60]
            self.add(e.ts, "arrive", f"{e.rid} arrived" + (f"  {preview!r}" if preview else ""), e.rid)
        elif t is ev.ReqFinished:
            if e.reason == "abort":
                self.add(e.ts, "abort", f"{e.rid} aborted after {e.completion_tokens} tokens", e.rid, e.step)
            else:
                # the latencies first: a narrow panel cuts the end of the line, not them
                self.add(
                    e.ts,
                    "finish",
                    f"{e.rid} finished: TTFT {fmt_s(e.ttft)} · E2E {fmt_s(e.e2e)} · "
                    f"{e.prompt_tokens} prompt ({e.cached_tokens} cached) + {e.completion_tokens} "
                    f"out · {e.reason}",
                    e.rid,
                    e.step,
                )
        elif t is ev.ReqAborted:
            self.add(e.ts, "abort", f"{e.rid} aborted{': ' + e.reason if e.reason else ''}", e.rid, e.step)
        elif t is ev.ReqRetracted:
            self.add(
                e.ts,
                "retract",
                f"{e.rid} retracted after {e.output_tokens} output tokens (KV pool full; it will be prefilled again)",
                e.rid,
                e.step,
            )
        elif t is ev.CacheEvict:
            self.add(e.ts, "evict", f"evicted {len(e.node_ids)} node(s), {e.tokens} tokens", step=e.step)
        elif t is ev.TraceDropped:
            self.add(e.ts, "drop", f"{e.count} trace events dropped (the view fell behind)")
        elif t is ev.ProcStarted:
            self.add(e.ts, "proc", f"{e.proc or e.role} started (pid {e.pid})")
        elif t is ev.ProcExited:
            cat = "error" if e.exitcode not in (0, None) or e.reason else "proc"
            self.add(
                e.ts,
                cat,
                f"{e.proc or e.role} exited (pid {e.pid}, code {e.exitcode}){': ' + e.reason if e.reason else ''}",
            )
        elif t is ev.WeightsUpdated:
            self.add(e.ts, "weights", f"weights updated from {e.source} (version {e.version})")


class TuiModel:
    """The shared picture: `state` (TraceState), `log` (EventLog), `now_ns` (the app's
    clock, trace time), `selected` (a rid or None), `version` (bumps when events are
    folded) and `epoch` (bumps when the state is reset, e.g. a replay seeks back)."""

    def __init__(self, state: TraceState | None = None, log_len: int = 2000):
        self.state = state if state is not None else TraceState()
        self.log = EventLog(log_len)
        self.now_ns = 0
        self.selected: str | None = None
        self.version = 0
        self.epoch = 0
        self.t0_ns: int | None = None  # trace time shown as +0.000 s
        self.paused = False  # the scheduler (or the replay) is paused: set by the app

    def apply(self, events: Iterable[ev.Event]) -> int:
        """Fold events into the state and the log; returns how many were folded."""
        n = 0
        st, log = self.state, self.log
        seq0 = log.seq
        for e in events:
            n += 1
            if type(e) is ev.TraceReset:
                self.epoch += 1
                log.clear()
            elif self.t0_ns is None and e.ts:
                self.t0_ns = e.ts
                log.restamp(e.ts)  # app notes made before any event: at the start, not at ts 0
            st.apply(e)
            log.observe(e)
        if log.seq > seq0:
            self._step_finishes(seq0)
        if n:
            self.version += 1
        return n

    def _step_finishes(self, seq0: int) -> None:
        """Give the request lines logged since `seq0` without a step (finishes and aborts come from
        the tokenizer) their request's last step. Done once the whole batch is folded: live, a
        finish is often delivered just before the batch.step that produced its last token."""
        lines, st = self.log.lines, self.state
        left = self.log.seq - seq0  # the new lines: mostly at the end, a late one a little earlier
        for i in range(len(lines) - 1, -1, -1):
            if left <= 0:
                break
            line = lines[i]
            if line.seq <= seq0:
                continue
            left -= 1
            if line.step < 0 and line.rid is not None and line.category in ("finish", "abort"):
                r = st.requests.get(line.rid)
                if r is not None and r.steps:
                    lines[i] = replace(line, step=r.steps[-1])

    def note(self, category: str, text: str, rid: str | None = None) -> None:
        """Add an app-side line (errors, workload changes) to the log at the current clock."""
        self.log.add(self.now_ns or self.state.last_ts, category, text, rid)
        self.version += 1

    def rel_s(self, ts: int | None) -> float:
        """Seconds since the start of the trace."""
        if ts is None or self.t0_ns is None:
            return 0.0
        return (ts - self.t0_ns) / 1e9
