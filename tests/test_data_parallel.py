"""Data parallel (`--dp-size 2`): a DataParallelController in front of two real scheduler replicas.

The pure parts (load balancer, prefix index, reply merging, the reducer's per-replica view)
are tested in-process; the rest on the real default model: outputs equal DP 1 (greedy), both
replicas serve (the trace says which), shortest_queue steers around a long request, the
prefix-aware method keeps a shared prefix on one replica, and abort / flush / step gate /
internal state reach every replica.
"""

from __future__ import annotations

import threading

import pytest
import torch
from pipeline_helpers import assert_no_kv_leak, drain_events, generate_traced
from workbench.core.engine import Engine
from workbench.core.io_struct import (
    FlushCacheReqOutput,
    GetInternalStateReqOutput,
    GetWeightsByNameReqOutput,
    StepGateReqOutput,
)
from workbench.core.managers.data_parallel_controller import (
    BALANCE_ABS_THRESHOLD,
    PREFIX_BLOCK,
    ApproxPrefixIndex,
    LoadBalancer,
    merge_replies,
)
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState

NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
WORDS = (
    "ocean volcano robot tea chess winter bees moon library trains jazz mountain bread lighthouse maps clocks"
).split()
SYSTEM = (
    "You are a careful assistant for a course on computer systems. Answer briefly and plainly. "
    "The course covers operating systems, caches, schedulers, networking and compilers. "
) * 3


def _engine(**kw) -> Engine:
    return Engine(dtype="float32", max_total_tokens=4096, show_progress=False, **kw)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    # 32 distinct short prompts of varied length.
    return [
        tokenizer.encode(f"Tell me about {WORDS[i % 16]} " + "and more " * (i % 5), add_special_tokens=False)
        + [i + 100]
        for i in range(32)
    ]


# ==== in-process: the controller's bookkeeping ==============================================


def test_round_robin_cycles_and_counts_in_flight():
    lb = LoadBalancer(3, "round_robin")
    ranks = [lb.choose(f"r{i}", [1, 2, 3]).dp_rank for i in range(7)]
    assert ranks == [0, 1, 2, 0, 1, 2, 0]
    assert lb.load == [3, 2, 2]
    lb.on_output("r0", [5], finished=False)
    assert lb.load == [3, 2, 2]
    lb.on_output("r0", [6], finished=True)
    lb.on_output("r0", [6], finished=True)  # a duplicate finish must not count twice
    assert lb.load == [2, 2, 2] and lb.rank_of("r0") is None and lb.rank_of("r1") == 1


def test_shortest_queue_follows_finishes():
    lb = LoadBalancer(2, "shortest_queue")
    assert lb.choose("long", [1]).dp_rank == 0
    # While "long" runs on 0, every short request goes to 1 (and finishes there).
    for i in range(3):
        assert lb.choose(f"s{i}", [1]).dp_rank == 1
        lb.on_output(f"s{i}", [2], finished=True)
    assert lb.load == [1, 0]
    lb.on_output("long", [2], finished=True)
    assert lb.choose("next", [1]).dp_rank == 0


def test_prefix_index_matches_whole_blocks_and_is_bounded():
    idx = ApproxPrefixIndex(capacity_tokens=4 * PREFIX_BLOCK)
    seq = list(range(3 * PREFIX_BLOCK + 5))
    idx.insert(idx.block_keys(seq))
    assert idx.match(idx.block_keys(seq)) == 3 * PREFIX_BLOCK
    other = seq[:PREFIX_BLOCK] + [999] + seq[PREFIX_BLOCK + 1 :]
    assert idx.match(idx.block_keys(other)) == PREFIX_BLOCK  # diverges in the second block
    assert idx.match(idx.block_keys(seq[: PREFIX_BLOCK - 1])) == 0
    idx.insert(idx.block_keys([7] * (3 * PREFIX_BLOCK)))  # LRU: the oldest blocks go
    assert len(idx) == 4 and idx.match(idx.block_keys(seq)) == 0
    idx.clear()
    assert len(idx) == 0


def test_prefix_aware_prefers_the_replica_that_saw_the_prefix():
    lb = LoadBalancer(2, "prefix_aware")
    a = [1] * 64 + [2]
    b = [3] * 64 + [4]
    first = lb.choose("a0", a + [10])
    assert first.dp_rank == 0 and first.matched_tokens == 0
    assert lb.choose("b0", b + [10]).dp_rank == 1  # no match anywhere: least loaded
    for i in range(1, 4):  # the families stick to their replicas
        da, db = lb.choose(f"a{i}", a + [10 + i]), lb.choose(f"b{i}", b + [10 + i])
        assert (da.dp_rank, db.dp_rank) == (0, 1) and da.matched_tokens == 64
    # A finished request teaches the index its output too (the radix cache keeps both).
    lb.on_output("a0", list(range(40)), finished=True)
    follow_up = a + [10] + list(range(40)) + [77]
    assert lb.choose("a0-turn2", follow_up).matched_tokens >= 96
    # Affinity gives way when it would pile everything on one replica.
    lb2 = LoadBalancer(2, "prefix_aware")
    ranks = [lb2.choose(f"x{i}", a).dp_rank for i in range(2 * BALANCE_ABS_THRESHOLD)]
    assert ranks.count(1) > 0 and ranks.count(0) >= BALANCE_ABS_THRESHOLD


def test_replies_merge_over_replicas():
    def state(**kw):
        base = dict(
            num_waiting=1,
            num_running=2,
            kv_total=100,
            kv_free=60,
            kv_evictable=30,
            kv_used=10,
            req_slots_free=7,
            req_slots_total=8,
            step=5,
            max_total_num_tokens=100,
            max_running_requests=8,
            max_req_input_len=50,
        )
        return GetInternalStateReqOutput(**{**base, **kw})

    m = merge_replies([state(), state(step=9, kv_free=70, kv_used=0, max_req_input_len=40)])
    assert (m.num_running, m.kv_total, m.kv_free, m.kv_used, m.step, m.max_req_input_len) == (4, 200, 130, 10, 9, 40)
    assert [r["kv_free"] for r in m.per_replica] == [60, 70]
    assert not merge_replies([FlushCacheReqOutput(success=True), FlushCacheReqOutput(success=False)]).success
    assert merge_replies(
        [StepGateReqOutput(paused=True, step=3), StepGateReqOutput(paused=True, step=4)]
    ) == StepGateReqOutput(paused=True, step=4)
    same = [GetWeightsByNameReqOutput(values=[1.0, 2.0]), GetWeightsByNameReqOutput(values=[1.0, 2.0])]
    assert merge_replies(same).values == [1.0, 2.0]
    split = merge_replies([GetWeightsByNameReqOutput(values=[1.0]), GetWeightsByNameReqOutput(values=[3.0])])
    assert split.values is None and "different values" in split.message


def test_trace_state_keeps_replicas_side_by_side():
    evs = [
        ev.ReqArrived(ts=1, proc="tokenizer", rid="a"),
        ev.ReqArrived(ts=2, proc="tokenizer", rid="b"),
        ev.ReqDispatched(ts=3, proc="dp_controller", rid="a", dp_rank=0, method="round_robin", loads=[1, 0]),
        ev.ReqDispatched(ts=4, proc="dp_controller", rid="b", dp_rank=1, method="round_robin", loads=[1, 1]),
        ev.ReqQueued(ts=5, proc="scheduler.dp0", rid="a", prompt_tokens=4, queue_len=1),
        ev.ReqQueued(ts=6, proc="scheduler.dp1", rid="b", prompt_tokens=4, queue_len=1),
        ev.QueueState(ts=7, proc="scheduler.dp0", waiting=["a"], running=[], chunked=[]),
        ev.QueueState(ts=8, proc="scheduler.dp1", waiting=[], running=["b"], chunked=[]),
        ev.KVUsage(ts=9, proc="scheduler.dp1", used=4, evictable=0, free=96, total=100),
        ev.BatchStep(
            ts=10,
            proc="scheduler.dp1",
            step=1,
            mode="extend",
            batch_size=1,
            padded_size=1,
            reqs=[ev.StepReq("b", 0, 4, 0)],
        ),
    ]
    st = TraceState()
    st.apply_many(evs)
    assert st.req_replica == {"a": "scheduler.dp0", "b": "scheduler.dp1"}
    reps = st.replicas()
    assert [(r.dp_rank, r.waiting, r.running, r.requests, r.steps) for r in reps] == [
        (0, ["a"], [], 1, 0),
        (1, [], ["b"], 1, 1),
    ]
    assert reps[1].kv.used == 4 and reps[0].kv is None
    assert any(t.kind == "dispatched" and "dp1" in t.detail for t in st.requests["b"].timeline)
    rebuilt = TraceState()
    rebuilt.apply_many(st.snapshot_events())
    assert rebuilt.req_replica == st.req_replica
    assert TraceState().replicas() == []


def test_dp_with_tp_is_refused_with_a_clear_error(default_prepared):
    with pytest.raises(ValueError, match="--dp-size > 1 together with --tp-size > 1 is not supported"):
        _engine(dp_size=2, tp_size=3)


# ==== the real model: DP 2 against DP 1 ==========================================================


@pytest.fixture(scope="module")
def dp1_outputs(prompts, default_prepared):
    with _engine() as e:
        return [o["output_ids"] for o in e.generate(input_ids=prompts, sampling_params=GREEDY)]


class TestShortestQueue:
    @pytest.fixture(scope="class")
    def engine(self, default_prepared):
        with _engine(dp_size=2, load_balance_method="shortest_queue") as e:
            yield e

    def test_32_concurrent_requests_equal_dp1_and_use_both_replicas(self, engine, prompts, dp1_outputs):
        outs, events = generate_traced(engine, prompts, GREEDY)
        assert [o["output_ids"] for o in outs] == dp1_outputs
        rids = {o["meta_info"]["id"] for o in outs}
        queued_on = {e.rid: e.proc for e in events if isinstance(e, ev.ReqQueued) and e.rid in rids}
        assert set(queued_on) == rids
        per_replica = {p: sum(1 for v in queued_on.values() if v == p) for p in set(queued_on.values())}
        assert set(per_replica) == {"scheduler.dp0", "scheduler.dp1"} and min(per_replica.values()) >= 8
        dispatched = {e.rid: f"scheduler.dp{e.dp_rank}" for e in events if isinstance(e, ev.ReqDispatched)}
        assert {r: dispatched[r] for r in rids} == queued_on  # the controller's word = where it ran
        st = TraceState()
        st.apply_many(events)
        assert [r.proc for r in st.replicas()] == ["scheduler.dp0", "scheduler.dp1"]
        assert all(r.steps > 0 for r in st.replicas())
        state = assert_no_kv_leak(engine)
        assert len(state["per_replica"]) == 2
        assert all(r["kv_free"] == r["kv_total"] > 0 for r in state["per_replica"])

    def test_skewed_load_goes_around_a_long_request_then_abort_reaches_it(self, engine, prompts):
        sub = engine.subscribe(with_snapshot=False)
        started, last = threading.Event(), {}

        def run_long():
            for chunk in engine.generate(
                input_ids=prompts[0],
                stream=True,
                rid="long-1",
                sampling_params={"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True},
            ):
                last.update(chunk)
                started.set()

        t = threading.Thread(target=run_long)
        t.start()
        try:
            assert started.wait(120), "the long request produced no token"
            shorts = [
                engine.generate(
                    input_ids=p, sampling_params={"max_new_tokens": 4, "temperature": 0.0}, rid=f"short-{i}"
                )
                for i, p in enumerate(prompts[1:5])
            ]
            engine.abort_request("long-1")
            t.join(60)
            events = drain_events(sub)
        finally:
            sub.close()
        assert not t.is_alive()
        # It was still running when every short request had finished: the load really was skewed.
        assert last["meta_info"]["finish_reason"]["type"] == "abort"
        assert last["meta_info"]["completion_tokens"] < 3000
        where = {e.rid: e.dp_rank for e in events if isinstance(e, ev.ReqDispatched)}
        long_rank = where["long-1"]
        assert [where[s["meta_info"]["id"]] for s in shorts] == [1 - long_rank] * 4
        assert all(s["meta_info"]["finish_reason"]["type"] in ("length", "stop") for s in shorts)
        assert_no_kv_leak(engine)

    def test_abort_all_and_step_gate_reach_every_replica(self, engine, prompts):
        sp = {"max_new_tokens": 3000, "temperature": 0.0, "ignore_eos": True}
        assert engine.step_gate("pause")["paused"]
        results = {}
        threads = [
            threading.Thread(
                target=lambda i=i: results.update({i: engine.generate(input_ids=prompts[i], sampling_params=sp)})
            )
            for i in range(2)
        ]
        for th in threads:
            th.start()
        try:
            state = _wait_for(engine, lambda s: s["num_waiting"] == 2)
            # Paused: each replica holds one request in its queue, neither has run a step for it.
            assert sorted(r["num_waiting"] for r in state["per_replica"]) == [1, 1]
            stepped = engine.step_gate("step", 1)  # one iteration on every replica
            assert stepped["paused"]
            state = engine.get_internal_state()
            assert [r["num_running"] for r in state["per_replica"]] == [1, 1]
        finally:
            engine.step_gate("resume")
        _wait_for(engine, lambda s: s["num_running"] == 2)
        engine.abort_request("")  # "" = every request, on every replica
        for th in threads:
            th.join(60)
        assert [results[i]["meta_info"]["finish_reason"]["type"] for i in range(2)] == ["abort", "abort"]
        assert_no_kv_leak(engine)

    def test_weight_update_reaches_every_replica(self, engine):
        name = "model.norm.weight"
        full = engine.get_weights_by_name(name, truncate_size=10_000)
        new = torch.tensor(full, dtype=torch.float32) * 0.5
        try:
            out = engine.update_weights_from_tensor([(name, new)])
            assert out["success"] and out["version"] >= 1
            # Replies merge only when both replicas agree, so this reads both of them.
            assert engine.get_weights_by_name(name, truncate_size=8) == pytest.approx(new[:8].tolist())
        finally:
            engine.update_weights_from_tensor([(name, torch.tensor(full, dtype=torch.float32))])
        assert engine.get_weights_by_name(name, truncate_size=8) == pytest.approx(full[:8])

    def test_distributed_weight_update_gives_each_replica_its_own_rank(self, engine):
        from workbench.core.distributed.launch import free_loopback_addr
        from workbench.core.managers.weight_updater import TrainerWeightSync

        name, group = "model.norm.weight", "dp-test-group"
        full = engine.get_weights_by_name(name, truncate_size=10_000)
        new = torch.tensor(full, dtype=torch.float32) * 0.25
        port = int(free_loopback_addr().rsplit(":", 1)[1])
        done, errors = threading.Event(), []

        def trainer():  # rank 0 of a group of 1 trainer + 2 replicas
            try:
                with TrainerWeightSync("127.0.0.1", port, world_size=3, group_name=group, timeout_s=60) as sync:
                    sync.broadcast([(name, new)])
                    done.wait(60)
            except Exception as exc:  # surfaced by the assertion below
                errors.append(exc)

        t = threading.Thread(target=trainer)
        t.start()
        try:
            joined = engine.init_weights_update_group("127.0.0.1", port, 1, 3, group, "gloo", timeout_s=60)
            assert joined["success"]
            out = engine.update_weights_from_distributed([name], ["float32"], [[len(full)]], group)
            assert out["success"]
            assert engine.get_weights_by_name(name, truncate_size=8) == pytest.approx(new[:8].tolist())
            engine.destroy_weights_update_group(group)
        finally:
            done.set()
            t.join(60)
            engine.update_weights_from_tensor([(name, torch.tensor(full, dtype=torch.float32))])
        assert not errors, errors


class TestPrefixAware:
    @pytest.fixture(scope="class")
    def engine(self, default_prepared):
        with _engine(dp_size=2, load_balance_method="prefix_aware") as e:
            yield e

    def test_shared_prefix_requests_stay_on_one_replica_and_flush_reaches_all(self, engine, tokenizer):
        system = tokenizer.encode(SYSTEM, add_special_tokens=False)
        asks = [
            tokenizer.encode(f" Question {i}: what is a {w}?", add_special_tokens=False)
            for i, w in enumerate(("cache", "queue", "thread", "socket"))
        ]
        sp = {"max_new_tokens": 4, "temperature": 0.0}
        sub = engine.subscribe(with_snapshot=False)
        try:
            # Sequential, so both replicas are idle at each choice: round robin would alternate.
            outs = [engine.generate(input_ids=system + q, sampling_params=sp) for q in asks]
            other = engine.generate(
                input_ids=tokenizer.encode("Name three colours.", add_special_tokens=False), sampling_params=sp
            )
            events = drain_events(sub)
        finally:
            sub.close()
        queued_on = {e.rid: e.proc for e in events if isinstance(e, ev.ReqQueued)}
        replicas = [queued_on[o["meta_info"]["id"]] for o in outs]
        assert len(set(replicas)) == 1
        assert outs[0]["meta_info"]["cached_tokens"] == 0
        assert all(o["meta_info"]["cached_tokens"] >= len(system) for o in outs[1:])
        matched = [e.matched_tokens for e in events if isinstance(e, ev.ReqDispatched)]
        assert matched[0] == 0 and all(m > 0 for m in matched[1:4])
        # A prompt with nothing cached anywhere goes to the least loaded replica (both idle: dp0).
        assert queued_on[other["meta_info"]["id"]] == "scheduler.dp0"

        assert engine.flush_cache()
        again = [engine.generate(input_ids=system + q, sampling_params=sp) for q in asks[:2]]
        assert again[0]["meta_info"]["cached_tokens"] == 0  # the cache really was emptied
        assert again[1]["meta_info"]["cached_tokens"] >= len(system)  # ... and the index relearned
        assert_no_kv_leak(engine)


def _wait_for(engine, cond, timeout: float = 60.0) -> dict:
    import time

    deadline = time.monotonic() + timeout
    while True:
        state = engine.get_internal_state()
        if cond(state):
            return state
        assert time.monotonic() < deadline, f"condition not reached: {state}"
        time.sleep(0.05)
