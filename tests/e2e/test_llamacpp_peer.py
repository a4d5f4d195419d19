"""`workbench bench engine --peer llamacpp`: the driver's protocol, the bench's helpers and table, and the
path without a usable peer (recipe, exit status 1), all without llama.cpp. The real comparison runs only when
WORKBENCH_LLAMACPP_PYTHON names a python that can import llama_cpp."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from workbench.bench import harness, peer_wire
from workbench.bench import llamacpp_bench as lb
from workbench.bench import llamacpp_peer as lp
from workbench.bench.peer_wire import ProtocolError
from workbench.bench.peers import LlamaCppPeer, PeerEngine
from workbench.bench.prompts import Workload

WORKBENCH = str(Path(sys.executable).with_name("workbench"))
LLAMACPP_PYTHON = os.environ.get("WORKBENCH_LLAMACPP_PYTHON")


def test_modules_never_import_llama_cpp():
    code = (
        "import sys, workbench.bench.llamacpp_bench, workbench.bench.llamacpp_peer; print('llama_cpp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_protocol_messages_round_trip():
    load = lp.load_request("/m/x-f32.gguf", 2, n_ctx=256, seed=3, kv_type="f32")
    assert load == {"op": "load", "gguf": "/m/x-f32.gguf", "n_threads": 2, "n_ctx": 256, "seed": 3, "kv_type": "f32"}
    run = lp.run_request([1, 2, 3], 128)
    assert run == {"op": "run", "prompt": [1, 2, 3], "max_new_tokens": 128, "greedy": True}
    for msg in (load, run, peer_wire.quit_request()):
        line = peer_wire.encode_message(msg)
        assert line.endswith("\n") and line.count("\n") == 1
        assert lp.check_request(peer_wire.decode_message(line)) == msg


@pytest.mark.parametrize(
    "msg, why",
    [
        ({"op": "eval"}, "unknown op"),
        ({"op": "load", "gguf": "", "n_threads": 1, "n_ctx": 256}, "'gguf'"),
        ({"op": "load", "gguf": "a.gguf", "n_threads": 0, "n_ctx": 256}, "'n_threads'"),
        ({"op": "load", "gguf": "a.gguf", "n_threads": True, "n_ctx": 256}, "'n_threads'"),
        ({"op": "load", "gguf": "a.gguf", "n_threads": 1, "n_ctx": 8}, "'n_ctx'"),
        ({"op": "load", "gguf": "a.gguf", "n_threads": 1, "n_ctx": 256, "kv_type": "q8_0"}, "'kv_type'"),
        ({"op": "run", "prompt": [], "max_new_tokens": 4}, "'prompt'"),
        ({"op": "run", "prompt": [1, "2"], "max_new_tokens": 4}, "'prompt'"),
        ({"op": "run", "prompt": [1, -2], "max_new_tokens": 4}, "'prompt'"),
        ({"op": "run", "prompt": [1], "max_new_tokens": 0}, "'max_new_tokens'"),
    ],
)
def test_protocol_rejects_bad_requests(msg, why):
    with pytest.raises(ProtocolError, match=why):
        lp.check_request(msg)


def test_protocol_lines_and_replies():
    for bad in ("", "   ", "not json", "[1, 2]"):
        with pytest.raises(ProtocolError):
            peer_wire.decode_message(bad)
    with pytest.raises(ProtocolError, match="boolean 'ok'"):
        peer_wire.parse_reply('{"seconds": 1.0}')
    reply = lp.summarize_output(list(range(40)), 2.5)
    assert reply == {"ok": True, "seconds": 2.5, "output_tokens": 40, "first_ids": list(range(16))}
    assert peer_wire.parse_reply(peer_wire.encode_message(reply)) == reply
    try:
        raise RuntimeError("boom")
    except RuntimeError as exc:
        err = peer_wire.error_reply(exc)
    assert err["ok"] is False and err["error"] == "RuntimeError: boom" and "Traceback" in err["traceback"]


def test_cpu_features_from_system_info():
    new = (
        "CPU : SSE3 = 1 | SSSE3 = 1 | AVX = 1 | AVX2 = 1 | F16C = 1 | FMA = 1 | BMI2 = 1 | "
        "LLAMAFILE = 1 | OPENMP = 1 | REPACK = 1 | "
    )
    assert lp.missing_cpu_features(new) == []
    old = "AVX = 1 | AVX2 = 0 | AVX512 = 0 | FMA = 1 | F16C = 0 | SSE3 = 1 |"
    assert lp.missing_cpu_features(old) == ["AVX2", "F16C"]
    assert lp.missing_cpu_features("CPU : SSE3 = 1 | ") == ["AVX2", "FMA", "F16C"]


def test_driver_speaks_the_protocol_without_llama_cpp():
    lines = [
        peer_wire.encode_message({"op": "run", "prompt": [1], "max_new_tokens": 2}),  # before load
        "garbage\n",
        peer_wire.encode_message({"op": "load", "gguf": "/nonexistent.gguf", "n_threads": 1, "n_ctx": 64}),
        peer_wire.encode_message(peer_wire.quit_request()),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-S", str(LlamaCppPeer.driver)],
        input="".join(lines),
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    replies = [peer_wire.parse_reply(line) for line in proc.stdout.splitlines()]
    assert proc.returncode == 0 and len(replies) == 4, proc.stdout + proc.stderr
    assert "send 'load' before 'run'" in replies[0]["error"]
    assert "ProtocolError" in replies[1]["error"]
    assert replies[2]["ok"] is False and "llama_cpp" in replies[2]["error"]  # -S: no site-packages here
    assert replies[3] == {"ok": True}
    check = subprocess.run(
        [sys.executable, "-S", str(LlamaCppPeer.driver), "--check"], capture_output=True, text=True, timeout=60, env=env
    )
    assert check.returncode == 1 and peer_wire.parse_reply(check.stdout.splitlines()[-1])["ok"] is False


def test_check_peer_and_recipe(tmp_path):
    assert LlamaCppPeer.check(None) == (False, "no --peer-python given (nor WORKBENCH_LLAMACPP_PYTHON)")
    ok, why = LlamaCppPeer.check(str(tmp_path / "nope" / "python"))
    assert not ok and "not an executable file" in why
    recipe = LlamaCppPeer.install_recipe("/opt/lv/bin/python")
    assert "python3 -m venv /opt/lv" in recipe
    assert "-DGGML_NATIVE=ON" in recipe and f"llama-cpp-python=={LlamaCppPeer.version}" in recipe
    assert "--no-binary llama-cpp-python" in recipe
    assert "~/llama-venv" in LlamaCppPeer.install_recipe(None)
    assert "python3 -m venv ~/llama-venv" in LlamaCppPeer.install_recipe("/usr/bin/python3")  # no venv: never /usr


def test_thread_counts():
    assert lb.thread_counts(None, 2) == [1, 2]
    assert lb.thread_counts("both", 4) == [1, 4]
    assert lb.thread_counts(None, 1) == [1]
    assert lb.thread_counts("all", 2) == [2]
    assert lb.thread_counts("2", 8) == [2]
    assert lb.thread_counts("1,2,1", 8) == [1, 2]
    for bad in ("0", "x", "1,-2", ","):
        with pytest.raises(ValueError):
            lb.thread_counts(bad, 2)


def test_rows_table_ratio_and_goal():
    ahead = lb.make_row("float32", 2, [30.0, 34.0], [20.0, 20.0], [1.5, 2.25], first_equal=True)
    assert ahead.workbench_tok_s == 32.0 and ahead.llamacpp_tok_s == 20.0 and ahead.ratio == pytest.approx(1.6)
    behind = lb.make_row("bfloat16", 1, [10.0, 12.0], [22.0, 22.0], [0.5, 0.7], first_equal=False)
    table = lb.format_table([ahead, behind])
    lines = table.splitlines()
    assert lines[0].startswith("| dtype | threads | workbench tok/s | llama.cpp tok/s | ratio | goal ≥1×")
    assert lines[2] == "| float32 | 2 | 32.0 | 20.0 | **1.60×** | met | - | - | - | yes | 1.50–2.25 |"
    assert lines[3] == "| bfloat16 | 1 | 11.0 | 22.0 | **0.50×** | not met | - | - | - | no | 0.50–0.70 |"
    # with the shapes and a peak: GEMM GFLOP/s at 2 FLOPs a weight, the weights' bytes against the read bandwidth
    from types import SimpleNamespace

    from workbench.core.layers.cpu_ops.peak import Peak

    from workbench.bench.gemm_work import LinearShapes

    shapes = LinearShapes.from_config(
        SimpleNamespace(
            hidden_size=1000,
            num_attention_heads=10,
            num_key_value_heads=10,
            intermediate_size=1000,
            num_hidden_layers=1,
            vocab_size=1000,
        )
    )  # 1000 x (3000 + 1000 + 2000 + 1000 + 1000) weights: 8e6, 16 MFLOP a token
    peak = Peak("Test CPU", "k", "AVX2 + FMA", 2, 100.0, 200.0, read_core={"huge": 10.0}, read_all={"huge": 16.0})
    lb.apply_peak([ahead, behind], shapes, peak)
    assert ahead.gemm_gflops == pytest.approx(32 * 0.016) and ahead.peak_gflops == 200.0
    assert ahead.weight_gbs == pytest.approx(32 * 0.032) and ahead.read_gbs == 16.0 and behind.read_gbs == 10.0
    line = lb.format_table([ahead]).splitlines()[2]
    assert "| 0.5 (0%) | 0% | 1.0 (6%) | yes |" in line
    text = "\n".join(lb.summary_lines([ahead, behind], repeats=2))
    assert "medians of 4 measurements each (A B B A × 2)" in text
    assert "127 / (time for 128 new − time for 1 new)" in text
    assert "stay ahead of llama.cpp at equal dtype" in text
    assert "float32, 2 threads: 1.60× — ahead (met)" in text and "bfloat16, 1 thread: 0.50× — behind (not met)" in text
    nan = lb.make_row("float32", 1, [1.0], [0.0], [])
    assert harness.ratio_text(nan.ratio) == "n/a" and "| **n/a** | n/a |" in lb.format_table([nan])


class _FakePeer(LlamaCppPeer):
    """The llama.cpp peer with its driver replaced: `run` requests answered like the driver's, with fixed
    per-token times, so decode tok/s is known."""

    def __init__(self, prefill_s: float, per_token_s: float):  # no driver process
        self.prefill_s, self.per_token_s, self.requests = prefill_s, per_token_s, []

    def request(self, msg, timeout):
        self.requests.append(msg)
        new = msg["max_new_tokens"]
        ids = [(7 * i) % 50 for i in range(new)]
        return lp.summarize_output(ids, self.prefill_s + (new - 1) * self.per_token_s)


def test_measure_interleaves_and_subtracts_the_prefill(capsys):
    wl = Workload("iii", "(iii) bs 1", [[5] * 64], 128, decode_only=True)
    calls = []

    def fake_workbench_run(prompts, new):
        calls.append(("workbench", new))
        return 0.3 + (new - 1) * 0.02, new, [[(7 * i) % 50 for i in range(min(new, 16))]]

    peer = _FakePeer(prefill_s=0.5, per_token_s=0.04)
    assert isinstance(peer, PeerEngine)
    with pytest.raises(ValueError, match="batch 1 only"):
        peer.run([[1], [2]], 4)
    row = lb.measure_pair({"workbench": fake_workbench_run, "llama.cpp": peer.run}, wl, "float32", 2, repeats=2)
    assert row.workbench_tok_s == pytest.approx(50.0) and row.llamacpp_tok_s == pytest.approx(25.0)
    assert row.ratio == pytest.approx(2.0) and row.first_equal is True
    assert len(row.workbench_samples) == len(row.llamacpp_samples) == 4 and len(row.load_1m) == 8
    # warm-up, then per measurement a 1-token and a 128-token run; every prompt is the workload's
    assert [m["max_new_tokens"] for m in peer.requests] == [4] + [1, 128] * 4
    assert all(m["prompt"] == [5] * 64 and m["greedy"] for m in peer.requests)
    assert calls == [("workbench", 4)] + [("workbench", 1), ("workbench", 128)] * 4
    out = capsys.readouterr().out
    sides = re.findall(r"\[\d/2\] (\S+) .* tok/s", out)
    assert sides == ["workbench", "llama.cpp", "llama.cpp", "workbench"] * 2  # A B B A per round
    assert "(load 1m " in out


def test_gguf_cache_paths_and_reuse(tmp_path, monkeypatch):
    hf = tmp_path / "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef"
    assert lb.gguf_path_for(hf, "float32", tmp_path).name == "SmolLM2-135M-Instruct.Q4_1-0123456789abcdef-f32.gguf"
    assert lb.gguf_path_for(hf, "bfloat16", tmp_path).name.endswith("-bf16.gguf")
    with pytest.raises(ValueError):
        lb.gguf_path_for(hf, "float16", tmp_path)
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path / "c"))
    assert lb.llamacpp_cache() == tmp_path / "c" / "llamacpp"
    cached = lb.gguf_path_for(hf, "float32", tmp_path)
    cached.write_bytes(b"GGUF....")

    def no_subprocess(*a, **k):
        raise AssertionError("a cached GGUF is reused, never converted again")

    monkeypatch.setattr(lb.subprocess, "run", no_subprocess)
    assert lb.ensure_gguf(hf, "float32", "0.3.36", sys.executable, cache=tmp_path) == cached


def test_converter_members_of_the_sdist():
    names = [
        "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_hf_to_gguf.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/convert_lora_to_gguf.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/conversion/__init__.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/conversion/llama.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py/gguf/__init__.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/gguf-py/tests/test_x.py",
        "llama_cpp_python-0.3.36/vendor/llama.cpp/ggml/src/ggml.c",
        "llama_cpp_python-0.3.36/llama_cpp/llama.py",
    ]
    assert lb._converter_members(names) == {
        names[0]: "convert_hf_to_gguf.py",
        names[2]: "conversion/__init__.py",
        names[3]: "conversion/llama.py",
        names[4]: "gguf-py/gguf/__init__.py",
    }


def test_sentencepiece_stub_fails_like_a_missing_model(tmp_path, monkeypatch):
    monkeypatch.setattr(lb.importlib.util, "find_spec", lambda name: None)
    stub = lb._sentencepiece_stub(tmp_path)
    code = (
        "import sentencepiece\n"
        "try:\n    sentencepiece.SentencePieceProcessor()\nexcept FileNotFoundError:\n    print('ok')"
    )
    out = subprocess.run(
        [sys.executable, "-S", "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(stub)},
    )
    assert out.stdout.strip() == "ok", out.stderr
    monkeypatch.setattr(lb.importlib.util, "find_spec", lambda name: object())
    assert lb._sentencepiece_stub(tmp_path) is None  # the real package: nothing to stand in for


def test_cli_without_a_peer_prints_the_recipe_and_fails(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORKBENCH_LLAMACPP_PYTHON", "WORKBENCH_VLLM_PYTHON")}
    proc = subprocess.run(
        [
            WORKBENCH,
            "bench",
            "engine",
            "--peer",
            "llamacpp",
            "--peer-python",
            sys.executable,
            "--json",
            str(tmp_path / "x.json"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "llama.cpp peer unavailable" in proc.stdout and "cannot import llama_cpp" in proc.stdout
    assert "-DGGML_NATIVE=ON" in proc.stdout and "llama-cpp-python==0.3.36" in proc.stdout
    assert "no usable llama.cpp peer" in proc.stderr
    assert not (tmp_path / "x.json").exists()  # nothing measured, nothing written
    proc = subprocess.run(
        [WORKBENCH, "bench", "engine", "--peer", "llamacpp"], capture_output=True, text=True, timeout=300, env=env
    )
    assert proc.returncode == 1 and "no --peer-python given" in proc.stdout


def _usable_peer() -> tuple[bool, str]:
    if not LLAMACPP_PYTHON:
        return False, (
            "needs a venv with llama-cpp-python: set WORKBENCH_LLAMACPP_PYTHON to its python "
            "(CI has none; the recipe is in README's Benchmarks section)"
        )
    ok, detail = LlamaCppPeer.check(LLAMACPP_PYTHON)
    return (True, "") if ok else (False, f"WORKBENCH_LLAMACPP_PYTHON={LLAMACPP_PYTHON} is not usable: {detail}")


_USABLE, _WHY = _usable_peer()


@pytest.mark.skipif(not _USABLE, reason=_WHY)
def test_real_llamacpp_peer_quick(tmp_path):
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [
            WORKBENCH,
            "bench",
            "engine",
            "--peer",
            "llamacpp",
            "--peer-python",
            LLAMACPP_PYTHON,
            "--quick",
            "--repeats",
            "1",
            "--dtype",
            "float32",
            "--threads",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    data = json.loads(out.read_text())
    [row] = data["rows"]
    assert row["dtype"] == "float32" and row["threads"] == 1
    assert row["workbench_tok_s"] > 0 and row["llamacpp_tok_s"] > 0 and len(row["llamacpp_samples"]) == 2
    assert row["first_equal"] is True  # same float32 weights, greedy: the same tokens
    assert (
        "| dtype | threads | workbench tok/s | llama.cpp tok/s |" in proc.stdout and "goal: stay ahead" in proc.stdout
    )
