""" "Pause on": stop the scheduler when a rare event happens (a retraction, an eviction, a chunked
prefill, a priority preemption), so it does not flash by.

`pause_triggers` reads the trace events the app drains (no Textual, no engine here) and says
which of the chosen kinds happened, at which step, in one line; the app pauses the real
scheduler through its controller (as the guided tour does) and says why. `PauseOnScreen` is the
small menu (`o`) that picks the kinds; `workbench tui --pause-on retract,evict` picks them at start.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.screen import ModalScreen
from textual.widgets import Static
from workbench.core.trace import events as ev

#: the kinds one can pause on: (name, key in the menu, what it is)
PAUSE_KINDS = (
    ("retract", "r", "the KV pool ran dry while decoding: running requests sent back to the queue"),
    ("evict", "e", "the radix cache freed cached prefixes to make room"),
    ("chunk", "c", "a prompt longer than the prefill chunk starts its chunked prefill"),
    ("preempt", "x", "priority scheduling: a running request preempted for a more urgent one"),
)
KIND_NAMES = tuple(name for name, _, _ in PAUSE_KINDS)


def parse_pause_on(value: str) -> set[str]:
    """`retract,evict` → {"retract", "evict"}; an unknown name raises ValueError naming the choices."""
    kinds = {k.strip() for k in value.split(",") if k.strip()}
    unknown = sorted(kinds - set(KIND_NAMES))
    if unknown:
        raise ValueError(f"unknown --pause-on kind(s): {', '.join(unknown)}; choose from {','.join(KIND_NAMES)}")
    return kinds


@dataclass(frozen=True)
class PauseTrigger:
    """One chosen event seen in the trace: its kind, the scheduler `step` and `proc`, and a line."""

    kind: str
    step: int
    proc: str
    line: str


def pause_triggers(events: Iterable[ev.Event], kinds: set[str]) -> list[PauseTrigger]:
    """The events among `events` of the chosen `kinds`, in order (several may come in one drain)."""
    out: list[PauseTrigger] = []
    if not kinds:
        return out
    for e in events:
        t = type(e)
        if t is ev.StepDecision:
            preempted = {p.split(" ")[1] for p in e.preemptions if p.count(" ") > 1}
            retracted = [rid for rid in e.retracted if rid not in preempted]
            if "evict" in kinds and e.evicted > 0:
                n = len(e.evicted_nodes)
                out.append(
                    PauseTrigger(
                        "evict",
                        e.step,
                        e.proc,
                        f"the radix cache evicted {e.evicted} tokens ({n} node{'s' if n != 1 else ''}) to make room",
                    )
                )
            if "retract" in kinds and retracted:
                out.append(
                    PauseTrigger(
                        "retract",
                        e.step,
                        e.proc,
                        f"the KV pool ran dry: retracted {', '.join(retracted[:3])}"
                        + (f" +{len(retracted) - 3}" if len(retracted) > 3 else "")
                        + " (back to the queue, prefilled again later)",
                    )
                )
            if "preempt" in kinds and e.preemptions:
                out.append(PauseTrigger("preempt", e.step, e.proc, "; ".join(e.preemptions[:2])))
        elif t is ev.ReqScheduled and "chunk" in kinds and e.num_chunks > 1 and e.chunk_index == 0:
            out.append(
                PauseTrigger(
                    "chunk",
                    e.step,
                    e.proc,
                    f"{e.rid}'s prompt is prefilled in {e.num_chunks} chunks: chunk 1 computed {e.extend_len} "
                    "tokens (s steps through the rest)",
                )
            )
    return out


class PauseOnScreen(ModalScreen):
    """The "pause on" menu: each kind's key toggles it; Esc (or o, Enter) closes. The app reads
    `kinds` back when it closes."""

    BINDINGS = [
        Binding("escape,o,enter", "dismiss_kinds", "close"),
        *[Binding(key, f"toggle('{name}')", name) for name, key, _ in PAUSE_KINDS],
    ]
    DEFAULT_CSS = """
    PauseOnScreen { align: center middle; }
    PauseOnScreen > Static { width: 80; height: auto; border: thick $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, kinds: set[str]) -> None:
        super().__init__()
        self.kinds = set(kinds)

    def compose(self) -> ComposeResult:
        yield Static(self._text(), id="pause-on-menu")

    def _text(self) -> Text:
        t = Text("Pause the scheduler when this happens (its key toggles it):\n\n", style="bold")
        for name, key, what in PAUSE_KINDS:
            on = name in self.kinds
            t.append(f"  [{'x' if on else ' '}] ", style="bold" if on else "")
            t.append(f"{key}  {name:<8}", style="bold")
            t.append(f" {what}\n")
        t.append("\nEsc closes. When it pauses, the line under the status says why; h opens that step.", style="dim")
        return t

    def action_toggle(self, name: str) -> None:
        self.kinds ^= {name}
        self.query_one("#pause-on-menu", Static).update(self._text())

    def action_dismiss_kinds(self) -> None:
        self.dismiss(set(self.kinds))


#: a step's own events that may come after the next step's (the overlap loop processes a step's
#: result while the next one runs): folded with their step, never held back
_STEP_COMPANIONS = (ev.BatchStep, ev.SpecVerify, ev.MoeRouting)


def split_after_step(events: list[ev.Event], step: int, proc: str) -> tuple[list[ev.Event], list[ev.Event]]:
    """(the events up to the end of `proc`'s `step`, the rest): the app folds the first part and
    holds the rest back while it is paused on that step, so the panels show the step it paused at
    even when the scheduler (or a fast replay) ran a step or two more before the pause landed."""
    cut = next((i for i, e in enumerate(events) if e.proc == proc and e.step > step), len(events))
    now, later = events[:cut], []
    for e in events[cut:]:
        if type(e) in _STEP_COMPANIONS and e.proc == proc and e.step <= step:
            now.append(e)
        else:
            later.append(e)
    return now, later
