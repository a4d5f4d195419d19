"""Workloads for demos, recordings and benchmarks: generated prompts sent to an engine at a rate.

Kinds (`--workload`): "chat" (short, unrelated questions), "shared-prefix"
(one long system prompt + different questions: the radix tree grows one
shared node with many children), "long-prompt" (prompts long enough to be
prefilled in chunks) and "burst" (groups of requests at once, same mean rate).

If a plugin registered a workload of that name (registry "workload"), its
`requests()` items are used as prompts instead of the generators here. The
runner owns one daemon thread with its own asyncio loop and calls
`engine.async_generate`, so hundreds of requests can be in flight cheaply.
"""
from __future__ import annotations

import asyncio
import itertools
import random
import threading
from typing import Any, Iterator, Optional

KINDS = ("chat", "shared-prefix", "long-prompt", "burst")
_SHORT = {"chat": "chat", "shared-prefix": "sp", "long-prompt": "long", "burst": "burst"}

# The first few start with different words, so N shared-prefix requests branch N ways.
_QUESTIONS = [
    "What is a radix tree?", "Name three prime numbers.", "Why is the sky blue?",
    "Explain batching in one sentence.", "How do bees make honey?", "Write a haiku about caches.",
    "Give me a fun fact about octopuses.", "Describe the color green.", "Suggest a name for a cat.",
    "What does a scheduler do?", "What is the capital of France?", "What is 12 times 12?",
    "Why do we sleep?", "What is a token?", "How far is the Moon?", "What is recursion?",
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


def chat_text(engine: Any, messages: list[dict]) -> str:
    """The chat template applied as text (falls back to decoding the template's ids)."""
    tok = getattr(engine, "tokenizer", None)
    try:
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:
        return tok.decode(engine.apply_chat_template(messages))


def _plugin_prompts(kind: str) -> Optional[Iterator[Any]]:
    try:
        from workbench.plugins import load_plugins
        spec = load_plugins().workloads.get(kind)
        if spec is None:
            return None
        return iter(spec.factory().requests())
    except Exception:
        return None


class WorkloadRunner:
    """Sends requests of one kind at `rate` per second until `stop()`.

    Attributes `sent`, `completed`, `failed`, `in_flight` and `last_error` let
    the UI (and tests) see what it is doing. `max_requests` stops sending after
    that many (the thread idles until `stop()`).
    """

    def __init__(self, engine: Any, kind: str = "chat", rate: float = 1.0, *, max_new_tokens: int = 32,
                 seed: int = 0, burst_size: int = 8, max_in_flight: int = 256, use_plugins: bool = True,
                 max_requests: Optional[int] = None, temperature: float = 0.7):
        if kind not in KINDS and (not use_plugins or _plugin_prompts(kind) is None):
            raise ValueError(f"unknown workload {kind!r}; choose one of {', '.join(KINDS)}")
        self.engine = engine
        self.kind = kind
        self.rate = max(0.05, float(rate))
        self.max_new_tokens = max_new_tokens
        self.burst_size = burst_size
        self.max_in_flight = max_in_flight
        self.max_requests = max_requests
        self.temperature = temperature
        self.sent = self.completed = self.failed = 0
        self.last_error = ""
        self._prompts = (_plugin_prompts(kind) if use_plugins else None) or make_prompts(kind, seed)
        self._ids = itertools.count(1)
        self._rids: set[str] = set()
        self._stop = threading.Event()
        self._wake: Optional[asyncio.Event] = None
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    @property
    def in_flight(self) -> int:
        return len(self._rids)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name=f"workload-{self.kind}", daemon=True)
        self._thread.start()

    def set_rate(self, rate: float) -> None:
        self.rate = max(0.05, float(rate))
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop sending, abort what is in flight, and join the thread."""
        self._stop.set()
        if self._loop is not None and self._wake is not None:
            try:
                self._loop.call_soon_threadsafe(self._wake.set)
            except RuntimeError:
                pass       # the loop already closed
        for rid in list(self._rids):
            try:
                self.engine.abort_request(rid)
            except Exception:
                pass
        if self._thread is not None:
            self._thread.join(timeout)

    # ---- the thread -------------------------------------------------------------
    def _main(self) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._run())
        finally:
            loop.close()

    def _next_request(self) -> tuple[str, dict]:
        item = next(self._prompts)
        params = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature}
        if isinstance(item, dict) and ("prompt" in item or "messages" in item or "input_ids" in item):
            params.update(item.get("sampling_params") or {})
            item = item.get("messages") or item.get("input_ids") or item.get("prompt")
        elif hasattr(item, "prompt"):
            params.update(getattr(item, "sampling_params", None) or {})
            item = item.prompt
        rid = f"{_SHORT.get(self.kind, self.kind)}-{next(self._ids)}"
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
        except Exception as exc:          # aborted on stop, engine gone, bad input
            self.failed += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
        finally:
            self._rids.discard(rid)

    async def _run(self) -> None:
        self._wake = asyncio.Event()
        tasks: set[asyncio.Task] = set()
        while not self._stop.is_set():
            n = self.burst_size if self.kind == "burst" else 1
            for _ in range(n):
                if self.in_flight >= self.max_in_flight or (
                        self.max_requests is not None and self.sent >= self.max_requests):
                    break
                try:
                    rid, kwargs = self._next_request()
                except Exception as exc:
                    self.failed += 1
                    self.last_error = f"{type(exc).__name__}: {exc}"
                    break
                self._rids.add(rid)
                self.sent += 1
                t = asyncio.ensure_future(self._one(rid, kwargs))
                tasks.add(t)
                t.add_done_callback(tasks.discard)
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=n / self.rate)
            except asyncio.TimeoutError:
                pass
        if tasks:
            # Aborted requests finish quickly; do not wait forever on a dead engine.
            await asyncio.wait(tasks, timeout=3.0)
            for t in tasks:
                t.cancel()


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


def record_workload(args) -> int:
    """`workbench record`: run `args.num_requests` of a workload and write the trace as JSONL."""
    import time

    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.trace.recorder import Recorder

    sa = ServerArgs.from_cli_args(args)
    sa.record = None
    with Engine(server_args=sa) as engine:
        recorder = Recorder(args.output, model=engine.served_model_name)
        handle = engine.bus.subscribe_callback(recorder, name="recorder", with_snapshot=True)
        runner = WorkloadRunner(engine, args.workload, args.rate, max_new_tokens=args.max_new_tokens,
                                max_requests=args.num_requests, temperature=0.0)
        runner.start()
        t0 = time.monotonic()
        while runner.completed + runner.failed < args.num_requests:
            time.sleep(0.2)
            done = runner.completed + runner.failed
            print(f"\r[record] {done}/{args.num_requests} requests done", end="", flush=True)
        print()
        runner.stop()
        time.sleep(0.5)             # let the last events reach the bus
        handle.close()
        recorder.close()
    print(f"wrote {args.output}: {runner.completed} requests in {time.monotonic() - t0:.1f} s "
          f"({runner.failed} failed)")
    return 0 if runner.failed == 0 else 1
