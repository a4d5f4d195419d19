"""`workbench bench engine --quick`: the serving workloads run end to end and report every figure."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_bench_engine_quick_reports_every_workload(tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run([str(Path(sys.executable).with_name("workbench")), "bench", "engine", "--quick", "--repeats", "2",
                           "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    systems = {(r["workload"], r["system"]) for r in data["rows"]}
    assert systems == {("a: mixed", "workbench"), ("b: shared prefix", "workbench"),
                       ("b: shared prefix", "workbench, no radix cache"),
                       ("a: mixed", "transformers (static batch)"), ("b: shared prefix", "transformers (static batch)")}
    for r in data["rows"]:
        assert r["output_tokens"] == 4 * 8 and r["seconds"] > 0          # 4 requests x 8 new tokens each
        if r["system"] != "transformers (static batch)":
            assert r["ratio_vs_transformers"] > 0
    mixed = [r for r in data["rows"] if r["workload"] == "a: mixed"]
    assert all(r["note"] == "best of 2" for r in mixed)                 # both sides repeated, best kept
    assert set(data["rss_mib"]) == {"main (tokenizer manager)", "scheduler", "detokenizer"}
    assert data["warm_start_s"] > 0 and data["cold_start_s"] is None    # --quick skips the cold start
    assert "radix cache speed-up" in proc.stdout and "Engine(...) to ready: warm" in proc.stdout
