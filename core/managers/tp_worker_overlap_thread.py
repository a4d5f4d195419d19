"""TpModelWorkerClient: the model worker run one batch ahead of the scheduler (overlap loop).

The overlap loop launches batch N and, while it runs, processes batch N-1's result
on the scheduler thread. Batch N is built before N-1's tokens are known, so a
decode input may be a *future token id*: `-(k + 1)` stands for slot k of
`future_token_ids_map`. Each launch reserves one slot per row; the worker writes
the ids it samples into those slots, and replaces the placeholders of a batch
with the real ids just before running it. Launches run strictly in launch order,
so a placeholder's slot is always written before any later batch reads it.

Devices:
- CPU: a single background thread runs the batches. torch releases the GIL in
  its kernels, so the scheduler's Python work overlaps the forward pass.
- CUDA: the same thread enqueues each batch on a dedicated forward stream, which
  first waits for the scheduler stream's work up to the launch (its writes to the
  req_to_token table). The sampled ids come back with a non-blocking copy into
  pinned memory plus an event; the scheduler waits on that event only when it
  processes the result, so the GPU never idles while the scheduler works.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from workbench.core.managers.schedule_batch import ModelWorkerBatch
from workbench.core.managers.scheduler_contract import ForwardOutput, GenerationBatchResult, ModelWorker

# Rows per launch are at most max_running_requests + 1 (a chunked request rides along) and a
# placeholder is read at most one launch after it was handed out; 4x that bound keeps the ring
# from reusing a slot that a queued batch still has to read.
FUTURE_MAP_FACTOR = 4


@dataclass
class _Job:
    mwb: ModelWorkerBatch
    future_start: int  # first future-map slot of this launch
    done: concurrent.futures.Future  # -> _Launched
    launch_event: Any = None  # CUDA: the scheduler stream's work up to the launch


@dataclass
class _Launched:
    out: ForwardOutput
    next_token_ids: Any  # CPU: list[int]; CUDA: pinned CPU tensor being filled
    forward_ms: float = 0.0
    copy_done: Any = None  # CUDA event: outputs computed and copied back
    start_event: Any = None
    end_event: Any = None


class TpModelWorkerClient:
    """Runs a ModelWorker's `forward_batch` (TpModelWorker's, or a stand-in's) on a background
    thread, one launch ahead: the real OverlapWorker (scheduler_contract.py).

    `forward_batch_generation(mwb)` returns at once with one future token id per row
    and a handle; `resolve_batch_result(handle)` waits for that launch and returns
    the usual `GenerationBatchResult`.
    """

    def __init__(self, worker: ModelWorker, max_rows_per_batch: int):
        self.worker = worker
        self.device = torch.device(worker.model_runner.device)
        self.is_cuda = self.device.type == "cuda"
        self.future_map_size = FUTURE_MAP_FACTOR * max(1, max_rows_per_batch)
        self.future_token_ids_map = torch.zeros(self.future_map_size, dtype=torch.int64, device=self.device)
        self.future_token_ids_ct = 0
        self.forward_stream = torch.cuda.Stream(device=self.device) if self.is_cuda else None
        self.num_threads = torch.get_num_threads()
        self.input_queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self.forward_thread = threading.Thread(target=self._forward_thread_func, daemon=True, name="overlap-forward")
        self.forward_thread.start()

    # ---- scheduler thread ---------------------------------------------------------
    def forward_batch_generation(self, mwb: ModelWorkerBatch) -> tuple[list[int], concurrent.futures.Future]:
        """Queue `mwb`; return the future token id of each row's sampled token and a handle."""
        bs = len(mwb.seq_lens_cpu)
        rows = sum(mwb.spec_rows) if mwb.spec_rows else bs  # a verify pass samples every draft's row
        if rows > self.future_map_size:
            raise RuntimeError(f"batch of {rows} rows exceeds the future-token map ({self.future_map_size})")
        if self.future_token_ids_ct + rows > self.future_map_size:
            self.future_token_ids_ct = 0  # a launch's slots never wrap around the end
        start = self.future_token_ids_ct
        self.future_token_ids_ct += rows
        launch_event = None
        if self.is_cuda:
            launch_event = torch.cuda.Event()
            launch_event.record(torch.cuda.current_stream(self.device))
        done: concurrent.futures.Future = concurrent.futures.Future()
        self.input_queue.put(_Job(mwb, start, done, launch_event))
        return [-(start + i + 1) for i in range(bs)], done

    def resolve_batch_result(self, handle: concurrent.futures.Future) -> GenerationBatchResult:
        """Wait for a launch and return its result (re-raises the worker's exception)."""
        launched: _Launched = handle.result()
        forward_ms = launched.forward_ms
        ids = launched.next_token_ids
        if launched.copy_done is not None:
            launched.copy_done.synchronize()
            forward_ms = launched.start_event.elapsed_time(launched.end_event)
            ids = ids.tolist()
        out = launched.out
        return GenerationBatchResult(out.logits_output, out.sampler_output, ids, forward_ms, out.prompt_logprobs)

    def shutdown(self) -> None:
        """Stop the thread after the launches already queued."""
        self.input_queue.put(None)

    # ---- forward thread -------------------------------------------------------------
    def _forward_thread_func(self) -> None:
        # OpenMP keeps the thread count per thread: without this the forward thread would use the
        # machine default, not the scheduler's --num-threads.
        torch.set_num_threads(self.num_threads)
        while True:
            job = self.input_queue.get()
            if job is None:
                return
            if torch.get_num_threads() != self.num_threads:  # the adaptive policy changed it
                torch.set_num_threads(self.num_threads)
            try:
                with torch.inference_mode():
                    if self.forward_stream is not None:
                        with torch.cuda.stream(self.forward_stream):
                            self.forward_stream.wait_event(job.launch_event)
                            launched = self._run(job)
                    else:
                        launched = self._run(job)
                job.done.set_result(launched)
            except BaseException as exc:  # surfaces in the scheduler thread via the future
                job.done.set_exception(exc)

    def _run(self, job: _Job) -> _Launched:
        mwb = job.mwb
        t0 = time.perf_counter()
        start_event = end_event = None
        if self.is_cuda:
            start_event = torch.cuda.Event(enable_timing=True)
            end_event = torch.cuda.Event(enable_timing=True)
            start_event.record()
            mwb = self._to_device(mwb)
        if mwb.forward_mode.is_decode():
            mwb.input_ids = self.resolve_future_token_ids(mwb.input_ids)
        out = self.worker.forward_batch(mwb)
        next_ids = out.sampler_output.next_token_ids
        n = next_ids.shape[0]
        self.future_token_ids_map[job.future_start : job.future_start + n] = next_ids
        if end_event is None:  # not CUDA (the events exist only there): the ids are on the host
            return _Launched(out, next_ids.tolist(), (time.perf_counter() - t0) * 1000)
        end_event.record()
        host = torch.empty((n,), dtype=torch.int64, pin_memory=True)
        host.copy_(next_ids, non_blocking=True)
        copy_done = torch.cuda.Event()
        copy_done.record()
        return _Launched(out, host, copy_done=copy_done, start_event=start_event, end_event=end_event)

    def resolve_future_token_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Replace every placeholder -(k + 1) by slot k of the map (no host sync: always a where)."""
        slots = (-input_ids - 1).clamp(min=0)
        return torch.where(input_ids < 0, self.future_token_ids_map[slots], input_ids)

    def _to_device(self, mwb: ModelWorkerBatch) -> ModelWorkerBatch:
        dev = self.device
        return replace(
            mwb,
            input_ids=mwb.input_ids.to(dev, non_blocking=True),
            positions=mwb.positions.to(dev, non_blocking=True),
            req_pool_indices=mwb.req_pool_indices.to(dev, non_blocking=True),
            seq_lens=mwb.seq_lens.to(dev, non_blocking=True),
            out_cache_loc=mwb.out_cache_loc.to(dev, non_blocking=True),
        )
