"""Data parallel (`--dp-size 2`): a DataParallelController in front of two real scheduler replicas.

The pure parts (load balancer, prefix index, reply merging, the reducer's per-replica view)
are tested in-process; the rest on the real default model: outputs equal DP 1 (greedy), both
replicas serve (the trace says which), shortest_queue steers around a long request, the
prefix-aware method keeps a shared prefix on one replica, and abort / flush / step gate /
internal state reach every replica.

The end-to-end tests of this module are in tests/e2e/test_data_parallel_e2e.py.
"""

from __future__ import annotations

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
