"""The Scheduler process: continuous batching over a radix prefix cache.

One iteration of the event loop (`event_loop_normal`) is the whole story:

    recv_requests()            take new requests and control messages off the socket
    process_input_requests()   queue new requests, answer control messages
    get_next_batch_to_run()    a prefill batch if one can be formed, else the decode batch
    run_batch()                forward + sample on the model worker
    process_batch_result()     append tokens, check stops, hand KV to the radix cache,
                               stream new tokens to the detokenizer

Every step emits trace events (batch composition, queues, KV usage, cache activity).

`event_loop_overlap` (scheduler_overlap.py; `Engine(disable_overlap_schedule=False)`, CLI
`--no-disable-overlap-schedule`) runs the same steps but launches batch N before processing
batch N-1's result.
Both loops share everything below; the pieces that care are marked "overlap".

Seams (scheduler_contract.py, the contract in one file): the Scheduler is handed its model worker,
its I/O, its tokenizer, its tracer, its step clock, its drafter and its overlap client when given
(`Scheduler(..., worker=, io=, tokenizer=, tracer=, step_clock=, drafter=, overlap_worker=)`); each
one not given is the real one (TpModelWorker, ZMQ sockets, the host's time). `run_scheduler_process`
asks a `SchedulerFactory` for them (the real one: `real_scheduler_parts`; a simulated deployment
brings its own). One iteration of either loop is a method (`step_normal`, `step_overlap`), so the
in-process tests (tests/scheduler_harness.py) and the offline simulator drive the same code with
their own workers and a list-based I/O. The KV integrity check is scheduler_kv_check.py.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import zmq
from workbench.core.args import ServerArgs
from workbench.core.constrained.grammar import GrammarBackend, constraint_kind, grammar_of
from workbench.core.distributed.msg_broadcast import broadcast_msgs
from workbench.core.engine_log import LOG_PATH_KEY, attach_log_file
from workbench.core.io_struct import (
    AbortReq,
    DestroyWeightsUpdateGroupReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetWeightsByNameReq,
    InitWeightsUpdateGroupReq,
    LoadLoRAAdapterReq,
    SetTraceReq,
    StepGateReq,
    StepGateReqOutput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReq,
    UpdateWeightsFromDiskReq,
    UpdateWeightsFromDistributedReq,
    UpdateWeightsFromTensorReq,
)
from workbench.core.ipc import PortArgs, get_zmq_socket, recv_all_nowait, send_msg
from workbench.core.lora import scheduling as lora_sched
from workbench.core.managers.schedule_batch import FinishReason, Req, ScheduleBatch
from workbench.core.managers.schedule_policy import AddReqResult, HeldBack, PrefillAdder, SchedulePolicy
from workbench.core.managers.scheduler_contract import (
    Disaggregation,
    Drafter,
    HostStepClock,
    ModelWorker,
    OverlapWorker,
    SchedulerFactory,
    SchedulerIO,
    SchedulerParts,
    StepClock,
    TextDecoder,
)
from workbench.core.managers.scheduler_control import SchedulerControlMixin
from workbench.core.managers.scheduler_kv_check import SchedulerKVCheckMixin, kv_check_enabled
from workbench.core.managers.scheduler_narration import StepNarrator
from workbench.core.managers.scheduler_output import SchedulerOutputMixin
from workbench.core.managers.scheduler_overlap import InflightBatch, SchedulerOverlapMixin
from workbench.core.managers.scheduler_priority import PriorityPreemption
from workbench.core.managers.tp_worker import GenerationBatchResult, TpModelWorker
from workbench.core.mem_cache.chunk_cache import ChunkCache
from workbench.core.mem_cache.radix_cache import RadixCache
from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev
from workbench.core.trace.startup import set_phase_sink
from workbench.core.trace.tracer import Tracer
from workbench.core.trace.tree_digest import TREE_DIGEST_ENV

if TYPE_CHECKING:
    from tokenizers import Tokenizer
    from workbench.core.model_executor.cpu_threads import AdaptiveThreads, ThreadPlan

logger = logging.getLogger(__name__)

# new_token_ratio: the fraction of each running request's remaining max_new_tokens the
# admission budget reserves. It starts high (conservative), decays each decode step as
# requests finish early, and jumps back up after a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler(SchedulerOutputMixin, SchedulerOverlapMixin, SchedulerKVCheckMixin, SchedulerControlMixin):
    def __init__(
        self,
        server_args: ServerArgs,
        port_args: PortArgs | None,
        tp_rank: int = 0,
        tp_size: int = 1,
        prepared=None,
        proc_name: str = "scheduler",
        *,
        worker: ModelWorker | None = None,
        io: SchedulerIO | None = None,
        tokenizer: TextDecoder | None = None,
        tracer: Tracer | None = None,
        step_clock: StepClock | None = None,
        drafter: Drafter | None = None,
        overlap_worker: OverlapWorker | None = None,
        disaggregation: Callable[[Scheduler], Disaggregation] | None = None,
    ):
        """The collaborators (scheduler_contract.py) are built here when not given: `worker` a
        TpModelWorker, `io` ZMQ sockets (ZmqSchedulerIO), `tokenizer` the model's fast tokenizer,
        `tracer` one on the engine's trace socket, `step_clock` the host's time (HostStepClock),
        `drafter` the STANDALONE draft model when asked for (None: NGRAM, or no speculation),
        `overlap_worker` a TpModelWorkerClient over `worker` when the overlap loop starts,
        `disaggregation` (a factory: this Scheduler -> its PD side) the real one for
        --disaggregation-mode."""
        self.server_args = server_args
        self.port_args = port_args
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # Only TP rank 0 talks to the rest of the engine: it traces, receives and sends.
        if tracer is None:
            endpoint = port_args.trace_ipc_name if tp_rank == 0 and port_args is not None else None
            tracer = Tracer(proc_name, endpoint=endpoint)
        self.tracer = tracer
        self.tp_worker: ModelWorker = (
            worker if worker is not None else TpModelWorker(server_args, tp_rank, tp_size, prepared)
        )
        self.step_clock: StepClock = step_clock if step_clock is not None else HostStepClock()
        runner = self.tp_worker.model_runner
        self.model_config = runner.model_config
        self.max_total_num_tokens = runner.max_total_num_tokens
        self.max_running_requests = runner.max_running_requests
        self.req_to_token_pool = runner.req_to_token_pool
        self.token_to_kv_pool_allocator = runner.token_to_kv_pool_allocator
        self.tokenizer = tokenizer if tokenizer is not None else _load_fast_tokenizer(runner.prepared.model_dir)
        # Structured outputs: made at the first constrained request (it loads transformers' tokenizer).
        self.grammar_backend: GrammarBackend | None = None

        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache = cache_cls(
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            on_event=self._on_cache_event,
            decode_text=self._decode_preview,
        )
        if server_args.enable_hierarchical_cache:  # HiCache: a host tier under the device pool
            from workbench.core.mem_cache.hiradix_cache import make_hiradix_cache

            self.tree_cache = make_hiradix_cache(
                server_args, runner, on_event=self._on_cache_event, decode_text=self._decode_preview
            )
            # Overlap loop: a copy on this thread first waits for a prefill in flight (scheduler_overlap.py).
            self.tree_cache.sync_before_copy = self.sync_inflight_for_cache_copy
        # Multi-LoRA (core/lora/): the runner's adapter manager (None without --enable-lora).
        self.lora = getattr(runner, "lora_manager", None)
        if self.lora is not None:
            self.lora.in_use = lambda: lora_sched.lora_in_use(self)
        self.lora_waited: list[str] = []  # requests the last admission left waiting for an adapter slot
        self.policy = SchedulePolicy(
            server_args.schedule_policy,
            self.tree_cache,
            not server_args.disable_radix_cache,
            server_args.random_seed,
            enable_priority_scheduling=server_args.enable_priority_scheduling,
            schedule_low_priority_values_first=server_args.schedule_low_priority_values_first,
        )
        self.priority = PriorityPreemption(self)  # --enable-priority-scheduling: preemption (scheduler_priority.py)
        self.chunked_prefill_size = server_args.resolved_chunked_prefill_size()
        self.stream_interval = server_args.stream_interval
        self.max_prefill_tokens = server_args.max_prefill_tokens
        self.max_req_input_len = self.model_config.context_len - 1

        self.waiting_queue: list[Req] = []
        self.adaptive_threads: AdaptiveThreads | None = None  # set by init_adaptive_threads (CPU, one rank per node)
        self.held_back: list[HeldBack] = []  # waiting requests the last prefill held back (trace)
        # batch.decision (trace)
        self.narrator = StepNarrator(self.token_to_kv_pool_allocator, self.tree_cache, self.max_total_num_tokens)
        # Speculative decoding: drafts per request per step. They are proposed from the previous step's
        # tokens, so the overlap loop waits for those before a decode step (needs_output_history).
        self.spec_num_draft = server_args.resolved_num_draft_tokens()
        # STANDALONE: the draft model, in this process (speculative/standalone.py); or one handed in
        self.drafter: Drafter | None = drafter
        if drafter is None and server_args.speculative_algorithm == "STANDALONE":
            from workbench.core.speculative.standalone import StandaloneDrafter

            self.drafter = StandaloneDrafter(
                server_args, self.model_config.vocab_size, self.max_running_requests, self.max_total_num_tokens
            )
        self.spec_verify_steps = 0  # steps that verified drafts
        self.spec_verified_total = 0  # (request, step) pairs verified ...
        self.spec_proposed_total = 0  # ... the drafts they proposed ...
        self.spec_accepted_total = 0  # ... and kept
        self.running_batch: ScheduleBatch = self._new_batch([])
        self.chunked_req: Req | None = None
        self.last_batch: ScheduleBatch | None = None
        # --schedule-conservativeness scales how much decoding admission expects (SGLang's rule).
        c = server_args.schedule_conservativeness
        self.init_new_token_ratio = min(INIT_NEW_TOKEN_RATIO * c, 1.0)
        self.min_new_token_ratio = min(MIN_NEW_TOKEN_RATIO * c, self.init_new_token_ratio)
        self.new_token_ratio = self.init_new_token_ratio
        self.forward_ct = 0
        self.num_retracted_total = 0
        self.last_tree_snapshot_ns = 0
        self.tree_dirty = True
        # Tests: the scheduler's own tree digest after every step (`cache.digest`, core/trace/tree_digest.py).
        self.trace_tree_digest = os.environ.get(TREE_DIGEST_ENV, "") == "1"
        self.last_gen_throughput = 0.0
        self._step_start = 0.0
        self.trace_ns = 0  # time inside tracing code (see `trace_cost`)
        # Step gate: while paused the loop runs only when given step credits.
        self.paused = False
        self.step_credits = 0
        self.pending_step_reply = False
        # Overlap loop: the launch whose result is not processed yet (always None in the normal loop).
        # None (undecided) starts normal; init_adaptive_threads may turn it on once the thread plan is known.
        self.enable_overlap = server_args.disable_overlap_schedule is False
        self.inflight: InflightBatch | None = None
        self.overlap_worker: OverlapWorker | None = overlap_worker
        self.thread_plan: ThreadPlan | None = None  # the compute threads' plan (init_adaptive_threads)
        # KV integrity check when the loop goes idle (scheduler_kv_check.py); once per idle period.
        self.kv_check_enabled = kv_check_enabled(server_args)
        self._kv_checked_idle = True

        if io is None:
            # Ranks > 0 get their input by broadcast from rank 0 and compute the same outputs,
            # which rank 0 alone sends.
            if tp_rank > 0:
                io = _DiscardingIO()
            elif port_args is None:
                raise ValueError("a Scheduler without port_args needs its io (e.g. scheduler_contract.ListIO)")
            else:
                io = ZmqSchedulerIO(port_args)
        self.io: SchedulerIO = io
        # Disaggregated serving (core/disaggregation/): the prefill side's handover or the decode side's
        # queues, composed in; None when one engine does both (--disaggregation-mode null).
        self.disagg: Disaggregation | None = None
        if server_args.disaggregation_mode != "null" and tp_rank == 0 and disaggregation is not None:
            self.disagg = disaggregation(self)  # handed in (a simulated server's transport is timed by a link model)
        elif server_args.disaggregation_mode == "prefill" and tp_rank == 0:
            from workbench.core.disaggregation.prefill import PrefillBootstrap

            self.disagg = PrefillBootstrap(self)
        elif server_args.disaggregation_mode == "decode" and tp_rank == 0:
            from workbench.core.disaggregation.decode import DecodeTransferQueue

            self.disagg = DecodeTransferQueue(self)

    def _new_batch(self, reqs: list[Req]) -> ScheduleBatch:
        return ScheduleBatch(
            reqs,
            self.req_to_token_pool,
            self.token_to_kv_pool_allocator,
            self.tree_cache,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            spec_num_draft=self.spec_num_draft,
            drafter=self.drafter,
        )

    # ==== the event loop ==========================================================
    def event_loop_normal(self) -> None:
        while True:
            self.step_normal()

    def step_normal(self) -> None:
        """One iteration of the normal loop."""
        recv_reqs = self.recv_requests()
        self.process_input_requests(recv_reqs)
        if self.paused and self.step_credits == 0:
            return  # recv_requests blocks briefly: no busy spin
        batch = self.get_next_batch_to_run()
        if batch is not None:
            result = self.run_batch(batch)
            self.process_batch_result(batch, result)
        self.last_batch = batch
        self.finish_step(batch)

    def recv_requests(self) -> list:
        """The messages this step processes, as the step clock takes them off the I/O (the host's:
        everything waiting, after up to 50 ms for one when there is no work).

        Under tensor parallelism rank 0 reads the socket and broadcasts the list, so every
        rank processes the same messages at the same iteration (and others wait in the broadcast).
        """
        msgs = None
        if self.tp_rank == 0:
            msgs = self.step_clock.recv(self)
        if self.tp_size > 1:
            msgs = broadcast_msgs(msgs)
        return msgs if msgs is not None else []

    def process_input_requests(self, recv_reqs: list) -> None:
        for msg in recv_reqs:
            if isinstance(msg, TokenizedGenerateReqInput):
                self.handle_generate_request(msg)
            elif isinstance(msg, AbortReq):
                self.abort_request(msg.rid)
            elif isinstance(msg, FlushCacheReq):
                self.io.send(FlushCacheReqOutput(success=self.flush_cache()))
            elif isinstance(msg, GetInternalStateReq):
                self.io.send(self.get_internal_state())
            elif isinstance(msg, SetTraceReq):
                self.tracer.set_enabled(msg.enabled)
                if msg.enabled:
                    self.emit_snapshot()
            elif isinstance(msg, StepGateReq):
                self.handle_step_gate(msg)
            elif isinstance(msg, (LoadLoRAAdapterReq, UnloadLoRAAdapterReq)):
                self.sync_inflight()  # overlap: the pass in flight reads the adapters
                self.io.send(lora_sched.handle_lora_request(self.lora, msg, lora_sched.lora_in_use(self)))
            elif isinstance(
                msg,
                (
                    UpdateWeightsFromDiskReq,
                    GetWeightsByNameReq,
                    UpdateWeightsFromTensorReq,
                    InitWeightsUpdateGroupReq,
                    UpdateWeightsFromDistributedReq,
                    DestroyWeightsUpdateGroupReq,
                ),
            ):
                self.handle_weights_request(msg)
            else:
                logger.warning("scheduler: ignoring unexpected message %s", type(msg).__name__)
        self.poll_weights_join()  # a weight-group join runs beside the loop: answer it once it has ended

    @contextmanager
    def trace_cost(self):
        """Count the wall time of the block as tracing (`trace_ms` in get_internal_state).

        Used around every traced section of the loop, so `workbench bench trace` can say what
        share of the scheduler's time tracing took, a figure machine noise barely moves."""
        t0 = time.perf_counter_ns()
        try:
            yield
        finally:
            self.trace_ns += time.perf_counter_ns() - t0

    def begin_step(self) -> None:
        self.forward_ct += 1
        self.tracer.begin_step(self.forward_ct)
        self._kv_checked_idle = False
        self._step_start = time.perf_counter()
        self.narrator.begin(self.tracer.clock())

    def finish_step(self, batch: ScheduleBatch | None) -> None:
        # Trace first: a client that steps the scheduler and then reads the trace should
        # find this step's events already on their way (they travel a separate socket).
        if batch is not None:
            self.narrator.end_step(self.tracer, batch, self.waiting_queue, self.running_batch.reqs)
        if self.tracer.enabled:
            with self.trace_cost():
                if batch is not None:
                    self.emit_state()
                else:
                    self.emit_tree_if_due()  # an idle step can change the tree too (an abort frees its locks)
                self.tracer.flush()
        if batch is not None and self.paused and self.step_credits > 0:
            self.step_credits -= 1
            if self.step_credits == 0 and self.pending_step_reply:
                self.pending_step_reply = False
                self.io.send(StepGateReqOutput(paused=True, step=self.forward_ct))
        self.step_clock.after_step(self, batch)

    # ==== requests in =================================================================
    def handle_generate_request(self, recv: TokenizedGenerateReqInput) -> None:
        req = Req(
            recv.rid,
            recv.input_text,
            list(recv.input_ids),
            recv.sampling_params,
            self.model_config.eos_token_ids,
            recv.return_logprob,
            recv.top_logprobs_num,
            recv.logprob_start_len,
            recv.arrival_ts,
            recv.stream,
        )
        req.forced_output_ids = recv.forced_output_ids
        req.forced_drafts = recv.forced_drafts
        req.lora_path = recv.lora_path
        self.priority.assign(req, recv.priority)
        error = None
        if not req.origin_input_ids:
            error = "the prompt is empty"
        elif len(req.origin_input_ids) > self.max_req_input_len:
            error = (
                f"the prompt has {len(req.origin_input_ids)} tokens; this model's context allows "
                f"{self.max_req_input_len}"
            )
        elif len(req.origin_input_ids) + req.sampling_params.max_new_tokens > self.max_total_num_tokens:
            error = (
                f"prompt ({len(req.origin_input_ids)}) + max_new_tokens ({req.sampling_params.max_new_tokens}) "
                f"can never fit in the KV pool of {self.max_total_num_tokens} tokens"
            )
        status = 0
        if error is None and self.disagg is not None:
            error = self.disagg.admit(req, recv)  # PD: the bootstrap room (prefill: one token to sample)
            status = 400 if error is not None else 0  # answered as a bad request, not an empty result
        if error is None and req.lora_path is not None:
            error = lora_sched.attach_lora(self.lora, req, self.tree_cache)
            status = 400 if error is not None else 0  # an unknown adapter is a bad request
        if error is None:
            error = self.attach_grammar(req)
        if error is not None:
            req.finished_reason = FinishReason("abort", message=error, status=status)
            self.stream_output([req])
            return
        if self.disagg is not None and self.disagg.takes(req):
            return  # decode: it waits for its KV in the disaggregation queues, not for a prefill
        self.waiting_queue.append(req)
        if self.tracer.enabled:
            with self.trace_cost():
                self.tracer.emit(
                    ev.ReqQueued(
                        rid=req.rid,
                        prompt_tokens=len(req.origin_input_ids),
                        queue_len=len(self.waiting_queue),
                        constraint=constraint_kind(req.sampling_params) if req.grammar is not None else "",
                        priority=req.priority if self.priority.enabled else None,
                        lora=req.lora_path or "",
                    )
                )

    def attach_grammar(self, req: Req) -> str | None:
        """Give a constrained request (json_schema / regex / ebnf) its grammar matcher; returns
        why it cannot have one (a grammar xgrammar cannot read, or no xgrammar), else None."""
        grammar = grammar_of(req.sampling_params)
        if grammar is None:
            return None
        try:
            if self.grammar_backend is None:
                from workbench.core.model_loader import load_tokenizer  # transformers: only when needed

                model_dir = self.tp_worker.model_runner.prepared.model_dir
                self.grammar_backend = GrammarBackend(
                    load_tokenizer(model_dir), self.model_config.vocab_size, self.model_config.eos_token_ids
                )
            req.grammar = self.grammar_backend.matcher(*grammar)
        except ValueError as e:
            return str(e)
        return None

    def abort_request(self, rid: str) -> None:
        """Abort one request ("" = all): dropped from the queue, or stopped at its next step."""
        keep = []
        for req in self.waiting_queue:
            if rid in ("", req.rid):
                req.finished_reason = FinishReason("abort", message="aborted")
                if req.is_retracted:
                    req.is_retracted = False
                self.stream_output([req])
                if self.tracer.enabled:
                    self.tracer.emit(ev.ReqAborted(rid=req.rid, reason="aborted while waiting"))
            else:
                keep.append(req)
        self.waiting_queue = keep
        for req in (
            self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else []) + self.just_prefilled_reqs()
        ):
            if rid in ("", req.rid) and not req.finished():
                req.to_abort = "aborted"
        if self.disagg is not None:
            self.disagg.abort(rid)

    def just_prefilled_reqs(self) -> list[Req]:
        """Requests of the last prefill batch: out of the queue, in the running batch only next step."""
        if self.last_batch is None or self.last_batch.forward_mode != ForwardMode.EXTEND:
            return []
        return [r for r in self.last_batch.reqs if not r.finished() and r is not self.chunked_req]

    def running_reqs(self) -> list[Req]:
        """Unfinished requests past their prefill: the running batch plus those joining it next step."""
        running = [r for r in self.running_batch.reqs if not r.finished()]
        seen = {id(r) for r in running}
        return running + [r for r in self.just_prefilled_reqs() if id(r) not in seen]

    def has_work(self) -> bool:
        """Anything to run (has_batch_work), or PD requests waiting for their KV to arrive."""
        return self.has_batch_work() or (self.disagg is not None and self.disagg.has_pending())

    def has_batch_work(self) -> bool:
        """Anything queued, running, half-prefilled, just prefilled, or launched and unprocessed."""
        return bool(
            self.waiting_queue
            or any(not r.finished() for r in self.running_batch.reqs)
            or self.chunked_req is not None
            or self.inflight is not None
            or self.just_prefilled_reqs()
        )

    # ==== choosing the next batch ========================================================
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        # Requests that just finished their prefill join the running (decode) batch.
        done_prefill = self.just_prefilled_reqs()
        if done_prefill:
            self.running_batch.merge_batch(self._new_batch(done_prefill))
        self.last_batch = None
        if self.disagg is not None:
            # PD: transfers that ended are traced; on a decode server their requests join the running batch
            # (and queued ones get their slots reserved).
            self.disagg.step()
        if not self.has_batch_work():
            self.running_batch.filter_batch()
            if not self.has_work():
                self.check_kv_invariants_when_idle()
            return None  # idle (or only KV transfers in flight): no step number is used up
        self.begin_step()
        batch = self.get_new_batch_prefill()
        if batch is not None:
            return batch
        if not self.running_batch.is_empty():
            self.update_running_batch()
            return self.running_batch if not self.running_batch.is_empty() else None
        return None

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        # Admission locks the cached prefixes it matches: those slots become held (kv_reused).
        with self.narrator.account("reused"):
            return self._get_new_batch_prefill()

    def _get_new_batch_prefill(self) -> ScheduleBatch | None:
        self.held_back = []
        if self.chunked_req is not None:
            self.continue_chunked_req()
        if not self.waiting_queue and self.chunked_req is None:
            return None
        running = len(self.running_batch.reqs)
        if (
            running >= self.max_running_requests
            and self.chunked_req is None
            and not self.priority.may_preempt(self.waiting_queue, self.running_batch.reqs)
        ):
            self.narrator.admission(None, None, self._running_stop(0))
            return None
        self.policy.calc_priority(self.waiting_queue)
        adder = PrefillAdder(
            self.tree_cache,
            self.token_to_kv_pool_allocator,
            self.running_batch.reqs,
            self.new_token_ratio,
            self.max_prefill_tokens,
            self.chunked_prefill_size,
            in_batch_prefix_caching=not self.server_args.disable_radix_cache,
        )
        # In-batch prefix caching: prompts launched but not processed yet (overlap loop) reach the
        # radix cache only when their result is processed; who shares them waits for that.
        if self.inflight is not None and self.inflight.batch.forward_mode == ForwardMode.EXTEND:
            for req in self.inflight.batch.reqs:
                if req is not self.chunked_req:  # added below with its chunks still to come
                    adder.add_pending(req)
        chunk_carry = None
        if self.chunked_req is not None:
            self.chunked_req.init_next_round_input()  # keep its prefix: its computed part
            chunk_carry = adder.add_chunked_req(self.chunked_req)
        # Multi-LoRA: the adapters the batch runs after this step (running, then admitted) stay within
        # --max-loras-per-batch; a request whose adapter would be one too many waits for a later step.
        lora_running = lora_sched.batch_adapters(self.running_batch.reqs) if self.lora is not None else set()
        self.lora_waited = []
        lora_failed: list[tuple[Req, str]] = []
        for req in self.waiting_queue:
            if self.lora is not None:
                # an adapter that could not be loaded on arrival (every loaded one in use) is loaded now if it can be
                settled = lora_sched.settle(self.lora, req, self.tree_cache)
                if settled not in ("", "wait"):
                    lora_failed.append((req, settled))
                    continue
                if settled == "wait" or not lora_sched.admits(
                    req, lora_running | lora_sched.batch_adapters(adder.can_run_list), self.lora.max_per_batch
                ):
                    self.lora_waited.append(req.rid)
                    continue
            slots_full = running + len(adder.can_run_list) >= self.max_running_requests or (
                self.req_to_token_pool.available_size()
                <= len([r for r in adder.can_run_list if r.req_pool_idx is None])
            )
            if slots_full and not self.priority.enabled:
                adder.note_stop("running")  # no slot, and no one may be preempted: not even matched
                break
            req.init_next_round_input(self.tree_cache)  # (a HiCache match may load its prefix back)
            if slots_full:
                # Priority scheduling: a running request of lower priority may give up its slot.
                if not self.priority.preempt_for(req, adder, need_slot=True):
                    adder.note_stop("running")
                    break
                running = len(self.running_batch.reqs)
            stop_before = adder.stop_reason
            result = adder.add_one_req(req)
            if result == AddReqResult.NO_TOKEN and self.priority.preempt_for(req, adder, need_slot=False):
                adder.stop_reason = stop_before  # it may fit now: the "kv" stop just noted is retried
                result = adder.add_one_req(req)
            if result == AddReqResult.HELD:
                continue  # stays queued, in order; the requests behind it may still fit
            if result != AddReqResult.CONTINUE:
                break
        self.priority.requeue()  # this step's preempted requests wait again (after the loop: not admitted now)
        if lora_failed:  # an adapter that cannot be loaded at all (its file went away meanwhile): a 400
            failed = {id(r) for r, _ in lora_failed}
            self.waiting_queue = [r for r in self.waiting_queue if id(r) not in failed]
            for req, message in lora_failed:
                req.finished_reason = FinishReason("abort", message=message, status=400)
                self.stream_output([req])
                if self.tracer.enabled:
                    self.tracer.emit(ev.ReqAborted(rid=req.rid, reason=message))
        self.narrator.lora_waited = list(self.lora_waited)
        self.held_back = adder.held
        self._fit_prefill_to_pool(adder, chunk_carry)
        self.narrator.admission(adder, self.chunked_req)
        if self.narrator.stop_reason == "running":
            self.narrator.stop_reason = self._running_stop(len(adder.can_run_list))
        if not adder.can_run_list:
            return None
        admitted = set(id(r) for r in adder.can_run_list)
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in admitted]
        self.chunked_req = adder.new_chunked_req or chunk_carry
        batch = self._new_batch(adder.can_run_list)
        batch.chunked_req = self.chunked_req
        for req in adder.can_run_list:
            if req.num_chunks_done == 0 and not req.is_retracted:
                req.cached_tokens = len(req.prefix_indices)
        return batch

    def _running_stop(self, admitted: int) -> str:
        """Why the running limit stopped admission, in truth: "running" when the requests still
        running (plus the `admitted`) fill it, "finishing" when it counted requests that finished
        in the last step. Like SGLang, the limit is checked against the running batch before
        `update_running_batch` filters finished requests out (docs/design.md), so it lags a step."""
        live = sum(1 for r in self.running_batch.reqs if not r.finished())
        rows_free = self.req_to_token_pool.available_size() > admitted  # else the row pool is full, truly
        return "finishing" if live + admitted < self.max_running_requests and rows_free else "running"

    def _fit_prefill_to_pool(self, adder: PrefillAdder, chunk_carry: Req | None) -> None:
        """Give admitted requests back (last first) until the batch's new tokens fit in the pool.

        PrefillAdder's budget already accounts for locked prefixes and running requests' reserves,
        so this is a last guard for what the estimate cannot see (a continuing chunk's own tokens:
        it is admitted unconditionally and is never given back here)."""
        can_run = adder.can_run_list
        need = sum(r.extend_input_len for r in can_run)
        room = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size()
        while can_run and need > room and can_run[-1] is not chunk_carry:
            req = can_run.pop()
            need -= req.extend_input_len
            room += self.tree_cache.dec_lock_ref(req.last_node)
            adder.stop_reason = "kv"  # it goes back to the queue, first of those turned away
            if req is adder.new_chunked_req:
                adder.new_chunked_req = None

    def continue_chunked_req(self) -> None:
        """Before its next chunk: hand the chunks computed so far to the cache (or end an abort).

        Only the slots recorded in the request's row are needed, not the KV values, so this runs
        at scheduling time, even while the previous chunk is still in flight (overlap loop):
        anything that reads those slots is launched after it.
        """
        req = self.chunked_req
        assert req is not None, "continue_chunked_req needs a chunked request"
        if req.to_abort is None:
            self.tree_cache.cache_unfinished_req(req)
            return
        self.sync_inflight()  # overlap: let its last chunk's result be processed first
        req.finished_reason = FinishReason("abort", message=req.to_abort)
        with self.narrator.account("aborted", req.rid):
            self.tree_cache.cache_finished_req(req, kv_len=req.kv_len)
        self.chunked_req = None
        self.stream_output([req])

    def update_running_batch(self) -> None:
        """Drop finished requests; retract some if the pool cannot hold one more token each."""
        batch = self.running_batch
        batch.filter_batch()
        if batch.is_empty():
            return
        need = batch.new_decode_tokens_needed()
        short = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() < need
        if short and self.sync_inflight():
            # overlap: retraction needs every request's real tokens and KV length; the in-flight
            # result may also finish requests and free their KV.
            batch.filter_batch()
            if batch.is_empty():
                return
            need = batch.new_decode_tokens_needed()
            short = self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() < need
        if short:
            self.retract_decode(batch, need)
        self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, self.min_new_token_ratio)

    def retract_decode(self, batch: ScheduleBatch, need: int) -> None:
        """Send decoding requests back to the queue until the rest can take a step."""
        # Retract the requests that have decoded least (cheapest to redo), longest prompt first.
        order = sorted(batch.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        retracted = []
        while order and (
            self.token_to_kv_pool_allocator.available_size() + self.tree_cache.evictable_size() < len(order)
        ):
            req = order.pop(0)
            self.retract_req(req)
            retracted.append(req)
        batch.filter_batch([r for r in batch.reqs if r not in retracted])
        self.waiting_queue = retracted + self.waiting_queue
        self.num_retracted_total += len(retracted)
        # After a retraction, be conservative again about how much decoding lies ahead.
        self.new_token_ratio = self.init_new_token_ratio

    def retract_req(self, req: Req, reason: str = "") -> None:
        """Send one running request back toward the queue: its own KV freed, its cached prefix unlocked,
        to be prefilled again over its prompt and outputs (the caller removes it from the running batch
        and queues it). `reason` says why when it is not the KV pool running out (a preemption)."""
        with self.narrator.account("retracted", req.rid):
            self.release_req_kv(req)
        req.reset_for_retract()
        self.narrator.on_retract(req.rid)
        if self.tracer.enabled:
            self.tracer.emit(
                ev.ReqRetracted(rid=req.rid, output_tokens=len(req.output_ids), reason=reason, priority=req.priority)
            )

    def release_req_kv(self, req: Req) -> None:
        """Free a request's own KV slots and row; the cached prefix stays in the tree."""
        table, row = self.req_to_token_pool.req_to_token, req.req_pool_idx
        assert row is not None, f"{req.rid} holds no request row"
        # With ChunkCache (--disable-radix-cache) prefix_indices are the request's own slots
        # (record_unfinished_req_without_caching): nothing is in a tree, all of them are freed.
        p = 0 if isinstance(self.tree_cache, ChunkCache) else len(req.prefix_indices)
        if req.kv_len > p:
            self.token_to_kv_pool_allocator.free(table[row, p : req.kv_len].clone())
        self.tree_cache.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)

    # ==== running ==================================================================
    def run_batch(self, batch: ScheduleBatch) -> GenerationBatchResult:
        mwb, step_reqs = self.prepare_launch(batch)
        schedule_ms = (time.perf_counter() - self._step_start) * 1000
        result = self.tp_worker.forward_batch_generation(mwb)
        if self.tracer.enabled:
            with self.trace_cost():
                self.emit_batch_step(batch, schedule_ms, result.forward_ms, step_reqs)
                self.emit_moe_routing(step_reqs, getattr(result.logits_output, "routing", None))
        self.note_forward_time(batch, result.forward_ms)
        return result

    def prepare_launch(self, batch: ScheduleBatch):
        """Allocate KV, advance the requests' bookkeeping and build the worker batch."""
        mwb = batch.prepare_for_decode() if batch is self.running_batch else batch.prepare_for_extend()
        mwb.reqs = batch.reqs  # rows' requests, for a worker that reads them (forced_output_ids)
        # For the trace: whether this pass replays a CUDA graph, and the bucket it pads to.
        batch.cuda_graph, batch.padded_size = self.tp_worker.model_runner.graph_plan(
            mwb.forward_mode, len(batch.reqs), mwb.return_all_logits
        )
        step_reqs = None
        if self.tracer.enabled:
            with self.trace_cost():
                step_reqs = self.describe_batch_step(batch)
        if batch.forward_mode == ForwardMode.EXTEND:
            for req in batch.reqs:
                req.num_chunks_done += 1
        if self.grammar_backend is not None:
            # Structured outputs: what each constrained row's grammar allows at this step (the
            # overlap loop waits for the previous token first: needs_output_history).
            t0 = time.perf_counter()
            bitmask = self.grammar_backend.fill_bitmask([r.grammar for r in batch.reqs])
            if bitmask is not None:
                mwb.sampling_info.vocab_mask = bitmask
                rows = sum(1 for r in batch.reqs if r.grammar is not None)
                self.narrator.on_mask(rows, 1000 * (time.perf_counter() - t0))
        return mwb, step_reqs

    def note_forward_time(self, batch: ScheduleBatch, forward_ms: float) -> None:
        if batch.forward_mode == ForwardMode.DECODE and forward_ms > 0 and self.adaptive_threads is not None:
            self.adaptive_threads.on_decode_step(len(batch.reqs), forward_ms)
        if batch.forward_mode == ForwardMode.DECODE and forward_ms > 0:
            self.last_gen_throughput = len(batch.reqs) / (forward_ms / 1000)

    # ==== helpers ====================================================================
    def _decode_preview(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _on_cache_event(self, event) -> None:
        self.tree_dirty = True
        if type(event) is ev.CacheEvict:
            self.narrator.on_evict(event)
        elif type(event) is ev.HiCacheTransfer:
            self.narrator.on_hicache(event)
        if self.tracer.enabled:
            with self.trace_cost():
                self.tracer.emit(event)


class ZmqSchedulerIO:
    """The scheduler's I/O in the engine: requests from the TokenizerManager (or the DP controller),
    outputs to the Detokenizer, over ZMQ. Any object with these two methods can stand in."""

    def __init__(self, port_args: PortArgs):
        ctx = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(ctx, zmq.PULL, port_args.scheduler_input_ipc_name, bind=True)
        self.send_to_detokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args.detokenizer_ipc_name, bind=False)
        self.poller = zmq.Poller()
        self.poller.register(self.recv_from_tokenizer, zmq.POLLIN)

    def recv(self, timeout_ms: int = 0) -> list:
        """Every message waiting; with `timeout_ms`, first wait up to that long for one."""
        if timeout_ms:
            self.poller.poll(timeout_ms)
        return recv_all_nowait(self.recv_from_tokenizer)

    def send(self, msg) -> None:
        send_msg(self.send_to_detokenizer, msg)


class _DiscardingIO:
    """The I/O of a TP rank > 0: its input comes by broadcast, rank 0 sends the identical outputs."""

    def recv(self, timeout_ms: int = 0) -> list:
        return []

    def send(self, msg) -> None:
        pass


def load_fast_tokenizer(model_dir) -> Tokenizer:
    """The `tokenizers` library directly: fast to load, no transformers import in this process."""
    from pathlib import Path

    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))


_load_fast_tokenizer = load_fast_tokenizer  # the Scheduler's default (a test swaps it for a stub)


def real_scheduler_parts(
    server_args: ServerArgs, port_args: PortArgs, tp_rank: int, tp_size: int, dp_rank: int
) -> SchedulerParts:
    """The SchedulerFactory of a real engine: this rank's compute threads planned and pinned (before
    anything starts torch's OpenMP team: its threads inherit the affinity); every collaborator the
    Scheduler's own default."""
    return SchedulerParts(server_args, thread_plan=_apply_thread_plan(server_args, tp_rank, tp_size))


def run_scheduler_process(
    server_args: ServerArgs,
    port_args: PortArgs,
    pipe_writer,
    tp_rank: int = 0,
    tp_size: int = 1,
    proc_name: str = "scheduler",
    dp_rank: int = 0,
    scheduler_factory: SchedulerFactory | None = None,
) -> None:
    """Spawn target: build the Scheduler from `scheduler_factory`'s parts (None: the real ones,
    `real_scheduler_parts`), report ready (or the error), run the loop."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    try:
        trace_clock.attach(port_args.extra.get(trace_clock.SHARED_CLOCK_KEY))  # the engine's, if it shares one
        attach_log_file(port_args.extra.get(LOG_PATH_KEY), own_process=True)
        if tp_rank == 0 and dp_rank == 0:  # one rank speaks for the start-up (the Engine shows its phases)
            set_phase_sink(lambda e: pipe_writer.send({"status": "phase", "event": ev.encode_batch([e])}))
        factory = scheduler_factory if scheduler_factory is not None else real_scheduler_parts
        parts = factory(server_args, port_args, tp_rank, tp_size, dp_rank)
        scheduler = Scheduler(
            parts.server_args,
            port_args,
            tp_rank,
            parts.tp_size if parts.tp_size is not None else tp_size,
            proc_name=proc_name,
            worker=parts.worker,
            io=parts.io,
            tokenizer=parts.tokenizer,
            step_clock=parts.step_clock,
            drafter=parts.drafter,
            overlap_worker=parts.overlap_worker,
            disaggregation=parts.disaggregation,
        )
        plan = parts.thread_plan
        if plan is not None:
            scheduler.init_adaptive_threads(plan)
        runner = scheduler.tp_worker.model_runner
        if tp_rank == 0:
            scheduler.tracer.set_enabled(True)
            scheduler.tracer.emit(ev.ProcStarted(pid=os.getpid(), role=proc_name))
            scheduler.tracer.flush()
            scheduler.tracer.set_enabled(False)
        set_phase_sink(None)
        from workbench.core.layers.cpu_ops import gemm as cpu_gemm  # what this process's model measured at load

        pipe_writer.send(
            {
                "status": "ready",
                "role": proc_name,
                "pid": os.getpid(),
                "max_total_num_tokens": scheduler.max_total_num_tokens,
                "max_running_requests": scheduler.max_running_requests,
                "context_len": scheduler.model_config.context_len,
                "dtype": str(runner.dtype).replace("torch.", ""),
                "attention_backend": runner.attention_backend_name,
                "chunked_prefill_size": scheduler.chunked_prefill_size,
                "device": str(runner.device),
                "tp_rank": tp_rank,
                "tp_size": tp_size,
                "kv_head_num": runner.kv_head_num,
                "threads": f"{plan.describe() if plan else 'no compute threads'}; {scheduler.loop_text()}",
                "load_time_s": runner.load_time_s,
                "huge_pages": runner.huge_pages.describe() if runner.huge_pages is not None else "",
                "linears": cpu_gemm.ready_text() if str(runner.device) == "cpu" else "",
            }
        )
    except Exception as exc:
        import traceback

        pipe_writer.send(
            {
                "status": "error",
                "role": proc_name,
                "error": f"{type(exc).__name__}: {exc}",
                "traceback": traceback.format_exc(),
            }
        )
        raise SystemExit(1)
    _watch_parent()
    if scheduler.enable_overlap:
        scheduler.event_loop_overlap()
    else:
        scheduler.event_loop_normal()


def _apply_thread_plan(server_args: ServerArgs, tp_rank: int, tp_size: int):
    """Pin this rank's cores (if asked) and set its starting thread count; returns the ThreadPlan."""
    import torch
    from workbench.core.model_executor.cpu_threads import plan_threads

    ranks_here = max(1, tp_size // server_args.nnodes)  # TP ranks on one node share its cores
    plan = plan_threads(
        server_args.num_threads,
        server_args.cpu_omp_threads_bind,
        tp_rank % ranks_here,
        ranks_here,
        server_args.resolved_device(),
    )
    if plan.cores:
        os.sched_setaffinity(0, plan.cores)
    torch.set_num_threads(plan.threads)
    logger.info("scheduler rank %d: %s", tp_rank, plan.describe())
    return plan


def _watch_parent() -> None:
    """Exit when the parent dies, so no scheduler outlives its engine."""
    import multiprocessing
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return
    ppid = parent.pid

    def watch():
        while True:
            time.sleep(1.0)
            if os.getppid() != ppid:
                os._exit(0)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()
