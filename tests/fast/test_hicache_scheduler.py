"""HiCache in the real Scheduler (in-process, stand-in worker; tests/scheduler_harness.py).

A prompt evicted from a small device pool comes back from the host tier: its tokens count as
cached (the BatchTokenIDOut's cached_tokens, what meta_info.cached_tokens reports) and its output
equals the stand-in model's reference, which it only does if the loaded-back KV slots really hold
the prompt's tokens (a slot the model reads that holds anything else changes the next token). The
harness runs the KV check, both tiers, after every step.
"""

from __future__ import annotations

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens
from workbench.core.mem_cache.hiradix_cache import WRITE_POLICIES, HiRadixCache
from workbench.core.model_executor.forward_batch_info import ForwardMode
from workbench.core.trace import clock as trace_clock
from workbench.core.trace import events as ev

PROMPT = list(range(10, 70))  # 60 tokens
OTHERS = [[500 + i] + list(range(100 + 60 * i, 159 + 60 * i)) for i in range(4)]


def run_a_others_a(h: SchedulerHarness) -> set[str]:
    """A, then prompts that push it off the device, then A again; returns the tiers the tree's
    nodes were in just before A came back (as the views' tree snapshot shows them)."""
    h.submit("a", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    for i, p in enumerate(OTHERS):
        h.submit(f"o{i}", p, max_new_tokens=4)
        h.run_until_idle()
    tiers = {n.tier for n in h.s.tree_cache.snapshot()}
    h.submit("a2", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    return tiers


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_evicted_prompt_comes_back_from_host_as_cached_tokens(policy, overlap):
    h = SchedulerHarness(
        max_total_tokens=128,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=4.0,
        overlap=overlap,
    )
    assert isinstance(h.s.tree_cache, HiRadixCache)
    tiers = run_a_others_a(h)
    want = expected_tokens(PROMPT, 4)
    assert h.tokens("a") == want and h.cached["a"] == 0
    assert h.tokens("a2") == want
    assert h.cached["a2"] == len(PROMPT) - 1  # all but the last prompt token (it must be computed)
    loads = [e for e in h.trace(ev.HiCacheTransfer) if e.what == "load_back"]
    assert loads and loads[-1].tokens >= len(PROMPT) - 1 and loads[-1].bytes > 0
    for i, p in enumerate(OTHERS):
        assert h.tokens(f"o{i}") == expected_tokens(p, 4)
    assert "host" in tiers
    h.assert_idle_and_clean()


def test_without_hicache_the_evicted_prompt_is_recomputed():
    h = SchedulerHarness(max_total_tokens=128)
    run_a_others_a(h)
    assert h.cached["a2"] == 0 and h.tokens("a2") == expected_tokens(PROMPT, 4)


def test_selective_backs_up_only_what_was_hit():
    h = SchedulerHarness(
        max_total_tokens=128, enable_hierarchical_cache=True, hicache_write_policy="write_through_selective"
    )
    run_a_others_a(h)
    assert h.cached["a2"] == 0  # "a" was computed once and never hit before its eviction: not backed
    h.submit("a3", PROMPT, max_new_tokens=4)  # a device hit: the second hit backs it up
    h.run_until_idle()
    assert h.cached["a3"] == len(PROMPT) - 1
    for i, p in enumerate(OTHERS):
        h.submit(f"p{i}", [700 + i] + p[1:], max_new_tokens=4)
        h.run_until_idle()
    assert "host" in {n.tier for n in h.s.tree_cache.snapshot()}
    h.submit("a4", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    assert h.tokens("a4") == expected_tokens(PROMPT, 4)
    assert h.cached["a4"] == len(PROMPT) - 1
    h.assert_idle_and_clean()


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_many_requests_sharing_prefixes_stay_consistent(policy):
    """Concurrent requests over shared stems through a pool that keeps evicting: every output
    right, and the KV check (both tiers) after every step."""
    h = SchedulerHarness(
        max_total_tokens=160, enable_hierarchical_cache=True, hicache_write_policy=policy, hicache_ratio=1.5
    )
    stems = [list(range(1000 + 40 * s, 1030 + 40 * s)) for s in range(4)]
    prompts = {}
    for wave in range(3):
        for s, stem in enumerate(stems):
            rid = f"w{wave}s{s}"
            prompts[rid] = stem + [5 + wave, 6 + s]
            h.submit(rid, prompts[rid], max_new_tokens=3)
        h.run_until_idle()
    for rid, p in prompts.items():
        assert h.tokens(rid) == expected_tokens(p, 3), rid
    assert sum(h.cached[r] for r in prompts) > 0
    h.assert_idle_and_clean()


def test_views_narrate_load_backs_show_tiers_and_count_metrics():
    from workbench.core.entrypoints.metrics import ServerMetrics
    from workbench.tui.model import TuiModel
    from workbench.tui.panels.tree import render_tree

    h = SchedulerHarness(
        max_total_tokens=128, enable_hierarchical_cache=True, hicache_write_policy="write_back", hicache_ratio=4.0
    )
    h.submit("a", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    for i, p in enumerate(OTHERS):
        h.submit(f"o{i}", p, max_new_tokens=4)
        h.run_until_idle()
    h.s.emit_tree()  # the tree with "a" on host, as the views get it
    h.s.tracer.flush()
    m = TuiModel()
    m.apply(h.events)
    tree = m.state.trees[m.state.tree_proc]
    assert "host" in {n.tier for n in tree.values()}
    text, _ = render_tree(tree, now_ns=0)
    assert " host" in text.plain
    # (the harness has no tokenizer process: its arrival event, which the TTFT parts start from)
    h.events.append(ev.ReqArrived(rid="a2", ts=trace_clock.now_ns(), proc="tokenizer"))
    h.submit("a2", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    h.s.tracer.flush()
    m = TuiModel()
    m.apply(h.events)
    lines = [m.state.narrate(sv) for sv in m.state.steps]
    assert any("loaded back 59 tok from host" in line for line in lines), lines
    assert any("wrote back" in line for line in lines)
    parts = m.state.ttft_parts("a2")
    assert parts is not None
    assert any("59 cached" in p.detail and "loaded back 59 tok from host" in p.detail for p in parts.parts), parts
    metrics = ServerMetrics("m")
    metrics.on_events(h.events)
    text = metrics.render().decode()
    assert 'sglang:load_back_tokens_total{model_name="m"} 59.0' in text
    assert "sglang:hicache_host_write_tokens_total" in text and "sglang:prefetched_tokens_total" in text


def test_the_simulator_runs_hicache_bookkeeping_without_kv_tensors():
    """`workbench sim` (pool-only runner, no K/V tensors): the tiers and load-backs happen (their time: test_simulation_hicache.py)."""
    from workbench.core.simulation.simulator import Simulator, poisson_workload

    work = poisson_workload(rate=5, n=40, prompt_len=(64, 300), output_len=(4, 12), seed=3, groups=6, prefix_len=200)
    cached = {}
    for hicache in (False, True):
        events: list = []
        sim = Simulator(
            "smollm2-135m",
            "cpu-here",
            trace_sink=events.extend,
            max_total_tokens=1024,
            max_running_requests=8,
            enable_hierarchical_cache=hicache,
        )
        cached[hicache] = sim.run(work).cached_tokens
        sim.scheduler.check_kv_invariants()
        if hicache:
            assert any(isinstance(e, ev.HiCacheTransfer) and e.what == "load_back" for e in events)
    assert cached[True] > cached[False]


def test_flags_refuse_a_storage_tier_without_hicache():
    from workbench.core.args import ServerArgs

    with pytest.raises(ValueError, match="add --enable-hierarchical-cache"):
        ServerArgs(hicache_storage_backend="file")
    ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file")


@pytest.mark.parametrize("fixed", [True, False])
def test_overlap_load_back_waits_for_an_inflight_prefill(fixed):
    """Overlap loop: a load-back (on the scheduler thread) never copies while a prefill is still
    running on the worker thread (it could read or write the slots the load-back is handed). The
    stand-in pass (the prefill in flight) holds the worker for 1 s, so a copy that does not wait lands inside it; with the
    hook removed (`fixed=False`) the test sees that, which is what makes it able to fail."""
    import threading
    import time

    h = SchedulerHarness(max_total_tokens=128, enable_hierarchical_cache=True, hicache_ratio=4.0, overlap=True)
    cache = h.s.tree_cache
    assert isinstance(cache, HiRadixCache) and cache.sync_before_copy is not None
    if not fixed:
        cache.sync_before_copy = None
    busy, armed = threading.Event(), threading.Event()
    forward = h.worker.forward_batch

    def slow_forward(mwb):
        if not armed.is_set():
            return forward(mwb)
        armed.clear()  # only the pass launched while armed is held
        busy.set()
        try:
            time.sleep(1.0)
            return forward(mwb)
        finally:
            busy.clear()

    h.worker.forward_batch = slow_forward
    copies_during_pass: list[bool] = []
    host = cache.token_to_kv_pool_host
    load = host.load_to_device

    def watched_load(host_idx, device_idx):
        copies_during_pass.append(busy.is_set())
        return load(host_idx, device_idx)

    host.load_to_device = watched_load
    h.submit("a", PROMPT, max_new_tokens=4)
    h.run_until_idle()
    for i, p in enumerate(OTHERS):
        h.submit(f"o{i}", p, max_new_tokens=4)
        h.run_until_idle()
    h.submit("b", list(range(900, 950)), max_new_tokens=4)
    armed.set()
    h.step()  # b's prefill is launched and in flight (held 1 s on the worker thread)
    h.submit("a2", PROMPT, max_new_tokens=4)
    h.run_until_idle()  # a2's match loads A back from host
    assert copies_during_pass, "a2 was meant to load A back"
    if fixed:
        assert copies_during_pass == [False] * len(copies_during_pass)
        assert cache.copy_waits >= 1
        assert h.tokens("a2") == expected_tokens(PROMPT, 4) and h.cached["a2"] == len(PROMPT) - 1
        h.assert_idle_and_clean()
    else:
        assert any(copies_during_pass)


def test_internal_state_and_metrics_report_the_host_pool_and_transfers():
    from workbench.core.entrypoints.metrics import ServerMetrics

    h = SchedulerHarness(max_total_tokens=128, enable_hierarchical_cache=True, hicache_ratio=4.0)
    assert h.s.get_internal_state().hicache == {**h.s.tree_cache.internal_state()}
    run_a_others_a(h)
    h.s.tracer.flush()
    state = h.s.get_internal_state().hicache
    cache = h.s.tree_cache
    host = cache.token_to_kv_pool_host
    assert state is not None and state["host_total_tokens"] == 4 * 128 == host.size
    # used = what the tree's nodes hold on host (the KV check's count, walked independently)
    assert state["host_used_tokens"] == cache.host_size() > 0
    loads = [e for e in h.trace(ev.HiCacheTransfer) if e.what == "load_back"]
    assert state["load_back_tokens"] == sum(e.tokens for e in loads) >= len(PROMPT) - 1
    assert state["load_back_bytes"] == sum(e.bytes for e in loads)
    backups = [e for e in h.trace(ev.HiCacheTransfer) if e.what in ("write_through", "write_back")]
    assert state["backup_tokens"] == sum(e.tokens for e in backups) > 0
    assert state["prefetch_tokens"] == 0  # no storage tier
    from workbench.core.managers.data_parallel_controller import merge_replies

    full = h.s.get_internal_state()
    merged = merge_replies([full, full]).hicache  # data parallel: two replicas' counters add up
    assert merged is not None and merged["host_total_tokens"] == 2 * host.size
    assert merged["bytes_per_token"] == state["bytes_per_token"]
    metrics = ServerMetrics("m")
    metrics.on_events(h.events)
    text = metrics.render().decode()
    assert f'sglang:hicache_host_total_tokens{{model_name="m"}} {float(host.size)}' in text
    used = [e for e in h.events if isinstance(e, ev.KVUsage)][-1].host_used
    assert used == state["host_used_tokens"]
    assert f'sglang:hicache_host_used_tokens{{model_name="m"}} {float(used)}' in text
    plain = SchedulerHarness(max_total_tokens=128)
    assert plain.s.get_internal_state().hicache is None
    metrics = ServerMetrics("m")
    plain.submit("x", PROMPT, max_new_tokens=2)
    plain.run_until_idle()
    plain.s.tracer.flush()
    metrics.on_events(plain.events)
    assert "hicache_host_total_tokens" not in metrics.render().decode()


def test_overlap_chunk_backup_waits_for_the_chunk_in_flight():
    """write_through in the overlap loop: caching a chunk at scheduling time (continue_chunked_req) backs
    it up to host while that chunk's pass may still be writing its KV; the backup waits for the pass
    first (every prefill pass held 0.3 s here, so a backup that did not wait would land inside one)."""
    import threading
    import time

    h = SchedulerHarness(
        max_total_tokens=256,
        enable_hierarchical_cache=True,
        hicache_ratio=4.0,
        overlap=True,
        chunked_prefill_size=32,
    )
    cache = h.s.tree_cache
    busy = threading.Event()  # a prefill pass is running (a decode pass writes only its own new slots)
    forward = h.worker.forward_batch

    def slow_forward(mwb):
        if mwb.forward_mode == ForwardMode.DECODE:
            return forward(mwb)
        busy.set()
        try:
            time.sleep(0.3)
            return forward(mwb)
        finally:
            busy.clear()

    h.worker.forward_batch = slow_forward
    host = cache.token_to_kv_pool_host
    backup = host.backup_from_device
    during: list[bool] = []

    def watched_backup(host_idx, device_idx):
        during.append(busy.is_set())
        return backup(host_idx, device_idx)

    host.backup_from_device = watched_backup
    prompt = list(range(10, 110))  # 100 tokens: 4 chunks of 32
    h.submit("a", prompt, max_new_tokens=3)
    h.run_until_idle()
    assert h.tokens("a") == expected_tokens(prompt, 3)
    assert during and not any(during), during
    assert cache.copy_waits >= 2  # one per chunk cached while the next was being scheduled
    h.assert_idle_and_clean()
