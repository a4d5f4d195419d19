"""Prometheus metrics with SGLang's names, folded from the engine's trace events.

`ServerMetrics` subscribes a callback on the engine's trace bus (which also
switches the child processes' tracers on) and folds the same events the TUI
sees into counters, gauges and histograms:

- `req.finished` -> prompt/generation/cached token counters, request count,
  TTFT / inter-token latency / E2E histograms (ITL: the request's mean time per
  output token, observed once per inter-token gap);
- `batch.step` -> recent decode tokens, for `gen_throughput` (tokens/s over the
  last `throughput_window_s` seconds);
- `queue.state` -> `num_running_reqs`, `num_queue_reqs`;
- `kv.usage` -> `num_used_tokens`, `token_usage`; with HiCache `hicache_host_used_tokens` and
  `hicache_host_total_tokens` (the host pool, as dashboards read them from SGLang);
- `req.aborted` -> `num_aborted_requests_total` (and `num_requests_total`; once per rid);
- `hicache.transfer` -> `load_back_tokens_total` (host -> device), `prefetched_tokens_total`
  (storage -> host) and `backuped_tokens_total` (-> storage), SGLang's names, and
  `hicache_host_write_tokens_total` (device -> host, ours);
- `req.queued` with an adapter (--enable-lora) -> `num_lora_requests_total{lora_name=...}`;
- `req.retracted` -> `num_retracted_reqs`; `cache.evict` -> `evicted_tokens_total`;
  a retraction that was a priority preemption (--enable-priority-scheduling) also counts in
  `num_priority_preempted_reqs_total{priority=...}`, by the preempted request's priority.

`cache_hit_rate` is cached_tokens_total / prompt_tokens_total (cumulative), so
it does not drop to 0 while the engine decodes. Exposed with a private
`CollectorRegistry` (one per server, so several apps in one process never
clash); `render()` gives the text format for `GET /metrics`.
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict, deque
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev
from workbench.core.trace.views import format_priority

PREFIX = "sglang:"

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 600.0)


class _Histogram:
    """Cumulative bucket counts that can take k observations of one value at once."""

    def __init__(self, buckets: Iterable[float]):
        self.bounds = tuple(sorted(buckets))
        self.counts = [0] * (len(self.bounds) + 1)  # last slot: +Inf
        self.sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        if count <= 0 or value != value:  # NaN never lands anywhere
            return
        self.counts[bisect.bisect_left(self.bounds, value)] += count
        self.sum += value * count

    def family(self, name: str, doc: str, labels: dict[str, str]) -> HistogramMetricFamily:
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        acc, buckets = 0, []
        for bound, c in zip(self.bounds + (float("inf"),), self.counts):
            acc += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        fam.add_metric(list(labels.values()), buckets, self.sum)
        return fam


class ServerMetrics:
    """Folds trace event batches into SGLang-named Prometheus metrics; see the module docstring."""

    def __init__(
        self,
        model_name: str,
        *,
        throughput_window_s: float = 10.0,
        max_remembered_rids: int = 50_000,
        labels: dict[str, str] | None = None,
    ):
        self.clock: trace_clock.TraceClock = trace_clock.TraceClock()  # attach() takes the engine's
        # Every series carries model_name and the deployment's own labels (a simulated one's
        # simulated="h100x8": scheduler_contract.Deployment.metric_labels).
        self.labels = {"model_name": model_name, **(labels or {})}
        self.window_ns = int(throughput_window_s * 1e9)
        self._lock = threading.Lock()
        self._finished: OrderedDict[str, None] = OrderedDict()  # dedupe req.finished per rid
        self._max_rids = max_remembered_rids
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.cached_tokens = 0
        self.num_requests = 0
        self.num_aborted = 0
        self.num_retracted = 0
        self.preempted_by_priority: dict[str, int] = {}  # priority preemptions, by the victim's priority
        self.requests_by_lora: dict[str, int] = {}  # multi-LoRA: requests queued, by adapter
        self.evicted_tokens = 0
        # HiCache (hicache.transfer), tokens by kind: load_back, write_through/write_back (to host),
        # prefetch (from storage), storage_write
        self.hicache_tokens: dict[str, int] = {}
        self.dropped_events = 0
        self.spec_verified = 0  # speculative decoding: (request, step) pairs that verified drafts ...
        self.spec_proposed = 0
        self.spec_accepted = 0  # ... and the drafts they kept
        self._queues: dict[str, ev.QueueState] = {}
        self._kv: dict[str, ev.KVUsage] = {}
        self._decode_steps: deque[tuple[int, int]] = deque(maxlen=100_000)  # (ts, decode tokens)
        self.ttft = _Histogram(TTFT_BUCKETS)
        self.itl = _Histogram(ITL_BUCKETS)
        self.e2e = _Histogram(E2E_BUCKETS)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self._handle: Any = None

    # ---- input ----------------------------------------------------------------

    def attach(self, engine: Any) -> None:
        """Subscribe to the engine's trace (switches tracing on for the server's lifetime)."""
        self.clock = getattr(engine, "clock", self.clock)  # the events' clock (simulated time, if so)
        sub = getattr(engine, "subscribe_callback", None)
        if sub is not None:
            self._handle = sub(self.on_events)
        else:
            self._handle = engine.bus.subscribe_callback(self.on_events, name="http-metrics")

    def close(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            try:
                h.close()
            except Exception:  # noqa: BLE001 - the bus may already be gone at shutdown
                pass

    def on_events(self, batch: list[ev.Event]) -> None:
        """Bus callback (runs on the bus thread)."""
        with self._lock:
            for e in batch:
                t = type(e)
                if t is ev.BatchStep:
                    dec = sum(r.decode for r in e.reqs)
                    if dec:
                        self._decode_steps.append((e.ts, dec))
                elif t is ev.ReqFinished:
                    self._on_finished(e)
                elif t is ev.QueueState:
                    old = self._queues.get(e.proc)
                    if old is None or old.ts <= e.ts:
                        self._queues[e.proc] = e
                elif t is ev.KVUsage:
                    old = self._kv.get(e.proc)
                    if old is None or old.ts <= e.ts:
                        self._kv[e.proc] = e
                elif t is ev.ReqQueued:
                    if e.lora:
                        self.requests_by_lora[e.lora] = self.requests_by_lora.get(e.lora, 0) + 1
                elif t is ev.ReqAborted:
                    self._on_aborted(e.rid)
                elif t is ev.ReqRetracted:
                    self.num_retracted += 1
                    if e.reason:  # a priority preemption
                        key = format_priority(e.priority)
                        self.preempted_by_priority[key] = self.preempted_by_priority.get(key, 0) + 1
                elif t is ev.CacheEvict:
                    self.evicted_tokens += e.tokens
                elif t is ev.HiCacheTransfer:
                    self.hicache_tokens[e.what] = self.hicache_tokens.get(e.what, 0) + e.tokens
                elif t is ev.TraceDropped:
                    self.dropped_events += e.count
                elif t is ev.SpecVerify and not e.snapshot:
                    kept = sum(r.accepted for r in e.reqs)
                    self.spec_verified += sum(r.verified for r in e.reqs)
                    self.spec_proposed += sum(len(r.drafts) if r.proposed < 0 else r.proposed for r in e.reqs)
                    self.spec_accepted += kept
                    if kept:  # tokens beyond the step's one per request
                        self._decode_steps.append((e.ts, kept))

    def _remember(self, rid: str) -> bool:
        """False when this rid was already counted."""
        if rid in self._finished:
            return False
        self._finished[rid] = None
        if len(self._finished) > self._max_rids:
            self._finished.popitem(last=False)
        return True

    def _on_aborted(self, rid: str) -> None:
        # A client that went away: the tokenizer manager has already dropped the request,
        # so the scheduler's req.aborted is the only event that tells.
        if self._remember(rid):
            self.num_requests += 1
            self.num_aborted += 1

    def _on_finished(self, e: ev.ReqFinished) -> None:
        if not self._remember(e.rid):
            return
        self.num_requests += 1
        self.prompt_tokens += e.prompt_tokens
        self.generation_tokens += e.completion_tokens
        self.cached_tokens += e.cached_tokens
        if e.reason == "abort":
            self.num_aborted += 1
            return
        self.ttft.observe(e.ttft)
        self.e2e.observe(e.e2e)
        if e.completion_tokens > 1:
            self.itl.observe(e.tpot, e.completion_tokens - 1)

    # ---- derived values ---------------------------------------------------------

    @property
    def cache_hit_rate(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def gen_throughput(self, now_ns: int | None = None) -> float:
        """Decode tokens/s over the last window (0 when idle for a whole window)."""
        now = self.clock.now_ns() if now_ns is None else now_ns
        lo = now - self.window_ns
        total = sum(n for ts, n in self._decode_steps if lo < ts <= now)
        return total / (self.window_ns / 1e9)

    def loads(self) -> list[dict[str, int]]:
        """SGLang's /get_load: per data-parallel rank, requests (running + waiting), the waiting
        ones, and KV tokens in use (what sglang-router's power_of_two policy compares)."""
        with self._lock:
            procs = sorted(set(self._queues) | set(self._kv)) or ["scheduler"]
            out = []
            for proc in procs:
                q, kv = self._queues.get(proc), self._kv.get(proc)
                rank = proc.rsplit(".dp", 1)[1] if ".dp" in proc else "0"
                waiting = len(q.waiting) if q is not None else 0
                out.append(
                    {
                        "dp_rank": int(rank) if rank.isdigit() else 0,
                        "num_reqs": waiting + (len(q.running) if q is not None else 0),
                        "num_waiting_reqs": waiting,
                        "num_tokens": kv.used if kv is not None else 0,
                    }
                )
            return out

    def snapshot(self) -> dict[str, float]:
        """The current values by short name (for tests and /get_server_info)."""
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> dict[str, float]:
        running = sum(len(q.running) for q in self._queues.values())
        waiting = sum(len(q.waiting) for q in self._queues.values())
        used = sum(k.used for k in self._kv.values())
        total = sum(k.total for k in self._kv.values())
        return {
            "num_running_reqs": running,
            "num_queue_reqs": waiting,
            "num_used_tokens": used,
            "token_usage": used / total if total else 0.0,
            "hicache_host_used_tokens": sum(k.host_used for k in self._kv.values()),
            "hicache_host_total_tokens": sum(k.host_total for k in self._kv.values()),
            "gen_throughput": self.gen_throughput(),
            "cache_hit_rate": self.cache_hit_rate,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generation_tokens,
            "cached_tokens_total": self.cached_tokens,
            "num_requests_total": self.num_requests,
            "num_aborted_requests_total": self.num_aborted,
            "num_retracted_reqs": self.num_retracted,
            "evicted_tokens_total": self.evicted_tokens,
            "load_back_tokens_total": self.hicache_tokens.get("load_back", 0),
            "hicache_host_write_tokens_total": self.hicache_tokens.get("write_through", 0)
            + self.hicache_tokens.get("write_back", 0),
            "prefetched_tokens_total": self.hicache_tokens.get("prefetch", 0),
            "backuped_tokens_total": self.hicache_tokens.get("storage_write", 0),
            "trace_dropped_events_total": self.dropped_events,
            "spec_accept_length": (self.spec_accepted + self.spec_verified) / self.spec_verified
            if self.spec_verified
            else 0.0,
            "spec_verify_total": self.spec_verified,
            "spec_draft_tokens_total": self.spec_proposed,
            "spec_accepted_tokens_total": self.spec_accepted,
        }

    # ---- prometheus -------------------------------------------------------------

    def collect(self):
        """prometheus_client Collector protocol: called on every scrape.

        Values and histograms are read under one lock hold, so a scrape never shows a request
        counted in `num_requests_total` but missing from the latency histograms."""
        with self._lock:
            s = self._snapshot_locked()
            preempted = dict(self.preempted_by_priority)
            by_lora_counts = dict(self.requests_by_lora)
            histograms = [
                self.ttft.family(PREFIX + "time_to_first_token_seconds", "Time to first token.", self.labels),
                self.itl.family(PREFIX + "inter_token_latency_seconds", "Time between output tokens.", self.labels),
                self.e2e.family(PREFIX + "e2e_request_latency_seconds", "End-to-end request latency.", self.labels),
            ]
        names, values = list(self.labels), list(self.labels.values())

        def gauge(short, doc):
            g = GaugeMetricFamily(PREFIX + short, doc, labels=names)
            g.add_metric(values, float(s[short]))
            return g

        def counter(short, doc):
            # CounterMetricFamily appends _total itself.
            c = CounterMetricFamily(PREFIX + short.removesuffix("_total"), doc, labels=names)
            c.add_metric(values, float(s[short]))
            return c

        yield gauge("num_running_reqs", "Requests in the running batch.")
        yield gauge("num_queue_reqs", "Requests waiting in the scheduler's queue.")
        yield gauge("num_used_tokens", "KV cache slots held by requests.")
        yield gauge("token_usage", "Fraction of the KV cache held by requests.")
        if s["hicache_host_total_tokens"]:  # HiCache on
            yield gauge("hicache_host_used_tokens", "HiCache: host-pool tokens held by the radix tree.")
            yield gauge("hicache_host_total_tokens", "HiCache: host-pool size in tokens.")
        yield gauge("gen_throughput", "Decode throughput (tokens/s) over the recent window.")
        yield gauge("cache_hit_rate", "Prefix cache hit rate: cached_tokens_total / prompt_tokens_total.")
        yield gauge("num_retracted_reqs", "Requests retracted (preempted) since the server started.")
        yield counter("prompt_tokens_total", "Prompt tokens of finished requests.")
        yield counter("generation_tokens_total", "Generated tokens of finished requests.")
        yield counter("cached_tokens_total", "Prompt tokens served from the prefix cache.")
        yield counter("num_requests_total", "Finished requests (aborted ones included).")
        yield counter("num_aborted_requests_total", "Aborted requests.")
        yield counter("evicted_tokens_total", "Tokens evicted from the radix cache.")
        yield counter("load_back_tokens_total", "HiCache: tokens loaded back from the host tier for a match.")
        yield counter("hicache_host_write_tokens_total", "HiCache: tokens written from the device to the host tier.")
        yield counter("prefetched_tokens_total", "HiCache: tokens prefetched from the storage tier for a match.")
        yield counter("backuped_tokens_total", "HiCache: tokens written to the storage tier.")
        yield counter("trace_dropped_events_total", "Trace events lost before reaching the metrics.")
        by_priority = CounterMetricFamily(
            PREFIX + "num_priority_preempted_reqs",
            "Priority scheduling: running requests preempted for a more urgent one, by their priority.",
            labels=names + ["priority"],
        )
        for prio, n in sorted(preempted.items()):
            by_priority.add_metric(values + [prio], float(n))
        yield by_priority
        by_lora = CounterMetricFamily(
            PREFIX + "num_lora_requests",
            "Multi-LoRA: requests queued under each LoRA adapter (the base model's are not counted).",
            labels=names + ["lora_name"],
        )
        for name, n in sorted(by_lora_counts.items()):
            by_lora.add_metric(values + [name], float(n))
        yield by_lora
        yield gauge(
            "spec_accept_length",
            "Speculative decoding: tokens a request gains per verify step (1 + accepted drafts), on average.",
        )
        yield counter("spec_verify_total", "Speculative decoding: (request, step) pairs that verified drafts.")
        yield counter("spec_draft_tokens_total", "Speculative decoding: draft tokens proposed.")
        yield counter("spec_accepted_tokens_total", "Speculative decoding: draft tokens accepted.")
        yield from histograms

    def render(self) -> bytes:
        return generate_latest(self.registry)
