"""Messages between the processes (TokenizerManager <-> Scheduler <-> Detokenizer).

Every message is a msgspec Struct tagged with its class name and travels as
msgpack over ZMQ (see ipc.py): typed on both ends, and never pickle.
"""

from __future__ import annotations

from typing import Union

import msgspec
from workbench.core.sampling.sampling_params import SamplingParams


class Msg(msgspec.Struct, tag=True, kw_only=True):
    """Base of every inter-process message (tag = class name)."""


# ---- tokenizer manager -> scheduler -----------------------------------------


class TokenizedGenerateReqInput(Msg):
    rid: str
    input_text: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1  # -1: no prompt logprobs
    stream: bool = False
    arrival_ts: int = 0  # monotonic ns at the tokenizer manager
    # Tokens to emit instead of sampling, in turn, where the worker honours them (Req.forced_output_ids),
    # and speculative drafts to propose instead of drafting, by the output length they follow.
    forced_output_ids: list[int] | None = None
    forced_drafts: dict[int, list[int]] | None = None
    # Disaggregated serving (core/disaggregation/): the prefill server's bootstrap address and the room
    # that names this request on both sides, as SGLang's PD router adds them.
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = None
    # Priority scheduling (--enable-priority-scheduling): larger is more urgent unless
    # --schedule-low-priority-values-first; None: the least urgent. Ignored when it is off (SGLang's rule).
    priority: int | None = None
    # Multi-LoRA (--enable-lora): the adapter this request runs under, by name; None: the base model.
    lora_path: str | None = None


class AbortReq(Msg):
    rid: str  # "" aborts everything


class FlushCacheReq(Msg):
    pass


class FlushCacheReqOutput(Msg):
    success: bool
    message: str = ""


class GetInternalStateReq(Msg):
    pass


class GetInternalStateReqOutput(Msg):
    num_waiting: int
    num_running: int
    kv_total: int
    kv_free: int
    kv_evictable: int
    kv_used: int
    req_slots_free: int
    req_slots_total: int
    step: int
    max_total_num_tokens: int
    max_running_requests: int
    max_req_input_len: int
    last_gen_throughput: float = 0.0
    trace_ms: float = 0.0  # wall time the scheduler has spent in its own tracing code (bench trace)
    num_threads: int = 0  # compute threads now (the adaptive policy may change it; see cpu_threads.py)
    others_load: float = -1.0  # cores other processes kept busy in the last window (-1: not measured)
    thread_probes: int = 0  # times the adaptive policy tried the other thread count
    kv_check_error: str = ""  # --enable-kv-invariant-check: the last violation seen ("" = none)
    # Speculative decoding: (request, step) pairs that verified drafts, drafts proposed, drafts kept.
    # Accept length (tokens per request per verify step) = (spec_accepted + spec_verified) / spec_verified.
    spec_verified: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    kv_used_peak: int = 0  # most KV tokens in use after a step, where the step clock keeps it (0: not kept)
    retracted_total: int = 0  # requests retracted (sent back to wait) since the scheduler began
    received_total: int = 0  # generate requests received, where the step clock counts them (0: not kept)
    # Data parallel: the fields above are summed over replicas; here each replica's own figures.
    per_replica: list[dict[str, int | float]] | None = None
    # Disaggregated serving: the mode and its queues and transfer counters (core/disaggregation/)
    disaggregation: dict[str, int | float | str] | None = None
    # HiCache (--enable-hierarchical-cache): host pool used / total tokens and the transfer totals
    # (HiRadixCache.internal_state); None without a host tier
    hicache: dict[str, int | float] | None = None


class SetTraceReq(Msg):
    """Turn the scheduler's tracer on/off; on enable it emits a full snapshot."""

    enabled: bool


class StepGateReq(Msg):
    """Pause the scheduler loop, resume it, or run exactly `steps` iterations while paused."""

    action: str  # "pause" | "resume" | "step"
    steps: int = 1


class StepGateReqOutput(Msg):
    paused: bool
    step: int


class LoadLoRAAdapterReq(Msg):
    """Load (or reload) a LoRA adapter in PEFT's format under `lora_name` (SGLang's /load_lora_adapter)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterReq(Msg):
    """Forget a LoRA adapter (refused while a request uses it)."""

    lora_name: str


class LoRAUpdateOutput(Msg):
    success: bool
    message: str = ""
    loaded_adapters: dict[str, str] = {}  # name -> path of every adapter the server knows


class UpdateWeightsFromDiskReq(Msg):
    model_path: str
    flush_cache: bool = True  # False keeps the radix cache (KV computed with the old weights)


class UpdateWeightsReqOutput(Msg):
    success: bool
    message: str = ""
    version: int = 0


class NamedTensorPayload(msgspec.Struct, kw_only=True):
    """One tensor on the wire: raw little-endian bytes (C order) plus dtype name and shape."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32", "bfloat16"
    shape: list[int]
    data: bytes


class UpdateWeightsFromTensorReq(Msg):
    """In-process weight push (a notebook): the tensors travel as bytes, never pickled."""

    tensors: list[NamedTensorPayload]
    flush_cache: bool = True


class InitWeightsUpdateGroupReq(Msg):
    """Join a trainer's process group (the trainer is rank 0) to receive broadcast weights."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str = "weight_update_group"
    backend: str = "gloo"
    timeout_s: float = 120.0  # joining, and each broadcast later, fails after this long (at most 300 s)


class InitWeightsUpdateGroupReqOutput(UpdateWeightsReqOutput):
    """The answer to InitWeightsUpdateGroupReq. Its own type because it comes when the group has formed or
    failed, after answers to messages sent later (the join runs beside the scheduler's loop)."""


class UpdateWeightsFromDistributedReq(Msg):
    """Receive `names` by broadcast from rank 0 of `group_name`, in order, and load them."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = "weight_update_group"
    flush_cache: bool = True


class DestroyWeightsUpdateGroupReq(Msg):
    group_name: str = "weight_update_group"


class GetWeightsByNameReq(Msg):
    name: str
    truncate_size: int = 100


class GetWeightsByNameReqOutput(Msg):
    values: list[float] | None = None
    message: str = ""


# ---- scheduler -> detokenizer -> tokenizer manager --------------------------


class BatchTokenIDOut(Msg):
    """New tokens of the requests that produced output in one scheduler step.

    Per-request lists are aligned with `rids`. `new_token_ids` holds only the
    tokens produced since the previous message for that request.
    """

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[str | None]  # None while running; "stop" | "length" | "abort"
    matched_stops: list[int | str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]]
    output_token_logprobs: list[list[float]] | None = None
    output_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    input_token_logprobs: list[list[float | None] | None] | None = None
    # per request (None: not asked), per prompt position: its top (id, logprob) pairs (None: unscored)
    input_top_logprobs: list[list[list[tuple[int, float]] | None] | None] | None = None
    error_messages: list[str | None] | None = None
    # An abort that is the server's answer, not a stop (HTTP's status: 400 a bad request, 502 a PD peer
    # that failed, ...); 0 or None: a plain abort (a client's, a disconnect)
    error_status: list[int] | None = None
    ts: int = 0  # the trace clock when the step's output left the scheduler (read where the clock is shared)


class BatchStrOut(Msg):
    """BatchTokenIDOut with the incremental text of each request added."""

    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[str | None]
    matched_stops: list[int | str | None]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    output_token_logprobs: list[list[float]] | None = None
    output_top_logprobs: list[list[list[tuple[int, float]]]] | None = None
    input_token_logprobs: list[list[float | None] | None] | None = None
    # per request (None: not asked), per prompt position: its top (id, logprob) pairs (None: unscored)
    input_top_logprobs: list[list[list[tuple[int, float]] | None] | None] | None = None
    error_messages: list[str | None] | None = None
    error_status: list[int] | None = None
    ts: int = 0  # BatchTokenIDOut's


AnyMsg = Union[  # noqa: UP007 (a runtime alias msgspec decodes)
    TokenizedGenerateReqInput,
    AbortReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SetTraceReq,
    StepGateReq,
    StepGateReqOutput,
    UpdateWeightsFromDiskReq,
    UpdateWeightsReqOutput,
    GetWeightsByNameReq,
    GetWeightsByNameReqOutput,
    BatchTokenIDOut,
    BatchStrOut,
    UpdateWeightsFromTensorReq,
    InitWeightsUpdateGroupReq,
    InitWeightsUpdateGroupReqOutput,
    UpdateWeightsFromDistributedReq,
    DestroyWeightsUpdateGroupReq,
    LoadLoRAAdapterReq,
    UnloadLoRAAdapterReq,
    LoRAUpdateOutput,
]

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)


def encode_msg(msg: Msg) -> bytes:
    return _encoder.encode(msg)


def decode_msg(data: bytes) -> Msg:
    return _decoder.decode(data)
