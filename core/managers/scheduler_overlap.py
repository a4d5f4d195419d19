"""The overlap event loop: launch batch N, then process batch N-1's result while N runs.

One iteration of `event_loop_overlap`:

    recv_requests / process_input_requests     as in the normal loop
    get_next_batch_to_run()                    batch N, built before N-1's tokens are known
    launch_batch(N)                            KV bookkeeping moves now; N goes to the worker thread
    process_inflight(N-1)                      wait for N-1, append its tokens, stream them

How batch N can be built without N-1's tokens:
- KV lengths, slots and chunk counts advance at launch (`ScheduleBatch.prepare_for_*`), so N
  writes its KV after N-1's whatever N-1 turns out to produce.
- A decode input whose token N-1 is still sampling is a negative future token id
  (`Req.future_token_id`); the worker swaps in the real id just before running N
  (tp_worker_overlap_thread.py).
- A request that finishes in N-1 is still in N. N's row for it is wasted: when N's result is
  processed the request is skipped and the KV slot N allocated for it is given back
  (`process_batch_result_decode`). Its own row and KV were handed to the cache when N-1's result
  was processed; N may still read that row, but only to compute the discarded row, and N writes
  only to its own slot, so no live request is affected even if the row is reused meanwhile.
- The radix cache only needs the slot indices recorded in a request's row, so caching a chunk
  (`continue_chunked_req`) or a finished request can happen while KV is still being written:
  everything that could read those slots is launched later, and launches run in order.

Where the loop waits for the in-flight batch first (`sync_inflight`), trading overlap for
simplicity: before retracting (it needs real tokens and KV lengths), before ending an aborted
chunked request, before flushing the cache, before HiCache copies device KV on the scheduler thread
while a prefill is in flight (`sync_inflight_for_cache_copy`), while paused and on every gated step (a step is one
whole launch-and-process, as in the normal loop), and for batches whose sampling reads the
output history: penalties and min_new_tokens build their tensors from `output_ids`, which would
miss the in-flight token.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from workbench.core.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from workbench.core.managers.schedule_batch import ModelWorkerBatch, ScheduleBatch
    from workbench.core.managers.scheduler_contract import ModelWorker, OverlapWorker
    from workbench.core.managers.tp_worker import GenerationBatchResult
    from workbench.core.trace.tracer import Tracer


@dataclass
class InflightBatch:
    """A launch whose result is not processed yet."""

    batch: ScheduleBatch  # snapshot of the launch (ScheduleBatch.copy)
    handle: concurrent.futures.Future  # TpModelWorkerClient's handle
    step: int  # the scheduler step that launched it (for the trace)
    schedule_ms: float
    step_reqs: list | None = None  # trace: each request's share, taken at launch


class SchedulerOverlapMixin:
    overlap_worker: OverlapWorker | None  # the launch-now, resolve-later client (Scheduler.__init__)

    # The Scheduler's state this loop reads and writes (set in Scheduler.__init__; bare
    # annotations, so they only tell the type checker what the Scheduler mixing this in holds).
    tp_worker: ModelWorker
    tracer: Tracer
    running_batch: ScheduleBatch
    last_batch: ScheduleBatch | None
    inflight: InflightBatch | None
    paused: bool
    step_credits: int
    forward_ct: int
    max_running_requests: int
    spec_num_draft: int
    _step_start: float
    processing_inflight: bool = False  # True while a result is folded in (process_inflight)

    if TYPE_CHECKING:  # the Scheduler's steps this loop calls (scheduler.py, scheduler_output.py)

        def recv_requests(self) -> list: ...
        def process_input_requests(self, recv_reqs: list) -> None: ...
        def get_next_batch_to_run(self) -> ScheduleBatch | None: ...
        def prepare_launch(self, batch: ScheduleBatch) -> tuple[ModelWorkerBatch, list | None]: ...
        def process_batch_result(self, batch: ScheduleBatch, result: GenerationBatchResult) -> None: ...
        def note_forward_time(self, batch: ScheduleBatch, forward_ms: float) -> None: ...
        def finish_step(self, batch: ScheduleBatch | None) -> None: ...
        def trace_cost(self) -> AbstractContextManager[None]: ...
        def emit_moe_routing(self, step_reqs: list | None, routing: list | None, step: int = -1) -> None: ...
        def emit_batch_step(
            self,
            batch: ScheduleBatch,
            schedule_ms: float,
            forward_ms: float,
            step_reqs: list | None = None,
            step: int = -1,
        ) -> None: ...

    # ==== the event loop ==========================================================
    def event_loop_overlap(self) -> None:
        """The overlap loop (`disable_overlap_schedule=False`); same results as `event_loop_normal`."""
        self.init_overlap_worker()
        while True:
            self.step_overlap()

    def step_overlap(self) -> None:
        """One iteration of the overlap loop (`init_overlap_worker` first)."""
        recv_reqs = self.recv_requests()
        self.process_input_requests(recv_reqs)
        if self.paused:
            self.sync_inflight()  # nothing half-done while paused or single-stepping
            if self.step_credits == 0:
                return
        batch = self.get_next_batch_to_run()
        if batch is not None and self.inflight is not None and self.needs_output_history(batch):
            self.sync_inflight()
            batch = self._without_finished(batch)
        previous, self.inflight = self.inflight, None
        if batch is not None:
            self.inflight = self.launch_batch(batch)
        if previous is not None:
            self.process_inflight(previous)
        if self.paused:
            self.sync_inflight()  # a gated step ends with its own result processed
        self.last_batch = batch
        self.finish_step(batch)

    def init_overlap_worker(self) -> None:
        from workbench.core.managers.tp_worker_overlap_thread import TpModelWorkerClient

        if self.overlap_worker is None:
            # a verify pass samples 1 + drafts rows per request, each with a slot in the future map
            rows = (self.max_running_requests + 1) * (1 + self.spec_num_draft)
            self.overlap_worker = TpModelWorkerClient(self.tp_worker, rows)

    # ==== launch and result ============================================================
    def launch_batch(self, batch: ScheduleBatch) -> InflightBatch:
        """Prepare `batch` and queue it on the worker thread; returns at once."""
        mwb, step_reqs = self.prepare_launch(batch)
        schedule_ms = (time.perf_counter() - self._step_start) * 1000
        worker = self.overlap_worker
        assert worker is not None, "init_overlap_worker runs before the first launch"
        future_ids, handle = worker.forward_batch_generation(mwb)
        batch.future_ids = future_ids
        for req, fid in zip(batch.reqs, future_ids):
            if req is not batch.chunked_req:  # a cut prompt samples nothing anyone reads
                req.future_token_id = fid
        return InflightBatch(batch.copy(), handle, self.forward_ct, schedule_ms, step_reqs)

    def process_inflight(self, inflight: InflightBatch) -> None:
        """Wait for a launch and fold its result into the requests (tokens, cache, output)."""
        worker = self.overlap_worker
        assert worker is not None, "a launch went through this worker"
        result = worker.resolve_batch_result(inflight.handle)
        batch = inflight.batch
        # Rows of requests that had finished before this result: computed for nothing.
        wasted = {i for i, r in enumerate(batch.reqs) if r.finished()}
        self.processing_inflight = True
        try:
            self.process_batch_result(batch, result)
        finally:
            self.processing_inflight = False
        if self.tracer.enabled:
            with self.trace_cost():
                step_reqs = inflight.step_reqs
                self.emit_moe_routing(step_reqs, getattr(result.logits_output, "routing", None), step=inflight.step)
                if step_reqs is not None and wasted:
                    step_reqs = [s for i, s in enumerate(step_reqs) if i not in wasted]
                self.emit_batch_step(batch, inflight.schedule_ms, result.forward_ms, step_reqs, step=inflight.step)
        self.note_forward_time(batch, result.forward_ms)

    def sync_inflight(self) -> bool:
        """Process the in-flight launch now, if any; True if there was one (no-op in the normal loop)."""
        inflight, self.inflight = self.inflight, None
        if inflight is None:
            return False
        self.process_inflight(inflight)
        return True

    def sync_inflight_for_cache_copy(self) -> bool:
        """HiCache's hook (`HiRadixCache.sync_before_copy`): before the scheduler thread copies KV
        into or out of device slots, wait for an in-flight prefill; True if it waited.

        A prefill in flight may still write slots the tree already names (a chunk cached at
        scheduling time by `continue_chunked_req`) or read slots freed as duplicates while it runs
        (handed out again, a load-back would overwrite them under it). A decode in flight writes
        only its own new slots and reads tree slots that stay locked, or, for a request that has
        already finished, only to compute a row nobody reads: no wait. While a result is being
        processed (`processing_inflight`), the batch in flight is the next one, launched after every
        slot that processing copies was written: no wait either (and waiting there would fold the
        next result into the middle of this one).
        """
        inflight = self.inflight
        if inflight is None or self.processing_inflight or inflight.batch.forward_mode == ForwardMode.DECODE:
            return False
        return self.sync_inflight()

    # ==== when to wait ===================================================================
    def needs_output_history(self, batch: ScheduleBatch) -> bool:
        """Whether sampling this batch reads output tokens that may still be in flight.

        Only a decode batch can hold a request with an in-flight token (a prefill batch's
        requests are new, retracted after a sync, or mid-prompt).
        """
        if batch is not self.running_batch:
            return False
        if self.spec_num_draft:  # speculative decoding proposes drafts from the previous step's tokens
            return True
        for req in batch.reqs:
            sp = req.sampling_params
            if sp.frequency_penalty != 0.0 or sp.presence_penalty != 0.0 or sp.repetition_penalty != 1.0:
                return True
            if sp.min_new_tokens > len(req.output_ids):
                return True
            if req.grammar is not None:  # its mask depends on the token still in flight
                return True
        return False

    def _without_finished(self, batch: ScheduleBatch) -> ScheduleBatch | None:
        # The result just processed may have finished requests of the decode batch built before it.
        if batch is self.running_batch:
            batch.filter_batch()
            return batch if not batch.is_empty() else None
        return batch
