"""End-to-end part of tests/fast/test_data_parallel.py (what starts processes, engines or servers, or loads the
reference model).

Data parallel (`--dp-size 2`): a DataParallelController in front of two real scheduler replicas.

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
