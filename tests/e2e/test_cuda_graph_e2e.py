"""End-to-end part of tests/fast/test_cuda_graph.py (what starts processes, engines or servers, or loads the
reference model).

The CUDA-graph runner's whole flow on CPU, through the stand-in graph mechanism.

The stand-in records the decode step's callable at capture and re-runs it at
replay into the same output tensor, so everything around the graph is real:
bucket choice, static input buffers, padding rows that touch only the scratch
KV slot, the attention backend's capture/replay hooks, output slicing, and the
eager fallback. Greedy tokens on the default model must equal eager decoding.
"""

from __future__ import annotations

import pytest
from workbench.core.layers.attention.registry import default_attention_backend
from workbench.core.model_executor.cuda_graph_runner import (
    CudaGraphRunner,
    StandInGraphMechanism,
)
from workbench.core.sampling.sampling_params import SamplingParams


# ---- the runner on the default model -------------------------------------------------------------
@pytest.fixture(scope="module")
def runner(default_prepared):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    r = ModelRunner(
        ServerArgs(dtype="float32", max_total_tokens=2048, max_running_requests=8, show_progress=False),
        prepared=default_prepared,
    )
    assert r.graph_runner is None  # CPU: no CUDA graphs unless a test attaches one
    return r


@pytest.fixture(scope="module")
def graph_runner(runner):
    """Captured here: in one module with the fast half, that half's capture test used to do it first."""
    graphs = CudaGraphRunner(runner, [1, 2, 4], StandInGraphMechanism())
    graphs.capture()
    return graphs


def test_greedy_tokens_with_graphs_equal_eager(graph_runner, runner):
    """Default model: three requests of different lengths shrink the batch 3 -> 2 -> 1 (buckets 4, 2, 1);
    a larger batch (5 rows) runs eagerly (above the largest bucket)."""
    from workbench.core.model_executor.offline_harness import OfflineHarness

    prompts = [[1, 504, 3458, 314, 260, 3458, 28, 2], [1, 1066, 1745, 253, 17212], [1, 2436, 30, 2830, 282, 2]]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 4, 2)]
    harness = OfflineHarness(runner)
    eager = harness.generate(prompts, params, return_logprob=True)
    five = prompts + [[1, 42, 43], [1, 7, 8, 9]]
    five_params = [SamplingParams(max_new_tokens=3, temperature=0.0, ignore_eos=True)] * 5
    eager_five = harness.generate(five, five_params)
    counts = dict(graph_runner.replay_count)
    runner.graph_runner = graph_runner
    try:
        graphed = harness.generate(prompts, params, return_logprob=True)
        graphed_five = harness.generate(five, five_params)
    finally:
        runner.graph_runner = None
    assert [r.output_ids for r in graphed] == [r.output_ids for r in eager]
    assert len({tuple(r.output_ids) for r in eager}) == 3
    for a, b in zip(eager, graphed):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert [r.output_ids for r in graphed_five] == [r.output_ids for r in eager_five]
    replays = {b: graph_runner.replay_count[b] - counts[b] for b in counts}
    assert replays[4] > 0 and replays[2] > 0 and replays[1] > 0, replays


def test_engine_decodes_through_stand_in_graphs_and_traces_them(tokenizer, hf_model):
    """--cuda-graph-stand-in: the real scheduler decodes through the graph runner on CPU.

    Greedy tokens equal transformers; every decode batch.step says graph + padded bucket."""
    from conftest import chat_ids, hf_greedy
    from pipeline_helpers import assert_no_kv_leak, drain_events
    from workbench.core.engine import Engine
    from workbench.core.trace import events as ev

    prompts = [chat_ids(tokenizer, t) for t in ("Name a color.", "What is two plus two?", "Say hi.")]
    lens = (7, 4, 2)
    with Engine(
        dtype="float32",
        show_progress=False,
        num_threads=1,
        max_total_tokens=4096,
        cuda_graph_stand_in=True,
        cuda_graph_max_bs=4,
    ) as e:
        sub = e.subscribe(with_snapshot=False)
        try:
            outs = e.generate(
                input_ids=prompts,
                sampling_params=[{"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in lens],
            )

            def every_decode_traced(got):  # the last steps' events may still be on their way
                decoded: dict = {}
                for x in got:
                    if isinstance(x, ev.BatchStep):
                        for r in x.reqs:
                            decoded[r.rid] = decoded.get(r.rid, 0) + r.decode
                return all(decoded.get(o["meta_info"]["id"], 0) >= n - 1 for o, n in zip(outs, lens))

            events = drain_events(sub, until=every_decode_traced)
        finally:
            sub.close()
        assert_no_kv_leak(e)
    assert [o["output_ids"] for o in outs] == [hf_greedy(hf_model, p, n) for p, n in zip(prompts, lens)]
    steps = [x for x in events if isinstance(x, ev.BatchStep)]
    decodes = [s for s in steps if s.mode == "decode"]
    assert decodes and all(s.cuda_graph and s.backend == default_attention_backend("cpu") for s in decodes)
    assert all(not s.cuda_graph and s.padded_size == s.batch_size for s in steps if s.mode != "decode")
    sizes = {(s.batch_size, s.padded_size) for s in decodes}
    assert sizes <= {(1, 1), (2, 2), (3, 4), (4, 4)} and (1, 1) in sizes


# ---- the CPU analogue: eager vs compiled decode benchmark -------------------------------------------
def test_bench_compare_compile_runs_end_to_end(tmp_path):
    """`bench model --compare-compile` on a one-layer tiny model, one batch size (one compile)."""
    import argparse
    import json
    import shutil

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("torch.compile needs a C++ compiler")
    from tiny_models import make_tiny_llama

    from workbench.bench.model_bench import add_parser, format_compile_table, run_compile_bench

    model_dir = make_tiny_llama(tmp_path / "tiny", seed=2, num_hidden_layers=1)
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        [
            "model",
            "--compare-compile",
            "--quick",
            "--quiet",
            "--batches",
            "2",
            "--model",
            str(model_dir),
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    rows = run_compile_bench(args)
    assert [(r.batch, r.dtype) for r in rows] == [(2, "float32")]
    assert rows[0].eager_tok_s > 0 and rows[0].compiled_tok_s > 0 and rows[0].compile_s > 0
    assert "compiled tok/s" in format_compile_table(rows)
    assert args.func(args) == 0
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["compile_rows"][0]["batch"] == 2
    with pytest.raises(ValueError, match="batches"):
        run_compile_bench(parser.parse_args(["model", "--compare-compile", "--batches", "0"]))
