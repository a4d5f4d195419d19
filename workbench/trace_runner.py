"""A production trace played on a live engine (issue #37): `workbench tui --workload trace.jsonl`.

The file is read by workbench/traces.py (Mooncake's JSONL, Azure's and BurstGPT's CSVs, the
project's own workload JSONL or a real engine's `--record` file, detected or named by
`--workload-format`, cut by `--start/--duration/--sample/--max-requests`). `TraceRunner` then sends
each request when its arrival comes, on the engine's clock: a prompt of the trace's length (Mooncake's
hash ids as the same 512 token ids wherever they appear, so shared ids are shared prefixes the radix
cache hits; a recording's own token ids when it carries them; else ids of its own) and exactly the
trace's output length (`ignore_eos`).

A production trace comes at a production rate; one CPU cannot serve it. So arrivals are stretched by
a time scale: `--time-scale X` multiplies them (as `sim run` does), and without it the scale is
chosen so the trace's mean rate becomes `--rate`, or by default 1 request/s and at most 1000 prompt
tokens/s (about what two CPU cores prefill with the default model). The runner's status line says
the scale in use; `+` and `-` in the TUI (`set_rate`) change it from where the trace has got to.
Prompts longer than the model's context are cut to fit (the prefix, so sharing stays), and said so.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from dataclasses import dataclass, field, replace
from typing import ClassVar

from workbench.traces import (
    FORMATS,
    TraceCut,
    TraceWorkload,
    WorkloadError,
    detect_format,
    fit_vocab,
    read_workload,
)

__all__ = ["TraceRunner", "TraceSpec", "WorkloadError", "add_live_trace_args", "trace_spec_from_args"]
from workbench.workloads import ADAPT_PERIOD_S, KINDS, WorkloadRunner, fmt_rate

DEFAULT_RATE = 1.0  # mean requests/s a trace is slowed (or sped) to when no --time-scale is given
# ... and at most this many prompt tokens/s: about what a 2-core CPU prefills with the default model
# (docs/benchmarks.md, prefill 512: ~750 tok/s float32 and ~1250 bfloat16 on one thread of the earlier
# machine, so some 500 to 2500 on two cores of these). Mooncake's prompts are thousands of tokens: at
# 1 req/s they would pile up from the first minute.
DEFAULT_PROMPT_TOKENS_PER_S = 1000.0
_RID_PREFIX = {"mooncake": "mc", "azure": "az", "burstgpt": "bg", "recording": "rec", "workbench": "wl"}


def speed_words(scale: float) -> str:
    """How a time scale plays the trace, for people: '1/20 speed', '2x speed', 'real time'."""
    if abs(scale - 1.0) < 1e-9:
        return "real time"
    if scale > 1:
        return f"1/{scale:.3g} speed"
    return f"{1 / scale:.3g}x speed"


@dataclass
class TraceSpec:
    """A trace file to play live: where, how to read and cut it, and the time scale (None: from the
    rate). `load()` reads it (raising `WorkloadError` with a fix), so a bad file fails before an
    engine starts."""

    path: str
    fmt: str = "auto"
    cut: TraceCut = field(default_factory=TraceCut)
    time_scale: float | None = None
    loaded: TraceWorkload | None = None
    runner_class: ClassVar[type]  # TraceRunner (set below): what WorkloadRunner(engine, spec) builds

    def load(self) -> TraceWorkload:
        if self.loaded is None:
            cut = TraceCut(
                self.cut.start, self.cut.duration, self.cut.sample, self.cut.max_requests, 1.0, self.cut.seed
            )
            self.loaded = read_workload(self.path, self.fmt, cut, seed=self.cut.seed)
        return self.loaded

    @property
    def name(self) -> str:
        fmt = self.loaded.format if self.loaded is not None else self.fmt
        return f"{fmt} {os.path.basename(self.path)}"

    def __str__(self) -> str:
        return self.name

    @property
    def span_s(self) -> float:
        """Seconds of trace from its first kept arrival to its last."""
        reqs = self.load().requests
        return reqs[-1].arrival - reqs[0].arrival if len(reqs) > 1 else 0.0

    def mean_rate(self) -> float:
        """The trace's own mean requests/s (0: one request, or all at once)."""
        reqs = self.load().requests
        return (len(reqs) - 1) / self.span_s if self.span_s > 0 else 0.0

    def scale_for(self, rate: float | None, simulated: bool = False) -> float:
        """The time scale: --time-scale if given, else the one that makes the mean rate `rate` (a
        simulated deployment without a `rate`: the trace as it is, the simulated hardware's to serve)."""
        if self.time_scale is not None:
            return self.time_scale
        if simulated and rate is None:
            return 1.0
        mean = self.mean_rate()
        if mean <= 0:
            return 1.0
        if rate is not None:
            return mean / rate
        return max(mean / DEFAULT_RATE, self.prompt_tokens_per_s() / DEFAULT_PROMPT_TOKENS_PER_S)

    def prompt_tokens_per_s(self) -> float:
        """The trace's own prompt tokens per second (0: no span)."""
        reqs = self.load().requests
        return sum(r.prompt_len for r in reqs[:-1]) / self.span_s if self.span_s > 0 else 0.0

    def played_rate(self, rate: float | None, simulated: bool = False) -> float | None:
        """The mean requests/s the trace is played at (None: it has no rate, one request or all at once).
        A controller that keeps its own rate starts from this, so + and - scale from what is played."""
        mean = self.mean_rate()
        return mean / self.scale_for(rate, simulated) if mean > 0 else rate

    def describe(self, rate: float | None = None, simulated: bool = False) -> str:
        """One line for the console: what was read and how fast it plays, and how to change that."""
        scale = self.scale_for(rate, simulated)
        if self.time_scale is not None:
            how = "--time-scale"
        elif simulated and rate is None:
            how = "a simulated deployment takes the trace's own rate"
        elif rate is not None:
            how = f"chosen for a mean {fmt_rate(rate)} req/s"
        else:
            how = (
                f"chosen for a mean {fmt_rate(DEFAULT_RATE)} req/s and at most {DEFAULT_PROMPT_TOKENS_PER_S:.0f} "
                "prompt tokens/s, about what a 2-core CPU prefills"
            )
        reqs = self.load().requests
        prompt = sum(r.prompt_len for r in reqs) / len(reqs)
        output = sum(r.output_len for r in reqs) / len(reqs)
        return (
            f"{self.load().summary(self.path)}, prompts {prompt:.0f} and outputs {output:.0f} tokens on average; "
            f"played at {speed_words(scale)} (time scale {scale:.3g}, {how}; --time-scale 1 plays it as "
            "recorded, --rate R sets the mean rate, + and - change it live)"
        )


def is_trace_workload(kind: object) -> bool:
    """Whether a `--workload` value names a trace (a TraceSpec, or a file that is not a workload kind)."""
    return isinstance(kind, TraceSpec) or (isinstance(kind, str) and kind not in KINDS and os.path.isfile(kind))


def workload_hint(path: str) -> str | None:
    """For `replay FILE`: a workload (a production trace, a workbench JSONL) is no recording of events;
    say how to play it instead (None: it is not one of those)."""
    try:
        fmt = detect_format(path)
    except (WorkloadError, OSError):
        return None
    if fmt == "recording":
        return None
    return (
        f"{path} is a {fmt} workload, not a recording of a run: play it on the engine with "
        f"`workbench tui --workload {path}`, or simulate it with `workbench sim run --workload {path}`"
    )


class TraceRunner(WorkloadRunner):
    """Sends a trace's requests at their (scaled) arrivals until it ends or `stop()`. `rate` is the
    mean rate the trace is played at (see the module docstring); `set_rate` rescales from the
    current position. `WorkloadRunner(engine, TraceSpec(...), ...)` builds one of these (so the TUI's
    controller needs nothing new); `kind` may also be the trace file's path."""

    def __init__(
        self,
        engine,
        kind,
        rate: float | None = None,
        *,
        seed: int = 0,
        label: str | None = None,
        vocab: int | None = None,
        context_len: int | None = None,
        **kw,
    ):
        """`vocab` and `context_len` default to the engine's: prompt ids are drawn below `vocab`, and
        a request longer than `context_len` is cut to fit."""
        spec = kind if isinstance(kind, TraceSpec) else TraceSpec(str(kind), cut=TraceCut(seed=seed))
        self.spec = spec
        loaded = spec.load()
        for ignored in ("max_new_tokens", "burst_size", "prompts", "adaptive", "target_in_flight", "use_plugins"):
            kw.pop(ignored, None)  # lengths come from the trace; arrivals too
        mean = spec.mean_rate()
        super().__init__(engine, "chat", 1.0, prompts=iter(()), seed=seed, ignore_eos=True, **kw)
        self._scale = spec.scale_for(rate, simulated=self._sim is not None)
        self.kind = "trace"
        self._name = label or spec.name
        self.rate = mean / self._scale if mean > 0 else (rate or DEFAULT_RATE)
        self.requests = loaded.requests
        self.clipped = 0  # prompts cut to fit the model's context
        self.position_s = 0.0  # seconds of trace played
        self._next = 0
        self._seed = seed
        self._vocab = vocab or _engine_vocab(engine)
        if self._vocab:
            fit_vocab(self.requests, self._vocab)
        # a request must fit the context and the KV pool (a small --max-total-tokens), or it is refused
        room = [n for n in (getattr(engine, "context_len", 0), getattr(engine, "max_total_num_tokens", 0)) if n]
        self._context = int(context_len or (min(room) if room else 0))
        self._prefix = _RID_PREFIX.get(loaded.format, "trace")

    # ---- what the status line shows --------------------------------------------------
    @property
    def label(self) -> str:
        done = "done, " if self.finished_sending else ""
        return f"{self._name} at {speed_words(self._scale)} ({done}{self.sent}/{len(self.requests)} sent)"

    @label.setter
    def label(self, value: str) -> None:
        pass  # set by WorkloadRunner.__init__; this runner's label says where the trace is

    @property
    def time_scale(self) -> float:
        return self._scale

    @property
    def finished_sending(self) -> bool:
        return self._next >= len(self.requests) or (self.max_requests is not None and self.sent >= self.max_requests)

    def set_rate(self, rate: float) -> None:
        """Play the rest of the trace at mean `rate` requests/s: the time scale changes by the ratio."""
        rate = max(1e-6, float(rate))
        self._scale *= self.rate / rate
        self.rate = rate
        self._poke()

    # ---- sending ------------------------------------------------------------------------
    def _request_kwargs(self, i: int) -> dict:
        from workbench.core.simulation.simulator import request_prompt

        r = self.requests[i]
        output = r.output_len
        ids = request_prompt(i, r, self._seed, self._vocab or 32000)
        if self._vocab and ids and max(ids) >= self._vocab:  # a recording of a model with more token ids
            ids = request_prompt(i, replace(r, prompt_ids=None), self._seed, self._vocab)
        if self._context:
            output = min(output, max(1, self._context // 4))
            room = self._context - output - 1
            if len(ids) > room:
                ids = ids[: max(1, room)]
                self.clipped += 1
        params = {"max_new_tokens": output, "temperature": self.temperature, "ignore_eos": True}
        return {"input_ids": ids, "sampling_params": params}

    def _send_due(self, tasks: set) -> None:
        while not self.finished_sending and self.requests[self._next].arrival <= self.position_s + 1e-9:
            if self.in_flight >= self.max_in_flight:
                return
            i = self._next
            self._next += 1
            rid = f"{self._prefix}-{next(self._ids)}"
            try:
                kwargs = self._request_kwargs(i)
            except Exception as exc:
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                continue
            self._dispatch(rid, kwargs, tasks)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        last = self._active_now()
        while not self._stop.is_set():
            self._wake.clear()
            now = self._active_now()  # paused time is not active: the trace waits with the scheduler
            self.position_s += (now - last) / self._scale
            last = now
            if self.paused:
                self._announce(None)
                await self._sleep(ADAPT_PERIOD_S)
                continue
            before = self.sent
            noted = self._sim.sent() if self._sim is not None else 0
            self._send_due(tasks)
            if self._sim is not None and self.sent > before:
                await self._until_noted(noted + self.sent - before)
            if self.finished_sending:
                self._announce(None)
                await self._sleep(ADAPT_PERIOD_S)
                continue
            wait = max(0.0, (self.requests[self._next].arrival - self.position_s) * self._scale)
            wait = min(wait, ADAPT_PERIOD_S)  # a rate change or a long gap: look again within a second
            self._announce(now + wait if self.in_flight < self.max_in_flight else None)
            await self._sleep(wait)
        self._announce(None)
        if tasks:
            await asyncio.wait(tasks, timeout=3.0)
            for t in tasks:
                t.cancel()


def _engine_vocab(engine) -> int:
    tok = getattr(engine, "tokenizer", None)
    try:
        return len(tok) if tok is not None else 0
    except TypeError:
        return int(getattr(tok, "vocab_size", 0) or 0)


# ---- flags (workbench tui, workbench record) ------------------------------------------------
def add_live_trace_args(group, duration_flag: str = "--duration") -> None:
    """The flags that read and pace a trace `--workload FILE` on a live engine (`duration_flag`: where
    a command's --duration means something else already, the window's length goes by another name)."""
    group.add_argument(
        "--workload-format",
        default="auto",
        choices=FORMATS,
        help="a --workload FILE's format (auto: detected from its first line): workbench JSONL, a "
        "recording, Mooncake's trace JSONL, Azure's LLM inference trace CSV or BurstGPT's CSV",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        default=None,
        help="multiply a trace's arrivals by this (20: twenty times slower; default: the scale that makes "
        "its mean rate --rate, else 1 req/s and at most 1000 prompt tokens/s, since one CPU cannot serve a "
        "production rate)",
    )
    group.add_argument(
        "--start", type=float, default=0.0, help="a trace's window: seconds from its first request where it begins"
    )
    group.add_argument(
        duration_flag,
        dest="trace_duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="a trace's window: this many seconds of it, from --start (default: to its end)",
    )
    group.add_argument(
        "--sample", type=float, default=None, help="keep this fraction of a trace's requests (seeded), e.g. 0.1"
    )
    group.add_argument(
        "--max-requests", type=int, default=None, help="play only the first N requests of a trace (after the cut)"
    )


def trace_spec_from_args(args: argparse.Namespace, seed: int = 0) -> TraceSpec | None:
    """The TraceSpec that `--workload FILE` and the trace flags ask for (None: a workload kind);
    read at once, so a wrong file or flag is a `WorkloadError` that says what to do."""
    workload = getattr(args, "workload", None)
    if not is_trace_workload(workload):
        trace_flags = [
            f
            for f, on in (
                ("--workload-format", getattr(args, "workload_format", "auto") != "auto"),
                ("--time-scale", getattr(args, "time_scale", None) is not None),
                ("--start", bool(getattr(args, "start", 0.0))),
                ("the trace's --duration", getattr(args, "trace_duration", None) is not None),
                ("--sample", getattr(args, "sample", None) is not None),
                ("--max-requests", getattr(args, "max_requests", None) is not None),
            )
            if on
        ]
        if workload and workload not in KINDS:
            raise WorkloadError(
                f"--workload {workload}: no such file, and not a workload kind ({', '.join(KINDS)}); give a "
                "trace file (Mooncake JSONL, Azure or BurstGPT CSV, a workbench JSONL or a --record file)"
            )
        if trace_flags:
            raise WorkloadError(f"{', '.join(trace_flags)}: for a --workload FILE (a trace to cut or pace)")
        return None
    checks = (
        (args.time_scale is not None and args.time_scale <= 0, "--time-scale: a factor above 0 (20: 20x slower)"),
        (args.max_requests is not None and args.max_requests < 1, "--max-requests: 1 or more"),
        (args.start < 0, "--start: seconds of the trace from its first request, 0 or more"),
        (args.trace_duration is not None and args.trace_duration <= 0, "--duration (of the trace): seconds above 0"),
        (args.sample is not None and not 0 < args.sample <= 1, "--sample: a fraction in (0, 1], e.g. 0.1"),
    )
    for bad, text in checks:
        if bad:
            raise WorkloadError(text)
    cut = TraceCut(args.start, args.trace_duration, args.sample, args.max_requests, 1.0, seed=seed)
    spec = TraceSpec(workload, args.workload_format, cut, args.time_scale)
    spec.load()
    return spec


TraceSpec.runner_class = TraceRunner  # WorkloadRunner(engine, spec) makes a TraceRunner
