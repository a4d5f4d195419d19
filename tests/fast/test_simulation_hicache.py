"""The simulator models HiCache (issue #39): a simulated deployment with a small device pool and a host
tier serves a returning prompt from host, each load-back charged its bytes over the hardware's host link
(exactly, from the cost model), and the prompt's TTFT is lower than recomputing it."""

from __future__ import annotations

import pytest
from workbench.core.simulation.hardware import HARDWARE
from workbench.core.simulation.simulator import SimRequest, Simulator
from workbench.core.trace import events as ev

PROMPT = list(range(10, 610))  # 600 tokens


def workload() -> list[SimRequest]:
    """A; four other 600-token prompts that push it off a 1024-token device pool; A again, alone."""
    reqs = [SimRequest(0.0, len(PROMPT), 2, prompt_ids=PROMPT)]
    for i in range(4):
        other = [20_000 + 1000 * i + j for j in range(600)]
        reqs.append(SimRequest(1000.0 * (i + 1), 600, 2, prompt_ids=other))
    reqs.append(SimRequest(10_000.0, len(PROMPT), 2, prompt_ids=PROMPT))
    return reqs


def run(hicache: bool):
    events: list = []
    sim = Simulator(
        "llama-3.1-8b",
        "cpu-here",
        calibration=None,
        trace_sink=events.extend,
        max_total_tokens=1024,
        max_running_requests=4,
        enable_hierarchical_cache=hicache,
        hicache_ratio=4.0,
    )
    res = sim.run(workload())
    sim.scheduler.check_kv_invariants()
    return sim, res, events


def test_host_hits_are_charged_at_the_host_link_and_beat_recompute():
    sim, res, events = run(True)
    loads = [e for e in events if isinstance(e, ev.HiCacheTransfer) and e.what == "load_back"]
    assert loads and res.host_hit_tokens >= len(PROMPT) - 1 and res.hicache
    per_token = sim.cost.kv_bytes_per_token_per_rank()
    assert all(e.bytes == e.tokens * per_token for e in loads)  # the model's KV bytes, not the CPU engine's
    hw = HARDWARE["cpu-here"]
    # Backups (write_through) are far shorter than these passes: all overlapped, none charged.
    assert res.hicache_s == pytest.approx(sum(e.bytes for e in loads) / hw.host_link_bw, rel=1e-9)
    assert "HiCache:" in res.summary() and f"{res.host_hit_tokens} tokens loaded back from host" in res.summary()
    _, base, _ = run(False)
    assert base.host_hit_tokens == 0 and base.hicache_s == 0.0 and "HiCache" not in base.summary()
    last = f"r{len(workload()) - 1}"
    # Recomputing 600 tokens of an 8B model on this CPU takes seconds; loading them back milliseconds.
    assert res.ttft[last] < base.ttft[last]
    assert res.cached_tokens > base.cached_tokens


def test_cost_model_charges_loads_before_the_pass_and_only_the_backup_past_it():
    from workbench.core.simulation.cost_model import CostModel
    from workbench.core.simulation.hardware import get_hardware
    from workbench.core.simulation.model_specs import model_spec

    hw = get_hardware("h100")
    cm = CostModel(model_spec("llama-3.1-8b"), hw)
    step = cm.step([1] * 8, [1000] * 8)
    base = step.total
    cm.hicache(step, load_bytes=55e6, backup_bytes=0)
    assert step.hicache == pytest.approx(55e6 / hw.host_link_bw) and step.total == pytest.approx(base + 1e-3)
    step = cm.step([1] * 8, [1000] * 8)
    cm.hicache(step, load_bytes=0, backup_bytes=1e12)  # a backup far longer than the pass
    assert step.total == pytest.approx(step.backup) and step.backup == pytest.approx(1e12 / hw.host_link_bw)
    step = cm.step([1] * 8, [1000] * 8)
    cm.hicache(step, load_bytes=0, backup_bytes=1.0, prefetch_bytes=5e6)
    assert step.hicache == pytest.approx(5e6 / hw.storage_bw)


def run_with_storage(storage: bool):
    """The same workload with a host pool too small to keep A (ratio 1.5: 1536 tokens, two prompts), so A leaves
    the device and the host; with the storage tier it comes back from there."""
    events: list = []
    kw = dict(hicache_storage_backend="file") if storage else {}
    sim = Simulator(
        "llama-3.1-8b",
        "cpu-here",
        calibration=None,
        trace_sink=events.extend,
        max_total_tokens=1024,
        max_running_requests=4,
        enable_hierarchical_cache=True,
        hicache_ratio=1.5,
        **kw,
    )
    res = sim.run(workload())
    sim.scheduler.check_kv_invariants()
    return sim, res, events


def test_storage_prefetches_are_charged_at_storage_bw_and_beat_recompute():
    sim, res, events = run_with_storage(True)
    transfers = [e for e in events if isinstance(e, ev.HiCacheTransfer)]
    prefetches = [e for e in transfers if e.what == "prefetch"]
    loads = [e for e in transfers if e.what == "load_back"]
    assert any(e.what == "storage_write" for e in transfers)
    # A's whole pages (600 // 32 = 18) come from storage, then are loaded back to the device.
    assert [e.tokens for e in prefetches] == [18 * 32]
    per_token = sim.cost.kv_bytes_per_token_per_rank()
    assert all(e.bytes == e.tokens * per_token for e in prefetches + loads)
    assert sum(e.tokens for e in loads) == 18 * 32  # only what storage brought: A was off the host
    hw = HARDWARE["cpu-here"]
    want = prefetches[0].bytes / hw.storage_bw + sum(e.bytes for e in loads) / hw.host_link_bw
    assert res.hicache_s == pytest.approx(want, rel=1e-9)
    state = sim.scheduler.tree_cache.internal_state()
    assert state["prefetch_tokens"] == 18 * 32 and state["prefetch_bytes"] == prefetches[0].bytes
    assert "(576 prefetched from storage)" in res.summary()
    _, base, base_events = run_with_storage(False)
    assert not any(isinstance(e, ev.HiCacheTransfer) and e.what == "prefetch" for e in base_events)
    assert base.host_hit_tokens == 0  # no storage: A, gone from the host, is recomputed
    last = f"r{len(workload()) - 1}"
    assert res.ttft[last] < base.ttft[last]
    assert res.cached_tokens >= base.cached_tokens + 18 * 32
