"""Trace event schema: the contract between the engine's processes and every view.

Every event is a small msgspec Struct tagged by its `kind` (e.g. "req.arrived").
All events share `ts` (time.monotonic_ns(), comparable across processes on one
host — CLOCK_MONOTONIC is system-wide on Linux), `proc` (emitting process name,
e.g. "tokenizer", "scheduler", "scheduler.dp1", "detokenizer") and `step`
(the scheduler iteration the event belongs to, -1 outside the scheduler).

One encoder (msgspec JSON or msgpack) serializes them; nothing here is pickled.
Bump SCHEMA_VERSION when a field changes meaning or disappears.
"""

from __future__ import annotations

from typing import Union, cast

import msgspec

SCHEMA_VERSION = 1


class Event(msgspec.Struct, tag_field="kind", kw_only=True, omit_defaults=False):
    ts: int = 0
    proc: str = ""
    step: int = -1


# ---- requests ---------------------------------------------------------------


class ReqArrived(Event, tag="req.arrived"):
    rid: str
    prompt_preview: str = ""


class ReqTokenized(Event, tag="req.tokenized"):
    rid: str
    prompt_tokens: int
    max_new_tokens: int
    input_ids: list[int] | None = None  # with --trace-token-ids (a recording to replay in simulation)


class ReqQueued(Event, tag="req.queued"):
    rid: str
    prompt_tokens: int
    queue_len: int
    constraint: str = ""  # structured outputs: "json_schema" | "json_object" | "regex" | "ebnf" ("" free)
    priority: int | None = None  # --enable-priority-scheduling: the request's priority (None: scheduling off)
    lora: str = ""  # --enable-lora: the LoRA adapter it runs under ("" the base model)


class ReqScheduled(Event, tag="req.scheduled"):
    """A request enters a prefill (extend) batch: one event per chunk."""

    rid: str
    prefix_hit: int  # tokens reused from the radix cache (first chunk; 0 for later chunks,
    # whose prefix is the request's own earlier chunks)
    extend_len: int  # tokens computed in this chunk
    chunk_index: int = 0  # k (0-based) ...
    num_chunks: int = 1  # ... of n (estimate at scheduling time)


class ReqDispatched(Event, tag="req.dispatched"):
    """Data parallel: the controller sent a request to replica `dp_rank` (proc "scheduler.dp<rank>")."""

    rid: str
    dp_rank: int
    method: str  # "round_robin" | "shortest_queue" | "prefix_aware"
    matched_tokens: int = 0  # prefix_aware: the controller's guess of the replica's cached prefix
    loads: list[int] = []  # in-flight requests per replica, this one included


class ReqFirstToken(Event, tag="req.first_token"):
    rid: str


class ReqFinished(Event, tag="req.finished"):
    rid: str
    reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float  # seconds
    tpot: float  # seconds per output token after the first
    e2e: float  # seconds
    output_ids: list[int] | None = None  # with --trace-token-ids


class ReqAborted(Event, tag="req.aborted"):
    rid: str
    reason: str = ""


class ReqRetracted(Event, tag="req.retracted"):
    rid: str
    output_tokens: int
    reason: str = ""  # "" the KV pool ran out; else why (a priority preemption: "preempted r1 (priority 0) for r5 ...")
    priority: int | None = None  # the request's priority (priority scheduling), else None


class ReqText(Event, tag="req.text"):
    """Incremental decoded text of a request (emitted by the tokenizer manager)."""

    rid: str
    delta: str


# ---- batches and queues -----------------------------------------------------


class StepReq(msgspec.Struct, array_like=True):
    """One request's share of one scheduler step."""

    rid: str
    cached: int = 0  # prefix tokens read from the cache (extend only)
    computed: int = 0  # prompt tokens computed in this step (extend only)
    decode: int = 0  # tokens decoded in this step (0 or 1)
    chunk_index: int = 0
    num_chunks: int = 1
    drafts: int = (
        0  # speculative decoding: draft tokens verified with its decode token (spec.verify says how many stood)
    )


class BatchStep(Event, tag="batch.step"):
    mode: str  # "extend" | "decode" | "mixed" | "idle"
    reqs: list[StepReq]
    batch_size: int
    padded_size: int
    cuda_graph: bool = False
    backend: str = "torch_native"
    schedule_ms: float = 0.0
    forward_ms: float = 0.0


class KVRelease(msgspec.Struct, array_like=True):
    """Slots one request gave back in a step: they left the slots held by requests (to the radix
    cache, where they stay cached and evictable, or back to the free pool)."""

    rid: str
    why: str  # "finished" | "aborted" | "retracted"
    slots: int


class StepDecision(Event, tag="batch.decision"):
    """What the scheduler decided in one step, and why: the companion of that step's `batch.step`
    (same `proc` and `step`), emitted at the end of the step. In the overlap loop the step's
    `batch.step` comes later (when its result is processed); TraceState joins the two.

    A request left waiting was either held back (`held`; the reason is in queue.state's `held`)
    or queued behind `stop_rid`, the first one that did not fit, for `stop_reason`."""

    mode: str = ""  # "extend" | "decode": the batch this step ran
    admitted: list[str] = []  # rids taken from the waiting queue into this step's prefill
    chunk_continued: str = ""  # a chunked request whose next chunk ran in this step
    waiting: int = 0  # requests still waiting after this step
    stop_reason: str = ""  # why admission stopped: "budget" (prefill token budget), "kv"
    # (KV room), "running" (running-request limit), "held" (too many
    # held this step), "" (nobody was turned away)
    stop_rid: str = ""  # the first waiting request that did not fit
    held: list[str] = []  # waiting requests held back for in-batch prefix caching
    budget: int = 0  # the step's prefill token budget (chunk size / max prefill tokens)
    budget_used: int = 0  # prompt tokens computed in this step
    running_waited: int = 0  # running requests that did not advance (an extend step)
    kv_alloc: int = 0  # KV slots allocated in this step
    kv_freed: int = 0  # KV slots freed in this step (finishes, evictions, retractions)
    evicted: int = 0  # tokens evicted from the radix cache in this step ...
    evicted_nodes: list[int] = []  # ... from these nodes
    retracted: list[str] = []  # requests sent back to the queue (KV pool full, or preempted)
    preemptions: list[str] = []  # priority preemptions among them, each with its reason
    # ("preempted r1 (priority 0) for r5 (priority 10)")
    constrained: int = 0  # rows of this step's batch sampled under a grammar (structured outputs) ...
    mask_ms: float = 0.0  # ... and the scheduler's time on their grammars: masks filled, tokens accepted
    # HiCache: this step's moves between tiers, one phrase per kind
    # ("loaded back 59 tok from host (944 B, 0.1 ms)"; empty without --enable-hierarchical-cache)
    hicache: list[str] = []
    start_ts: int = 0  # when the step began (monotonic ns; `ts` is when it ended): with
    # it a view knows what the scheduler was busy with at any moment
    # (0 in older recordings)
    # The slots held by requests (kv.usage's `used`), accounted: since the previous decision they
    # moved by kv_alloc (new slots) + kv_reused (cached prefixes locked by admitted requests)
    # - the slots in `released` - kv_returned (slots dropped outside a release: duplicates handed
    # to the cache, rejected drafts, a finished request's unused row) + kv_other (anything else;
    # 0 unless some path is not accounted). kv_held: held after the step (-1: older recordings).
    kv_reused: int = 0
    released: list[KVRelease] = []
    kv_returned: int = 0
    kv_other: int = 0
    kv_held: int = -1
    # Multi-LoRA (--enable-lora): the adapters this step's batch ran, and the waiting requests whose
    # adapter would have been one too many for --max-loras-per-batch (they wait for a slot)
    loras: list[str] = []
    lora_waited: list[str] = []


class ExpertRoute(msgspec.Struct, array_like=True):
    """One request's tokens among the experts: for each of MoeRouting.layers, flat (expert, tokens)
    pairs [e0, n0, e1, n1, ...] over the experts that got any of its tokens."""

    rid: str
    pairs: list[list[int]]


class MoeRouting(Event, tag="moe.routing"):
    """Where one step's tokens went among the experts of a mixture-of-experts model: the companion
    of that step's `batch.step` (same `proc` and `step`). Each token goes to `top_k` experts in
    every sparse layer, so a layer's counts sum to top_k x the step's tokens."""

    num_experts: int
    top_k: int
    layers: list[int]  # the sparse layers' ids (dense layers are left out)
    counts: list[list[int]]  # [i][e]: tokens layer layers[i] sent to expert e
    reqs: list[ExpertRoute] = []
    steps: int = 1  # the steps these counts cover (a view's snapshot folds many into one)


class SpecReq(msgspec.Struct, array_like=True):
    """One request's drafts in a speculative verify step."""

    rid: str
    drafts: list[int]  # the draft tokens proposed (ids)
    accepted: int  # how many of them the target agreed with (it adds one token of its own)
    verified: int = 1  # verify steps this record covers (a view's snapshot folds many)
    proposed: int = -1  # drafts proposed, when `drafts` is left out (a snapshot); -1: len(drafts)
    at: int = -1  # output tokens the request had when they were proposed (-1: a snapshot or older recording)


class SpecVerify(Event, tag="spec.verify"):
    """A speculative decoding step's verdicts: the companion of that step's `batch.step` (whose
    decode counts are then 1 + accepted per request)."""

    algorithm: str
    reqs: list[SpecReq]
    snapshot: bool = False  # a view's snapshot of the totals so far, not one step


class HeldReq(msgspec.Struct, array_like=True):
    """A waiting request the scheduler held back (in-batch prefix caching)."""

    rid: str
    waits_for: str  # the request computing the prefix they share
    shared_tokens: int  # shared tokens not cached yet: what holding saves it from computing

    def reason(self) -> str:
        return f"waits for {self.waits_for}'s shared prefix ({self.shared_tokens} tokens) to be cached"


class QueueState(Event, tag="queue.state"):
    waiting: list[str]
    running: list[str]
    chunked: list[str]
    # Waiting requests held back in this step (a subset of `waiting`); absent in older recordings.
    held: list[HeldReq] = []


class KVUsage(Event, tag="kv.usage"):
    used: int
    evictable: int
    free: int
    total: int
    # HiCache (--enable-hierarchical-cache): host-pool tokens held by tree nodes, and its size (0: no host tier)
    host_used: int = 0
    host_total: int = 0


# ---- radix cache ------------------------------------------------------------


class CacheMatch(Event, tag="cache.match"):
    rid: str
    matched: int
    prompt_tokens: int


class CacheInsert(Event, tag="cache.insert"):
    node_id: int
    parent_id: int
    tokens: int
    text: str = ""


class CacheEvict(Event, tag="cache.evict"):
    node_ids: list[int]
    tokens: int


class CacheTouch(Event, tag="cache.touch"):
    """The tree's locks or hit counts changed since its last `cache.tree` snapshot (no node was
    inserted or evicted). Sent once per snapshot at most: it tells the scheduler (and a reader of
    the trace) that a fresh `cache.tree` is due at the next step boundary."""

    what: str  # "lock" | "hit" | "evict" (HiCache: a node left the device, kept on host): the first change
    node_id: int  # the node it touched


class TreeNode(msgspec.Struct, array_like=True):
    node_id: int
    parent_id: int  # -1 for the root
    tokens: int  # tokens held by this node's edge
    text: str  # decoded preview of the edge (may be empty)
    lock_ref: int
    hits: int
    last_access: int  # monotonic ns
    # HiCache: where the node's KV lives: "device", "host" (evicted from the device, kept in the host
    # pool), "device+host" (both), "storage" (only in the L3 tier). Plain radix cache: always "device".
    tier: str = "device"


class HiCacheTransfer(Event, tag="hicache.transfer"):
    """HiCache moved KV between tiers (core/mem_cache/hiradix_cache.py).

    `what`: "write_through" / "write_back" (device -> host, when the node entered the tree or when
    it was evicted from the device), "load_back" (host -> device, for a match), "storage_write"
    (host -> L3 files), "prefetch" (L3 -> host, for a match). The nodes stay in the tree; their
    tier shows in the next `cache.tree`."""

    what: str
    node_ids: list[int]
    tokens: int
    bytes: int
    ms: float


class CacheTree(Event, tag="cache.tree"):
    nodes: list[TreeNode]
    evictable_size: int
    protected_size: int


class CacheDigest(Event, tag="cache.digest"):
    """The scheduler's own digest of its radix tree after this step (core/trace/tree_digest.py).
    Emitted only when `WORKBENCH_TRACE_TREE_DIGEST=1` (tests): a reducer that folded the step's
    events must hold a tree with the same digest."""

    digest: str


class PDTransfer(Event, tag="pd.transfer"):
    """Disaggregated serving: one request's prompt KV handed from a prefill server to a decode server.

    Each side emits its own when its part ends: `role` "prefill" (the bytes sent, or why not) on the
    prefill server, "decode" (the bytes received and installed, or why not) on the decode server.
    `wait_ms` is the time before the bytes moved (prefill: the KV waiting for the decode side to ask;
    decode: the pull waiting for the prefill to finish), `ms` the bytes on the wire."""

    rid: str
    room: int
    role: str  # "prefill" | "decode"
    tokens: int  # prompt tokens whose KV moved
    nbytes: int
    ms: float
    wait_ms: float = 0.0
    ok: bool = True
    error: str = ""


class PDBootstrap(Event, tag="pd.bootstrap"):
    """Disaggregated serving: a request with a bootstrap room was admitted on this server (`role`
    "prefill" or "decode"). The room names the same request on both servers: the views join the two
    traces by it (core/trace/pd.py)."""

    rid: str
    room: int
    role: str  # "prefill" | "decode"


class PDReserved(Event, tag="pd.reserved"):
    """Disaggregated serving, decode side: a request row and `tokens` KV slots were reserved for the
    request, which leaves the prealloc queue and starts pulling its KV (the end of the "decode queue")."""

    rid: str
    room: int
    tokens: int


# ---- processes, weights, the trace itself -----------------------------------


class WeightsUpdated(Event, tag="weights.updated"):
    source: str
    version: int = 0


class ProcStarted(Event, tag="proc.started"):
    pid: int
    role: str


class ProcExited(Event, tag="proc.exited"):
    pid: int
    role: str
    exitcode: int | None = None
    reason: str = ""


class EnginePhase(Event, tag="engine.phase"):
    """Engine start-up: `phase` begins (and the one before it ends), in the process doing it.

    `phase` is one of trace/startup.py's PHASES ("model", "processes", "kernels", "weights",
    "warmup", "ready", "failed"); a phase may come back after a nested one (weights, kernels,
    weights). `ts` is the host's time.monotonic_ns(), whatever clock the trace uses, because
    start-up is real time. `log_path`: where the engine's log is (set on the engine's own events)."""

    phase: str
    detail: str = ""
    log_path: str = ""


class TraceDropped(Event, tag="trace.dropped"):
    count: int


class TraceHeader(Event, tag="trace.header"):
    """First record of every recording and every remote stream."""

    schema_version: int = SCHEMA_VERSION
    model: str = ""


# ---- synthetic events (snapshots for late subscribers, replay control) ------
# Never emitted by the engine's processes: the bus builds them from its
# TraceState (TraceState.snapshot_events) and Replay emits TraceReset on a
# backward seek. Views need no special handling: TraceState.apply folds them.


class TimelineItem(msgspec.Struct, array_like=True):
    """One entry of a request's timeline (see state.TimelineEntry)."""

    ts: int
    kind: str
    detail: str = ""
    end_ts: int = 0
    count: int = 1
    step: int = -1


class ReqSnapshot(Event, tag="req.snapshot"):
    """The whole known picture of one request; replaces what a reducer had for it."""

    rid: str
    state: str
    prompt_preview: str = ""
    prompt_tokens: int = 0
    max_new_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    recomputed_tokens: int = 0  # prefilled again after retractions (absent in older recordings)
    output_tokens: int = 0
    chunk_index: int = 0
    num_chunks: int = 1
    arrival_ts: int | None = None
    queued_ts: int | None = None
    first_token_ts: int | None = None
    finish_ts: int | None = None
    finish_reason: str | None = None
    ttft: float | None = None
    tpot: float | None = None
    e2e: float | None = None
    retractions: int = 0
    text: str = ""
    timeline: list[TimelineItem] = []
    steps: list[int] = []
    round_chunks: list[int] = []  # computed tokens per prefill chunk of the current round
    round_sampled: bool = False  # the current round's last chunk already sampled a token
    replica: str = ""  # data parallel: the scheduler replica that holds it
    constraint: str = ""  # structured outputs: the kind of grammar ("" free)
    priority: int | None = None  # priority scheduling: the request's priority
    preempted: str = ""  # its last priority preemption, with the reason
    lora: str = ""  # multi-LoRA: the adapter it runs under


class TraceCounters(Event, tag="trace.counters"):
    """Cumulative counters of a TraceState; a reducer takes them as-is."""

    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    cached_tokens_total: int = 0
    num_requests_total: int = 0
    num_aborted: int = 0
    num_retracted: int = 0
    evicted_tokens_total: int = 0
    dropped_events: int = 0
    prefill_computed_total: int = 0
    prefill_cached_total: int = 0
    decode_tokens_total: int = 0
    weights_version: int = 0
    model: str = ""


class TraceReset(Event, tag="trace.reset"):
    """Forget everything: the events that follow rebuild the picture (replay seek)."""


AnyEvent = Union[  # noqa: UP007 (a runtime alias msgspec decodes)
    ReqArrived,
    ReqTokenized,
    ReqQueued,
    ReqScheduled,
    ReqDispatched,
    ReqFirstToken,
    ReqFinished,
    ReqAborted,
    ReqRetracted,
    ReqText,
    BatchStep,
    StepDecision,
    MoeRouting,
    SpecVerify,
    PDTransfer,
    PDBootstrap,
    PDReserved,
    QueueState,
    KVUsage,
    CacheMatch,
    CacheInsert,
    CacheEvict,
    CacheTouch,
    HiCacheTransfer,
    CacheTree,
    CacheDigest,
    WeightsUpdated,
    ProcStarted,
    ProcExited,
    EnginePhase,
    TraceDropped,
    TraceHeader,
    ReqSnapshot,
    TraceCounters,
    TraceReset,
]

_json_encoder = msgspec.json.Encoder()
_json_decoder = msgspec.json.Decoder(AnyEvent)
_mp_encoder = msgspec.msgpack.Encoder()
_mp_batch_decoder = msgspec.msgpack.Decoder(list[AnyEvent])


def encode_json(event: Event) -> bytes:
    return _json_encoder.encode(event)


def decode_json(data: bytes | str) -> Event:
    return _json_decoder.decode(data)


def encode_batch(events: list[Event]) -> bytes:
    """Binary batch encoding used on ZMQ links between processes."""
    return _mp_encoder.encode(events)


def decode_batch(data: bytes) -> list[Event]:
    # Every AnyEvent is an Event, and the list is new, so no one holds it by its narrower type.
    return cast("list[Event]", _mp_batch_decoder.decode(data))
