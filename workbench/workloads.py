"""Workloads for demos, recordings and benchmarks: generated prompts sent to an engine at a rate.

Kinds (`--workload`): "chat" (short, unrelated questions), "shared-prefix"
(one long system prompt + different questions: the radix tree grows one
shared node with many children), "long-prompt" (prompts long enough to be
prefilled in chunks) and "burst" (groups of requests at once, same mean rate).

If a plugin registered a workload of that name (registry "workload"), its
`requests()` items are used as prompts instead of the generators here. The
runner owns one daemon thread with its own asyncio loop and calls
`engine.async_generate`, so hundreds of requests can be in flight cheaply.

Arrivals come at a fixed rate, or adapt (`adaptive=True`): every second the
rate is set from what this machine measurably completes (`adapt_rate`), so a
demo neither starves a fast machine nor piles hundreds of requests onto a slow
or busy one. Scenarios (workbench/scenarios.py) run adaptive workloads.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import random
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

KINDS = ("chat", "shared-prefix", "long-prompt", "burst")
_SHORT = {"chat": "chat", "shared-prefix": "sp", "long-prompt": "long", "burst": "burst"}

# The first few start with different words, so N shared-prefix requests branch N ways.
_QUESTIONS = [
    "What is a radix tree?",
    "Name three prime numbers.",
    "Why is the sky blue?",
    "Explain batching in one sentence.",
    "How do bees make honey?",
    "Write a haiku about caches.",
    "Give me a fun fact about octopuses.",
    "Describe the color green.",
    "Suggest a name for a cat.",
    "What does a scheduler do?",
    "What is the capital of France?",
    "What is 12 times 12?",
    "Why do we sleep?",
    "What is a token?",
    "How far is the Moon?",
    "What is recursion?",
]

SHARED_SYSTEM = (
    "You are a patient teaching assistant for a course on computer systems. Answer in one or two "
    "short sentences, use plain words, avoid jargon unless asked, and when a question is ambiguous "
    "pick the most common meaning. The course covers operating systems, memory hierarchies, caches, "
    "schedulers, networking and the serving of large language models."
)

_LONG_TEXT = (
    "The serving engine keeps a pool of key-value slots in memory. Every request first looks up the "
    "longest prefix of its prompt that is already cached in the radix tree, reuses those slots and "
    "computes only the rest. Long prompts are split into chunks so that a single request cannot hold "
    "the whole batch hostage, and decoding requests keep making progress between the chunks. "
)


def make_prompts(kind: str, seed: int = 0) -> Iterator[Any]:
    """An endless stream of prompts (str, or chat messages list) for `kind`."""
    if kind not in KINDS:
        raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(KINDS)}")
    rng = random.Random(seed)
    for i in itertools.count():
        q = _QUESTIONS[(i + seed) % len(_QUESTIONS)]
        if kind == "shared-prefix":
            yield [{"role": "system", "content": SHARED_SYSTEM}, {"role": "user", "content": q}]
        elif kind == "long-prompt":
            yield [{"role": "user", "content": _LONG_TEXT * rng.randint(3, 6) + f"\nIn short ({i}): {q}"}]
        else:
            yield [{"role": "user", "content": q}]


# ---- the adaptive arrival rate ------------------------------------------------------
MIN_RATE, MAX_RATE = 0.05, 50.0
ADAPT_PERIOD_S = 1.0  # how often an adaptive runner recomputes its rate
RATE_WINDOW_S = 10.0  # completions over this much unpaused time measure the machine


def adapt_rate(
    rate: float,
    done_per_s: float,
    in_flight: int,
    target_in_flight: float,
    *,
    max_change: float = 2.0,
    min_rate: float = MIN_RATE,
    max_rate: float = MAX_RATE,
) -> float:
    """The next arrival rate (requests/s) of an adaptive workload.

    By Little's law a steady state that holds `target_in_flight` requests in the engine has
    arrivals equal to completions. So the rule starts from what the machine measurably completes
    (`done_per_s`; before anything has completed, the current rate) and pulls towards the target
    by sqrt(target / in_flight), kept within [1/max_change, max_change]: fewer in flight than the
    target speeds arrivals up, more (a pile-up) slows them down. The result moves at most
    `max_change` times away from the current rate per update, so one noisy window cannot swing
    it, and stays within [min_rate, max_rate]. Until something has completed (a slow machine's
    first long requests, or a stalled engine) the rate is also at most the gap to the target per
    second (an update comes every second): the ramp-up never sends past the target blind.
    """
    pull = math.sqrt(max(target_in_flight, 0.5) / max(in_flight, 0.5))
    pull = min(max_change, max(1.0 / max_change, pull))
    base = done_per_s if done_per_s > 0 else rate
    new = min(rate * max_change, max(rate / max_change, base * pull))
    if done_per_s <= 0:
        new = min(new, target_in_flight - in_flight)
    return min(max_rate, max(min_rate, new))


def fmt_rate(rate: float) -> str:
    """A request rate for people: '12', '2.3', '0.67' (never '0.666667')."""
    if rate >= 10:
        return f"{rate:.0f}"
    if rate >= 1:
        return f"{rate:.1f}"
    return f"{rate:.2f}"


def chat_text(engine: Any, messages: list[dict]) -> str:
    """The chat template applied as text (falls back to decoding the template's ids)."""
    tok = getattr(engine, "tokenizer", None)
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:
        return tok.decode(engine.apply_chat_template(messages))


def _plugin_prompts(kind: str) -> Iterator[Any] | None:
    try:
        from workbench.plugins import load_plugins

        spec = load_plugins().workloads.get(kind)
        if spec is None:
            return None
        return iter(spec.factory().requests())
    except Exception:
        return None


class WorkloadRunner:
    """Sends requests of one kind until `stop()`: at `rate` per second, or (`adaptive`) at a rate
    that keeps about `target_in_flight` requests in the engine (see `adapt_rate`).

    Attributes `sent`, `completed`, `failed`, `in_flight`, `aborted` and `last_error` let the UI
    (and tests) see what it is doing. `max_requests` stops sending after that many (the thread
    idles until `stop()`); `max_in_flight` never lets more than that many be in the engine at
    once (a burst is sent whole or waits). `pause()` holds arrivals back (the TUI pauses the
    workload with the scheduler); paused time does not count in the measured throughput.

    `prompts` replaces the kind's generated prompts (items: a prompt string, chat messages, or a
    dict with "messages"/"prompt"/"input_ids", optional "sampling_params" and "rid_prefix");
    `ids` is the counter that numbers rids (share one to keep rids unique across runners).
    A `trace_runner.TraceSpec` as `kind` (Mooncake's JSONL, Azure's or BurstGPT's CSV, a recording)
    plays that trace instead: see workbench/trace_runner.py.
    """

    def __new__(cls, engine: Any = None, kind: Any = "chat", *args: Any, **kwargs: Any):
        """A kind that names its own runner class (workbench/trace_runner.py's TraceSpec: a production
        trace) builds that runner instead."""
        runner_class = getattr(kind, "runner_class", None)
        if cls is WorkloadRunner and isinstance(runner_class, type) and issubclass(runner_class, WorkloadRunner):
            return super().__new__(runner_class)
        return super().__new__(cls)

    def __init__(
        self,
        engine: Any,
        kind: str = "chat",
        rate: float = 1.0,
        *,
        max_new_tokens: int = 32,
        seed: int = 0,
        burst_size: int = 8,
        max_in_flight: int = 256,
        use_plugins: bool = True,
        max_requests: int | None = None,
        temperature: float = 0.7,
        ignore_eos: bool = False,
        prompts: Iterable[Any] | None = None,
        ids: Iterator[int] | None = None,
        label: str | None = None,
        adaptive: bool = False,
        target_in_flight: float = 8.0,
        paused: bool = False,
    ):
        if prompts is None and kind not in KINDS and (not use_plugins or _plugin_prompts(kind) is None):
            raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(KINDS)}")
        self.engine = engine
        # A simulated deployment in this process (Engine(simulate=...)): arrivals on its clock, and each
        # announced so its scheduler holds time for it (core/simulation/live.py); else the host's clock.
        clock = getattr(engine, "clock", None)
        self._sim = clock if clock is not None and clock.simulated else None
        sa = getattr(engine, "server_args", None)
        self._speed = (sa.sim_speed or 1.0) if self._sim is not None else 1.0
        self.kind = kind
        self.label = label or kind
        self.rate = min(MAX_RATE, max(MIN_RATE, float(rate)))
        self.max_new_tokens = max_new_tokens
        self.burst_size = burst_size
        self.max_in_flight = max_in_flight
        self.max_requests = max_requests
        self.temperature = temperature
        self.ignore_eos = ignore_eos
        self.adaptive = adaptive
        self.target_in_flight = float(target_in_flight)
        self.sent = self.completed = self.failed = self.aborted = 0
        self.measured_per_s = 0.0  # completions/s at the last adaptive update (0: none yet)
        self.last_error = ""
        if prompts is not None:
            self._prompts = iter(prompts)
        else:
            self._prompts = (_plugin_prompts(kind) if use_plugins else None) or make_prompts(kind, seed)
        self._ids = ids if ids is not None else itertools.count(1)
        self._rids: set[str] = set()
        self._stop = threading.Event()
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # The active clock: monotonic time minus time spent paused.
        self._clock_lock = threading.Lock()
        self._paused_total = 0.0
        self._paused_at: float | None = self._clock_s() if paused else None
        self._t0 = self._active_now()
        self._done_at: collections.deque[float] = collections.deque()

    @property
    def in_flight(self) -> int:
        return len(self._rids)

    @property
    def paused(self) -> bool:
        return self._paused_at is not None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"workload-{self.label}", daemon=True)
        self._thread.start()

    def set_rate(self, rate: float) -> None:
        """A fixed runner's rate; an adaptive runner starts its next update from it."""
        self.rate = min(MAX_RATE, max(MIN_RATE, float(rate)))
        self._poke()

    def set_target(self, target_in_flight: float) -> None:
        """An adaptive runner's target: how many requests it keeps in the engine."""
        self.target_in_flight = max(1.0, float(target_in_flight))
        self._poke()

    def pause(self) -> None:
        """Hold arrivals back until `resume()` (requests in flight go on)."""
        with self._clock_lock:
            if self._paused_at is None:
                self._paused_at = self._clock_s()
        self._poke()

    def resume(self) -> None:
        with self._clock_lock:
            if self._paused_at is not None:
                self._paused_total += self._clock_s() - self._paused_at
                self._paused_at = None
        self._poke()

    def done_per_s(self) -> float:
        """Requests completed per second over the last RATE_WINDOW_S of unpaused time (0: none yet)."""
        now = self._active_now()
        done = self._done_at
        while done and done[0] < now - RATE_WINDOW_S:
            done.popleft()
        span = min(RATE_WINDOW_S, now - self._t0)
        return len(done) / span if span > 0.5 else 0.0

    def stop(self, timeout: float = 5.0) -> int:
        """Stop sending, abort what is in flight, and join the thread; returns how many were aborted."""
        self._stop.set()
        self._poke()
        rids = list(self._rids)
        for rid in rids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
        self.aborted += len(rids)
        if self._thread is not None:
            self._thread.join(timeout)
        return len(rids)

    # ---- the thread -------------------------------------------------------------
    def _poke(self) -> None:
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass  # the loop already closed

    def _clock_s(self) -> float:
        return self._sim.now_ns() / 1e9 if self._sim is not None else time.monotonic()

    def _announce(self, due: float | None) -> None:
        """Tell a simulated deployment when the next request comes (active time; None: not sure one does)."""
        if self._sim is not None:
            ok = due is not None and math.isfinite(due) and not self.paused and not self._stop.is_set()
            self._sim.announce(math.ceil((due + self._paused_total) * 1e9) if ok else None)

    def _active_now(self) -> float:
        with self._clock_lock:
            now = self._clock_s()
            held = self._paused_total + (now - self._paused_at if self._paused_at is not None else 0.0)
        return now - held

    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run())
        finally:
            loop.close()

    def _next_request(self) -> tuple[str, dict]:
        item = next(self._prompts)
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature}
        if self.ignore_eos:
            params["ignore_eos"] = True
        prefix = _SHORT.get(self.kind, self.kind)
        if isinstance(item, dict) and ("prompt" in item or "messages" in item or "input_ids" in item):
            params.update(item.get("sampling_params") or {})
            prefix = item.get("rid_prefix") or prefix
            item = item.get("messages") or item.get("input_ids") or item.get("prompt")
        elif hasattr(item, "prompt"):
            params.update(getattr(item, "sampling_params", None) or {})
            item = item.prompt
        rid = f"{prefix}-{next(self._ids)}"
        if isinstance(item, list) and item and isinstance(item[0], dict):
            # As text (not ids) so the trace carries a readable prompt preview.
            return rid, {"prompt": chat_text(self.engine, item), "sampling_params": params}
        if isinstance(item, list):
            return rid, {"input_ids": item, "sampling_params": params}
        return rid, {"prompt": str(item), "sampling_params": params}

    async def _one(self, rid: str, kwargs: dict) -> None:
        try:
            await self.engine.async_generate(rid=rid, **kwargs)
            self.completed += 1
            self._done_at.append(self._active_now())
        except Exception as exc:  # aborted on stop, engine gone, bad input
            self.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._rids.discard(rid)
            if self._wake is not None:
                self._wake.set()  # room for a waiting burst

    def _how_many(self) -> int:
        """How many to send now: a whole burst (or one request) if the limits allow it, else 0."""
        n = self.burst_size if self.kind == "burst" else 1
        if self.max_requests is not None:
            n = min(n, self.max_requests - self.sent)
        if n <= 0 or self.in_flight + n > self.max_in_flight:
            return 0
        return n

    def _send(self, n: int, tasks: set) -> None:
        for _ in range(n):
            try:
                rid, kwargs = self._next_request()
            except Exception as exc:
                self.failed += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                return
            self._dispatch(rid, kwargs, tasks)

    def _dispatch(self, rid: str, kwargs: dict, tasks: set) -> None:
        """Send one request as a task kept in `tasks` until it ends (counted as sent)."""
        self._rids.add(rid)
        self.sent += 1
        t = asyncio.ensure_future(self._one(rid, kwargs))
        tasks.add(t)
        t.add_done_callback(tasks.discard)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        last_send = -math.inf  # active time of the last send: the first goes at once ...
        if self._sim is not None:  # ... but on a simulated clock one period in, announced like the rest
            last_send = self._active_now()
        last_adapt = self._active_now()
        while not self._stop.is_set():
            self._wake.clear()
            if self.paused:
                self._announce(None)
                await self._sleep(ADAPT_PERIOD_S)
                continue
            now = self._active_now()
            if self.adaptive and now - last_adapt >= ADAPT_PERIOD_S:
                self.measured_per_s = self.done_per_s()
                self.rate = adapt_rate(self.rate, self.measured_per_s, self.in_flight, self.target_in_flight)
                last_adapt = now
            per = (self.burst_size if self.kind == "burst" else 1) / self.rate
            due = last_send + per
            if now >= due - 1e-9:  # a nanosecond's slack: a simulated clock stops exactly at an announced due
                n = self._how_many()
                if n:
                    noted = self._sim.sent() + n if self._sim is not None else 0
                    self._send(n, tasks)
                    await self._until_noted(noted)
                    last_send = now
                    due = now + per
                else:
                    due = now + ADAPT_PERIOD_S  # at a limit: a completion (or stop) wakes us
            # Never sleep past an adaptive update (a rate of 0.05/s would otherwise wait 20 s).
            wait = min(due - now, ADAPT_PERIOD_S) if self.adaptive else due - now
            # Only an arrival that will come: a send is allowed and this sleep ends at it.
            self._announce(due if self._how_many() and due - now <= wait + 1e-9 else None)
            await self._sleep(wait)
        self._announce(None)
        if tasks:
            # Aborted requests finish quickly; do not wait forever on a dead engine.
            await asyncio.wait(tasks, timeout=3.0)
            for t in tasks:
                t.cancel()

    async def _until_noted(self, sent: int) -> None:
        """A simulated deployment: wait (1 s at most) until the tokenizer manager has taken what was just
        sent, so the next arrival is announced only then (the scheduler holds time for this one)."""
        deadline = time.monotonic() + 1.0
        while self._sim is not None and self._sim.sent() < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.0005)

    async def _sleep(self, seconds: float) -> None:
        if self._sim is not None and not self.paused:  # simulated seconds: 1/speed of it, checking often
            seconds = min(seconds / self._speed, 0.002)
        try:
            await asyncio.wait_for(self._wake.wait(), timeout=max(0.0, seconds))
        except asyncio.TimeoutError:
            pass


_HELP = {
    "chat": "short, unrelated questions",
    "shared-prefix": "one long system prompt + different questions (one shared radix node, many children)",
    "long-prompt": "prompts long enough to be prefilled in chunks",
    "burst": "groups of requests at once (with a small --max-total-tokens: retraction)",
}


class _BuiltinWorkload:
    def __init__(self, kind: str, seed: int = 0):
        self.kind, self.seed = kind, seed

    def requests(self) -> Iterator[Any]:
        return make_prompts(self.kind, self.seed)


def register_builtin(registry) -> None:
    """The built-in workloads, registered through the plugin host like any other."""
    for kind in KINDS:
        registry.add_workload(kind, lambda _k=kind, **kw: _BuiltinWorkload(_k, **kw), help=_HELP[kind])
