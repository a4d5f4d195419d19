"""TraceState: the pure reducer every view reads. Hand-written event sequences, no model."""

from __future__ import annotations

import random

import pytest
from synthetic import synthetic_trace
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState

MS = 1_000_000
S = 1_000_000_000
T0 = 5 * S


def one_request_events() -> list[ev.Event]:
    """r1: 40-token prompt, 8 cached, two prefill chunks (16 + 16), then 3 decode steps."""
    t = T0
    return [
        ev.ReqArrived(ts=t, proc="tokenizer", rid="r1", prompt_preview="Hello"),
        ev.ReqTokenized(ts=t + 1 * MS, proc="tokenizer", rid="r1", prompt_tokens=40, max_new_tokens=4),
        ev.ReqQueued(ts=t + 2 * MS, proc="scheduler", step=0, rid="r1", prompt_tokens=40, queue_len=1),
        ev.CacheMatch(ts=t + 3 * MS, proc="scheduler", step=1, rid="r1", matched=8, prompt_tokens=40),
        ev.ReqScheduled(
            ts=t + 3 * MS, proc="scheduler", step=1, rid="r1", prefix_hit=8, extend_len=16, chunk_index=0, num_chunks=2
        ),
        ev.BatchStep(
            ts=t + 10 * MS,
            proc="scheduler",
            step=1,
            mode="extend",
            reqs=[ev.StepReq("r1", 8, 16, 0, 0, 2)],
            batch_size=1,
            padded_size=1,
            schedule_ms=1.0,
            forward_ms=6.0,
        ),
        ev.ReqScheduled(
            ts=t + 11 * MS, proc="scheduler", step=2, rid="r1", prefix_hit=8, extend_len=16, chunk_index=1, num_chunks=2
        ),
        ev.BatchStep(
            ts=t + 20 * MS,
            proc="scheduler",
            step=2,
            mode="extend",
            reqs=[ev.StepReq("r1", 24, 16, 0, 1, 2)],
            batch_size=1,
            padded_size=1,
            schedule_ms=1.0,
            forward_ms=8.0,
        ),
        ev.ReqFirstToken(ts=t + 22 * MS, proc="tokenizer", rid="r1"),
        ev.ReqText(ts=t + 22 * MS, proc="tokenizer", rid="r1", delta="Hi"),
        *[
            ev.BatchStep(
                ts=t + (30 + 10 * i) * MS,
                proc="scheduler",
                step=3 + i,
                mode="decode",
                reqs=[ev.StepReq("r1", 0, 0, 1)],
                batch_size=1,
                padded_size=2,
                cuda_graph=True,
                forward_ms=5.0,
            )
            for i in range(3)
        ],
        ev.ReqText(ts=t + 52 * MS, proc="tokenizer", rid="r1", delta=" there"),
        ev.ReqFinished(
            ts=t + 55 * MS,
            proc="tokenizer",
            rid="r1",
            reason="length",
            prompt_tokens=40,
            completion_tokens=4,
            cached_tokens=8,
            ttft=0.022,
            tpot=0.011,
            e2e=0.055,
        ),
    ]


def fold(events, **kw) -> TraceState:
    st = TraceState(**kw)
    st.apply_many(events)
    return st


def test_request_lifecycle_through_every_request_event():
    evs = one_request_events()
    st = TraceState()
    states = []
    for e in evs:
        st.apply(e)
        states.append(st.requests["r1"].state)
    assert states[:3] == ["arrived", "arrived", "queued"]
    assert states[4:7] == ["prefilling", "prefilling", "prefilling"]  # chunk 1 of 2 done: still prefilling
    assert states[7] == "running"  # last chunk sampled the first token
    assert states[-1] == "finished"
    r = st.requests["r1"]
    assert (r.prompt_preview, r.prompt_tokens, r.max_new_tokens) == ("Hello", 40, 4)
    assert (r.cached_tokens, r.computed_tokens, r.output_tokens) == (8, 32, 4)
    assert (r.chunk_index, r.num_chunks) == (1, 2)
    assert r.steps == [1, 2, 3, 4, 5]
    assert r.text == "Hi there"
    assert r.arrival_ts == T0 and r.queued_ts == T0 + 2 * MS and r.first_token_ts == T0 + 22 * MS
    assert (r.finish_ts, r.finish_reason, r.ttft, r.tpot, r.e2e) == (T0 + 55 * MS, "length", 0.022, 0.011, 0.055)
    kinds = [(t.kind, t.detail) for t in r.timeline]
    assert kinds == [
        ("arrived", ""),
        ("queued", "queue length 1"),
        ("prefill", "chunk 1/2: 8 cached + 16 computed"),
        ("prefill", "chunk 2/2: 16 computed"),  # its own chunk 1 is not "cached"
        ("first_token", ""),
        ("decode", "3 steps"),
        ("finished", "length, 4 tokens"),
    ]
    assert [t.ts for t in r.timeline] == sorted(t.ts for t in r.timeline)
    c = st.counters
    assert (c.num_requests_total, c.prompt_tokens_total) == (1, 40)
    assert (c.generation_tokens_total, c.cached_tokens_total) == (4, 8)
    assert (c.prefill_computed_total, c.prefill_cached_total, c.decode_tokens_total) == (32, 8, 3)
    assert st.cache_hit_rate == pytest.approx(8 / 40)
    assert st.last_ts == T0 + 55 * MS
    assert set(st.procs) == {"tokenizer", "scheduler"}


def test_output_tokens_counted_live_before_finish():
    evs = one_request_events()[:-1]  # no req.finished yet
    r = fold(evs).requests["r1"]
    assert r.state == "running"
    assert r.output_tokens == 4  # first token from the last chunk + 3 decode steps
    assert r.ttft == pytest.approx(0.022)  # from first_token - arrival


def test_step_views_split_tokens():
    st = fold(one_request_events())
    assert [s.step for s in st.steps] == [1, 2, 3, 4, 5]
    s1, s2, s3 = list(st.steps)[:3]
    assert (s1.mode, s1.prefill_tokens, s1.cached_tokens, s1.decode_tokens) == ("extend", 16, 8, 0)
    assert (s2.prefill_tokens, s2.cached_tokens) == (16, 0)  # cached counted on first chunks only
    assert (s3.mode, s3.decode_tokens, s3.padded_size, s3.cuda_graph) == ("decode", 1, 2, True)
    assert s1.reqs[0].rid == "r1" and s1.schedule_ms == 1.0 and s1.forward_ms == 6.0


def test_finished_before_last_step_out_of_order():
    evs = one_request_events()
    fin = evs.pop()  # req.finished overtakes the last decode batch.step
    last_step = evs.pop(-2)
    assert isinstance(last_step, ev.BatchStep)
    st = fold(evs + [fin, last_step])
    r = st.requests["r1"]
    assert r.state == "finished"
    assert r.output_tokens == 4  # req.finished is authoritative: the late step adds nothing
    assert r.steps[-1] == 5
    assert [t.ts for t in r.timeline] == sorted(t.ts for t in r.timeline)
    assert r.timeline[-1].kind == "finished"
    assert [t.kind for t in r.timeline].count("decode") == 1  # the late step joined its run
    assert st.counters.num_requests_total == 1


def test_late_tokenizer_events_do_not_move_state_back():
    evs = one_request_events()
    arrived = evs.pop(0)
    st = fold(evs[:4] + [arrived])  # req.arrived delivered after the scheduler's queued/scheduled
    r = st.requests["r1"]
    assert r.state == "prefilling" and r.arrival_ts == T0
    assert r.timeline[0].kind == "arrived"


def test_unknown_rid_created_lazily_from_any_event():
    st = fold(
        [
            ev.BatchStep(
                ts=S,
                proc="scheduler",
                step=7,
                mode="decode",
                reqs=[ev.StepReq("ghost", 0, 0, 1)],
                batch_size=1,
                padded_size=1,
            ),
            ev.ReqText(ts=S + 1, proc="tokenizer", rid="other", delta="x"),
        ]
    )
    assert st.requests["ghost"].state == "running" and st.requests["ghost"].steps == [7]
    assert st.requests["other"].text == "x" and st.requests["other"].state == "arrived"


def test_retract_and_reprefill():
    evs = one_request_events()[:11]  # after the first decode step
    evs += [
        ev.ReqRetracted(ts=T0 + 31 * MS, proc="scheduler", step=3, rid="r1", output_tokens=2),
        ev.ReqQueued(ts=T0 + 31 * MS, proc="scheduler", step=3, rid="r1", prompt_tokens=40, queue_len=1),
    ]
    st = fold(evs)
    r = st.requests["r1"]
    assert (r.state, r.retractions, r.output_tokens) == ("queued", 1, 2)
    assert st.counters.num_retracted == 1
    # Re-prefill of prompt + output (42 tokens, 8 cached), then one more token.
    st.apply(
        ev.BatchStep(
            ts=T0 + 40 * MS,
            proc="scheduler",
            step=4,
            mode="extend",
            reqs=[ev.StepReq("r1", 8, 34, 0, 0, 1)],
            batch_size=1,
            padded_size=1,
        )
    )
    assert r.state == "running"
    assert (r.computed_tokens, r.recomputed_tokens) == (32, 34)  # the re-prefill is counted apart (#40 item 3)
    assert r.output_tokens == 3
    assert "retracted" in [t.kind for t in r.timeline]


def test_abort_counted_once():
    st = fold(
        one_request_events()[:5]
        + [
            ev.ReqAborted(ts=T0 + 6 * MS, proc="tokenizer", rid="r1", reason="client disconnected"),
            ev.ReqFinished(
                ts=T0 + 7 * MS,
                proc="tokenizer",
                rid="r1",
                reason="abort",
                prompt_tokens=40,
                completion_tokens=0,
                cached_tokens=8,
                ttft=0.0,
                tpot=0.0,
                e2e=0.007,
            ),
            ev.BatchStep(
                ts=T0 + 10 * MS,
                proc="scheduler",
                step=1,
                mode="extend",
                reqs=[ev.StepReq("r1", 8, 16, 0, 0, 2)],
                batch_size=1,
                padded_size=1,
            ),
        ]
    )
    r = st.requests["r1"]
    assert r.state == "aborted" and r.finish_reason == "abort"
    assert st.counters.num_aborted == 1 and st.counters.num_requests_total == 1
    assert st.latency_percentiles(60, T0 + S)["e2e"] is None  # aborted requests are not latency samples


def test_queue_kv_weights_procs_dropped_header():
    st = fold(
        [
            ev.TraceHeader(ts=1, proc="recorder", model="smol"),
            ev.ProcStarted(ts=2, proc="scheduler", pid=11, role="scheduler"),
            ev.QueueState(ts=10, proc="scheduler", waiting=["a", "b"], running=["c"], chunked=["b"]),
            ev.QueueState(ts=20, proc="scheduler.dp1", waiting=["d"], running=[], chunked=[]),
            ev.QueueState(ts=5, proc="scheduler", waiting=["stale"], running=[], chunked=[]),  # older: ignored
            ev.KVUsage(ts=10, proc="scheduler", used=10, evictable=5, free=85, total=100),
            ev.KVUsage(ts=11, proc="scheduler.dp1", used=1, evictable=0, free=99, total=100),
            ev.WeightsUpdated(ts=30, proc="scheduler", source="/m2", version=3),
            ev.TraceDropped(ts=31, proc="scheduler", count=7),
            ev.TraceDropped(ts=32, proc="bus", count=3),
            ev.ProcExited(ts=40, proc="scheduler", pid=11, role="scheduler", exitcode=-9, reason="killed"),
        ]
    )
    assert st.model == "smol"
    assert (st.waiting, st.running, st.chunked) == (["a", "b", "d"], ["c"], ["b"])
    assert [(q.waiting, q.running) for q in st.queue_history] == [(2, 1), (3, 1)]
    assert (st.kv.used, st.kv.free, st.kv.total) == (11, 184, 200)
    assert [k.used for k in st.kv_history] == [10, 11]
    assert st.weights_version == 3 and st.weights_source == "/m2"
    assert st.counters.dropped_events == 10
    p = st.procs["scheduler"]
    assert (p.pid, p.alive, p.exitcode, p.reason, p.started_ts) == (11, False, -9, "killed", 2)


def test_latency_percentiles_on_known_data():
    st = TraceState()
    for i in range(1, 101):  # request i finishes at i s with ttft i ms, e2e i*10 ms
        st.apply(
            ev.ReqFinished(
                ts=i * S,
                proc="tokenizer",
                rid=f"r{i}",
                reason="stop",
                prompt_tokens=10,
                completion_tokens=1 if i % 2 else 5,
                cached_tokens=0,
                ttft=i / 1000,
                tpot=i / 10000,
                e2e=i / 100,
            )
        )
    p = st.latency_percentiles(window_s=1000, now_ns=100 * S)
    assert p["ttft"] == pytest.approx((0.0505, 0.0901, 0.09901))
    assert p["e2e"] == pytest.approx((0.505, 0.901, 0.9901))
    # tpot only from multi-token outputs: even i -> 2..100
    assert p["tpot"] == pytest.approx((0.0051, 0.00902, 0.009902))
    # window (95 s, 100 s] -> requests 96..100
    p5 = st.latency_percentiles(window_s=5, now_ns=100 * S)
    assert p5["ttft"] == pytest.approx((0.098, 0.0996, 0.09996))
    assert st.latency_percentiles(window_s=5, now_ns=500 * S) == {"ttft": None, "tpot": None, "e2e": None}


def test_throughput_over_window():
    st = TraceState()
    reqs = [ev.StepReq("p", 0, 50, 0, 0, 99), *[ev.StepReq(f"d{j}", 0, 0, 1) for j in range(4)]]
    for i in range(10):  # a step every 100 ms: 50 prefill + 4 decode tokens
        st.apply(
            ev.BatchStep(
                ts=S + (i + 1) * 100 * MS,
                proc="scheduler",
                step=i,
                mode="mixed",
                reqs=reqs,
                batch_size=5,
                padded_size=8,
                forward_ms=100.0,
            )
        )
    tp = st.throughput(window_s=0.5)
    assert tp.prefill_tps == pytest.approx(500) and tp.decode_tps == pytest.approx(40)
    tp_all = st.throughput(window_s=60)  # clipped to when the first step started
    assert tp_all.prefill_tps == pytest.approx(500)
    assert st.throughput(window_s=1, now_ns=10 * S).prefill_tps == 0.0


def test_tree_from_snapshot_inserts_and_evicts():
    node = lambda i, p, n: ev.TreeNode(i, p, n, f"n{i}", 0, 1, 100)  # noqa: E731
    st = fold(
        [
            ev.CacheTree(
                ts=1,
                proc="scheduler",
                nodes=[node(0, -1, 0), node(1, 0, 10), node(2, 1, 5)],
                evictable_size=15,
                protected_size=0,
            ),
            ev.CacheInsert(ts=2, proc="scheduler", node_id=3, parent_id=1, tokens=7, text="n3"),
            ev.CacheInsert(ts=3, proc="scheduler", node_id=4, parent_id=0, tokens=4, text="n4"),
            ev.CacheEvict(ts=4, proc="scheduler", node_ids=[2, 99], tokens=5),
        ]
    )
    t = st.tree
    assert sorted(t) == [0, 1, 2, 3, 4]
    assert t[0].children == [1, 4] and t[1].children == [2, 3]
    assert t[2].just_evicted and not t[3].just_evicted
    assert t[3].just_inserted and t[4].just_inserted and not t[1].just_inserted
    assert (t[3].parent_id, t[3].tokens, t[3].text) == (1, 7, "n3")
    assert st.counters.evicted_tokens_total == 5
    assert (st.tree_evictable_size, st.tree_protected_size) == (15, 0)
    st.apply(
        ev.CacheTree(
            ts=5,
            proc="scheduler",
            nodes=[node(0, -1, 0), node(1, 0, 10), node(3, 1, 7)],
            evictable_size=17,
            protected_size=0,
        )
    )
    t = st.tree
    assert sorted(t) == [0, 1, 3] and t[1].children == [3]
    assert not any(n.just_evicted or n.just_inserted for n in t.values())
    assert st.tree_evictable_size == 17


def test_bounded_rings_and_finished_cap():
    st = TraceState(max_steps=10, max_history=5, max_finished=5, max_requests=50)
    for i in range(25):
        st.apply(ev.BatchStep(ts=i + 1, proc="scheduler", step=i, mode="decode", reqs=[], batch_size=0, padded_size=0))
        st.apply(ev.KVUsage(ts=i + 1, proc="scheduler", used=i, evictable=0, free=100 - i, total=100))
        st.apply(ev.QueueState(ts=i + 1, proc="scheduler", waiting=[], running=[], chunked=[]))
    assert [s.step for s in st.steps] == list(range(15, 25))
    assert [k.used for k in st.kv_history] == list(range(20, 25))
    assert len(st.queue_history) == 5
    for i in range(12):
        st.apply(ev.ReqArrived(ts=100 + i, proc="tokenizer", rid=f"f{i}"))
        st.apply(ev.ReqAborted(ts=200 + i, proc="tokenizer", rid=f"f{i}"))
    st.apply(ev.ReqArrived(ts=300, proc="tokenizer", rid="active"))
    assert set(st.requests) == {"active"} | {f"f{i}" for i in range(7, 12)}
    assert st.counters.num_aborted == 12  # counters survive the cap
    for i in range(60):  # active requests are capped too (oldest first)
        st.apply(ev.ReqArrived(ts=400 + i, proc="tokenizer", rid=f"a{i}"))
    assert len(st.requests) == 50 and "a59" in st.requests and "active" not in st.requests


def test_synthetic_run_totals_and_determinism():
    evs = synthetic_trace(n_requests=10, seed=3)
    st = fold(evs)
    assert len(st.requests) == 10 and all(r.state == "finished" for r in st.requests.values())
    for r in st.requests.values():
        assert r.output_tokens == r.max_new_tokens
        assert r.cached_tokens + r.computed_tokens == r.prompt_tokens
        assert r.text == "".join(f" t{i}" for i in range(1, r.output_tokens + 1))
    assert st.counters.generation_tokens_total == sum(r.max_new_tokens for r in st.requests.values())
    assert st.counters.num_requests_total == 10 and st.counters.evicted_tokens_total > 0
    assert fold(evs).dump() == st.dump()
    assert (st.waiting, st.running, st.chunked) == ([], [], [])


@pytest.mark.parametrize("seed", range(6))
def test_any_cross_process_interleaving_gives_the_same_picture(seed):
    evs = synthetic_trace(n_requests=8, seed=seed, reorder=False)
    rng = random.Random(seed)
    by_proc: dict[str, list] = {}
    for e in evs:
        by_proc.setdefault(e.proc, []).append(e)
    # Random merge keeping each process's own order (what the bus guarantees).
    merged, queues = [], {p: list(q) for p, q in by_proc.items()}
    while queues:
        p = rng.choice(sorted(queues))
        merged.append(queues[p].pop(0))
        if not queues[p]:
            del queues[p]
    a, b = fold(evs), fold(merged)
    keys = (
        "state",
        "prompt_tokens",
        "cached_tokens",
        "computed_tokens",
        "output_tokens",
        "text",
        "steps",
        "arrival_ts",
        "first_token_ts",
        "finish_ts",
        "ttft",
        "tpot",
        "e2e",
    )
    for rid, ra in a.requests.items():
        rb = b.requests[rid]
        assert {k: getattr(ra, k) for k in keys} == {k: getattr(rb, k) for k in keys}
        assert sorted((t.ts, t.kind) for t in ra.timeline) == [(t.ts, t.kind) for t in rb.timeline]
    da, db = a.dump(), b.dump()
    for k in ("counters", "steps", "trees", "kv", "waiting", "running"):
        assert da[k] == db[k]


def test_snapshot_rebuilds_the_picture_and_later_events_apply_cleanly():
    evs = synthetic_trace(n_requests=8, seed=1)
    for cut in range(5, len(evs), 7):  # cut everywhere: mid chunked prefill, mid decode, ...
        live = fold(evs[:cut])
        rebuilt = fold(live.snapshot_events(max_finished=1000))
        live.apply_many(evs[cut:])
        rebuilt.apply_many(evs[cut:])
        dl, dr = live.dump(), rebuilt.dump()
        assert dr["requests"] == dl["requests"], cut
        assert dr["counters"] == dl["counters"], cut
        for k in ("waiting", "running", "chunked", "kv", "weights_version", "tree_evictable_size"):
            assert dr[k] == dl[k], (cut, k)
        shape = lambda st: {
            n: (v.parent_id, v.tokens, v.text, sorted(v.children), v.just_evicted)  # noqa: E731
            for n, v in st.tree.items()
        }
        assert shape(rebuilt) == shape(live), cut


def test_trace_reset_forgets_everything_but_keeps_caps():
    st = TraceState(max_steps=3)
    st.apply_many(synthetic_trace(4))
    st.apply(ev.TraceReset(ts=1))
    assert st.dump() == TraceState().dump() and st.steps.maxlen == 3


def test_req_snapshot_carries_every_request_view_field():
    """A late subscriber's snapshot must rebuild the whole RequestView: the wire form has them all."""
    from workbench.core.trace.views import REQUEST_SNAPSHOT_FIELDS, RequestView

    wire = set(ev.ReqSnapshot.__struct_fields__)
    assert set(REQUEST_SNAPSHOT_FIELDS) <= wire
    assert {"rid", "timeline", "steps"} <= wire
    assert set(REQUEST_SNAPSHOT_FIELDS) | {"rid", "timeline", "steps"} == {f for f in RequestView.__dataclass_fields__}


def test_hit_rate_counts_cached_tokens_as_requests_are_admitted():
    st = fold(
        [
            ev.BatchStep(
                ts=1,
                proc="scheduler",
                step=1,
                mode="extend",
                batch_size=2,
                padded_size=2,
                reqs=[ev.StepReq("a", cached=0, computed=40), ev.StepReq("b", cached=30, computed=10)],
            ),
        ]
    )
    # nobody finished yet, and still 30 of the 80 prefilled prompt tokens came from the cache
    assert st.counters.num_requests_total == 0
    assert st.cache_hit_rate == pytest.approx(30 / 80)


def test_one_evictable_figure_for_every_view():
    node = lambda i, p, n, lock: ev.TreeNode(i, p, n, f"n{i}", lock, 1, 100)  # noqa: E731
    st = fold(
        [
            ev.CacheTree(
                ts=1,
                proc="scheduler",
                nodes=[node(0, -1, 0, 0), node(1, 0, 10, 0)],
                evictable_size=10,
                protected_size=0,
            )
        ]
    )
    assert st.evictable == 10  # before any kv.usage: the tree's
    st.apply(ev.KVUsage(ts=2, proc="scheduler", used=10, evictable=0, free=90, total=100))
    assert st.evictable == 0 == st.kv.evictable  # kv.usage comes every step
    assert st.tree_evictable_size == 10  # (the stale tree's own figure is not shown)


def test_queue_counts_include_requests_not_listed_yet():
    st = fold(
        [
            ev.ReqArrived(ts=1, proc="tokenizer", rid="a"),
            ev.ReqArrived(ts=2, proc="tokenizer", rid="b"),
            ev.ReqArrived(ts=3, proc="tokenizer", rid="c"),
            ev.ReqQueued(ts=4, proc="scheduler", rid="b", prompt_tokens=5, queue_len=1),
            ev.QueueState(ts=5, proc="scheduler", waiting=[], running=["c"], chunked=[]),
        ]
    )
    assert [r.rid for r in st.unlisted()] == ["a", "b"]
    assert st.queue_counts() == {"waiting": 1, "new": 1, "running": 1, "chunked": 0}
