"""On the real engine, a kv-pressure recording rebuilds the scheduler's radix tree after every step
(issue #44): with `WORKBENCH_TRACE_TREE_DIGEST=1` the scheduler emits its own tree digest per step
(`cache.digest`), and the reducer folding the file in order holds a tree with that digest each time
(tests/tree_digest_check.py). The run stops at its first eviction with a request finished, so it
covers inserts, splits, lock changes and evictions in a short run."""

from __future__ import annotations

import pytest
from tree_digest_check import check_recording
from workbench.core.trace.tree_digest import TREE_DIGEST_ENV

from workbench.scenarios import get_scenario, record_run

pytestmark = pytest.mark.timeout(300)


def test_kv_pressure_recording_rebuilds_the_tree_after_every_step(tmp_path, monkeypatch):
    from workbench.core.args import ServerArgs

    monkeypatch.setenv(TREE_DIGEST_ENV, "1")  # the engine's processes inherit it
    scn = get_scenario("kv-pressure")
    out = tmp_path / "kv-pressure.jsonl"
    result = record_run(
        scn.server_args(ServerArgs(show_progress=False, dtype="float32")),
        str(out),
        scn.runner,
        duration_s=90,
        stop_when=lambda s: s.evicted_tokens > 0 and s.finished > 0,
        progress=lambda line: None,
    )
    assert result.failed == 0, result.summary()
    counts = check_recording(out)
    assert counts["digests"] > 10 and counts["evicts"] > 0, counts
    assert counts["trees"] >= counts["changed_steps"], counts


def test_a_live_simulated_engine_records_the_tree_the_same_way(tmp_path):
    """`workbench record --simulate`: the live simulator's scheduler process, on its simulated clock."""
    import os
    import subprocess
    import sys

    out = tmp_path / "live-sim.jsonl"
    cmd = [sys.executable, "-m", "workbench.cli", "record", "--simulate", "h100", "--model", "llama-3.1-8b"]
    env = {**os.environ, TREE_DIGEST_ENV: "1"}
    subprocess.run([*cmd, "--num-requests", "8", "-o", str(out)], env=env, check=True, timeout=120)
    counts = check_recording(out)
    assert counts["digests"] > 20 and counts["trees"] >= counts["changed_steps"] > 0, counts
