"""The Scheduler's contract: every collaborator it is handed, as a typed Protocol, in one file.

The Scheduler (scheduler.py) owns admission, batching, the radix cache and the output stream. What
it does not own comes from outside, through these seams (each with a real default, built by
`Scheduler.__init__` when not given):

    ModelWorker     runs a batch: forward + sample, returning tokens (and logprobs)   TpModelWorker
    RunnerFacts     what the scheduler reads off the worker's runner: pool sizes, the
                    pools themselves, dtype, device, the model's config, graph_plan    ModelRunner
    OverlapWorker   the overlap loop's client: launch now, resolve the result later    TpModelWorkerClient
    SchedulerIO     where requests come from and outputs go                            ZmqSchedulerIO
    TextDecoder     token ids to text (stop strings, cache previews)                   `tokenizers`
    Drafter         speculative decoding's proposals                                   StandaloneDrafter
    StepClock       when steps happen: what a step receives (and how long the loop
                    waits when idle), what it notes after a step                       HostStepClock
    Disaggregation  PD serving's side of the scheduler: the prefill server's KV
                    handover, or the decode server's reserve/pull/install queues       PrefillBootstrap,
                    (None: one engine does both)                                       DecodeTransferQueue

Three implementations of the worker side exist: the real one (TpModelWorker over ModelRunner), the
tests' stand-in (tests/scheduler_harness.py) and the simulator's (core/simulation/sim_worker.py
SimWorker, which times each pass with a cost model). The last two share `PoolRunner` (the runner
facts over real pools, no model) and `ListIO` below.

How an engine's scheduler processes are made is a `Deployment`: `run_scheduler_process` asks its
`scheduler_factory` for the collaborators (`SchedulerParts`); None there means the real ones. A
simulated deployment is one such factory (core/simulation/live.py); the scheduler module never
imports the simulation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch
from workbench.core.args import ServerArgs
from workbench.core.io_struct import GetInternalStateReqOutput, Msg, decode_msg, encode_msg
from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

if TYPE_CHECKING:
    from workbench.core.ipc import PortArgs
    from workbench.core.layers.logits_processor import LogitsOutput
    from workbench.core.layers.sampler import SamplerOutput
    from workbench.core.managers.schedule_batch import ModelWorkerBatch, Req, ScheduleBatch
    from workbench.core.model_executor.forward_batch_info import ForwardMode
    from workbench.core.trace.tracer import Tracer


# ==== what a pass returns ============================================================================
@dataclass
class ForwardOutput:
    """One forward + sample with everything still on the device (nothing synchronized)."""

    logits_output: LogitsOutput
    sampler_output: SamplerOutput
    prompt_logprobs: list | None


@dataclass
class GenerationBatchResult:
    """A pass's result as the scheduler reads it: the sampled ids on the host, the time it took."""

    logits_output: LogitsOutput
    sampler_output: SamplerOutput | None
    next_token_ids: list[int]
    forward_ms: float
    prompt_logprobs: list | None = None  # per request, from compute_prompt_logprobs


# ==== the model worker ===============================================================================
class ModelFacts(Protocol):
    """The model numbers the scheduler needs (ModelConfig has them and more)."""

    @property
    def context_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def eos_token_ids(self) -> list[int]: ...


class AttnBackendFacts(Protocol):
    @property
    def name(self) -> str: ...


class HugePagesFacts(Protocol):
    def describe(self) -> str: ...


class PreparedModelFacts(Protocol):
    @property
    def model_dir(self) -> Any: ...  # a Path, or None where no model files exist


class RunnerFacts(Protocol):
    """What the scheduler reads off its worker's runner: sizes, the KV pools it allocates from, and
    the facts it reports when the process is ready (ModelRunner is the real one)."""

    @property
    def model_config(self) -> ModelFacts: ...
    @property
    def max_total_num_tokens(self) -> int: ...
    @property
    def max_running_requests(self) -> int: ...
    @property
    def req_to_token_pool(self) -> ReqToTokenPool: ...
    @property
    def token_to_kv_pool_allocator(self) -> TokenToKVPoolAllocator: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def kv_head_num(self) -> int: ...
    @property
    def attn_backend(self) -> AttnBackendFacts: ...
    @property
    def attention_backend_name(self) -> str | None: ...
    @property
    def prepared(self) -> PreparedModelFacts: ...
    @property
    def load_time_s(self) -> float: ...
    @property
    def huge_pages(self) -> HugePagesFacts | None: ...
    @property
    def moe_blocks(self) -> list: ...  # (layer id, sparse block) of each mixture-of-experts layer

    def graph_plan(
        self, forward_mode: ForwardMode, batch_size: int, return_all_logits: bool = False
    ) -> tuple[bool, int]:
        """(CUDA graph replayed?, padded batch size) of a pass, for the trace."""
        ...


class ModelWorker(Protocol):
    """Runs one batch: `forward_batch_generation` for the normal loop (tokens on the host);
    `forward_batch` is what the overlap loop's client runs on its thread (TpModelWorkerClient)."""

    @property
    def model_runner(self) -> RunnerFacts: ...

    def forward_batch(self, mwb: ModelWorkerBatch) -> ForwardOutput: ...

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> GenerationBatchResult: ...


class OverlapWorker(Protocol):
    """The overlap loop's worker client: `forward_batch_generation` returns at once with a
    placeholder id per row and a handle; `resolve_batch_result(handle)` waits for that launch."""

    num_threads: int

    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> tuple[list[int], Any]: ...

    def resolve_batch_result(self, handle: Any) -> GenerationBatchResult: ...

    def shutdown(self) -> None: ...


class Drafter(Protocol):
    """Speculative decoding's proposals (None on the Scheduler: NGRAM proposes from each request's text).
    `runner` is the draft model's own runner whose pool the KV check counts, or None."""

    runner: Any

    def propose(self, reqs: list[Req], budgets: list[int]) -> list[list[int]]: ...

    def release(self) -> None: ...

    def held_tokens(self) -> int: ...


class TextDecoder(Protocol):
    """Token ids to text: the `tokenizers` library's Tokenizer, or anything with its `decode`."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


# ==== I/O and the step clock =========================================================================
class SchedulerIO(Protocol):
    """Requests and control messages in, outputs and replies out."""

    def recv(self, timeout_ms: int = 0) -> list:
        """Every message waiting; with `timeout_ms`, first wait up to that long for one."""
        ...

    def send(self, msg: Msg) -> None: ...


class Disaggregation(Protocol):
    """One side of disaggregated serving, composed into the Scheduler (core/disaggregation/). The Scheduler
    calls it at five points: a request admitted, a prefill finished, a request's end sent, an abort, and
    the top of every step."""

    mode: str  # "prefill" | "decode"

    def admit(self, req: Any, recv: Any) -> str | None:
        """A new request: None, or why it cannot be served here."""

    def takes(self, req: Any) -> bool:
        """Whether this side keeps the admitted request (decode: until its KV arrives) instead of the queue."""

    def on_prefilled(self, req: Any) -> None:
        """A request's prefill finished (first token sampled), before its KV goes into the radix cache."""

    def on_finished(self, req: Any) -> None:
        """A request's end is being sent to the client."""

    def abort(self, rid: str) -> None: ...

    def step(self) -> None:
        """Top of every loop iteration: finished transfers are traced (and, on decode, installed)."""

    def has_pending(self) -> bool:
        """Requests held here that the loop must keep polling for (not batch work)."""

    def held_reqs(self) -> list[Any]:
        """Requests holding a row and KV slots outside the scheduler's queues (for the KV check)."""

    def fill_state(self, state: dict) -> None: ...

    def close(self) -> None: ...


class SchedulerState(Protocol):
    """What a StepClock reads of the Scheduler it paces."""

    io: SchedulerIO
    tracer: Tracer
    paused: bool
    step_credits: int

    def has_work(self) -> bool: ...

    def has_batch_work(self) -> bool: ...

    def kv_used(self) -> int: ...


class StepClock(Protocol):
    """When the loop's steps happen, and what is noted around them.

    `recv` is the top of every iteration on TP rank 0: the messages the step processes (it may
    wait for them; it decides how long the loop sleeps when idle). `after_step` runs at the end of
    every iteration (`batch` None when nothing ran). `fill_state` adds what the clock keeps to
    get_internal_state's reply."""

    def recv(self, scheduler: SchedulerState) -> list: ...

    def after_step(self, scheduler: SchedulerState, batch: ScheduleBatch | None) -> None: ...

    def fill_state(self, state: GetInternalStateReqOutput) -> None: ...


class HostStepClock:
    """The default StepClock: the host's time. Read what is waiting; with no work (or paused),
    wait up to 50 ms for a message, so an idle loop does not spin."""

    IDLE_WAIT_MS = 50
    # Only PD transfers in flight (nothing to run until a KV arrives): poll often, without spinning a core.
    TRANSFER_POLL_MS = 1

    def recv(self, scheduler: SchedulerState) -> list:
        paused = scheduler.paused and scheduler.step_credits == 0
        idle = paused or not scheduler.has_batch_work()
        if idle:
            scheduler.tracer.flush()
        wait = 0 if not idle else (self.TRANSFER_POLL_MS if not paused and scheduler.has_work() else self.IDLE_WAIT_MS)
        return scheduler.io.recv(wait)

    def after_step(self, scheduler: SchedulerState, batch: ScheduleBatch | None) -> None:
        pass

    def fill_state(self, state: GetInternalStateReqOutput) -> None:
        pass


# ==== how the scheduler process is made ==============================================================
@dataclass
class SchedulerParts:
    """What a SchedulerFactory hands `run_scheduler_process`: the arguments the Scheduler runs with
    and its collaborators; each None is built by the Scheduler as usual (the real one).
    `tp_size`: the scheduler's TP group, if not the process's (1: one process stands for every
    device). `thread_plan`: the compute threads' plan (cpu_threads.ThreadPlan), if it has one.
    `disaggregation`: on a PD server, builds its side from the Scheduler (a simulated one hands in a
    transport timed by its link model); None: the Scheduler builds the real one for its mode."""

    server_args: ServerArgs
    worker: ModelWorker | None = None
    io: SchedulerIO | None = None
    tokenizer: TextDecoder | None = None
    step_clock: StepClock | None = None
    drafter: Drafter | None = None
    overlap_worker: OverlapWorker | None = None
    tp_size: int | None = None
    thread_plan: Any = None
    disaggregation: Callable[[Any], Disaggregation] | None = None  # the Scheduler -> its PD side (None: by mode)


class SchedulerFactory(Protocol):
    """Builds a scheduler process's parts (spawned: must be a picklable module-level function)."""

    def __call__(
        self, server_args: ServerArgs, port_args: PortArgs, tp_rank: int, tp_size: int, dp_rank: int
    ) -> SchedulerParts: ...


@dataclass(frozen=True)
class Deployment:
    """What an engine serves, as the processes and views need to know it; resolved from ServerArgs
    once, where the engine is built (core/deployment.py). The default: a real model.

    `scheduler_factory`: the scheduler process's parts (None: the real worker, sockets and threads).
    `loads_weights`: False when the worker knows the model by name only (the default model's
    tokenizer then stands in). `one_process_per_replica`: one scheduler process stands for all of a
    replica's tp_size devices. `shared_clock`: the engine's processes stamp with one clock kept in a
    file (trace/clock.py SharedClock) rather than each with the host's. `badge`: what every view
    and the trace's header put before the model's name ('' for none). `metric_labels`: extra
    labels on every /metrics series."""

    scheduler_factory: SchedulerFactory | None = None
    loads_weights: bool = True
    one_process_per_replica: bool = False
    shared_clock: bool = False
    badge: str = ""
    metric_labels: tuple[tuple[str, str], ...] = ()


# ==== shared stand-ins: the tests' and the simulator's ================================================
@dataclass
class PoolModelConfig:
    """ModelFacts without a model."""

    context_len: int
    vocab_size: int
    eos_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Named:
    name: str


@dataclass
class _NoModelDir:
    model_dir: Any = None


class PoolRunner:
    """RunnerFacts over real pools and no model, sized as ModelRunner sizes them: `max_total_tokens`
    KV slots, `max_running_requests + 1` request rows of context_len + 8. What the tests' stand-in
    worker and the simulator's worker hand the scheduler; `allocator` replaces the KV allocator."""

    def __init__(
        self,
        model_config: PoolModelConfig,
        max_total_tokens: int,
        max_running_requests: int,
        *,
        allocator: TokenToKVPoolAllocator | None = None,
        dtype: torch.dtype = torch.float32,
        backend_name: str = "stand-in",
        kv_head_num: int = 1,
    ):
        self.model_config = model_config
        self.max_total_num_tokens = max_total_tokens
        self.max_running_requests = max_running_requests
        self.req_to_token_pool = ReqToTokenPool(max_running_requests + 1, model_config.context_len + 8)
        self.token_to_kv_pool_allocator = (
            allocator if allocator is not None else TokenToKVPoolAllocator(max_total_tokens)
        )
        # HiCache with no K/V tensors (the simulator): the KV bytes a token would take, which the host
        # pool reports and the simulated worker charges (0: unknown); the worker sets it.
        self.kv_bytes_per_token = 0
        self.device = "cpu"
        self.dtype = dtype
        self.kv_head_num = kv_head_num
        self.attn_backend = _Named(backend_name)
        self.attention_backend_name: str | None = None
        self.prepared = _NoModelDir()
        self.load_time_s = 0.0
        self.huge_pages: HugePagesFacts | None = None
        self.moe_blocks: list = []

    def graph_plan(
        self, forward_mode: ForwardMode, batch_size: int, return_all_logits: bool = False
    ) -> tuple[bool, int]:
        return False, batch_size


class ListIO:
    """SchedulerIO as two lists: the driver appends to `inbox`, reads (and clears) `outbox`.
    With `roundtrip`, every message goes through msgspec both ways, as over ZMQ (the tests)."""

    def __init__(self, roundtrip: bool = False):
        self.inbox: list[Msg] = []
        self.outbox: list[Msg] = []
        self.roundtrip = roundtrip

    def recv(self, timeout_ms: int = 0) -> list:
        out, self.inbox = self.inbox, []
        return [decode_msg(encode_msg(m)) for m in out] if self.roundtrip else out

    def send(self, msg: Msg) -> None:
        self.outbox.append(decode_msg(encode_msg(msg)) if self.roundtrip else msg)
