"""The guided tour (`workbench tui --tour`): six stops, each the first time the trace shows one
of the scheduler's cases, in this order: a request waits, one is admitted, a prompt is prefilled
in chunks, a request reuses a cached prefix, the radix cache evicts, the scheduler retracts.

`TourGuide` reads the same events the panels do (no Textual, no engine here). Stop k is looked
for only from the step of stop k-1 on, so the stops come in the tour's order even when two
happen in one step; each stop keeps the step it happened at and one line of what happened, in the
TUI's words. The app pauses the scheduler at a stop and goes on at a key (`n`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from workbench.core.trace import events as ev

#: the stops, in the tour's order: (name, title)
STOPS = (
    ("waiting", "waiting"),
    ("admission", "admission"),
    ("chunk", "chunked prefill"),
    ("hit", "radix hit"),
    ("evict", "eviction"),
    ("retract", "retraction"),
)


@dataclass(frozen=True)
class TourStop:
    """One stop reached: `name` (a STOPS name), the scheduler `step` it happened at, and `line`,
    what just happened in one line."""

    index: int  # 1-based
    name: str
    title: str
    step: int
    line: str

    def banner(self) -> str:
        return f"tour {self.index}/{len(STOPS)} · {self.title} (step {self.step}): {self.line}"


class TourGuide:
    """Finds the tour's stops in a stream of trace events (`feed`), in order."""

    def __init__(self) -> None:
        self.found: list[TourStop] = []
        self._min_step = -1
        self._queued: dict[str, tuple[int, int]] = {}  # rid -> (prompt tokens, position when queued)
        self._scheduled: dict[int, list[ev.ReqScheduled]] = {}  # step -> its req.scheduled events
        self._pending: list[ev.Event] = []  # a step's events until its batch.decision closes it

    @property
    def done(self) -> bool:
        return len(self.found) == len(STOPS)

    @property
    def next_name(self) -> str | None:
        return None if self.done else STOPS[len(self.found)][0]

    def feed(self, events: Iterable[ev.Event]) -> list[TourStop]:
        """Fold `events` in; returns the stops reached by them (possibly several, in order)."""
        new: list[TourStop] = []
        for e in events:
            if self.done:
                break
            t = type(e)
            if t is ev.ReqQueued:
                self._queued[e.rid] = (e.prompt_tokens, e.queue_len)
            elif t is ev.ReqScheduled:
                self._scheduled.setdefault(e.step, []).append(e)
            elif t is ev.StepDecision:
                new += self._decision(e)
        return new

    def _reach(self, name: str, step: int, line: str) -> list[TourStop]:
        if name != self.next_name or step < self._min_step:
            return []
        i = len(self.found)
        stop = TourStop(i + 1, name, STOPS[i][1], step, line)
        self.found.append(stop)
        self._min_step = step
        return [stop]

    def _decision(self, d: ev.StepDecision) -> list[TourStop]:
        """One step's narrated decision: check it (and the step's req.scheduled events) for every
        stop still to come, in order, so two stops of one step are both reached."""
        out: list[TourStop] = []
        sched = self._scheduled.pop(d.step, [])
        for old in [s for s in self._scheduled if s < d.step - 64]:
            del self._scheduled[old]  # steps that never got a decision (none expected): keep it bounded
        progressed = True
        while progressed and not self.done:
            progressed = False
            name = self.next_name
            got: list[TourStop] = []
            if name == "waiting" and d.waiting:
                got = self._reach(
                    name,
                    d.step,
                    f"{d.waiting} request{'s' if d.waiting > 1 else ''} left waiting after this step"
                    + (f" ({_reason(d)})" if d.stop_reason else "")
                    + ": admission is limited by the prefill budget, the running limit and free KV (Queues: waiting)",
                )
            elif name == "admission" and d.admitted:
                who = ", ".join(d.admitted[:4]) + ("…" if len(d.admitted) > 4 else "")
                got = self._reach(
                    name,
                    d.step,
                    f"admitted {who} from the waiting queue into this step's prefill, using {d.budget_used} of "
                    f"its {d.budget}-token prefill budget and {d.kv_alloc} new KV slots (Batch composition)",
                )
            elif name == "chunk":
                chunks = [s for s in sched if s.num_chunks > 1]
                # a chunk with more to come tells it best; a last chunk will do
                c = next((s for s in chunks if s.chunk_index + 1 < s.num_chunks), chunks[0] if chunks else None)
                if c is not None:
                    rest = (
                        "the rest come in the next steps, while the running requests wait"
                        if c.chunk_index + 1 < c.num_chunks
                        else "its last chunk: the earlier ones ran in the steps before"
                    )
                    got = self._reach(
                        name,
                        d.step,
                        f"{c.rid}'s prompt is longer than the {d.budget}-token prefill chunk: this step computed "
                        f"{c.extend_len} of its tokens (chunk {c.chunk_index + 1}/{c.num_chunks}); {rest} "
                        "(Batch composition: chunk k/n)",
                    )
            elif name == "hit":
                h = max(sched, key=lambda s: s.prefix_hit, default=None)
                if h is not None and h.prefix_hit > 0:
                    got = self._reach(
                        name,
                        d.step,
                        f"{h.rid} found {h.prefix_hit} tokens of its prompt already in the radix cache, computed "
                        f"by an earlier request: they are reused and only {h.extend_len} computed (Radix tree: "
                        "the shared node and its children; Request detail: cached)",
                    )
            elif name == "evict" and d.evicted > 0:
                nodes = len(d.evicted_nodes)
                got = self._reach(
                    name,
                    d.step,
                    f"the KV pool was full: the radix cache evicted {d.evicted} tokens ({nodes} "
                    f"node{'s' if nodes != 1 else ''}), the least recently used prefixes no running request "
                    "holds, to make room (KV pool: evicted; Events: evict)",
                )
            elif name == "retract" and d.retracted:
                who = ", ".join(d.retracted[:3])
                got = self._reach(
                    name,
                    d.step,
                    f"decoding ran out of KV slots with nothing left to evict: the scheduler retracted {who} "
                    "(freed its slots and sent it back to the waiting queue, to be prefilled again) "
                    "(Events: retract)",
                )
            if got:
                out += got
                progressed = True
        return out


def _reason(d: ev.StepDecision) -> str:
    words = {"budget": "prefill budget spent", "kv": "no KV room", "running": "running limit"}
    return words.get(d.stop_reason, d.stop_reason)
