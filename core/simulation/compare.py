"""Two simulated deployments that differ in one setting, on one clock and one arrival stream.

    pair = SimPair("schedule_policy", ["fcfs", "lpm"])      # the default workload: shared prefixes, a queue
    while not pair.done:
        pair.step()                                          # both sides up to the next action of either
        events_a, events_b = pair.drain(0), pair.drain(1)    # each side's trace, for its own TraceState

Each side is a `Simulator` (the real Scheduler over the cost model) built with the same arguments
but the compared one, the same seed (so the same prompts, token for token) and the same workload
(so the same arrivals). The driver keeps one simulated clock `now` and advances both sides to it:
every action (a request reaching the scheduler, a step starting) whose time has come is taken on
both sides before the clock moves on, so at any moment the two traces show the same simulated
instant and a per-step comparison means what it says (`workbench tui --compare`, `Dashboard.compare`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from workbench.core.args import ServerArgs
from workbench.core.simulation.simulator import SimRequest, Simulator, poisson_workload
from workbench.core.trace.events import Event

#: The default deployment of a comparison when none is given: small enough that requests queue (a
#: running limit of 4 and a 512-token chunk), so the admission order, what policies differ on, matters.
COMPARE_DEFAULTS: dict[str, Any] = {"max_running_requests": 4, "chunked_prefill_size": 512, "max_total_tokens": 4000}
DEFAULT_MODEL = "smollm2-135m"
DEFAULT_HARDWARE = "l4"


def compare_workload(n: int = 120, rate: float = 100.0, seed: int = 0) -> list[SimRequest]:
    """The default arrival stream: `n` requests at `rate` per simulated second (Poisson, seeded),
    prompts of 200-400 tokens of which the first 160 are one of 4 shared prefixes, 32-64 output
    tokens. Faster than the default deployment serves, so a queue forms and a prefix-aware policy
    has cached prefixes to prefer."""
    return poisson_workload(rate, n, prompt_len=(200, 400), output_len=(32, 64), seed=seed, groups=4, prefix_len=160)


def parse_compare(text: str) -> tuple[str, list[Any]]:
    """'schedule_policy=fcfs,lpm' (or 'schedule-policy=...') -> ('schedule_policy', ['fcfs', 'lpm']):
    a ServerArgs field and two values, each converted to the field's type. Raises ValueError
    with the form to write."""
    key, _, values = text.partition("=")
    field = key.strip().lstrip("-").replace("-", "_")
    raw = [v.strip() for v in values.split(",") if v.strip()]
    if not field or len(raw) != 2:
        raise ValueError(
            f"--compare {text!r}: write FLAG=VALUE_A,VALUE_B with two values (e.g. schedule_policy=fcfs,lpm)"
        )
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    if field not in fields:
        close = [n for n in fields if field in n or n in field][:5]
        hint = f" (did you mean {', '.join(close)}?)" if close else " (`workbench serve --help` lists them)"
        raise ValueError(f"--compare: {field!r} is not an engine setting{hint}")
    default = getattr(ServerArgs(), field)
    return field, [_convert(field, v, default) for v in raw]


def _convert(field: str, value: str, default: Any) -> Any:
    low = value.lower()
    if isinstance(default, bool):
        if low not in ("true", "false", "1", "0", "yes", "no", "on", "off"):
            raise ValueError(f"--compare {field}: {value!r} is not true or false")
        return low in ("true", "1", "yes", "on")
    if low in ("none", "null"):
        return None
    kinds = (int, float) if isinstance(default, int) or default is None else (float,)
    if isinstance(default, (int, float)) or default is None:
        for kind in kinds:
            try:
                return kind(value)
            except ValueError:
                pass
        if default is not None:
            raise ValueError(f"--compare {field}: {value!r} is not a number")
    return value


class SimSide:
    """One side of a comparison: its Simulator, stepped through `run_steps`, and its trace so far."""

    def __init__(self, label: str, sim: Simulator, workload: list[SimRequest], events: list[Event]):
        """`events`: the list `sim`'s trace sink extends (`trace_sink=events.extend`)."""
        self.label = label
        self.sim = sim
        self._events = events
        self._steps: Iterator[float] = sim.run_steps(workload)
        self.next_t: float | None = next(self._steps, None)  # the time of its next action; None: done

    def advance_to(self, t: float) -> None:
        """Take every action due at or before simulated time `t`."""
        while self.next_t is not None and self.next_t <= t:
            self.next_t = next(self._steps, None)

    def drain(self) -> list[Event]:
        out, self._events[:] = list(self._events), []
        return out


class SimPair:
    """Two simulated deployments, one setting apart, on one simulated clock (see the module doc).

    `field`, `values`: the ServerArgs field compared and its two values; `model`, `hardware`,
    `tp_size`: the deployment; `server_args`: the other settings, the same on both sides (where
    not given, `COMPARE_DEFAULTS`); `workload`: the arrival stream (default `compare_workload(seed=seed)`)."""

    def __init__(
        self,
        field: str,
        values: list[Any],
        *,
        model: str = DEFAULT_MODEL,
        hardware: str = DEFAULT_HARDWARE,
        tp_size: int = 1,
        workload: list[SimRequest] | None = None,
        seed: int = 0,
        **server_args,
    ):
        if len(values) != 2:
            raise ValueError(f"compare {field}: two values, not {len(values)}")
        self.field = field
        self.values = list(values)
        self.labels = [side_label(field, v, values) for v in values]
        self.workload = workload if workload is not None else compare_workload(seed=seed)
        self.seed = seed
        base = {**COMPARE_DEFAULTS, **server_args}
        self.sides: list[SimSide] = []
        for label, value in zip(self.labels, self.values):
            events: list[Event] = []
            kw = {**base, field: value}
            sim = Simulator(model, hardware, tp_size=tp_size, seed=seed, trace_sink=events.extend, **kw)
            self.sides.append(SimSide(label, sim, self.workload, events))
        self.now = min((s.next_t for s in self.sides if s.next_t is not None), default=0.0)
        sim = self.sides[0].sim
        self.title = f"SIMULATED {sim.hw.name}x{tp_size} {sim.spec.name}"

    @property
    def done(self) -> bool:
        """Both sides have served every request."""
        return all(s.next_t is None for s in self.sides)

    def advance_to(self, t: float) -> None:
        """Move the shared clock to simulated time `t`: both sides take every action due by then."""
        self.now = max(self.now, t)
        for s in self.sides:
            s.advance_to(self.now)

    def step(self) -> bool:
        """Advance the clock to the next action of either side (one step of the side that is
        behind, and whatever the other has due by then). False once both are done."""
        due = [s.next_t for s in self.sides if s.next_t is not None]
        if not due:
            return False
        self.advance_to(min(due))
        return True

    def run(self, max_actions: int | None = None) -> None:
        """Step until done (or `max_actions` steps)."""
        n = 0
        while (max_actions is None or n < max_actions) and self.step():
            n += 1

    def drain(self, i: int) -> list[Event]:
        """Side `i`'s trace events since the last drain."""
        return self.sides[i].drain()


def side_label(field: str, value: Any, values: list[Any]) -> str:
    """A side's short name: the value itself ('fcfs'), or field=value when values alone say little."""
    text = str(value).lower() if isinstance(value, bool) else str(value)
    if isinstance(value, str) and value and str(values[0]) != str(values[1]):
        return text
    return f"{field}={text}"
