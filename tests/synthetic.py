"""A deterministic synthetic trace: a small simulated serving run, no model needed.

For tests of the trace machinery, and for building views (TUI panels,
widgets) without starting an engine. It imitates what the real processes
emit: tokenizer-side req.arrived/tokenized/first_token/text/finished,
scheduler-side req.queued/scheduled, batch.step (chunked prefill then
batched decode), queue.state, kv.usage, cache.match/insert/evict and periodic
cache.tree snapshots. With `reorder=True` the tokenizer's req.finished is
delivered before the scheduler's batch for the same step, as happens live.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.core.trace.ttft import PART_KINDS


@dataclass
class _SimReq:
    rid: str
    arrive_step: int
    prompt: int
    max_new: int
    hit: int = 0
    done_prefill: int = 0
    out: int = 0
    chunk: int = 0
    num_chunks: int = 1
    arrival_ts: int = 0
    first_ts: int = 0
    node: int = -1
    steps: list = field(default_factory=list)


def synthetic_trace(
    n_requests: int = 6,
    seed: int = 0,
    chunk_size: int = 32,
    max_running: int = 3,
    shared_prefix: int = 16,
    kv_total: int = 400,
    t0: int = 10**12,
    step_ms: float = 20.0,
    reorder: bool = True,
) -> list[ev.Event]:
    """Events of a simulated run in delivery order. Every request finishes with
    exactly its max_new_tokens ("length"), so totals are easy to check."""
    rng = random.Random(seed)
    reqs = [
        _SimReq(f"r{i}", arrive_step=i * 2 // 3, prompt=rng.randint(24, 90), max_new=rng.randint(2, 6))
        for i in range(n_requests)
    ]
    out: list[ev.Event] = []
    ns = lambda ms: int(ms * 1e6)  # noqa: E731
    t = t0
    for i, role in enumerate(("tokenizer", "scheduler", "detokenizer")):
        out.append(ev.ProcStarted(ts=t + i, proc=role, pid=1000 + i, role=role))
    tree = {0: ev.TreeNode(0, -1, 0, "", 1, 0, t)}
    next_node = 1
    prefix_node = None
    waiting: list[_SimReq] = []
    running: list[_SimReq] = []
    chunked: _SimReq | None = None
    finished = 0
    step = 0
    while finished < n_requests:
        t += ns(step_ms)
        for r in reqs:
            if r.arrive_step == step:
                r.arrival_ts = t - ns(step_ms * 0.98)
                out.append(
                    ev.ReqArrived(ts=r.arrival_ts, proc="tokenizer", rid=r.rid, prompt_preview=f"prompt of {r.rid}")
                )
                out.append(
                    ev.ReqTokenized(
                        ts=r.arrival_ts + ns(0.1),
                        proc="tokenizer",
                        rid=r.rid,
                        prompt_tokens=r.prompt,
                        max_new_tokens=r.max_new,
                    )
                )
                waiting.append(r)
                out.append(
                    ev.ReqQueued(
                        ts=t - ns(step_ms * 0.95),
                        proc="scheduler",
                        step=step,
                        rid=r.rid,
                        prompt_tokens=r.prompt,
                        queue_len=len(waiting),
                    )
                )
        sched: list[ev.Event] = []
        tok: list[ev.Event] = []
        if chunked is None and waiting and len(running) < max_running:
            chunked = waiting.pop(0)
            chunked.hit = shared_prefix if prefix_node is not None else 0
            chunked.num_chunks = -(-(chunked.prompt - chunked.hit) // chunk_size)
            sched.append(
                ev.CacheMatch(
                    ts=t - ns(step_ms * 0.9),
                    proc="scheduler",
                    step=step,
                    rid=chunked.rid,
                    matched=chunked.hit,
                    prompt_tokens=chunked.prompt,
                )
            )
        step_reqs: list[ev.StepReq] = []
        sampled: list[_SimReq] = []
        if chunked is not None:
            r = chunked
            n = min(chunk_size, r.prompt - r.hit - r.done_prefill)
            cached = r.hit + r.done_prefill
            sched.append(
                ev.ReqScheduled(
                    ts=t - ns(step_ms * 0.85),
                    proc="scheduler",
                    step=step,
                    rid=r.rid,
                    prefix_hit=r.hit,
                    extend_len=n,
                    chunk_index=r.chunk,
                    num_chunks=r.num_chunks,
                )
            )
            step_reqs.append(ev.StepReq(r.rid, cached, n, 0, r.chunk, r.num_chunks))
            r.done_prefill += n
            r.chunk += 1
            if r.hit + r.done_prefill >= r.prompt:
                chunked = None
                running.append(r)
                sampled.append(r)
                r.first_ts = t + ns(2)
                tok.append(ev.ReqFirstToken(ts=r.first_ts, proc="tokenizer", rid=r.rid))
            mode = "extend"
        else:
            mode = "decode"
            for r in running:
                step_reqs.append(ev.StepReq(r.rid, 0, 0, 1))
                sampled.append(r)
        for r in sampled:
            r.out += 1
            tok.append(ev.ReqText(ts=t + ns(2), proc="tokenizer", rid=r.rid, delta=f" t{r.out}"))
        done = [r for r in running if r.out >= r.max_new]
        for r in done:
            running.remove(r)
            finished += 1
            parent = 0
            if prefix_node is None:
                prefix_node = next_node
                tree[prefix_node] = ev.TreeNode(prefix_node, 0, shared_prefix, "System:", 0, 0, t)
                sched.append(
                    ev.CacheInsert(
                        ts=t,
                        proc="scheduler",
                        step=step,
                        node_id=prefix_node,
                        parent_id=0,
                        tokens=shared_prefix,
                        text="System:",
                    )
                )
                next_node += 1
            parent = prefix_node
            r.node = next_node
            toks = r.prompt + r.out - 1 - shared_prefix
            tree[r.node] = ev.TreeNode(r.node, parent, toks, r.rid, 0, 0, t)
            sched.append(
                ev.CacheInsert(
                    ts=t, proc="scheduler", step=step, node_id=r.node, parent_id=parent, tokens=toks, text=r.rid
                )
            )
            next_node += 1
            e2e = (t + ns(3) - r.arrival_ts) / 1e9
            ttft = (r.first_ts - r.arrival_ts) / 1e9
            tok.append(
                ev.ReqFinished(
                    ts=t + ns(3),
                    proc="tokenizer",
                    rid=r.rid,
                    reason="length",
                    prompt_tokens=r.prompt,
                    completion_tokens=r.out,
                    cached_tokens=r.hit,
                    ttft=ttft,
                    tpot=(e2e - ttft) / max(r.out - 1, 1),
                    e2e=e2e,
                )
            )
        cached_total = sum(n.tokens for n in tree.values())
        if cached_total > kv_total // 2:
            leaves = [
                n
                for n in tree.values()
                if n.node_id not in (0, prefix_node) and not any(c.parent_id == n.node_id for c in tree.values())
            ]
            victim = min(leaves, key=lambda n: n.node_id) if leaves else None
        else:
            victim = None
        if victim is not None:
            del tree[victim.node_id]
            sched.append(
                ev.CacheEvict(ts=t, proc="scheduler", step=step, node_ids=[victim.node_id], tokens=victim.tokens)
            )
        sched.append(
            ev.BatchStep(
                ts=t,
                proc="scheduler",
                step=step,
                mode=mode,
                reqs=step_reqs,
                batch_size=len(step_reqs),
                padded_size=len(step_reqs),
                schedule_ms=0.5,
                forward_ms=step_ms * 0.8,
            )
        )
        sched.append(
            ev.QueueState(
                ts=t,
                proc="scheduler",
                step=step,
                waiting=[r.rid for r in waiting],
                running=[r.rid for r in running],
                chunked=[chunked.rid] if chunked else [],
            )
        )
        used = sum(r.prompt + r.out for r in running) + (chunked.done_prefill if chunked else 0)
        cached_total = sum(n.tokens for n in tree.values())
        sched.append(
            ev.KVUsage(
                ts=t,
                proc="scheduler",
                step=step,
                used=used,
                evictable=cached_total,
                free=kv_total - used - cached_total,
                total=kv_total,
            )
        )
        if step % 5 == 4:
            sched.append(
                ev.CacheTree(
                    ts=t,
                    proc="scheduler",
                    step=step,
                    nodes=list(tree.values()),
                    evictable_size=cached_total,
                    protected_size=0,
                )
            )
        finishes = [e for e in tok if isinstance(e, ev.ReqFinished)]
        others = [e for e in tok if not isinstance(e, ev.ReqFinished)]
        # Live, the tokenizer's req.finished can reach the bus before the scheduler's batch.
        out.extend(finishes + sched + others if reorder else sched + tok)
        step += 1
    return out


def check_ttft_sums(st: TraceState, rid: str):
    """TraceState.ttft_parts of a finished request (tests/fast/test_ttft_parts.py, the e2e scenarios).

    The invariant: parts in order, none negative, contiguous, summing exactly to the TTFT."""
    r = st.requests[rid]
    b = st.ttft_parts(rid)
    assert b is not None and not b.partial
    assert b.parts[0].start_ts == r.arrival_ts and b.parts[-1].end_ts == r.first_token_ts
    for p, q in zip(b.parts, b.parts[1:]):
        assert p.end_ts == q.start_ts
    assert all(p.ns >= 0 for p in b.parts)
    assert sum(p.ns for p in b.parts) == b.ttft_ns == r.first_token_ts - r.arrival_ts
    assert abs(b.ttft - r.ttft) <= 1e-9
    kinds = [p.kind for p in b.parts]
    assert kinds == sorted(kinds, key=PART_KINDS.index) and kinds[0] == "arrived" and kinds[-1] == "first_token"
    return b
