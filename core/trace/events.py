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

from typing import Optional, Union

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


class ReqQueued(Event, tag="req.queued"):
    rid: str
    prompt_tokens: int
    queue_len: int


class ReqScheduled(Event, tag="req.scheduled"):
    """A request enters a prefill (extend) batch: one event per chunk."""
    rid: str
    prefix_hit: int          # tokens reused from the radix cache
    extend_len: int          # tokens computed in this chunk
    chunk_index: int = 0     # k (0-based) ...
    num_chunks: int = 1      # ... of n (estimate at scheduling time)


class ReqFirstToken(Event, tag="req.first_token"):
    rid: str


class ReqFinished(Event, tag="req.finished"):
    rid: str
    reason: str              # "stop" | "length" | "abort"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    ttft: float              # seconds
    tpot: float              # seconds per output token after the first
    e2e: float               # seconds


class ReqAborted(Event, tag="req.aborted"):
    rid: str
    reason: str = ""


class ReqRetracted(Event, tag="req.retracted"):
    rid: str
    output_tokens: int


class ReqText(Event, tag="req.text"):
    """Incremental decoded text of a request (emitted by the tokenizer manager)."""
    rid: str
    delta: str


# ---- batches and queues -----------------------------------------------------

class StepReq(msgspec.Struct, array_like=True):
    """One request's share of one scheduler step."""
    rid: str
    cached: int = 0          # prefix tokens read from the cache (extend only)
    computed: int = 0        # prompt tokens computed in this step (extend only)
    decode: int = 0          # tokens decoded in this step (0 or 1)
    chunk_index: int = 0
    num_chunks: int = 1


class BatchStep(Event, tag="batch.step"):
    mode: str                # "extend" | "decode" | "mixed" | "idle"
    reqs: list[StepReq]
    batch_size: int
    padded_size: int
    cuda_graph: bool = False
    backend: str = "torch_native"
    schedule_ms: float = 0.0
    forward_ms: float = 0.0


class QueueState(Event, tag="queue.state"):
    waiting: list[str]
    running: list[str]
    chunked: list[str]


class KVUsage(Event, tag="kv.usage"):
    used: int
    evictable: int
    free: int
    total: int


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


class TreeNode(msgspec.Struct, array_like=True):
    node_id: int
    parent_id: int           # -1 for the root
    tokens: int              # tokens held by this node's edge
    text: str                # decoded preview of the edge (may be empty)
    lock_ref: int
    hits: int
    last_access: int         # monotonic ns


class CacheTree(Event, tag="cache.tree"):
    nodes: list[TreeNode]
    evictable_size: int
    protected_size: int


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
    exitcode: Optional[int] = None
    reason: str = ""


class TraceDropped(Event, tag="trace.dropped"):
    count: int


class TraceHeader(Event, tag="trace.header"):
    """First record of every recording and every remote stream."""
    schema_version: int = SCHEMA_VERSION
    model: str = ""


AnyEvent = Union[
    ReqArrived, ReqTokenized, ReqQueued, ReqScheduled, ReqFirstToken, ReqFinished,
    ReqAborted, ReqRetracted, ReqText, BatchStep, QueueState, KVUsage, CacheMatch,
    CacheInsert, CacheEvict, CacheTree, WeightsUpdated, ProcStarted, ProcExited,
    TraceDropped, TraceHeader,
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
    return _mp_batch_decoder.decode(data)
