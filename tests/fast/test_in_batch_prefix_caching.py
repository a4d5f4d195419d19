"""In-batch prefix caching: requests sharing an uncached prefix wait for one of them to cache it.

No processes and no model: the real Scheduler (its admission, result processing and trace code)
runs over real KV pools and a real RadixCache, with a stand-in model worker that "samples" a
fixed token. One `step()` below is one iteration of `event_loop_normal`.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from workbench.core.args import ServerArgs
from workbench.core.managers import scheduler as scheduler_mod
from workbench.core.managers.schedule_batch import Req
from workbench.core.managers.schedule_policy import (
    IN_BATCH_PREFIX_CACHING_DEPRIORITIZE_THRESHOLD as THRESHOLD,
)
from workbench.core.managers.schedule_policy import (
    AddReqResult,
    PrefillAdder,
)
from workbench.core.managers.scheduler_contract import ListIO
from workbench.core.managers.tp_worker import GenerationBatchResult
from workbench.core.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPoolAllocator
from workbench.core.mem_cache.radix_cache import RadixCache
from workbench.core.sampling.sampling_params import SamplingParams
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.core.trace.tracer import Tracer

VOCAB = 1000
SAMPLED = 7  # the token the stand-in model always "samples" (not EOS)
PREFIX = list(range(100, 612))  # 512 shared tokens


class _FakeRunner:
    def __init__(self, pool: int, rows: int, ctx: int):
        self.model_config = SimpleNamespace(context_len=ctx, vocab_size=VOCAB, eos_token_ids=[2])
        self.max_total_num_tokens = pool
        self.max_running_requests = rows
        self.req_to_token_pool = ReqToTokenPool(rows, ctx)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(pool)
        self.prepared = SimpleNamespace(model_dir=None)
        self.attn_backend = SimpleNamespace(name="fake")
        self.forwarded: list[list[int]] = []  # extend lengths of every extend pass

    def graph_plan(self, forward_mode, batch_size, return_all_logits=False):
        return False, batch_size


class _FakeWorker:
    """Stands in for TpModelWorker: records what each pass computed, samples SAMPLED."""

    def __init__(self, runner: _FakeRunner):
        self.model_runner = runner

    def forward_batch_generation(self, mwb) -> GenerationBatchResult:
        if mwb.forward_mode.is_extend():
            self.model_runner.forwarded.append(list(mwb.extend_seq_lens_cpu))
        return GenerationBatchResult(None, None, [SAMPLED] * len(mwb.seq_lens_cpu), 0.0)


def make_scheduler(monkeypatch, *, pool=8192, rows=32, ctx=2048, chunk=None, policy="fcfs", disable_radix_cache=False):
    runner = _FakeRunner(pool, rows, ctx)
    args = ServerArgs(
        chunked_prefill_size=chunk or -1, schedule_policy=policy, disable_radix_cache=disable_radix_cache, device="cpu"
    )
    # tp_rank 1: no sockets (rank 0 alone talks to the other processes); the tracer is ours.
    # The worker and the tokenizer are handed in through the Scheduler's seams (scheduler_contract.py).
    events: list = []
    s = scheduler_mod.Scheduler(
        args,
        None,
        tp_rank=1,
        tp_size=1,
        worker=_FakeWorker(runner),
        io=ListIO(),
        tokenizer=SimpleNamespace(decode=lambda ids, **kw: ""),
        tracer=Tracer("scheduler", sink=events.extend, enabled=True),
    )
    s.trace_events = events
    return s


def req(rid: str, ids: list[int], max_new: int = 2, **kw) -> Req:
    return Req(
        rid,
        "",
        list(ids),
        SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True),
        eos_token_ids=[2],
        **kw,
    )


def shared(rid: str, i: int, prefix=PREFIX, own: int = 32) -> Req:
    """`prefix` + `own` tokens of its own (distinct first token per i)."""
    return req(rid, prefix + [700 + i] + [800 + i] * (own - 1))


def step(s):
    """One iteration of Scheduler.event_loop_normal; returns the batch it ran (or None)."""
    batch = s.get_next_batch_to_run()
    if batch is not None:
        result = s.run_batch(batch)
        s.process_batch_result(batch, result)
    s.last_batch = batch
    s.finish_step(batch)
    return batch


def run_until_idle(s, limit=50):
    for _ in range(limit):
        if not s.has_work():
            return
        step(s)
    raise AssertionError("the scheduler did not drain")


def queue_states(s) -> list[ev.QueueState]:
    return [e for e in s.trace_events if isinstance(e, ev.QueueState)]


def assert_no_leak(s):
    alloc, tree = s.token_to_kv_pool_allocator, s.tree_cache
    assert alloc.available_size() + tree.total_size() == s.max_total_num_tokens
    assert tree.protected_size() == 0
    assert s.req_to_token_pool.available_size() == s.req_to_token_pool.size


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "dfs-weight"])
def test_shared_uncached_prefix_admits_one_and_holds_the_rest(monkeypatch, policy):
    s = make_scheduler(monkeypatch, policy=policy)
    reqs = [shared(f"r{i}", i) for i in range(4)]
    s.waiting_queue = list(reqs)
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r0"]
    assert [r.rid for r in s.waiting_queue] == ["r1", "r2", "r3"]  # still queued, in order
    assert [(h.rid, h.waits_for, h.shared_tokens) for h in s.held_back] == [
        ("r1", "r0", 512),
        ("r2", "r0", 512),
        ("r3", "r0", 512),
    ]
    # The trace says who waits for whom, and the reducer keeps it for views.
    q = queue_states(s)[-1]
    assert [h.rid for h in q.held] == ["r1", "r2", "r3"] and q.waiting == ["r1", "r2", "r3"]
    st = TraceState()
    st.apply_many(s.trace_events)
    assert [h.rid for h in st.held] == ["r1", "r2", "r3"]
    assert st.held_reason("r2") == "waits for r0's shared prefix (512 tokens) to be cached"
    assert st.held_reason("r0") is None


def test_held_requests_are_admitted_next_step_and_hit_the_cache(monkeypatch):
    s = make_scheduler(monkeypatch)
    reqs = [shared(f"r{i}", i) for i in range(4)]
    s.waiting_queue = list(reqs)
    step(s)  # r0 computes the prefix; after it, it is cached
    assert s.tree_cache.match_prefix(PREFIX).device_indices.numel() == 512
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r1", "r2", "r3"]
    assert s.held_back == [] and queue_states(s)[-1].held == []
    assert [r.cached_tokens for r in reqs] == [0, 512, 512, 512]
    assert s.tp_worker.model_runner.forwarded == [[544], [32, 32, 32]]  # the prefix computed once
    run_until_idle(s)
    assert all(r.output_ids == [SAMPLED, SAMPLED] for r in reqs)
    assert_no_leak(s)


def test_without_sharing_nothing_is_held(monkeypatch):
    s = make_scheduler(monkeypatch)
    reqs = [req(f"r{i}", [100 + i] + list(range(200, 300))) for i in range(4)]  # differ at token 0
    s.waiting_queue = list(reqs)
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r0", "r1", "r2", "r3"] and s.held_back == []


def test_a_single_request_is_never_held(monkeypatch):
    s = make_scheduler(monkeypatch)
    s.waiting_queue = [shared("only", 0)]
    assert [r.rid for r in step(s).reqs] == ["only"] and s.held_back == []


@pytest.mark.parametrize("common, held", [(THRESHOLD - 1, False), (THRESHOLD, True)])
def test_a_shared_part_below_the_threshold_is_recomputed_not_waited_for(monkeypatch, common, held):
    s = make_scheduler(monkeypatch)
    head = list(range(100, 100 + common))
    s.waiting_queue = [shared("a", 0, prefix=head), shared("b", 1, prefix=head)]
    batch = step(s)
    assert [r.rid for r in batch.reqs] == (["a"] if held else ["a", "b"])
    assert [h.rid for h in s.held_back] == (["b"] if held else [])


def test_only_the_uncached_shared_part_counts(monkeypatch):
    """A prefix already in the cache is no reason to wait: only tokens beyond it are."""
    s = make_scheduler(monkeypatch)
    s.waiting_queue = [req("warm", PREFIX[:500] + [999])]
    run_until_idle(s)  # 500 tokens of PREFIX now cached
    s.waiting_queue = [shared("a", 0), shared("b", 1)]  # they share 12 more: below threshold
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["a", "b"] and s.held_back == []
    assert [r.cached_tokens for r in batch.reqs] == [500, 500]


def test_requests_sharing_nothing_with_the_first_still_run_beside_it(monkeypatch):
    s = make_scheduler(monkeypatch)
    other = req("other", list(range(2000 % VOCAB, 2000 % VOCAB + 40)))
    s.waiting_queue = [shared("a", 0), shared("b", 1), other, shared("c", 2)]
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["a", "other"]
    assert [r.rid for r in s.waiting_queue] == ["b", "c"]
    assert [r.rid for r in step(s).reqs] == ["b", "c"]


def test_a_chunked_first_request_holds_the_others_until_its_chunks_cover_the_shared_part(monkeypatch):
    s = make_scheduler(monkeypatch, chunk=400)
    reqs = [shared(f"r{i}", i) for i in range(3)]  # 544 tokens each
    s.waiting_queue = list(reqs)
    batch = step(s)  # r0's first chunk fills the step's budget: nobody else fits
    assert [r.rid for r in batch.reqs] == ["r0"] and s.chunked_req is reqs[0]
    batch = step(s)  # its first 400 tokens are cached; 112 shared ones are not
    assert [r.rid for r in batch.reqs] == ["r0"]
    assert [(h.rid, h.waits_for, h.shared_tokens) for h in s.held_back] == [("r1", "r0", 112), ("r2", "r0", 112)]
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r1", "r2"]
    assert [r.cached_tokens for r in reqs] == [0, 512, 512]
    assert s.tp_worker.model_runner.forwarded == [[400], [144], [32, 32]]
    run_until_idle(s)
    assert_no_leak(s)


def test_overlap_in_flight_prefill_holds_sharers_until_its_result_is_processed(monkeypatch):
    """Overlap loop: batch N+1 is built before N's result puts N's prompts into the cache."""
    s = make_scheduler(monkeypatch)
    reqs = [shared(f"r{i}", i) for i in range(2)]
    s.waiting_queue = [reqs[0]]
    first = s.get_next_batch_to_run()
    s.prepare_launch(first)  # launched, result not processed yet
    s.inflight = scheduler_mod.InflightBatch(first.copy(), None, s.forward_ct, 0.0)
    s.last_batch = first
    s.waiting_queue.append(reqs[1])  # arrives meanwhile
    nxt = s.get_next_batch_to_run()
    assert nxt is s.running_batch and [r.rid for r in nxt.reqs] == ["r0"]  # no prefill for r1 yet
    assert [(h.rid, h.waits_for, h.shared_tokens) for h in s.held_back] == [("r1", "r0", 512)]
    inflight, s.inflight = s.inflight, None  # what process_inflight does, minus the thread
    s.process_batch_result(inflight.batch, GenerationBatchResult(None, None, [SAMPLED], 0.0))
    s.last_batch = None
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r1"] and reqs[1].cached_tokens == 512
    run_until_idle(s)
    assert_no_leak(s)


def test_disable_radix_cache_holds_nothing(monkeypatch):
    s = make_scheduler(monkeypatch, disable_radix_cache=True)
    s.waiting_queue = [shared(f"r{i}", i) for i in range(3)]
    batch = step(s)
    assert [r.rid for r in batch.reqs] == ["r0", "r1", "r2"] and s.held_back == []
    run_until_idle(s)


def test_a_pending_prefill_holds_sharers_and_logprob_limits_what_waiting_saves():
    """`add_pending` (the overlap loop's in-flight launch) holds sharers; a request whose prompt
    logprobs start early can reuse no more of the cache than that, so waiting would save nothing."""
    pool = TokenToKVPoolAllocator(4096)
    cache = RadixCache(ReqToTokenPool(8, 1024), pool)
    adder = PrefillAdder(cache, pool, [], 1.0, 8192, None, in_batch_prefix_caching=True)
    adder.add_pending(shared("inflight", 0))
    b = shared("b", 1)
    lp = req("lp", PREFIX + [1] * 32, return_logprob=True, logprob_start_len=10)
    for r in (b, lp):
        r.init_next_round_input(cache)
    assert adder.add_one_req(b) == AddReqResult.HELD
    assert adder.add_one_req(lp) == AddReqResult.CONTINUE
    assert [(h.rid, h.waits_for) for h in adder.held] == [("b", "inflight")]
    # Without in-batch prefix caching the adder admits both.
    plain = PrefillAdder(cache, pool, [], 1.0, 8192, None)
    plain.add_pending(shared("inflight", 0))
    assert plain.add_one_req(shared("c", 2)) == AddReqResult.CONTINUE


def test_old_recordings_without_held_still_decode():
    line = b'{"kind":"queue.state","ts":5,"proc":"scheduler","step":1,"waiting":["a"],"running":[],"chunked":[]}'
    e = ev.decode_json(line)
    assert isinstance(e, ev.QueueState) and e.held == []
    again = ev.decode_json(
        ev.encode_json(ev.QueueState(waiting=["a"], running=[], chunked=[], held=[ev.HeldReq("a", "b", 64)]))
    )
    assert again.held == [ev.HeldReq("a", "b", 64)]
    st = TraceState()
    st.apply(again)
    assert st.dump()["held"] == [["a", "b", 64]]
    # A late subscriber's snapshot carries it too.
    assert [q.held for q in st.snapshot_events() if isinstance(q, ev.QueueState)] == [[ev.HeldReq("a", "b", 64)]]
