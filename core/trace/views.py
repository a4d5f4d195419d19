"""Typed views of the trace picture: what TraceState exposes to the TUI and widgets.

Plain dataclasses (and two event Structs reused as-is: StepReq, KVUsage);
views read them, only the reducer in state.py writes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from workbench.core.trace import events as ev

#: Request lifecycle states, in the order a request normally goes through them.
REQ_STATES = ("arrived", "queued", "prefilling", "running", "retracted", "finished", "aborted")
TERMINAL_STATES = frozenset({"finished", "aborted"})
LATENCY_METRICS = ("ttft", "tpot", "e2e")


def format_priority(p: int | None) -> str:
    """A request's priority as views show it: "unset" for one sent without a priority (the scheduler
    gave it the least urgent value, SGLang's ±sys.maxsize)."""
    if p is None or abs(p) >= 2**62:
        return "unset"
    return str(p)


@dataclass
class TimelineEntry:
    """One thing that happened to a request.

    kind: "arrived" | "queued" | "prefill" (one per chunk) | "first_token" |
    "decode" (a run of consecutive decode steps, `count` steps from `ts` to
    `end_ts`; a stall, e.g. behind a chunked prefill, starts a new run) |
    "retracted" | "finished" | "aborted".
    """

    ts: int
    kind: str
    detail: str = ""
    end_ts: int = 0
    count: int = 1
    step: int = -1  # scheduler step (for a decode run: its last step)


@dataclass
class RequestView:
    """Everything known about one request. Timestamps are monotonic ns; latencies seconds."""

    rid: str
    state: str = "arrived"
    prompt_preview: str = ""
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    cached_tokens: int = 0  # prefix tokens reused from the radix cache
    computed_tokens: int = 0  # prompt tokens computed by its first prefill (all chunks): cached + computed = prompt
    recomputed_tokens: int = 0  # tokens prefilled again after a retraction (prompt and output so far, less cache hits)
    output_tokens: int = 0
    chunk_index: int = 0  # current/last prefill chunk k (0-based) ...
    num_chunks: int = 1  # ... of n
    arrival_ts: int | None = None
    queued_ts: int | None = None
    first_token_ts: int | None = None
    finish_ts: int | None = None
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    retractions: int = 0
    constraint: str = ""  # structured outputs: "json_schema" | "json_object" | "regex" | "ebnf" ("" free)
    priority: int | None = None  # priority scheduling: the request's priority (None: scheduling off)
    preempted: str = ""  # its last priority preemption, with the reason ("preempted r1 (priority 0) for r5 ...")
    lora: str = ""  # multi-LoRA: the adapter it runs under ("" the base model)
    text: str = ""
    timeline: list[TimelineEntry] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # scheduler step ids it took part in

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES


# RequestView's plain fields, which `req.snapshot` (events.ReqSnapshot) carries under the same names:
# the reducer writes a snapshot from them and reads one back into them, so the two cannot drift apart
# unnoticed (tests/fast/test_trace_state.py checks ReqSnapshot has every one).
REQUEST_SNAPSHOT_FIELDS: tuple[str, ...] = tuple(
    f.name for f in fields(RequestView) if f.name not in ("rid", "timeline", "steps")
)


@dataclass
class ReplicaView:
    """One data-parallel replica side by side with the others (see TraceState.replicas)."""

    proc: str
    dp_rank: int
    waiting: list[str]
    running: list[str]
    kv: ev.KVUsage | None
    requests: int  # requests known to have gone to it
    steps: int  # its scheduler steps still in the step ring


@dataclass
class StepView:
    """One scheduler iteration (a `batch.step` event) with its token split."""

    step: int
    ts: int
    proc: str
    mode: str
    reqs: list[ev.StepReq]
    batch_size: int
    padded_size: int
    cuda_graph: bool
    backend: str
    schedule_ms: float
    forward_ms: float
    prefill_tokens: int = 0  # prompt tokens computed in this step
    cached_tokens: int = 0  # prefix tokens reused by first chunks in this step
    decode_tokens: int = 0  # tokens from decode entries
    decision: ev.StepDecision | None = None  # its `batch.decision` (what was decided and why), once known
    spec: ev.SpecVerify | None = None  # speculative decoding: its drafts' verdicts (`spec.verify`)


@dataclass
class TreeNodeView:
    """A radix-cache node. `just_evicted` / `just_inserted` hold until the next snapshot."""

    node_id: int
    parent_id: int
    tokens: int
    text: str = ""
    lock_ref: int = 0
    hits: int = 0
    last_access: int = 0
    children: list[int] = field(default_factory=list)
    just_evicted: bool = False
    just_inserted: bool = False
    tier: str = "device"  # HiCache: "device" | "host" | "device+host" | "storage" (events.TreeNode.tier)
    evicted_step: int = -1  # a ghost (TraceState.display_tree): the step that evicted it


@dataclass
class ProcView:
    name: str
    role: str = ""
    pid: int | None = None
    alive: bool = True
    started_ts: int | None = None
    exited_ts: int | None = None
    exitcode: int | None = None
    reason: str = ""
    last_ts: int = 0
    events: int = 0


@dataclass
class Counters:
    """Cumulative counters. The *_total request counters follow SGLang's metrics:
    they grow when a request finishes. The prefill_* and decode_* ones grow with every batch.step
    (TraceState.cache_hit_rate uses those: tokens served from cache as requests are admitted)."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted: int = 0
    num_retracted: int = 0
    evicted_tokens_total: int = 0
    dropped_events: int = 0
    prefill_computed_total: int = 0  # live, from batch.step
    prefill_cached_total: int = 0  # live, from batch.step (first chunks)
    decode_tokens_total: int = 0  # live, from batch.step decode entries


@dataclass(frozen=True)
class KVPoint:
    ts: int
    used: int
    evictable: int
    free: int
    total: int


@dataclass(frozen=True)
class QueuePoint:
    """Queue lengths at one moment: waiting counts requests queued but not yet listed by a
    scheduler's queue.state too (see TraceState.queue_counts); new: arrived, not yet queued."""

    ts: int
    waiting: int
    running: int
    new: int = 0


@dataclass(frozen=True)
class Throughput:
    prefill_tps: float
    decode_tps: float


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of an already sorted, non-empty list."""
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
