"""The real Scheduler over a cost model, on a simulated clock (issue #19).

    sim = Simulator("llama-3.1-70b", "h100", tp_size=8, schedule_policy="lpm")
    result = sim.run(poisson_workload(rate=20, n=1000, prompt_len=(256, 2048), output_len=(64, 512)))
    print(result.summary())

The Scheduler is the one `run_scheduler_process` builds (admission, every policy, chunked prefill,
the radix cache, retraction), constructed in-process and handed a `SimWorker` as its model worker
(scheduler_contract.ModelWorker; the simulator composes a Scheduler, it never subclasses it): a
pass computes nothing, samples its tokens from a seeded generator, and advances the
`SimClock` by the time `CostModel` predicts for the pass's shape. The driver feeds each request
when the simulated clock reaches its arrival time and jumps the clock over idle gaps, so a run
takes the scheduler's own Python time, not the deployment's. Every time reported (TTFT, TPOT,
latency, throughput, the trace's timestamps) is simulated time.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from workbench.core.args import ServerArgs
from workbench.core.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from workbench.core.managers.scheduler import Scheduler
from workbench.core.managers.scheduler_contract import (
    ListIO,
)
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.simulation import calibration as calibrations
from workbench.core.simulation.calibration import Calibration
from workbench.core.simulation.cost_model import CostModel
from workbench.core.simulation.hardware import get_hardware
from workbench.core.simulation.model_specs import ModelSpec, model_spec
from workbench.core.simulation.sim_worker import (
    FIRST_TOKEN,
    NoTokenizer,
    SimClock,
    SimOverlapClient,
    SimWorker,
    make_drafter,
    sim_runner,
)
from workbench.core.trace.events import ReqArrived, ReqDispatched, ReqFinished, ReqFirstToken, ReqTokenized
from workbench.core.trace.tracer import Tracer


def default_dtype_bytes(calibration: Calibration | None, hardware: str) -> int:
    """Bytes per weight/KV element: the calibrated engine's dtype; else bfloat16 on GPUs, float32 on CPU."""
    measured = calibration.meta.get("dtype_bytes") if calibration is not None else None
    return int(measured) if measured else (4 if hardware == "cpu-here" else 2)


@dataclass
class SimRequest:
    """One request of a workload: when it arrives, its prompt and output lengths, and optionally a
    shared-prefix group (requests of a group start with the same `prefix_len` tokens)."""

    arrival: float
    prompt_len: int
    output_len: int
    group: int | None = None
    prefix_len: int = 0
    prompt_ids: list[int] | None = None  # the prompt itself (else drawn: `request_prompt`)
    output_ids: list[int] | None = None  # the tokens to return in turn (a recorded run's), else sampled
    # a recorded run's speculative drafts, by the output length they followed (with output_ids)
    drafts: dict[int, list[int]] | None = None
    priority: int | None = None  # priority scheduling (enable_priority_scheduling): the request's priority


def request_prompt(i: int, r: SimRequest, seed: int, vocab: int) -> list[int]:
    """Request i's prompt: its own `prompt_ids`, else ids drawn from [3, vocab) by `seed`, the
    group's shared prefix first (the same ids for every request of the group)."""
    if r.prompt_ids is not None:
        return list(r.prompt_ids)
    shared = min(r.prefix_len, r.prompt_len) if r.group is not None else 0
    own = np.random.default_rng(seed * 1_000_003 + i).integers(FIRST_TOKEN, vocab, r.prompt_len - shared)
    if not shared or r.group is None:
        return own.tolist()
    prefix = np.random.default_rng(seed * 7919 + 104729 * (r.group + 1)).integers(FIRST_TOKEN, vocab, shared)
    return prefix.tolist() + own.tolist()


@dataclass
class SimResult:
    hardware: str
    model: str
    tp_size: int
    kv_pool_tokens: int
    wall_s: float  # real seconds the simulation took
    sim_s: float  # simulated seconds from the first arrival to the last token
    ttft: dict[str, float] = field(default_factory=dict)
    latency: dict[str, float] = field(default_factory=dict)
    tpot: dict[str, float] = field(default_factory=dict)
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    peak_kv_used: int = 0
    steps: int = 0
    retracted: int = 0
    dp_size: int = 1
    per_replica_requests: list[int] = field(default_factory=list)  # requests each replica served
    outputs: dict[str, list[int]] = field(default_factory=dict)  # the tokens of requests given output_ids
    spec_proposed: int = 0  # speculative decoding: drafts proposed ...
    spec_accepted: int = 0  # ... and kept
    priority_of: dict[str, int] = field(default_factory=dict)  # priority scheduling: each rid's priority
    preempted: int = 0  # ... running requests preempted for more urgent ones (in `retracted` too; -1 unknown)
    hicache: bool = False  # HiCache on: the host tier's figures below are reported
    host_hit_tokens: int = 0  # prompt tokens loaded back from the host tier instead of recomputed
    hicache_s: float = 0.0  # simulated time the passes were charged for HiCache copies
    prefetch_tokens: int = 0  # ... of host_hit_tokens, those first prefetched from the storage tier

    @property
    def deployment(self) -> str:
        """'h100x8', or 'h100x8 (dp 2 x tp 4)' with data parallelism."""
        devices = f"{self.hardware}x{self.tp_size * self.dp_size}"
        return devices if self.dp_size == 1 else f"{devices} (dp {self.dp_size} x tp {self.tp_size})"

    def _pct(self, values: dict[str, float], q: float) -> float:
        v = sorted(values.values())
        return v[min(len(v) - 1, int(q * len(v)))] if v else float("nan")

    def metrics(self) -> dict[str, float]:
        return {
            "requests": len(self.latency),
            "output_tok_s": self.output_tokens / self.sim_s if self.sim_s else 0.0,
            "ttft_p50_ms": 1000 * self._pct(self.ttft, 0.5),
            "ttft_p99_ms": 1000 * self._pct(self.ttft, 0.99),
            "tpot_p50_ms": 1000 * self._pct(self.tpot, 0.5),
            "tpot_p99_ms": 1000 * self._pct(self.tpot, 0.99),
            "cache_hit_rate": self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
            "peak_kv_frac": self.peak_kv_used / self.kv_pool_tokens if self.kv_pool_tokens else 0.0,
            "retracted": self.retracted,
            "steps": self.steps,
        }

    def _priority_summary(self) -> str:
        """Priority scheduling: TTFT p50 per priority (most urgent first as given) and the preemptions."""
        if not self.priority_of:
            return ""
        parts = []
        for prio in sorted(set(self.priority_of.values()), reverse=True):
            ttft = {rid: v for rid, v in self.ttft.items() if self.priority_of.get(rid) == prio}
            parts.append(f"{prio}: {1000 * self._pct(ttft, 0.5):.0f} ms ({len(ttft)})")
        preempted = f"; {self.preempted} preempted" if self.preempted >= 0 else ""
        return f"; TTFT p50 by priority {', '.join(parts)}{preempted}"

    def summary(self) -> str:
        m = self.metrics()
        return (
            f"SIMULATED {self.deployment}, {self.model}: {m['requests']} requests in {self.sim_s:.1f} "
            f"simulated s ({self.wall_s:.1f} s real, {m['steps']} steps); {m['output_tok_s']:.0f} output tok/s; "
            f"TTFT p50 {m['ttft_p50_ms']:.0f} ms p99 {m['ttft_p99_ms']:.0f} ms; TPOT p50 {m['tpot_p50_ms']:.1f} ms "
            f"p99 {m['tpot_p99_ms']:.1f} ms; cache hit {m['cache_hit_rate']:.0%}; peak KV {m['peak_kv_frac']:.0%} of "
            f"{self.kv_pool_tokens} tokens; {m['retracted']} retracted"
            + (f"; requests per replica {self.per_replica_requests}" if self.dp_size > 1 else "")
            + self._priority_summary()
            + (
                f"; HiCache: {self.host_hit_tokens} tokens loaded back from host"
                + (f" ({self.prefetch_tokens} prefetched from storage)" if self.prefetch_tokens else "")
                + f", copies {1000 * self.hicache_s:.1f} ms of the passes"
                if self.hicache
                else ""
            )
            + (
                f"; drafts kept {self.spec_accepted} of {self.spec_proposed} "
                f"({self.spec_accepted / self.spec_proposed:.0%})"
                if self.spec_proposed
                else ""
            )
        )


class SimFrontEnd:
    """The simulated deployment's front end: what the tokenizer manager knows and stamps in a real
    engine (traced as "tokenizer", on simulated time). A request is sent at its arrival
    (`req.arrived`, `req.tokenized`); its tokens reach the client `tm_out_s` after the step that
    sampled them (`req.first_token`, then `req.finished` with its TTFT, TPOT and latency). It keeps
    the figures `SimResult` reports, so a recording and the summary are the same numbers, and a
    replay of the recording shows what a live run's does (TTFT, latency, finished requests)."""

    def __init__(self, trace_sink, trace_token_ids: bool = False):
        self.clock = SimClock()
        self.tracer = Tracer("tokenizer", sink=trace_sink, enabled=trace_sink is not None, clock=self.clock.ns)
        self.trace_token_ids = trace_token_ids
        self.arrival: dict[str, float] = {}
        self.first: dict[str, float] = {}
        self.prompt_tokens: dict[str, int] = {}
        self.counts: dict[str, int] = {}  # output tokens so far
        self.output_ids: dict[str, list[int]] = {}  # with trace_token_ids

    def _emit(self, event, at: float) -> None:
        self.clock.now = at
        self.tracer.emit(event)

    def send(self, rid: str, at: float, input_ids: list[int], max_new_tokens: int) -> None:
        """The client sends request `rid` at simulated time `at`."""
        self.arrival[rid] = at
        self.prompt_tokens[rid] = len(input_ids)
        if self.tracer.enabled:
            self._emit(ReqArrived(rid=rid), at)
            ids = list(input_ids) if self.trace_token_ids else None
            self._emit(
                ReqTokenized(rid=rid, prompt_tokens=len(input_ids), max_new_tokens=max_new_tokens, input_ids=ids), at
            )
            self.tracer.flush()

    def take(self, msg: BatchTokenIDOut, now: float, res: SimResult, replayed: set[str]) -> None:
        """A step's outputs, reaching the client at `now`: first tokens, finishes, into `res` and the trace."""
        tracing = self.tracer.enabled
        for j, rid in enumerate(msg.rids):
            new = msg.new_token_ids[j]
            if new and rid not in self.first:
                self.first[rid] = now
                res.ttft[rid] = now - self.arrival[rid]
                if tracing:
                    self._emit(ReqFirstToken(rid=rid), now)
            n = self.counts[rid] = msg.completion_tokens[j]
            if rid in replayed:
                res.outputs.setdefault(rid, []).extend(new)
            if self.trace_token_ids:
                self.output_ids.setdefault(rid, []).extend(new)
            reason = msg.finished_reasons[j]
            if reason is None:
                continue
            res.latency[rid] = now - self.arrival[rid]
            res.cached_tokens += msg.cached_tokens[j]
            if n > 1:
                res.tpot[rid] = (now - self.first[rid]) / (n - 1)
            if tracing:
                self._emit(
                    ReqFinished(
                        rid=rid,
                        reason=reason,
                        prompt_tokens=self.prompt_tokens[rid],
                        completion_tokens=n,
                        cached_tokens=msg.cached_tokens[j],
                        ttft=res.ttft.get(rid, 0.0),
                        tpot=res.tpot.get(rid, 0.0),
                        e2e=res.latency[rid],
                        output_ids=self.output_ids.pop(rid, None),
                    ),
                    now,
                )
        if tracing:
            self.tracer.flush()


class _Replica:
    """One scheduler with its own clock, pools, worker and inbox: the whole deployment, or one of
    `dp_size` data-parallel replicas (traced as "scheduler.dp<rank>", as the real ones are)."""

    def __init__(self, sim: Simulator, rank: int, proc: str, seed: int, trace_sink):
        self.rank = rank
        self.clock = SimClock()
        pool = sim.args.max_total_tokens
        assert pool is not None  # Simulator sizes it from the cost model unless given
        self.runner = sim_runner(sim.spec, pool, sim.args.max_running_requests, sim.context)
        self.worker = SimWorker(self.runner, sim.cost, self.clock, seed, sim.accept_rate)
        self.io = ListIO()
        self.tracer = Tracer(proc, sink=trace_sink, enabled=trace_sink is not None, clock=self.clock.ns)
        drafter = make_drafter(self.worker, sim.spec.vocab, sim.draft_cost) if sim.accept_rate is not None else None
        self.scheduler = Scheduler(
            sim.args,
            None,
            worker=self.worker,
            io=self.io,
            tokenizer=NoTokenizer(),
            tracer=self.tracer,
            drafter=drafter,
            # the scheduler's own overlap loop over the two-timeline client (sim.args asks for it)
            overlap_worker=SimOverlapClient(self.worker) if sim.overlap else None,
        )
        self.step = self.scheduler.step_overlap if sim.overlap else self.scheduler.step_normal
        self.requests = 0

    def busy(self) -> bool:
        return self.scheduler.has_work() or bool(self.io.inbox)

    def kv_used(self) -> int:
        return self.scheduler.kv_used()


class Simulator:
    """A deployment that is not there: `model` (a name of model_specs.KNOWN, an HF config.json, a Hub
    id, or a ModelSpec already resolved),
    `hardware` (hardware.HARDWARE), `tp_size` devices per replica, `dp_size` replicas behind the data-
    parallel controller's `LoadBalancer` (`load_balance_method`: round_robin, shortest_queue,
    prefix_aware); the rest are ServerArgs fields (schedule_policy, chunked_prefill_size,
    max_running_requests, ...), as the real engine takes them, for each replica.

    With dp_size > 1 every replica keeps its own simulated clock and the driver always steps the one
    that is furthest behind, handing each request to the replica the balancer picks when the clocks
    reach its arrival, so the replicas run side by side in simulated time."""

    def __init__(
        self,
        model: str | ModelSpec,
        hardware: str,
        tp_size: int = 1,
        dtype_bytes: int | None = None,
        seed: int = 0,
        scale: float = 1.0,
        trace_sink=None,
        calibration="auto",
        dp_size: int = 1,
        load_balance_method: str = "round_robin",
        speculative_accept_rate: float | None = None,
        speculative_draft_model: str | None = None,
        replica_procs: list[str] | None = None,
        **server_args,
    ):
        from workbench.core.managers.data_parallel_controller import PROC_NAME, LoadBalancer, replica_proc_name

        dp_size = int(server_args.pop("dp_size", dp_size))
        load_balance_method = server_args.pop("load_balance_method", load_balance_method)
        if dp_size < 1:
            raise ValueError(f"dp_size must be at least 1, not {dp_size}")
        # Speculative decoding: drafts kept with this probability each (the scheduler's NGRAM path
        # with a simulated drafter, `speculative_num_draft_tokens` drafts per request per step).
        self.accept_rate = server_args.pop("speculative_accept_rate", speculative_accept_rate)
        if self.accept_rate is not None:
            self.accept_rate = float(self.accept_rate)
            if not 0.0 <= self.accept_rate <= 1.0:
                raise ValueError(f"speculative_accept_rate must be in [0, 1], not {self.accept_rate}")
            server_args["speculative_algorithm"] = "NGRAM"
        # STANDALONE: a draft model (a known name or a config.json) whose passes are costed (SimDrafter)
        draft_model = server_args.pop("speculative_draft_model", speculative_draft_model)
        if draft_model and self.accept_rate is None:
            raise ValueError("speculative_draft_model needs speculative_accept_rate: how often the target agrees")
        self.spec = model if isinstance(model, ModelSpec) else model_spec(model)
        self.hw = get_hardware(hardware)
        self.tp_size = tp_size
        # Where the calibration came from ("this machine", "shipped", "none", "given") and why it may be off.
        self.calibration_source, self.calibration_warning = "given" if calibration is not None else "none", None
        if calibration == "auto":  # this machine's own table, else the shipped one for this hardware and model
            choice = calibrations.auto(self.hw.name, self.spec.name) if tp_size == 1 else None
            calibration = choice.calibration if choice else None
            self.calibration_source = choice.source if choice else "none"
            self.calibration_warning = choice.warning if choice else None
        elif isinstance(calibration, (str, Path)):
            calibration = Calibration.load(calibration)
        if dtype_bytes is None:
            dtype_bytes = default_dtype_bytes(calibration, self.hw.name)
        self.calibration = calibration
        # The trip through the tokenizer manager and detokenizer, as calibrated on a real engine (0 where
        # the calibration has none): a request reaches the scheduler tm_in_s after it is sent and at least
        # tm_gap_s after the one before it (one loop hands requests over in turn), and a token reaches the
        # client tm_out_s after the step that sampled it. With a gap, requests sent at once trickle in, and
        # the first is prefilled alone, as the real engine's trace shows.
        # `scale` stretches the trip with the passes: this host's Python, slowed down alike.
        meta = calibration.meta if calibration is not None else {}
        self.tm_in_s, self.tm_gap_s, self.tm_out_s = (
            scale * float(meta.get(k, 0.0)) for k in ("tm_in_s", "tm_gap_s", "tm_out_s")
        )
        self.cost = CostModel(self.spec, self.hw, tp_size, dtype_bytes, scale, calibration)
        self.draft_cost = (
            CostModel(model_spec(draft_model), self.hw, tp_size, dtype_bytes, scale, None) if draft_model else None
        )
        pool = self.cost.kv_pool_tokens(draft=self.draft_cost)
        server_args.setdefault("max_total_tokens", pool)
        server_args.setdefault("chunked_prefill_size", 2048 if self.hw.name == "cpu-here" else 8192)
        server_args.setdefault("max_running_requests", 256 if self.hw.name != "cpu-here" else 128)
        # The normal loop unless disable_overlap_schedule=False is given (SGLang's default on GPUs is
        # the overlap loop; the shipped calibrations were measured with the normal one).
        self.overlap = server_args.pop("disable_overlap_schedule", True) is False
        self.args = ServerArgs(device="cpu", disable_overlap_schedule=not self.overlap, **server_args)
        self.context = min(self.spec.context_len, server_args.get("context_length") or self.spec.context_len)
        self.dp_size = dp_size
        # Each replica's trace name; `replica_procs` names them otherwise (a PD deployment's two sides: pd.py).
        procs = replica_procs or [replica_proc_name(r) if dp_size > 1 else "scheduler" for r in range(dp_size)]
        self.replicas = [_Replica(self, r, procs[r], seed + 7919 * r, trace_sink) for r in range(dp_size)]
        # The data-parallel controller's own routing and load bookkeeping, on simulated time.
        self.balancer = LoadBalancer(dp_size, load_balance_method, pool) if dp_size > 1 else None
        self._dispatch_clock = SimClock()
        self.controller_tracer = (
            Tracer(PROC_NAME, sink=trace_sink, enabled=trace_sink is not None, clock=self._dispatch_clock.ns)
            if dp_size > 1
            else None
        )
        # Replica 0 under the single-scheduler names (what a dp_size=1 simulation is).
        first = self.replicas[0]
        self.clock, self.runner, self.worker = first.clock, first.runner, first.worker
        self.io, self.tracer, self.scheduler = first.io, first.tracer, first.scheduler
        self.seed = seed
        self.trace_sink = trace_sink  # the front end's events go there too (SimFrontEnd)
        self.front_end: SimFrontEnd | None = None  # the last run's

    def _prompt(self, i: int, r: SimRequest) -> list[int]:
        return request_prompt(i, r, self.seed, self.spec.vocab)

    def run(self, workload: list[SimRequest], progress=None) -> SimResult:
        """Run every request to the end; returns the simulated-time metrics."""
        for _ in self.run_steps(workload, progress):
            pass
        assert self.result is not None
        return self.result

    def run_steps(self, workload: list[SimRequest], progress=None) -> Iterator[float]:
        """`run`, one action at a time: yields the simulated time of the next action (a request
        reaching a scheduler, or a step starting at that time) before taking it, so a driver can
        advance several simulators on one simulated clock (`next()` while the value is at most its
        time); `self.result` holds the metrics once the generator is exhausted."""
        self.result: SimResult | None = None
        t0 = time.perf_counter()
        reps = self.replicas
        order = sorted(range(len(workload)), key=lambda i: workload[i].arrival)
        front = self.front_end = SimFrontEnd(self.trace_sink, self.args.trace_token_ids)
        self._replayed: set[str] = set()
        self._ids: dict[int, list[int]] = {}  # prompts sent, not yet delivered
        res = SimResult(
            self.hw.name,
            self.spec.name,
            self.tp_size,
            sum(r.runner.max_total_num_tokens for r in reps),
            0.0,
            0.0,
            dp_size=self.dp_size,
        )
        at, last = {}, float("-inf")  # when each request reaches a scheduler (after the trip in)
        for i in order:
            last = at[i] = max(workload[i].arrival + self.tm_in_s, last + self.tm_gap_s)
        nxt = sent = 0

        def send_until(t: float) -> None:
            # The client sends requests as simulated time passes their arrival (in order: `at`
            # follows arrivals), so the front end's stamps interleave with the schedulers' steps.
            nonlocal sent
            while sent < len(order) and workload[order[sent]].arrival <= t:
                i = order[sent]
                sent += 1
                r = self._ids[i] = self._prompt(i, workload[i])
                front.send(f"r{i}", workload[i].arrival, r, workload[i].output_len)

        while True:
            t_arrival = at[order[nxt]] if nxt < len(order) else float("inf")
            busy = [r for r in reps if r.busy()]
            if not busy and nxt >= len(order):
                break
            rep = min(busy, key=lambda r: r.clock.now) if busy else None  # the replica furthest behind
            yield t_arrival if rep is None or t_arrival <= rep.clock.now else rep.clock.now
            if rep is None or t_arrival <= rep.clock.now:
                i = order[nxt]
                nxt += 1
                send_until(at[i])
                self._deliver(i, workload[i], res, at[i])
                continue
            send_until(rep.clock.now)
            rep.step()
            res.steps += 1
            res.peak_kv_used = max(res.peak_kv_used, sum(r.kv_used() for r in reps))
            now = rep.clock.now + self.tm_out_s  # when this step's tokens reach the client
            for msg in rep.io.outbox:
                if not isinstance(msg, BatchTokenIDOut):
                    continue
                if self.balancer is not None:
                    for j, rid in enumerate(msg.rids):
                        self.balancer.on_output(rid, msg.new_token_ids[j], msg.finished_reasons[j] is not None)
                front.take(msg, now, res, self._replayed)
            rep.io.outbox.clear()
            if progress is not None and res.steps % 500 == 0:
                progress(len(res.latency), len(workload), now)
        res.output_tokens = sum(front.counts.values())
        res.retracted = sum(r.scheduler.num_retracted_total for r in reps)
        res.preempted = sum(r.scheduler.priority.num_preempted_total for r in reps)
        res.priority_of = {f"r{i}": w.priority for i, w in enumerate(workload) if w.priority is not None}
        res.spec_proposed = sum(r.scheduler.spec_proposed_total for r in reps)
        res.spec_accepted = sum(r.scheduler.spec_accepted_total for r in reps)
        res.per_replica_requests = [r.requests for r in reps]
        res.hicache = self.args.enable_hierarchical_cache
        res.host_hit_tokens = sum(getattr(r.scheduler.tree_cache, "host_hit_tokens", 0) for r in reps)
        res.hicache_s = sum(r.worker.hicache_s for r in reps)
        res.prefetch_tokens = sum(getattr(r.scheduler.tree_cache, "storage_hit_tokens", 0) for r in reps)
        start = min((r.arrival for r in workload), default=0.0)
        res.sim_s = max(r.clock.now for r in reps) + self.tm_out_s - start
        res.wall_s = time.perf_counter() - t0
        self.result = res

    def _deliver(self, i: int, r: SimRequest, res: SimResult, at: float) -> None:
        """Request i (sent at r.arrival) reaches the deployment at `at`: the balancer picks its replica
        (data parallel), whose clock, if it was idle, moves on to that time."""
        rid = f"r{i}"
        ids = self._ids.pop(i)
        rank = 0
        if self.balancer is not None:
            d = self.balancer.choose(rid, ids)
            rank = d.dp_rank
            tracer = self.controller_tracer
            if tracer is not None and tracer.enabled:
                self._dispatch_clock.now = at
                tracer.emit(
                    ReqDispatched(
                        rid=rid,
                        dp_rank=rank,
                        method=self.balancer.method,
                        matched_tokens=d.matched_tokens,
                        loads=list(self.balancer.load),
                    )
                )
                tracer.flush()
        rep = self.replicas[rank]
        rep.clock.now = max(rep.clock.now, at)
        rep.requests += 1
        if r.output_ids:
            self._replayed.add(rid)
        params = SamplingParams(max_new_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        rep.io.inbox.append(
            TokenizedGenerateReqInput(
                rid=rid,
                input_text="",
                input_ids=ids,
                sampling_params=params,
                forced_output_ids=list(r.output_ids) if r.output_ids else None,
                forced_drafts=r.drafts if r.output_ids and r.drafts else None,  # used when drafting
                priority=r.priority,
            )
        )
        res.prompt_tokens += len(ids)


def poisson_workload(
    rate: float,
    n: int,
    prompt_len: tuple[int, int] = (128, 1024),
    output_len: tuple[int, int] = (64, 256),
    seed: int = 0,
    groups: int = 0,
    prefix_len: int = 0,
    priority_mix: list[tuple[int, float]] | None = None,
) -> list[SimRequest]:
    """`n` requests arriving as a Poisson process of `rate` per simulated second (rate <= 0: all at
    once), lengths uniform in the ranges; with `groups`, each request shares one of `groups` prefixes
    of `prefix_len` tokens; with `priority_mix` [(priority, weight), ...], each request draws its priority
    (drawn after everything else, so the same seed gives the same arrivals and lengths with or without it)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate > 0:
            t += rng.expovariate(rate)
        p = rng.randint(*prompt_len)
        g = rng.randrange(groups) if groups else None
        out.append(
            SimRequest(t, max(p, prefix_len + 1) if g is not None else p, rng.randint(*output_len), g, prefix_len)
        )
    if priority_mix:
        prio_rng = random.Random(seed * 31 + 7)
        values, weights = [p for p, _ in priority_mix], [w for _, w in priority_mix]
        for r in out:
            r.priority = prio_rng.choices(values, weights)[0]
    return out


def parse_priority_mix(text: str) -> list[tuple[int, float]]:
    """'10:0.2,0:0.8' -> [(10, 0.2), (0, 0.8)]: each priority and its share of the requests."""
    mix = []
    for part in text.split(","):
        prio, sep, weight = part.partition(":")
        try:
            mix.append((int(prio), float(weight) if sep else 1.0))
        except ValueError:
            raise ValueError(f"--priority-mix {text!r}: give PRIORITY:SHARE pairs, e.g. 10:0.2,0:0.8") from None
    if not mix or any(w < 0 for _, w in mix) or sum(w for _, w in mix) <= 0:
        raise ValueError(f"--priority-mix {text!r}: shares must be >= 0 and not all 0, e.g. 10:0.2,0:0.8")
    return mix
