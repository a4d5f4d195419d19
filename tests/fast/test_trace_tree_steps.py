"""The tree a trace rebuilds equals the scheduler's after every step (issue #44).

The scheduler (in-process, stand-in worker: tests/scheduler_harness.py) runs under KV pressure,
so its radix tree sees inserts, splits, evictions, lock changes and, with HiCache, tier moves.
After every step a `TraceState` folds the step's events, and the digest of the tree it holds
(core/trace/tree_digest.py) must equal the digest of the scheduler's live tree, and the
`cache.digest` the scheduler emitted for that step (`WORKBENCH_TRACE_TREE_DIGEST=1`).
"""

from __future__ import annotations

import random

import pytest
from scheduler_harness import SchedulerHarness, expected_tokens
from workbench.core.trace import events as ev
from workbench.core.trace.state import TraceState
from workbench.core.trace.tree_digest import TREE_DIGEST_ENV, digest_of_views


def _workload(seed: int):
    """Requests sharing a few prefixes, arriving over time: more than the pool holds at once."""
    rng = random.Random(seed)
    shared = [[1000 * (k + 1) + j for j in range(rng.randrange(20, 60))] for k in range(3)]
    reqs = []
    for i in range(14):
        n = rng.randrange(10, 90)
        start = rng.choice(shared + [[]])[: n - 1]
        body = [7 + (seed * 131 + i * 17 + j) % 900 for j in range(n - len(start))]
        reqs.append((f"r{i}", start + body, rng.randrange(1, 12), rng.randrange(0, 30)))
    return reqs


def _check_every_step(h: SchedulerHarness, reqs) -> dict[str, int]:
    state = TraceState()
    seen = 0
    counts = {"steps": 0, "digests": 0, "trees": 0, "evicts": 0}
    pending = sorted(reqs, key=lambda r: r[3])
    step = 0
    while pending or h.s.has_work() or step < 3:
        while pending and pending[0][3] <= step:
            rid, p, n, _ = pending.pop(0)
            h.submit(rid, p, max_new_tokens=n)
        h.step()
        step += 1
        assert step < 2000
        for e in h.events[seen:]:
            state.apply(e)
            if type(e) is ev.CacheDigest:
                counts["digests"] += 1
                assert digest_of_views(state.trees.get("scheduler", {})) == e.digest, f"step {e.step}"
            counts["trees"] += type(e) is ev.CacheTree
            counts["evicts"] += type(e) is ev.CacheEvict
        seen = len(h.events)
        assert digest_of_views(state.trees.get("scheduler", {})) == h.s.tree_cache.digest(), f"after step {step}"
        counts["steps"] += 1
    for rid, p, n, _ in reqs:
        assert h.tokens(rid) == expected_tokens(p, n), rid
    h.assert_idle_and_clean()
    return counts


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", [1, 2])
def test_reducer_tree_equals_scheduler_tree_after_every_step(monkeypatch, seed, overlap):
    monkeypatch.setenv(TREE_DIGEST_ENV, "1")
    h = SchedulerHarness(max_total_tokens=200, max_running_requests=4, overlap=overlap)
    counts = _check_every_step(h, _workload(seed))
    assert counts["evicts"] > 0, counts  # the pool was under pressure
    assert counts["digests"] >= counts["steps"] > 20, counts


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_reducer_tree_equals_scheduler_tree_with_hicache_tiers(monkeypatch, policy):
    monkeypatch.setenv(TREE_DIGEST_ENV, "1")
    h = SchedulerHarness(
        max_total_tokens=200,
        max_running_requests=4,
        enable_hierarchical_cache=True,
        hicache_write_policy=policy,
        hicache_ratio=4.0,
    )
    counts = _check_every_step(h, _workload(3))
    assert counts["digests"] >= counts["steps"] > 20, counts
    assert any(n.tier != "device" for n in h.s.tree_cache.snapshot()), "nothing left the device"


def test_without_the_env_var_no_digest_is_emitted():
    h = SchedulerHarness(max_total_tokens=200)
    h.submit("a", list(range(10, 40)), max_new_tokens=3)
    h.run_until_idle()
    assert not h.trace(ev.CacheDigest) and h.trace(ev.CacheTree)


def test_sim_run_record_rebuilds_the_tree_after_every_step(tmp_path, monkeypatch, capsys):
    """`workbench sim run --record` (the offline simulator: the real Scheduler on a simulated clock)."""
    from tree_digest_check import check_recording

    from workbench.cli import build_parser

    monkeypatch.setenv(TREE_DIGEST_ENV, "1")
    path = tmp_path / "sim.jsonl"
    line = ["sim", "run", "--model", "llama-3.1-8b", "--simulate", "h100", "--rate", "20", "--num-requests", "30"]
    args = build_parser().parse_args([*line, "--groups", "3", "--prefix-len", "64", "--record", str(path)])
    assert args.func(args) == 0
    assert "30 requests in" in capsys.readouterr().out
    counts = check_recording(path)
    assert counts["digests"] > 100 and counts["trees"] >= counts["changed_steps"] > 10, counts
