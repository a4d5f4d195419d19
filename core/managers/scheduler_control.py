"""The Scheduler's answers to control messages and its knobs between steps: flushing the cache, the step
gate (pause / resume / step N), weight updates, the internal state /get_server_info reads, and the compute
threads' count. A mixin of `Scheduler` (scheduler.py), as the output and overlap halves are; none of it runs
inside a step, so the event loop in scheduler.py reads without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.core.io_struct import (
    GetInternalStateReqOutput,
    InitWeightsUpdateGroupReq,
    StepGateReq,
    StepGateReqOutput,
    UpdateWeightsReqOutput,
)
from workbench.core.trace import events as ev

if TYPE_CHECKING:
    from workbench.core.args import ServerArgs
    from workbench.core.managers.schedule_batch import Req, ScheduleBatch
    from workbench.core.managers.scheduler_contract import (
        Disaggregation,
        ModelWorker,
        OverlapWorker,
        SchedulerIO,
        StepClock,
    )
    from workbench.core.mem_cache.chunk_cache import ChunkCache
    from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
    from workbench.core.mem_cache.radix_cache import RadixCache
    from workbench.core.model_executor.cpu_threads import AdaptiveThreads
    from workbench.core.trace.tracer import Tracer


class SchedulerControlMixin:
    adaptive_threads: AdaptiveThreads | None  # set by Scheduler.__init__ (None) and init_adaptive_threads

    # The Scheduler's state these answers read (set in Scheduler.__init__; bare annotations, so
    # they only tell the type checker what the Scheduler mixing this in holds).
    server_args: ServerArgs
    tp_worker: ModelWorker
    overlap_worker: OverlapWorker | None
    step_clock: StepClock
    io: SchedulerIO
    tracer: Tracer
    disagg: Disaggregation | None
    tree_cache: ChunkCache | RadixCache
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    running_batch: ScheduleBatch
    waiting_queue: list[Req]
    max_total_num_tokens: int
    max_running_requests: int
    max_req_input_len: int
    last_gen_throughput: float
    trace_ns: int
    forward_ct: int
    num_retracted_total: int
    spec_num_draft: int
    spec_verified_total: int
    spec_proposed_total: int
    spec_accepted_total: int
    kv_check_enabled: bool

    if TYPE_CHECKING:  # the Scheduler's methods these answers call (scheduler*.py)

        def has_work(self) -> bool: ...
        def running_reqs(self) -> list[Req]: ...
        def sync_inflight(self) -> bool: ...
        def emit_snapshot(self) -> None: ...
        def check_kv_invariants(self) -> dict: ...

    # ==== control ====================================================================
    def flush_cache(self) -> bool:
        """Reset the radix cache; only allowed when idle (nothing queued or running)."""
        self.sync_inflight()
        if self.has_work():
            return False
        self.running_batch.filter_batch()
        self.tree_cache.reset()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool_allocator.clear()
        self.tree_dirty = True
        if self.tracer.enabled:
            self.emit_snapshot()
        return True

    # ==== compute threads (core/model_executor/cpu_threads.py) ===========================
    def init_adaptive_threads(self, plan) -> None:
        """Let the thread count follow the neighbours' load, when the plan allows it."""
        from workbench.core.model_executor.cpu_threads import AdaptiveThreads, overlap_by_default

        self.thread_plan = plan
        if plan.adaptive:
            self.adaptive_threads = AdaptiveThreads(plan, apply=self.set_num_threads)
        sa = self.server_args
        if sa.disable_overlap_schedule is None and not self.spec_num_draft:
            self.enable_overlap = overlap_by_default(plan, sa.resolved_device(), sa.dp_size)

    def loop_text(self) -> str:
        """Which event loop runs and why, for the start-up line."""
        sa = self.server_args
        if not self.enable_overlap:
            return "normal loop"
        if sa.disable_overlap_schedule is False:
            return "overlap loop"
        return "overlap loop (a core is free beside the compute threads)"

    def set_num_threads(self, n: int) -> None:
        """Between steps: this thread now, the overlap loop's forward thread before its next batch."""
        import torch

        torch.set_num_threads(n)
        if self.overlap_worker is not None:
            self.overlap_worker.num_threads = n

    def _num_threads(self) -> int:
        import torch

        if self.overlap_worker is not None:
            return self.overlap_worker.num_threads
        return torch.get_num_threads()

    def kv_used(self) -> int:
        """KV tokens in use: neither free nor evictable from the cache."""
        free = self.token_to_kv_pool_allocator.available_size()
        return self.max_total_num_tokens - free - self.tree_cache.evictable_size()

    def get_internal_state(self) -> GetInternalStateReqOutput:
        at = self.adaptive_threads
        alloc = self.token_to_kv_pool_allocator
        free = alloc.available_size()
        evictable = self.tree_cache.evictable_size()
        state = GetInternalStateReqOutput(
            num_waiting=len(self.waiting_queue),
            num_running=len(self.running_reqs()),
            kv_total=self.max_total_num_tokens,
            kv_free=free,
            kv_evictable=evictable,
            kv_used=self.max_total_num_tokens - free - evictable,
            req_slots_free=self.req_to_token_pool.available_size(),
            req_slots_total=self.req_to_token_pool.size,
            step=self.forward_ct,
            max_total_num_tokens=self.max_total_num_tokens,
            max_running_requests=self.max_running_requests,
            max_req_input_len=self.max_req_input_len,
            last_gen_throughput=self.last_gen_throughput,
            trace_ms=self.trace_ns / 1e6,
            num_threads=self._num_threads(),
            others_load=-1.0 if at is None or at.others is None else round(at.others, 3),
            thread_probes=0 if at is None else at.policy.probes,
            kv_check_error=self.kv_check_error_now(),
            spec_verified=self.spec_verified_total,
            spec_proposed=self.spec_proposed_total,
            spec_accepted=self.spec_accepted_total,
            retracted_total=self.num_retracted_total,
        )
        if self.disagg is not None:
            state.disaggregation = {}
            self.disagg.fill_state(state.disaggregation)
            # PD decode: requests reserving slots or waiting for their KV are waiting requests too.
            state.num_waiting += int(state.disaggregation.get("pd_prealloc", 0))
            state.num_waiting += int(state.disaggregation.get("pd_transferring", 0))
        internal = getattr(self.tree_cache, "internal_state", None)  # HiCache's counters
        if internal is not None:
            state.hicache = internal()
        self.step_clock.fill_state(state)
        return state

    def kv_check_error_now(self) -> str:
        """For get_internal_state: with the check enabled and the scheduler idle, check now ("" = ok)."""
        if self.kv_check_enabled and not self.has_work():
            try:
                self.check_kv_invariants()
            except Exception as exc:  # KVInvariantError, or the check itself tripping on bad state
                self.kv_check_error = f"{type(exc).__name__}: {exc}"
        return self.kv_check_error

    def handle_step_gate(self, msg: StepGateReq) -> None:
        if msg.action == "pause":
            self.paused, self.step_credits = True, 0
        elif msg.action == "resume":
            self.paused, self.step_credits = False, 0
        elif msg.action == "step":
            self.paused = True
            self.step_credits += max(1, msg.steps)
            self.pending_step_reply = True
            # With nothing to run a step is a no-op: answer at once rather than hang the caller.
            self.sync_inflight()
            if not self.has_work():
                self.step_credits = 0
                self.pending_step_reply = False
            else:
                return
        self.io.send(StepGateReqOutput(paused=self.paused, step=self.forward_ct))

    def handle_weights_request(self, msg) -> None:
        """Weight updates and reads (the work is in weight_updater.py); replies on the usual socket.

        Joining a trainer's group waits for the trainer: it runs on a thread (weight_sync.py) and
        `poll_weights_join` answers it later, so the loop keeps serving meanwhile."""
        from workbench.core.managers import weight_sync, weight_updater

        if isinstance(msg, InitWeightsUpdateGroupReq):
            for answer in weight_sync.start_join(self.tp_worker.model_runner, msg):
                self.io.send(answer)
            return
        self.sync_inflight()  # overlap: nothing may still run on the old weights
        reply, source = weight_updater.handle_request(self.tp_worker.model_runner, msg, busy=self.has_work())
        if source is not None:
            if getattr(msg, "flush_cache", True):
                self.flush_cache()  # every cached KV entry was computed with the old weights
            self.weights_version = getattr(self, "weights_version", 0) + 1
            if isinstance(reply, UpdateWeightsReqOutput):
                reply.version = self.weights_version
            if self.tracer.enabled:
                self.tracer.emit(ev.WeightsUpdated(source=source, version=self.weights_version))
                self.tracer.flush()
        self.io.send(reply)

    def poll_weights_join(self) -> None:
        """Once per loop iteration (every rank): answer a weight-group join that has ended."""
        from workbench.core.managers import weight_sync

        if weight_sync.joining():
            for answer in weight_sync.poll_join(self.tp_worker.model_runner):
                self.io.send(answer)
