"""What one scheduler step decided, and why: the `batch.decision` trace event (events.StepDecision).

The scheduler tells a `StepNarrator` what it does as it does it (admission in
`get_new_batch_prefill`, retractions, evictions through the radix cache's events) and emits
one `StepDecision` per step that ran a batch, at the end of the step (`Scheduler.finish_step`).
KV figures are the allocator's counters (`TokenToKVPoolAllocator.num_allocated / num_freed`)
since the previous decision, so every slot handed out or taken back is counted in exactly one step.

The slots held by requests (kv.usage's `used`: the pool less free and evictable slots) are
accounted too: `account(...)` windows around the scheduler's calls measure how the held count
moved there (less the slots allocated inside, which are `kv_alloc`; less inner windows): cached
prefixes locked at admission (`kv_reused`), each request's release when it finishes, aborts or is
retracted (`released`), and slots dropped while results are processed (`kv_returned`). What no
window saw is `kv_other` (0 unless a path is not accounted; a test holds it at 0 under KV pressure).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.trace import events as ev

if TYPE_CHECKING:
    from workbench.core.managers.schedule_batch import Req, ScheduleBatch
    from workbench.core.managers.schedule_policy import PrefillAdder


class StepNarrator:
    """Collects one step's decisions; `decision()` turns them into the event and starts afresh."""

    def __init__(self, allocator, tree_cache=None, total: int = 0):
        self.allocator = allocator
        self.tree_cache = tree_cache
        self.total = total
        self._marks = (allocator.num_allocated, allocator.num_freed)
        self._held_mark = self.held_slots()
        self._windows: list[list[int]] = []  # open account() windows: [held, allocated, inner]
        self._reset()

    def held_slots(self) -> int:
        """KV slots held by requests now: the pool less free and evictable (cached, unlocked) slots."""
        evictable = self.tree_cache.evictable_size() if self.tree_cache is not None else 0
        return self.total - self.allocator.available_size() - evictable

    @contextmanager
    def account(self, part: str, rid: str = "") -> Iterator[None]:
        """Attribute the move of the held slots inside the block (less the slots allocated there
        and the inner windows' parts) to `part`: "reused" (admission), "returned" (results
        processed), or a release of request `rid`: "finished", "aborted", "retracted"."""
        frame = [self.held_slots(), self.allocator.num_allocated, 0]
        self._windows.append(frame)
        try:
            yield
        finally:
            self._windows.pop()
            delta = self.held_slots() - frame[0] - (self.allocator.num_allocated - frame[1]) - frame[2]
            if self._windows:
                self._windows[-1][2] += delta
            if part == "reused":
                self.reused += delta
            elif part == "returned":
                self.returned -= delta
            elif delta:
                last = self.released[-1] if self.released else None
                if last is not None and last.rid == rid and last.why == part:
                    last.slots -= delta
                else:
                    self.released.append(ev.KVRelease(rid, part, -delta))

    def _reset(self) -> None:
        self.reused = 0
        self.returned = 0
        self.released: list[ev.KVRelease] = []
        self.evicted = 0
        self.evicted_nodes: list[int] = []
        self.retracted: list[str] = []
        self.preemptions: list[str] = []
        self.constrained = 0
        self.mask_ms = 0.0
        self.hicache: dict[str, list[float]] = {}  # HiCache transfer kind -> [tokens, bytes, ms]
        self.begin()

    def begin(self, now_ns: int = 0) -> None:
        """A new step, begun at `now_ns` on the trace's clock: forget the last admission (evictions
        and retractions of a step that ran no batch are told with the next one that does)."""
        self.admitted: list[str] = []
        self.chunk_continued = ""
        self.stop_reason = ""
        self.held: list[str] = []
        self.lora_waited: list[str] = []  # waiting for a LoRA adapter slot (--max-loras-per-batch)
        self.budget = 0
        self.budget_used = 0
        self.start_ts = now_ns or time.monotonic_ns()  # the trace's clock (events' ts), not perf_counter

    # ---- what the scheduler reports ------------------------------------------------------
    def admission(self, adder: PrefillAdder | None, continued: Req | None, stop_reason: str | None = None) -> None:
        """The prefill admission of this step (adder None: not attempted, for `stop_reason`)."""
        if adder is None:
            self.stop_reason = stop_reason or ""
            return
        self.stop_reason = adder.stop_reason or stop_reason or ""
        self.held = [h.rid for h in adder.held]
        self.budget = adder.budget
        self.budget_used = sum(r.extend_input_len for r in adder.can_run_list)
        self.admitted = [r.rid for r in adder.can_run_list if r is not continued]
        self.chunk_continued = continued.rid if continued is not None else ""

    def on_evict(self, e: ev.CacheEvict) -> None:
        self.evicted += e.tokens
        self.evicted_nodes.extend(e.node_ids)

    def on_retract(self, rid: str) -> None:
        self.retracted.append(rid)

    def on_preempt(self, reason: str) -> None:
        """A retraction (told with on_retract) was a priority preemption, for `reason`."""
        self.preemptions.append(reason)

    def on_hicache(self, e: ev.HiCacheTransfer) -> None:
        """HiCache moved KV between tiers (summed per kind for the step's line)."""
        acc = self.hicache.setdefault(e.what, [0, 0, 0.0])
        acc[0] += e.tokens
        acc[1] += e.bytes
        acc[2] += e.ms

    def on_mask(self, rows: int, ms: float) -> None:
        """The step spent `ms` on grammars: masks filled for `rows` constrained rows, or (rows 0)
        sampled tokens fed to their matchers."""
        self.constrained += rows
        self.mask_ms += ms

    # ---- the event ---------------------------------------------------------------------------
    def end_step(self, tracer, batch: ScheduleBatch, waiting: list[Req], running: list[Req]) -> None:
        """A step that ran `batch` ends: emit its decision (or, tracing off, just start afresh)."""
        if tracer.enabled:
            tracer.emit(self.decision(batch, waiting, running))
        else:
            self._marks = (self.allocator.num_allocated, self.allocator.num_freed)
            self._held_mark = self.held_slots()
            self._reset()

    def decision(self, batch: ScheduleBatch, waiting: list[Req], running: list[Req]) -> ev.StepDecision:
        """This step's StepDecision (`waiting`: the queue after the step; `running`: the running
        batch's requests, which an extend step does not advance)."""
        alloc, freed = self.allocator.num_allocated, self.allocator.num_freed
        kv_alloc, kv_freed = alloc - self._marks[0], freed - self._marks[1]
        self._marks = (alloc, freed)
        kv_held = self.held_slots()
        other = (
            kv_held - self._held_mark - (kv_alloc + self.reused - sum(r.slots for r in self.released) - self.returned)
        )
        self._held_mark = kv_held
        decode = batch.forward_mode == ForwardMode.DECODE
        held = set(self.held)
        stop_rid = ""
        if self.stop_reason:
            stop_rid = next((r.rid for r in waiting if r.rid not in held), "")
        queued = {r.rid for r in waiting}
        in_batch = {id(r) for r in batch.reqs}
        out = ev.StepDecision(
            mode="decode" if decode else "extend",
            admitted=[] if decode else list(self.admitted),
            chunk_continued="" if decode else self.chunk_continued,
            waiting=len(waiting),
            stop_reason=self.stop_reason if stop_rid else "",
            stop_rid=stop_rid,
            held=[rid for rid in self.held if rid in queued],
            budget=0 if decode else self.budget,
            budget_used=0 if decode else self.budget_used,
            running_waited=0 if decode else sum(1 for r in running if not r.finished() and id(r) not in in_batch),
            kv_alloc=kv_alloc,
            kv_freed=kv_freed,
            evicted=self.evicted,
            evicted_nodes=list(self.evicted_nodes),
            retracted=list(self.retracted),
            preemptions=list(self.preemptions),
            constrained=self.constrained,
            mask_ms=round(self.mask_ms, 3),
            hicache=[_hicache_phrase(what, *acc) for what, acc in self.hicache.items()],
            start_ts=self.start_ts,
            kv_reused=self.reused,
            released=list(self.released),
            kv_returned=self.returned,
            kv_other=other,
            kv_held=kv_held,
            loras=sorted({r.lora_path for r in batch.reqs if r.lora_path is not None}),
            lora_waited=[rid for rid in self.lora_waited if rid in queued],
        )
        self._reset()
        return out


_HICACHE_VERBS = {
    "load_back": "loaded back {tok} tok from host",
    "prefetch": "prefetched {tok} tok from storage",
    "write_through": "wrote through {tok} tok to host",
    "write_back": "wrote back {tok} tok to host",
    "storage_write": "stored {tok} tok in storage",
}


def _hicache_phrase(what: str, tokens: float, nbytes: float, ms: float) -> str:
    """One kind of HiCache transfer in a step, for the narration."""
    verb = _HICACHE_VERBS.get(what, what + " {tok} tok").format(tok=int(tokens))
    size = (
        f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.1f} KB" if nbytes >= 1e3 else f"{int(nbytes)} B"
    )
    return f"{verb} ({size}, {ms:.1f} ms)"
