"""Which waiting requests go next (SchedulePolicy) and how many fit (PrefillAdder).

Policies (`--schedule-policy`):
- fcfs        first come, first served (the queue order).
- lpm         longest prefix match first: requests that reuse the most cached KV.
- dfs-weight  walk the radix tree depth-first, heaviest subtree first, so requests
              sharing a prefix run back to back while that prefix is still cached.
- lof         longest output first (largest max_new_tokens).
- random      shuffled (a baseline for experiments).
Prefix-aware policies fall back to fcfs when the queue is long, because matching
every waiting request each step would cost more than it saves.

Priority scheduling (`--enable-priority-scheduling`, SGLang's): every policy, built in or a
plugin's, orders the queue first by the requests' `priority` (larger first, or smaller first with
`--schedule-low-priority-values-first`; a request without one is the least urgent), then by its
own rule within one priority. Preemption of running work is scheduler_priority.py's.

In-batch prefix caching (every policy, unless --disable-radix-cache): a waiting request
whose not-yet-cached part shares a long prefix with a request admitted in this step (or
still being prefilled: a chunked request, an in-flight launch) is held back, so it finds
that prefix in the radix cache one step later instead of computing it a second time
(`InBatchPrefixIndex`, `PrefillAdder.add_one_req` -> `AddReqResult.HELD`).
"""

from __future__ import annotations

import random
import sys
from collections import defaultdict
from dataclasses import dataclass
from enum import Enum, auto

import torch
from workbench.core.managers.schedule_batch import Req
from workbench.core.mem_cache.radix_cache import RadixCache, TreeNode

PREFIX_POLICY_MAX_QUEUE = 128
# In-batch prefix caching holds a request back only when waiting would save it at least this
# many tokens of prefill. Below it, recomputing is cheaper than the step of delay it costs, and
# short common heads (a chat template's first tokens, a one-line system prompt) would otherwise
# serialize a burst of unrelated requests behind one of them. SGLang uses 32 as well.
IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD = 32
# At most this many held requests are looked at per step: past it the rest of the queue waits
# for the next step, so a long queue of requests behind one long shared prefix (computed over
# several chunked steps) does not cost a prefix match per request per step.
MAX_HELD_PER_STEP = 128
# Reserve for output tokens is clipped: a request asking for 4096 new tokens
# should not block admission as if it will surely use them all.
CLIP_MAX_NEW_TOKENS = 4096


BUILTIN_POLICIES = ("fcfs", "lpm", "dfs-weight", "lof", "random")


class SchedulePolicy:
    def __init__(
        self,
        policy: str,
        tree_cache,
        enable_prefix_cache: bool,
        rng_seed: int = 0,
        *,
        enable_priority_scheduling: bool = False,
        schedule_low_priority_values_first: bool = False,
    ):
        self.policy = policy
        self.enable_priority_scheduling = enable_priority_scheduling
        self.schedule_low_priority_values_first = schedule_low_priority_values_first
        self.tree_cache = tree_cache
        self.enable_prefix_cache = enable_prefix_cache
        self.rng = random.Random(rng_seed)
        self.plugin = None  # a plugin's policy object, when `policy` is not built in
        if policy not in BUILTIN_POLICIES:
            from workbench.core.plugins import policy_factory

            factory = policy_factory(policy)
            if factory is None:
                raise ValueError(
                    f"no scheduling policy {policy!r}: built in are {', '.join(BUILTIN_POLICIES)}; "
                    "`workbench plugins` lists the ones plugins registered"
                )
            self.plugin = factory(tree_cache, rng_seed=rng_seed)

    def calc_priority(self, waiting_queue: list[Req]) -> None:
        """Reorder `waiting_queue` in place; prefix-aware policies also match prefixes. With priority
        scheduling, the policy's order holds within one priority (a stable sort by priority after it)."""
        self._policy_order(waiting_queue)
        if self.enable_priority_scheduling:
            waiting_queue.sort(key=self.urgency_key)

    def urgency_key(self, req: Req) -> int:
        """Sort key: smaller is admitted first (the request's priority, signed by the direction)."""
        p = req.priority if req.priority is not None else least_urgent_priority(self.schedule_low_priority_values_first)
        return p if self.schedule_low_priority_values_first else -p

    def _policy_order(self, waiting_queue: list[Req]) -> None:
        if self.plugin is not None:
            self.plugin.calc_priority(waiting_queue)
            return
        policy = self.policy
        if policy in ("lpm", "dfs-weight") and (
            not self.enable_prefix_cache or len(waiting_queue) > PREFIX_POLICY_MAX_QUEUE
        ):
            policy = "fcfs"
        if policy == "fcfs":
            return
        if policy == "lof":
            waiting_queue.sort(key=lambda r: -r.sampling_params.max_new_tokens)
        elif policy == "random":
            self.rng.shuffle(waiting_queue)
        elif policy == "lpm":
            for r in waiting_queue:
                r.init_next_round_input(self.tree_cache)
            waiting_queue.sort(key=lambda r: -len(r.prefix_indices))
        elif policy == "dfs-weight":
            self._dfs_weight(waiting_queue)

    def _dfs_weight(self, waiting_queue: list[Req]) -> None:
        by_node: defaultdict[TreeNode | None, list[Req]] = defaultdict(list)
        for r in waiting_queue:
            r.init_next_round_input(self.tree_cache)
            by_node[r.last_node].append(r)
        weight: defaultdict[TreeNode, int] = defaultdict(int)
        for node, reqs in by_node.items():
            n = node
            while n is not None:  # each request adds weight to its whole path
                weight[n] += len(reqs)
                n = n.parent
        order: list[Req] = []
        stack = [self.tree_cache.root_node]
        while stack:
            node = stack.pop()
            order.extend(by_node.get(node, ()))
            kids = sorted((c for c in node.children.values() if weight[c] > 0), key=lambda c: weight[c])
            stack.extend(kids)  # heaviest popped first
        waiting_queue[:] = order


def least_urgent_priority(low_values_first: bool) -> int:
    """The priority of a request sent without one: the least urgent there is (SGLang's rule)."""
    return sys.maxsize if low_values_first else -sys.maxsize - 1


class AddReqResult(Enum):
    CONTINUE = auto()  # added; more may fit
    NO_TOKEN = auto()  # the KV pool cannot hold it now
    OTHER = auto()  # a per-batch limit (prefill tokens, chunk) is reached
    HELD = auto()  # not added: it waits for a shared prefix being computed; try the next one


@dataclass
class HeldBack:
    """A waiting request held back this step, and why."""

    rid: str
    waits_for: str  # the request computing the shared prefix
    shared_tokens: int  # tokens it would otherwise compute a second time


class InBatchPrefixIndex:
    """Token sequences whose KV will be in the radix cache soon but is not yet.

    Holds the prompts of requests being prefilled now: admitted into this step's batch, a
    chunked request with chunks still to come, or a launch whose result is not processed yet
    (overlap loop). Once such a request's extend has run, its KV goes into the radix cache
    (`cache_unfinished_req` / `cache_finished_req` when its result is processed, a chunked
    request's computed part at its next chunk), so a request sharing its prefix that waits one
    step matches it there instead of computing it again. A small `RadixCache` over token ids
    (no KV pool) indexes them; its values record which request put each token in, for the trace.
    SGLang keeps a similar temporary tree (`waiting_queue_radix_tree`).
    """

    def __init__(self, threshold: int = IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD):
        self.threshold = threshold
        self.tree = RadixCache(None, None)
        self.rids: list[str] = []

    def add(self, req: Req) -> None:
        """`req`'s whole sequence (prompt and, if retracted, its outputs) will be cached."""
        key = req.origin_input_ids + req.output_ids
        if len(key) < self.threshold:
            return  # nothing anyone could wait for
        self.tree.insert(key, torch.full((len(key),), len(self.rids), dtype=torch.int64))
        self.rids.append(req.rid)

    def blocker(self, req: Req) -> HeldBack | None:
        """Whom `req` should wait for, if waiting saves it >= threshold tokens; else None.

        `req.prefix_indices` must be its current radix-cache match (init_next_round_input):
        only the shared tokens beyond it count, and only those the cache may serve it
        (`Req.prefix_match_limit`).
        """
        if not self.rids:
            return None
        cached = len(req.prefix_indices)
        limit = req.prefix_match_limit()
        if limit - cached < self.threshold:
            return None
        match = self.tree.match_prefix(req.fill_ids[:limit]).device_indices
        shared = len(match) - cached
        if shared < self.threshold:
            return None
        return HeldBack(req.rid, self.rids[int(match[-1])], shared)


class PrefillAdder:
    """Admits waiting requests into one prefill batch within the token budgets.

    Budgets: `rem_total_tokens` = free + evictable KV minus what running requests
    are still expected to decode (scaled by `new_token_ratio`); `rem_input_tokens`
    = --max-prefill-tokens; `rem_chunk_tokens` = --chunked-prefill-size (a request
    larger than what is left is cut, and carried to the next step as the chunked req).

    With `in_batch_prefix_caching`, a request sharing >= IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD
    uncached prefix tokens with one being prefilled (admitted here, or registered with
    `add_pending`) is not added: `add_one_req` answers HELD and records it in `held`.
    """

    def __init__(
        self,
        tree_cache,
        token_to_kv_pool_allocator,
        running_reqs: list[Req],
        new_token_ratio: float,
        max_prefill_tokens: int,
        chunked_prefill_size: int | None,
        in_batch_prefix_caching: bool = False,
    ):
        self.tree_cache = tree_cache
        # In-batch prefix caching: prompts being prefilled, and whom this step held back for them.
        self.in_batch_prefix = InBatchPrefixIndex() if in_batch_prefix_caching else None
        self.held: list[HeldBack] = []
        self.rem_total_tokens = (
            token_to_kv_pool_allocator.available_size()
            + tree_cache.evictable_size()
            - sum(self._reserve(r, new_token_ratio) for r in running_reqs)
        )
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size
        self.new_token_ratio = new_token_ratio
        self.can_run_list: list[Req] = []
        self.new_chunked_req: Req | None = None
        self._locked_delta = 0
        # For the trace (events.StepDecision): this step's prefill token budget, and why admission
        # stopped ("budget" | "kv" | "running" | "held"; None while everyone tried got in).
        self.budget = min(max_prefill_tokens, chunked_prefill_size) if chunked_prefill_size else max_prefill_tokens
        self.stop_reason: str | None = None

    def note_stop(self, reason: str) -> None:
        """Admission stopped for `reason` (the first reason given sticks)."""
        if self.stop_reason is None:
            self.stop_reason = reason

    @staticmethod
    def _reserve(req: Req, ratio: float) -> int:
        left = min(req.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS) - len(req.output_ids)
        return int(max(left, 0) * ratio)

    def _lock(self, req: Req) -> int:
        """Lock the matched prefix (it must survive evictions made for this very batch); return the
        budget the request sees: locked tokens are no longer evictable, so no longer room."""
        self._locked_delta = self.tree_cache.inc_lock_ref(req.last_node)
        return self.rem_total_tokens + self._locked_delta

    def _keep_lock(self) -> None:
        self.rem_total_tokens += self._locked_delta

    def add_pending(self, req: Req) -> None:
        """A request prefilled outside this batch whose prompt is not in the cache yet (the
        overlap loop's in-flight launch): requests sharing its prefix wait for it."""
        if self.in_batch_prefix is not None:
            self.in_batch_prefix.add(req)

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a request whose prefill was cut in the previous step."""
        # Its later chunks are still to come: who shares them waits until they are cached.
        self.add_pending(req)
        truncated = self.rem_chunk_tokens is not None and req.extend_input_len > self.rem_chunk_tokens
        n = min(req.extend_input_len, self.rem_chunk_tokens) if self.rem_chunk_tokens else req.extend_input_len
        req.extend_input_len = n
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + n]
        self.can_run_list.append(req)
        self._consume(n, 0 if truncated else self._reserve(req, 1.0))
        return req if truncated else None

    def add_one_req(self, req: Req) -> AddReqResult:
        """Admit `req` (its prefix matched by init_next_round_input) if the budgets allow."""
        if self.rem_input_tokens <= 0 or (self.rem_chunk_tokens is not None and self.rem_chunk_tokens <= 0):
            self.note_stop("budget")
            return AddReqResult.OTHER
        if self.in_batch_prefix is not None:
            if len(self.held) >= MAX_HELD_PER_STEP:
                self.note_stop("held")
                return AddReqResult.OTHER
            held = self.in_batch_prefix.blocker(req)
            if held is not None:
                self.held.append(held)
                return AddReqResult.HELD
        result = self._add_one_req(req)
        if self.in_batch_prefix is not None and self.can_run_list and self.can_run_list[-1] is req:
            self.in_batch_prefix.add(req)
        return result

    def _add_one_req(self, req: Req) -> AddReqResult:
        # Lock before checking: an evictable prefix counted as room for the request's own tokens
        # would overcommit the pool as soon as the request pins it.
        budget = self._lock(req)
        if req.extend_input_len + self._reserve(req, 1.0) > budget:
            self.tree_cache.dec_lock_ref(req.last_node)
            self.note_stop("kv")
            return AddReqResult.NO_TOKEN
        self._keep_lock()
        chunk = self.rem_chunk_tokens
        if (chunk is None or req.extend_input_len <= chunk) and req.extend_input_len <= self.rem_input_tokens:
            self.can_run_list.append(req)
            self._consume(req.extend_input_len, self._reserve(req, 1.0))
            return AddReqResult.CONTINUE
        if chunk is None:
            # Without chunking a prompt larger than the per-step budget still runs, alone.
            self.note_stop("budget")
            if self.can_run_list:
                self.rem_total_tokens += self.tree_cache.dec_lock_ref(req.last_node)
                return AddReqResult.OTHER
            self.can_run_list.append(req)
            self._consume(req.extend_input_len, self._reserve(req, 1.0))
            return AddReqResult.OTHER
        # Cut the prompt: compute what fits now, carry the rest as the chunked request.
        n = min(chunk, self.rem_input_tokens)
        req.extend_input_len = n
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + n]
        self.can_run_list.append(req)
        self.new_chunked_req = req
        self._consume(n, 0)
        self.note_stop("budget")
        return AddReqResult.OTHER

    def _consume(self, extend: int, reserve: int) -> None:
        self.rem_total_tokens -= extend + reserve
        self.rem_input_tokens -= extend
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend


def register_builtin(registry) -> None:
    """Built-in policies, registered through the plugin host like any other."""
    for name, help_text in (
        ("fcfs", "first come, first served"),
        ("lpm", "longest cached prefix first"),
        ("dfs-weight", "depth-first over the radix tree, heaviest subtree first"),
        ("lof", "longest output first"),
        ("random", "shuffled"),
    ):
        registry.add_policy(
            name, lambda tree_cache, _n=name, **kw: SchedulePolicy(_n, tree_cache, True, **kw), help=help_text
        )
