"""Priority scheduling's preemption (`--enable-priority-scheduling`, SGLang's semantics).

The waiting queue's order by priority is the schedule policy's (schedule_policy.SchedulePolicy).
This collaborator of the Scheduler does the rest:

- a request's priority: the one it was sent with, or, sent without one, the least urgent value
  (SGLang's rule). Without --enable-priority-scheduling a priority is carried but has no effect
  (SGLang ignores it too).
- preemption: when a waiting request cannot be admitted (no running slot, or no KV room), running
  requests whose priority is worse than its by MORE than --priority-scheduling-preemption-threshold
  are preempted, the least urgent first (the latest arrival among equals), until it fits. A
  preempted request goes the scheduler's retraction path (`Scheduler.retract_req`: its own KV
  freed, its cached prefix unlocked in the radix cache, back to the waiting queue), is prefilled
  again later over its prompt and the tokens it had produced, and finishes with its full output.
  If even every eligible request would not make room, nothing is preempted (as SGLang does).

Each preemption is narrated (StepDecision.preemptions) and traced (ReqRetracted with a reason).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any, Protocol

from workbench.core.managers.schedule_policy import least_urgent_priority
from workbench.core.trace.views import format_priority

if TYPE_CHECKING:
    from workbench.core.managers.schedule_batch import Req, ScheduleBatch
    from workbench.core.managers.schedule_policy import PrefillAdder
    from workbench.core.managers.scheduler_narration import StepNarrator


class SchedulerState(Protocol):
    """What of the Scheduler preemption reads and drives (scheduler.py; a Protocol: no import cycle)."""

    server_args: Any
    running_batch: ScheduleBatch
    waiting_queue: list[Req]
    token_to_kv_pool_allocator: Any
    tree_cache: Any
    narrator: StepNarrator
    num_retracted_total: int

    def sync_inflight(self) -> bool: ...
    def retract_req(self, req: Req, reason: str = "") -> None: ...


class PriorityPreemption:
    """The Scheduler's priority rules: default priorities, and preempting running work for a waiting request."""

    def __init__(self, scheduler: SchedulerState):
        args = scheduler.server_args
        self.s = scheduler
        self.enabled = bool(args.enable_priority_scheduling)
        self.low_first = bool(args.schedule_low_priority_values_first)
        self.threshold = int(args.priority_scheduling_preemption_threshold)
        self.preempted: list[Req] = []  # this step's victims, queued again after admission (requeue)
        self.num_preempted_total = 0
        # Preempted requests by their priority, and the requests they made room for by theirs (/metrics).
        self.preempted_by_priority: Counter[str] = Counter()

    # ---- requests in --------------------------------------------------------------------
    def assign(self, req: Req, priority: int | None) -> None:
        """Give a new request its priority: the one sent, or the least urgent (priority scheduling on)."""
        req.priority = priority
        if self.enabled and priority is None:
            req.priority = least_urgent_priority(self.low_first)

    # ---- comparing ------------------------------------------------------------------------
    def urgency(self, req: Req) -> int:
        """Larger is more urgent, whichever way priorities are read."""
        p = req.priority if req.priority is not None else least_urgent_priority(self.low_first)
        return -p if self.low_first else p

    def beats(self, req: Req, running: Req) -> bool:
        """Whether waiting `req` may preempt `running`: more urgent by more than the threshold."""
        return self.urgency(req) - self.urgency(running) > self.threshold

    def may_preempt(self, waiting: list[Req], running: list[Req]) -> bool:
        """Whether any waiting request could preempt any running one (cheap; decides whether admission
        is attempted at all when every running slot is taken)."""
        if not self.enabled or not waiting or not running:
            return False
        best = max(waiting, key=self.urgency)
        return any(self.beats(best, r) for r in running if not r.finished())

    def _candidates(self, req: Req, exclude: list[Req]) -> list[Req]:
        """Running requests `req` may preempt, least urgent first, latest arrival first among equals."""
        skip = {id(r) for r in exclude}
        running = [
            r
            for r in self.s.running_batch.reqs
            if not r.finished() and id(r) not in skip and r.req_pool_idx is not None
        ]
        running.sort(key=lambda r: (self.urgency(r), -r.arrival_ts))
        out = []
        for r in running:
            if not self.beats(req, r):
                break  # sorted: no one after it is less urgent
            out.append(r)
        return out

    # ---- preempting -------------------------------------------------------------------------
    def preempt_for(self, req: Req, adder: PrefillAdder, need_slot: bool) -> bool:
        """Preempt running requests so that waiting `req` can be admitted (its prefix matched by
        init_next_round_input): one for a running slot (`need_slot`), else enough for its KV
        (its tokens and output reserve, beyond what the adder has left). True if any was preempted."""
        if not self.enabled or not self._candidates(req, adder.can_run_list):
            return False
        s = self.s
        if s.sync_inflight():  # overlap: retraction needs real tokens and KV lengths (as update_running_batch)
            s.running_batch.filter_batch()
            req.init_next_round_input(s.tree_cache)  # the in-flight result may have cached more of its prefix
        cands = self._candidates(req, adder.can_run_list)
        ratio = adder.new_token_ratio
        if need_slot:
            victims = cands[:1]
        else:
            short = req.extend_input_len + adder._reserve(req, 1.0) - adder.rem_total_tokens
            victims = []
            for r in cands:
                if short <= 0:
                    break
                victims.append(r)
                # Its whole sequence counts (SGLang's estimate): its cached prefix becomes evictable once
                # unlocked, unless another request shares it; the room really made is measured below.
                short -= r.kv_len + adder._reserve(r, ratio)
            if short > 0:
                return False  # even all of them would not make room: preempt no one
        if not victims:
            return False
        pool, cache = s.token_to_kv_pool_allocator, s.tree_cache
        room_before = pool.available_size() + cache.evictable_size()
        released_reserve = sum(adder._reserve(r, ratio) for r in victims)
        for r in victims:
            reason = (
                f"preempted {r.rid} (priority {format_priority(r.priority)}) for {req.rid} "
                f"(priority {format_priority(req.priority)})"
            )
            s.retract_req(r, reason=reason)
            s.narrator.on_preempt(reason)
            self.preempted_by_priority[format_priority(r.priority)] += 1
        gone = {id(r) for r in victims}
        s.running_batch.filter_batch([r for r in s.running_batch.reqs if id(r) not in gone])
        adder.rem_total_tokens += pool.available_size() + cache.evictable_size() - room_before + released_reserve
        self.preempted.extend(victims)
        self.num_preempted_total += len(victims)
        s.num_retracted_total += len(victims)
        return True

    def requeue(self) -> None:
        """After admission: this step's preempted requests join the waiting queue (the policy sorts it)."""
        if self.preempted:
            self.s.waiting_queue.extend(self.preempted)
            self.preempted = []
