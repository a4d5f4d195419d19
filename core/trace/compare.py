"""Two traces side by side, read from their reducers: where their decisions differ, and TTFT CDFs.

Views of a comparison (`workbench tui --compare`, `Dashboard.compare`) fold each side's events into
its own `TraceState` and ask here what to say about the pair; nothing here knows where the events
came from (two simulated deployments on one clock, or two real engines).
"""

from __future__ import annotations

from workbench.core.trace.state import TraceState
from workbench.core.trace.views import StepView


def admitted(sv: StepView) -> list[tuple[str, int]]:
    """(rid, cached prefix tokens) of each request step `sv` took from the waiting queue."""
    rids = list(sv.decision.admitted) if sv.decision is not None else []
    if not rids:  # no batch.decision (an older recording): the first chunks this step prefilled
        rids = [r.rid for r in sv.reqs if r.computed > 0 and r.chunk_index == 0]
    cached = {r.rid: r.cached for r in sv.reqs if r.chunk_index == 0}
    return [(rid, cached.get(rid, 0)) for rid in rids]


def _phrase(label: str, adm: list[tuple[str, int]], most: int = 3) -> str:
    if not adm:
        return f"{label} admitted nothing"
    parts = [f"{rid} ({cached} cached)" for rid, cached in adm[:most]]
    more = f" +{len(adm) - most} more" if len(adm) > most else ""
    return f"{label} admitted {', '.join(parts)}{more}"


class StepDiff:
    """The per-step diff of two traces: for each step number both sides have run, a line when
    they admitted different requests (`step 40: fcfs admitted r12 (0 cached) · lpm admitted r7
    (74 cached)`). Call `update(a, b)` after folding new events; it returns the new lines (each
    step once) and keeps them in `lines`."""

    def __init__(self, labels: tuple[str, str] | list[str], keep: int = 2000):
        self.labels = tuple(labels)
        self.lines: list[tuple[int, str]] = []  # (step, line)
        self.compared = 0  # steps compared so far
        self.differed = 0  # ... of which admitted differently
        self._next = 0  # the lowest step number not compared yet
        self._keep = keep

    def update(self, a: TraceState, b: TraceState) -> list[tuple[int, str]]:
        by_a = {sv.step: sv for sv in a.steps if sv.step >= self._next}
        by_b = {sv.step: sv for sv in b.steps if sv.step >= self._next}
        last = min(max(by_a, default=-1), max(by_b, default=-1))
        new: list[tuple[int, str]] = []
        for step in range(self._next, last + 1):
            sa, sb = by_a.get(step), by_b.get(step)
            if sa is None or sb is None:
                continue
            if sa.decision is None or sb.decision is None:
                last = step - 1  # its decision may still come (the overlap loop): compare it next time
                break
            self.compared += 1
            ad_a, ad_b = admitted(sa), admitted(sb)
            if {r for r, _ in ad_a} != {r for r, _ in ad_b}:
                self.differed += 1
                line = f"step {step}: {_phrase(self.labels[0], ad_a)} · {_phrase(self.labels[1], ad_b)}"
                new.append((step, line))
        self._next = max(self._next, last + 1)
        self.lines.extend(new)
        del self.lines[: max(0, len(self.lines) - self._keep)]
        return new


def ttft_cdf(state: TraceState) -> tuple[list[float], list[float]]:
    """The TTFT CDF of the requests that have their first token: (seconds sorted, fraction ≤ each)."""
    xs = sorted(r.ttft for r in state.requests.values() if r.ttft is not None)
    n = len(xs)
    return xs, [(i + 1) / n for i in range(n)]


def percentile(xs: list[float], q: float) -> float | None:
    """The q-quantile (0..1) of sorted `xs` (None when empty)."""
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None
