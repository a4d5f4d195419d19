"""Scenarios: demos that show the scheduler's hard cases on any machine.

A scenario is a workload (its prompts and sampling), engine settings (KV pool size, chunk size,
running limit) and an arrival policy. Arrivals are adaptive (`workloads.adapt_rate`): the rate
follows what this machine measurably completes, so the engine holds about `target_in_flight`
requests whether it runs on a fast workstation or a busy 2-core laptop: enough to form a waiting
queue and fill a small KV pool, never the hundred-request pile-up a fixed rate makes on a slow
machine. The same names work everywhere:

    workbench tui --scenario kv-pressure
    workbench record --scenario kv-pressure --duration 60 -o run.jsonl

    from workbench import Engine
    from workbench.scenarios import get_scenario
    scn = get_scenario("kv-pressure")
    engine = Engine(**scn.engine_kwargs())
    runner = scn.start(engine)          # a started WorkloadRunner; runner.stop() ends it

The engine settings apply only where the caller kept ServerArgs' default, so
`workbench tui --scenario kv-pressure --max-total-tokens 2048` keeps the user's pool size.
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from workbench.workloads import KINDS, RATE_WINDOW_S, WorkloadRunner, fmt_rate, make_prompts


@dataclass(frozen=True)
class Scenario:
    """One demo: what is sent, to an engine set up how, arriving how (see the module doc)."""

    name: str
    summary: str  # one line: what it is
    watch: str  # what to look for, in the TUI's words
    workload: str  # a workloads.KINDS name: the prompts
    engine: dict = field(default_factory=dict)  # ServerArgs fields (max_total_tokens, ...)
    rid_prefix: str = ""
    max_new_tokens: int = 32
    ignore_eos: bool = False  # every request decodes max_new_tokens: KV demand is predictable
    temperature: float = 0.7
    long_every: int = 0  # every Nth request is a long prompt (prefilled in chunks)
    long_max_new_tokens: int = 16
    burst_size: int = 1  # requests sent together (the "burst" workload)
    initial_rate: float = 2.0  # requests/s until the first completions are measured
    target_in_flight: float = 8.0  # what the adaptive rate keeps in the engine
    max_in_flight: int = 32  # never more in the engine at once (a burst waits for room)

    def engine_kwargs(self) -> dict:
        """The engine settings as `Engine(**kwargs)` keywords."""
        return dict(self.engine)

    def server_args(self, base: Any = None) -> Any:
        """`base` (a ServerArgs; None: the defaults) with this scenario's engine settings, each
        applied only where `base` still has ServerArgs' default (a flag the user gave wins)."""
        from workbench.core.args import ServerArgs

        if base is None:
            return ServerArgs(**self.engine)
        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        changes = {k: v for k, v in self.engine.items() if getattr(base, k) == defaults.get(k)}
        return dataclasses.replace(base, **changes)

    def prompts(self, seed: int = 0) -> Iterator[dict]:
        """An endless stream of request items for WorkloadRunner(prompts=...)."""
        main = make_prompts(self.workload, seed)
        long = make_prompts("long-prompt", seed) if self.long_every else None
        prefix = self.rid_prefix or self.workload
        for i in itertools.count(1):
            if long is not None and i % self.long_every == 0:
                yield {
                    "messages": next(long),
                    "rid_prefix": "long",
                    "sampling_params": {"max_new_tokens": self.long_max_new_tokens},
                }
            else:
                yield {"messages": next(main), "rid_prefix": prefix}

    def runner(self, engine: Any, *, rate: float | None = None, seed: int = 0, **overrides) -> WorkloadRunner:
        """A WorkloadRunner for this scenario on `engine` (not started). `rate`: the starting rate
        (it adapts from there); `overrides`: any other WorkloadRunner argument."""
        kw = dict(
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
            ignore_eos=self.ignore_eos,
            burst_size=self.burst_size,
            max_in_flight=self.max_in_flight,
            adaptive=True,
            target_in_flight=self.target_in_flight,
            label=self.name,
        )
        kw.update(overrides)
        return WorkloadRunner(engine, self.workload, rate or self.initial_rate, prompts=self.prompts(seed), **kw)

    def start(self, engine: Any, **kw) -> WorkloadRunner:
        """`runner(engine, **kw)`, started."""
        r = self.runner(engine, **kw)
        r.start()
        return r

    def describe(self) -> str:
        """Settings and what to watch, in a few lines (the TUI's events log and `--help`)."""
        settings = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in self.engine.items())
        return (
            f"{self.name}: {self.summary} ({settings}; adaptive arrivals keep ~{self.target_in_flight:g} "
            f"requests in the engine). Watch: {self.watch}"
        )


@dataclass(frozen=True)
class TourScenario(Scenario):
    """The guided tour's scenario (`workbench tui --tour`): a fixed cycle of requests, not a
    workload kind, so that every hard case comes within a few dozen scheduler steps (a minute on
    a busy 2-core laptop): shared-prefix questions whose prompt (~100 tokens) is longer than the
    64-token prefill chunk and whose system prompt later ones find cached, and short chats that
    finish at once and leave their prefixes evictable in a pool too small for what the running
    requests will decode (admission reserves little of it: `schedule_conservativeness`)."""

    #: the cycle: "sp" (a shared-prefix question decoding `max_new_tokens`) or "chat" (a short
    #: chat decoding `short_max_new_tokens`)
    cycle: tuple[str, ...] = ("sp", "chat", "sp", "sp")
    short_max_new_tokens: int = 2

    def prompts(self, seed: int = 0) -> Iterator[dict]:
        sp = make_prompts("shared-prefix", seed)
        chat = make_prompts("chat", seed + 7)  # other questions than the shared-prefix ones
        for i in itertools.count():
            if self.cycle[i % len(self.cycle)] == "sp":
                yield {"messages": next(sp), "rid_prefix": "sp"}
            else:
                yield {
                    "messages": next(chat),
                    "rid_prefix": "chat",
                    "sampling_params": {"max_new_tokens": self.short_max_new_tokens},
                }


TOUR = TourScenario(
    "tour",
    "the guided tour (workbench tui --tour): shared-prefix questions longer than the prefill chunk and "
    "short chats, in a KV pool too small for what they will decode",
    "in its first minute: requests wait, are admitted, a prompt longer than the chunk is prefilled in "
    "chunks, later requests hit the cached system prompt, finished prefixes are evicted, and the pool "
    "runs dry so the scheduler retracts a request",
    "shared-prefix",
    dict(max_total_tokens=256, chunked_prefill_size=64, max_running_requests=6, schedule_conservativeness=0.3),
    rid_prefix="sp",
    max_new_tokens=32,
    ignore_eos=True,
    initial_rate=6.0,
    target_in_flight=10,
    max_in_flight=16,
)

SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "shared-prefix",
            "one long system prompt, 16 different questions, a small KV pool",
            "the system prompt is one radix node with many children, locked while its requests run; "
            "requests wait at the running limit; once the pool fills with finished answers the coldest "
            "leaves are evicted (KV pool: evicted; the tree loses its cold branches)",
            "shared-prefix",
            dict(max_total_tokens=512, max_running_requests=8),
            rid_prefix="sp",
            max_new_tokens=32,
            target_in_flight=14,
            max_in_flight=24,
        ),
        Scenario(
            "kv-pressure",
            "more requests than a tiny KV pool holds, each decoding 64 tokens",
            "requests wait for KV room (queued: KV room); finished prefixes are evicted to admit new ones; "
            "admission reserves only part of each request's future tokens, so when the pool runs dry the "
            "scheduler retracts the requests that decoded least back to the queue (KV pool: retracted; "
            "Events: retract)",
            "chat",
            dict(max_total_tokens=640, max_running_requests=16),
            rid_prefix="kv",
            max_new_tokens=64,
            ignore_eos=True,
            target_in_flight=14,
            max_in_flight=24,
        ),
        Scenario(
            "chunked-prefill",
            "short chats decoding while a long prompt arrives every fifth request",
            "a long-N request is prefilled 64 tokens per step (chunk k/n in Batch composition); during "
            "those steps the running requests wait (last step: N running waited), so their decode "
            "stalls and their time per output token jumps",
            "chat",
            dict(chunked_prefill_size=64, max_total_tokens=4096, max_running_requests=16),
            rid_prefix="chat",
            max_new_tokens=64,
            ignore_eos=True,
            long_every=5,
            target_in_flight=8,
            max_in_flight=16,
        ),
        Scenario(
            "burst",
            "12 requests at once, 4 may run",
            "each burst forms a waiting queue (queued: run limit) that drains four at a time; the next "
            "burst comes once it has drained",
            "burst",
            dict(max_running_requests=4, max_total_tokens=4096),
            rid_prefix="burst",
            max_new_tokens=24,
            burst_size=12,
            target_in_flight=6,
            max_in_flight=14,
        ),
        TOUR,
    )
}
assert all(s.workload in KINDS for s in SCENARIOS.values())


def get_scenario(name: str) -> Scenario:
    """The scenario called `name` (ValueError naming the choices otherwise)."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise ValueError(f"unknown scenario {name!r}; choose one of {', '.join(SCENARIOS)}") from None


def runner_status(runner: WorkloadRunner) -> str:
    """What a running workload is doing, for a status line:
    'kv-pressure 2.3 req/s (auto: 2.1 done/s, 14/14 in flight)'."""
    if runner.paused:
        how = "paused"
    elif runner.adaptive:
        # what the rate follows: the machine's measured completions over the last RATE_WINDOW_S of
        # unpaused time. "measuring" only until the first completion: later a window with none (a
        # slow, retracting pool) says so instead of looking like a measurement that never ends.
        if runner.measured_per_s > 0:
            done = f"{fmt_rate(runner.measured_per_s)} done/s"
        elif runner.completed:
            done = f"none done in {RATE_WINDOW_S:g} s"
        else:
            done = "measuring"
        how = f"auto: {done}, {runner.in_flight}/{runner.target_in_flight:g} in flight"
    else:
        how = f"{runner.in_flight} in flight"
    return f"{runner.label} {fmt_rate(runner.rate)} req/s ({how})"


# ---- recording ----------------------------------------------------------------------
class Sightings:
    """A bus callback that counts the hard cases as they happen: tokens evicted from the radix
    cache, retracted requests, the longest waiting queue, narrated steps (`batch.decision`), and
    requests that finished (not aborted)."""

    def __init__(self) -> None:
        self.evicted_tokens = 0
        self.retracted = 0
        self.max_waiting = 0
        self.decisions = 0
        self.finished = 0

    def __call__(self, batch) -> None:
        for e in batch:
            kind = type(e).__name__
            if kind == "CacheEvict":
                self.evicted_tokens += e.tokens
            elif kind == "ReqRetracted":
                self.retracted += 1
            elif kind == "QueueState":
                self.max_waiting = max(self.max_waiting, len(e.waiting))
            elif kind == "StepDecision":
                self.decisions += 1
            elif kind == "ReqFinished" and e.reason != "abort":
                self.finished += 1

    def hard_cases_seen(self) -> bool:
        """A waiting queue, an eviction and a retraction have all happened."""
        return self.evicted_tokens > 0 and self.retracted > 0 and self.max_waiting > 0

    def line(self) -> str:
        return f"waiting up to {self.max_waiting} · evicted {self.evicted_tokens} tokens · retracted {self.retracted}"


@dataclass
class RecordResult:
    output: str
    seconds: float
    completed: int
    failed: int  # failed while the run went on (not the requests aborted at its end)
    aborted: int  # in flight when the run ended
    sightings: Sightings

    def summary(self) -> str:
        return (
            f"wrote {self.output}: {self.completed} requests in {self.seconds:.1f} s ({self.failed} failed, "
            f"{self.aborted} aborted at the end); {self.sightings.line()}"
        )


def _progress_printer() -> Callable[[str], None]:
    """Progress on stderr: one line rewritten in place on a terminal; into a pipe or a log, a new
    line when something changed and at most every 5 s (a CI log must not get five lines a second)."""
    tty = sys.stderr.isatty()
    last = {"line": "", "at": 0.0}

    def show(line: str) -> None:
        if line == "\n":
            if tty:
                print(file=sys.stderr, flush=True)
            return
        body = line if tty else line.split(" · ", 1)[-1]  # into a log: what changed, not the clock
        if body == last["line"] or (not tty and time.monotonic() - last["at"] < 5.0):
            return
        last["line"], last["at"] = body, time.monotonic()
        print(("\r" + line) if tty else line, end="" if tty else "\n", flush=True, file=sys.stderr)

    return show


def record_run(
    server_args: Any,
    output: str,
    make_runner: Callable[[Any], WorkloadRunner],
    *,
    num_requests: int | None = None,
    duration_s: float | None = None,
    stop_when: Callable[[Sightings], bool] | None = None,
    progress: Callable[[str], None] | None = None,
) -> RecordResult:
    """Start an engine, record its trace to `output` while `make_runner(engine)` runs, until
    `num_requests` completed or failed, `duration_s` passed, or `stop_when(sightings)` holds
    (whichever comes first; at least one of them must be given)."""
    from workbench.core.engine import Engine
    from workbench.core.trace.recorder import Recorder

    if num_requests is None and duration_s is None and stop_when is None:
        raise ValueError("record needs --num-requests or --duration (a scenario runs until stopped)")
    if progress is None:
        progress = _progress_printer()
    sightings = Sightings()
    with Engine(server_args=server_args) as engine:
        recorder = Recorder(output, model=engine.served_model_name)
        handle = engine.bus.subscribe_callback(recorder, name="recorder", with_snapshot=True)
        watch = engine.bus.subscribe_callback(sightings, name="record-sightings")
        runner = make_runner(engine)
        runner.start()
        t0 = time.monotonic()
        while True:
            time.sleep(0.2)
            elapsed = time.monotonic() - t0
            finished = runner.completed + runner.failed
            progress(f"[record] {elapsed:.0f} s · {finished} done · {sightings.line()}")
            if (
                (num_requests is not None and finished >= num_requests)
                or (duration_s is not None and elapsed >= duration_s)
                or (stop_when is not None and stop_when(sightings))
            ):
                break
        progress("\n")
        completed, failed = runner.completed, runner.failed  # an aborted request may end "completed"
        aborted = runner.stop()
        time.sleep(0.5)  # let the last events reach the bus
        watch.close()
        handle.close()
        recorder.close()
    return RecordResult(output, time.monotonic() - t0, completed, failed, aborted, sightings)


def _trace_spec(args, sa):
    """`record --workload FILE`: the trace to play (None: a workload kind); a wrong file or flag exits
    with what to do."""
    from workbench.trace_runner import WorkloadError, trace_spec_from_args

    try:
        return trace_spec_from_args(args, seed=sa.random_seed or 0)
    except WorkloadError as exc:
        raise SystemExit(f"workbench record: {exc}") from None


def record_workload(args) -> int:
    """`workbench record`: run a workload (`--workload`, `--num-requests` of them) or a scenario
    (`--scenario`, for `--duration` seconds) and write the trace as JSONL. It lives here, above
    workloads.py, because it needs both (workloads never import scenarios)."""
    from workbench.core.args import ServerArgs

    sa = ServerArgs.from_cli_args(args)
    sa.record = None
    name = getattr(args, "scenario", None)
    if name:
        scenario = get_scenario(name)
        sa = scenario.server_args(sa)
        make_runner = lambda engine: scenario.runner(engine, rate=args.rate, max_requests=args.num_requests)  # noqa: E731
        num = args.num_requests
        duration = args.duration if args.duration is not None else (None if num else 60.0)
    elif (trace := _trace_spec(args, sa)) is not None:  # a production trace (workbench/trace_runner.py)
        num = min(args.num_requests or len(trace.load().requests), len(trace.load().requests))
        print(f"[record] {trace.describe(args.rate, simulated=bool(sa.simulate))}", file=sys.stderr)
        make_runner = lambda engine: WorkloadRunner(  # noqa: E731
            engine, trace, args.rate, max_requests=num, temperature=0.0
        )
        duration = args.duration
    else:
        num = args.num_requests or 16
        make_runner = lambda engine: WorkloadRunner(  # noqa: E731
            engine,
            args.workload,
            args.rate or 4.0,
            max_new_tokens=args.max_new_tokens,
            max_requests=num,
            temperature=0.0,
        )
        duration = args.duration
    result = record_run(sa, args.output, make_runner, num_requests=num, duration_s=duration)
    print(result.summary())
    return 0 if result.failed == 0 else 1
