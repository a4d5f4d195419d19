"""The KV integrity check: every KV slot and request row accounted for, as code.

Ownership of KV slots (see mem_cache/radix_cache.py): a slot is free in the allocator, stored in
exactly one radix-tree node, or privately held by one live request (its `req_to_token` row from
`len(req.prefix_indices)` to `req.kv_len`; with ChunkCache the whole row up to `kv_len`). In the
overlap loop one more kind exists while a decode batch is in flight: the slot that batch allocated
for a request which finished before it (given back when the batch's result is processed).

`check_kv_invariants()` verifies, between scheduler steps:
- free + cached (evictable + locked) + held by requests (+ in flight) == total KV slots, and every
  slot 1..total is in exactly one of those places (no slot twice, none missing);
- request rows in use == the live requests holding one, each its own row;
- a request row starts with its cached prefix's slots;
- each radix node's lock count == the live requests whose prefix runs through it, and the cache's
  evictable / locked counters match its nodes;
- with HiCache (mem_cache/hiradix_cache.py), the host tier: host slots free + held by nodes == the
  host pool's size, each once; every node has its KV in some tier; device nodes never sit under
  host-only ones; evicted nodes are unlocked.
A violation raises `KVInvariantError` with the numbers.

It runs when the scheduler goes idle if `--enable-kv-invariant-check` (or the environment variable
WORKBENCH_KV_INVARIANT_CHECK=1) is set, its outcome is reported by `get_internal_state` (the tests'
leak check reads it), and the in-process scheduler tests call it after every step.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

import torch
from workbench.core.mem_cache.radix_cache import RadixCache
from workbench.core.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from workbench.core.managers.schedule_batch import Req, ScheduleBatch
    from workbench.core.managers.scheduler_contract import Disaggregation, Drafter
    from workbench.core.managers.scheduler_overlap import InflightBatch
    from workbench.core.mem_cache.chunk_cache import ChunkCache
    from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator

logger = logging.getLogger(__name__)

KV_CHECK_ENV = "WORKBENCH_KV_INVARIANT_CHECK"


class KVInvariantError(AssertionError):
    """The scheduler's KV bookkeeping does not add up (a leak, a double free or a lost lock)."""


def kv_check_enabled(server_args) -> bool:
    """The flag, or the environment override (1/true/yes on, 0/false/no off)."""
    env = os.environ.get(KV_CHECK_ENV, "").strip().lower()
    if env in ("1", "true", "yes", "on"):
        return True
    if env in ("0", "false", "no", "off"):
        return False
    return bool(getattr(server_args, "enable_kv_invariant_check", False))


class SchedulerKVCheckMixin:
    kv_check_error: str = ""  # the last idle check's violation ("" = none seen)

    # The Scheduler's state this check reads (set in Scheduler.__init__; bare annotations, so
    # they only tell the type checker what the Scheduler that mixes this in holds).
    running_batch: ScheduleBatch
    chunked_req: Req | None
    last_batch: ScheduleBatch | None
    inflight: InflightBatch | None
    waiting_queue: list[Req]
    tree_cache: ChunkCache | RadixCache
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool_allocator: TokenToKVPoolAllocator
    max_total_num_tokens: int
    forward_ct: int
    drafter: Drafter | None
    kv_check_enabled: bool
    _kv_checked_idle: bool
    disagg: Disaggregation | None

    def live_kv_reqs(self) -> list[Req]:
        """Requests that hold a request row (and so may hold KV slots and a cache lock) now."""
        cands = list(self.running_batch.reqs)
        if self.chunked_req is not None:
            cands.append(self.chunked_req)
        if self.last_batch is not None and self.last_batch.forward_mode == ForwardMode.EXTEND:
            cands += self.last_batch.reqs
        if self.inflight is not None:
            cands += self.inflight.batch.reqs
        if self.disagg is not None:
            cands += self.disagg.held_reqs()  # PD decode: slots reserved for KV on its way
        out, seen = [], set()
        for r in cands:
            if id(r) not in seen and not r.finished() and r.req_pool_idx is not None:
                seen.add(id(r))
                out.append(r)
        return out

    def check_kv_invariants(self) -> dict:
        """Raise KVInvariantError unless every KV slot, row and lock is accounted for; return the counts.

        Call it between steps (not inside one): the in-process tests do after every step, the
        event loop when it goes idle (with the flag)."""
        alloc, pool, cache = self.token_to_kv_pool_allocator, self.req_to_token_pool, self.tree_cache
        total = self.max_total_num_tokens
        tree = cache if isinstance(cache, RadixCache) and not cache.disable else None
        radix = tree is not None
        live = self.live_kv_reqs()
        problems: list[str] = []

        # ---- slots: free + cached + held (+ in flight) == total, each slot once ----------
        free_slots = alloc.free_slots
        cached_slots = cache.all_values()
        table = pool.req_to_token
        held_parts, held = [], 0
        for r in live:
            start = len(r.prefix_indices) if radix else 0
            if r.kv_len < start:
                problems.append(f"request {r.rid}: kv_len {r.kv_len} < its cached prefix {start}")
                continue
            held_parts.append(table[r.req_pool_idx, start : r.kv_len])
            held += r.kv_len - start
            if radix and start and not torch.equal(table[r.req_pool_idx, :start].cpu(), r.prefix_indices.cpu()):
                problems.append(f"request {r.rid}: its row does not start with its cached prefix's slots")
        drafter = getattr(self, "drafter", None)
        if drafter is not None and drafter.runner is not None:  # STANDALONE's own pool: every slot free or held
            d = drafter.runner
            d_free = d.token_to_kv_pool_allocator.available_size()
            if d_free + drafter.held_tokens() != d.max_total_num_tokens:
                problems.append(
                    f"draft model pool: {d_free} free + {drafter.held_tokens()} held != {d.max_total_num_tokens}"
                )
        inflight_parts, inflight = [], 0
        if self.inflight is not None and self.inflight.batch.forward_mode == ForwardMode.DECODE:
            b = self.inflight.batch
            for i, r in enumerate(b.reqs):
                if r.finished():  # a row computed for nothing; its slot comes back with the result
                    assert b.out_cache_loc is not None  # a launched decode batch has its slots
                    inflight_parts.append(b.out_cache_loc[i : i + 1])
                    inflight += 1
        free, evictable, locked = alloc.available_size(), cache.evictable_size(), cache.protected_size()
        cached = int(cached_slots.numel())
        counted = free + cached + held + inflight
        if counted != total:
            problems.append(
                f"free {free} + cached {cached} (evictable {evictable}, locked {locked}) + held by "
                f"{len(live)} requests {held} + in flight {inflight} = {counted} != total {total}"
            )
        allslots = torch.cat([free_slots.cpu(), cached_slots.cpu()] + [p.cpu() for p in held_parts + inflight_parts])
        if allslots.numel():
            lo, hi = int(allslots.min()), int(allslots.max())
            if lo < 1 or hi > total:
                problems.append(f"slot ids out of range 1..{total}: min {lo}, max {hi}")
            else:
                counts = torch.bincount(allslots, minlength=total + 1)[1:]
                dup, missing = int((counts > 1).sum()), int((counts == 0).sum())
                if dup or missing:
                    where = _where(
                        int((counts > 1).nonzero()[0]) + 1 if dup else None,
                        free_slots,
                        cached_slots,
                        live,
                        table,
                        radix,
                    )
                    problems.append(f"{dup} slots counted twice{where}, {missing} slots nowhere (leaked)")
        if cache.total_size() != cached or evictable + locked != cached:
            problems.append(f"cache counters: evictable {evictable} + locked {locked} != {cached} slots in the tree")

        # ---- request rows --------------------------------------------------------------
        rows_used = pool.size - pool.available_size()
        live_rows = [r.req_pool_idx for r in live if r.req_pool_idx is not None]  # all of them: live holds rows
        if rows_used != len(live_rows):
            problems.append(
                f"request rows in use {rows_used} != {len(live_rows)} live requests holding one "
                f"({pool.available_size()} free of {pool.size})"
            )
        if len(set(live_rows)) != len(live_rows):
            problems.append(f"two live requests share a request row: {sorted(live_rows)}")
        if set(live_rows) & set(pool.free_slots):
            problems.append(f"rows {sorted(set(live_rows) & set(pool.free_slots))} are in use and free")
        if len(set(pool.free_slots)) != len(pool.free_slots):
            problems.append("a request row is on the free list twice")
        for r in self.waiting_queue:
            if r.req_pool_idx is not None and r is not self.chunked_req and r not in live:
                problems.append(f"waiting request {r.rid} still holds row {r.req_pool_idx}")

        # ---- radix locks -------------------------------------------------------------
        if tree is not None:
            want: dict[int, int] = {}
            for r in live:
                n = r.last_node
                while n is not None and n is not tree.root_node:
                    want[id(n)] = want.get(id(n), 0) + 1
                    n = n.parent
            ev = lk = 0
            for n in tree._iter_nodes():
                # A LoRA adapter's namespace (a keyless node under the root) is locked for good, like the root.
                permanent = 1 if not n.key and n.parent is tree.root_node else 0
                if n.lock_ref != want.get(id(n), 0) + permanent:
                    problems.append(
                        f"radix node #{n.id} ({len(n.key)} tokens) has lock_ref {n.lock_ref}, "
                        f"{want.get(id(n), 0)} live requests use it"
                    )
                    if len(problems) > 12:
                        break
                # Device tokens (a HiCache node evicted to host holds none; otherwise len(n.key)).
                if n.lock_ref > 0:
                    lk += int(n.value.numel())
                else:
                    ev += int(n.value.numel())
            if (ev, lk) != (evictable, locked):
                problems.append(
                    f"cache counters say evictable {evictable}, locked {locked}; its nodes hold "
                    f"{ev} unlocked, {lk} locked"
                )
            if tree.root_node.lock_ref != 1:
                problems.append(f"radix root lock_ref {tree.root_node.lock_ref} != 1")
            # Unlocked device nodes with no child on the device (plain radix cache: no children at all).
            leaves = {
                id(n)
                for n in tree._iter_nodes()
                if not n.evicted and n.lock_ref == 0 and all(c.evicted for c in n.children.values())
            }
            kept = {id(n) for n in tree.evictable_leaves()}
            if leaves != kept:
                problems.append(
                    f"radix evictable leaves: {len(kept - leaves)} kept that are not, {len(leaves - kept)} missing"
                )
            host_problems = getattr(tree, "host_problems", None)
            if host_problems is not None:  # HiCache: the host tier and the tiers' shape too
                problems += host_problems()

        if problems:
            raise KVInvariantError(f"KV invariant violated at step {self.forward_ct}: {'; '.join(problems)}")
        return {
            "total": total,
            "free": free,
            "cached": cached,
            "evictable": evictable,
            "locked": locked,
            "held": held,
            "inflight": inflight,
            "live_reqs": len(live),
            "rows_used": rows_used,
        }

    def check_kv_invariants_when_idle(self) -> None:
        """The idle hook: run the check once per busy -> idle transition when enabled; log a violation."""
        if self.drafter is not None:
            self.drafter.release()  # STANDALONE: nothing runs, so no request's draft K/V is needed
        if not self.kv_check_enabled or self._kv_checked_idle:
            return
        self._kv_checked_idle = True
        try:
            self.check_kv_invariants()
        except KVInvariantError as exc:
            self.kv_check_error = str(exc)
            logger.error("%s", exc)


def _where(slot: int | None, free_slots, cached_slots, live, table, radix) -> str:
    """Where a doubly counted slot is (for the message)."""
    if slot is None:
        return ""
    places = []
    if bool((free_slots == slot).any()):
        places.append("free")
    if bool((cached_slots == slot).any()):
        places.append("cache")
    for r in live:
        start = len(r.prefix_indices) if radix else 0
        if bool((table[r.req_pool_idx, start : r.kv_len] == slot).any()):
            places.append(f"request {r.rid}")
    return f" (e.g. slot {slot}: {', '.join(places)})"
