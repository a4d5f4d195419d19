"""GPU paths that need CUDA: real graph capture/replay, flashinfer, triton compiled for the GPU.

Without CUDA every test here except the device-neutral helper check skips, saying
why. With a GPU: `pytest -m gpu tests/fast/test_gpu_only.py` (and `workbench selftest
--device cuda` for the whole table on the default model).

The end-to-end tests of this module are in tests/e2e/test_gpu_only_e2e.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from workbench.core.layers.attention.flashinfer_backend import kv_indices_from_rows
from workbench.core.sampling.sampling_params import SamplingParams

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs a CUDA GPU (none on this machine); the CPU stand-in covers the device-neutral flow"
)
needs_flashinfer = pytest.mark.skipif(
    importlib.util.find_spec("flashinfer") is None, reason="needs flashinfer-python (pip install -e '.[gpu]') and CUDA"
)
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

PROMPTS = [[1, 504, 3458, 314, 260, 3458, 28, 2], [1, 1066, 1745, 253, 17212], [1, 2436, 30, 2830, 282, 2]]


def test_flashinfer_kv_indices_from_rows():
    """Page-size-1 page tables from req_to_token rows (pure torch; runs on CPU)."""
    table = torch.tensor([[0, 0, 0, 0], [7, 8, 9, 10], [3, 4, 0, 0], [5, 0, 0, 0]])
    indptr, indices = kv_indices_from_rows(table, torch.tensor([2, 1, 3]), torch.tensor([2, 3, 1]), [2, 3, 1])
    assert indptr.tolist() == [0, 2, 5, 6] and indptr.dtype == torch.int32
    assert indices.tolist() == [3, 4, 7, 8, 9, 5] and indices.dtype == torch.int32
    indptr, indices = kv_indices_from_rows(table, torch.tensor([1, 2]), torch.tensor([0, 0]), [0, 0])
    assert indptr.tolist() == [0, 0, 0] and indices.numel() == 0


def _greedy(default_prepared, **server_args):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness

    runner = ModelRunner(
        ServerArgs(
            device="cuda",
            dtype="float32",
            max_total_tokens=4096,
            max_running_requests=8,
            show_progress=False,
            **server_args,
        ),
        prepared=default_prepared,
    )
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 8, 4)]
    halves = [len(p) // 2 for p in PROMPTS]
    out = [r.output_ids for r in OfflineHarness(runner).generate(PROMPTS, params, prefix_lens=halves)]
    return runner, out


@pytest.fixture(scope="module")
def reference_tokens(default_prepared):
    _, out = _greedy(default_prepared, attention_backend="torch_native", disable_cuda_graph=True)
    return out


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_triton_backend_on_gpu_matches_torch_native(default_prepared, reference_tokens):
    _, out = _greedy(default_prepared, attention_backend="triton", disable_cuda_graph=True)
    assert out == reference_tokens


def _greedy_bf16(default_prepared, prompts=PROMPTS, **server_args):
    """bfloat16 greedy with each step's top-2 logprobs (FlashInfer's kernels are 16-bit only)."""
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness

    from workbench.selftest import Greedy

    runner = ModelRunner(
        ServerArgs(
            device="cuda",
            dtype="bfloat16",
            max_total_tokens=4096,
            max_running_requests=8,
            show_progress=False,
            **server_args,
        ),
        prepared=default_prepared,
    )
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (12, 8, 4)]
    halves = [len(p) // 2 for p in prompts]
    res = OfflineHarness(runner).generate(prompts, params, prefix_lens=halves, return_logprob=True, top_logprobs_num=2)
    return runner, Greedy([r.output_ids for r in res], [r.top_logprobs for r in res])


@pytest.fixture(scope="module")
def reference_bf16(default_prepared):
    return _greedy_bf16(default_prepared, attention_backend="torch_native", disable_cuda_graph=True)[1]


@pytest.mark.gpu
@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("graphs", [False, True])
def test_flashinfer_backend_matches_torch_native(default_prepared, reference_bf16, graphs):
    from workbench.selftest import compare_greedy

    runner, out = _greedy_bf16(
        default_prepared, attention_backend="flashinfer", disable_cuda_graph=not graphs, cuda_graph_max_bs=4
    )
    ok, detail = compare_greedy(reference_bf16, out)
    assert ok, detail
    if graphs:
        gr = runner.graph_runner
        assert gr is not None and gr.mechanism.name == "cuda"
        assert all(gr.replay_count[b] > 0 for b in (1, 2, 4)), gr.replay_count


@pytest.mark.gpu
@needs_cuda
@needs_flashinfer
@pytest.mark.parametrize("graphs", [False, True])
def test_flashinfer_tensor_core_decode_on_a_gqa4_model(tmp_path, graphs):
    # Four or more query heads per KV head take FlashInfer's tensor-core decode kernels
    # (use_tensor_cores); the default model has three, so this needs a model of its own.
    from tiny_models import make_tiny_llama
    from workbench.core.model_loader import prepare_model

    from workbench.selftest import compare_greedy

    model_dir = make_tiny_llama(
        tmp_path / "gqa4",
        seed=3,
        hidden_size=512,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_hidden_layers=2,
    )
    prepared = prepare_model(str(model_dir), progress=False)
    prompts = [[1, 5, 9, 12, 7, 3, 22, 14], [1, 30, 8, 8, 41], [1, 17, 26, 2, 33, 9]]
    runner, out = _greedy_bf16(
        prepared, prompts, attention_backend="flashinfer", disable_cuda_graph=not graphs, cuda_graph_max_bs=4
    )
    assert runner.attn_backend.use_tensor_cores
    reference = _greedy_bf16(prepared, prompts, attention_backend="torch_native", disable_cuda_graph=True)[1]
    ok, detail = compare_greedy(reference, out)
    assert ok, detail


def test_flashinfer_refuses_float32_with_what_to_do():
    from workbench.core.layers.attention.registry import default_attention_backend, unavailable_reason

    msg = unavailable_reason("flashinfer", "cuda", "float32")
    assert msg and "--dtype bfloat16" in msg and "triton" in msg
    assert default_attention_backend("cuda", "float32") != "flashinfer"


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_cuda_graph_capture_and_replay(default_prepared, reference_tokens):
    runner, out = _greedy(default_prepared, attention_backend="triton", cuda_graph_max_bs=4)
    gr = runner.graph_runner
    assert gr is not None and gr.mechanism.name == "cuda" and sorted(gr.graphs) == [1, 2, 4]
    assert out == reference_tokens
    assert all(gr.replay_count[b] > 0 for b in (1, 2, 4)), gr.replay_count


@pytest.mark.gpu
@needs_cuda
def test_overlap_worker_uses_a_forward_stream(default_prepared):
    from workbench.core.args import ServerArgs
    from workbench.core.managers.tp_worker import TpModelWorker
    from workbench.core.managers.tp_worker_overlap_thread import TpModelWorkerClient

    worker = TpModelWorker(
        ServerArgs(device="cuda", max_total_tokens=1024, show_progress=False), prepared=default_prepared
    )
    client = TpModelWorkerClient(worker, 8)
    try:
        assert client.is_cuda and client.forward_stream is not None
        assert client.future_token_ids_map.device.type == "cuda"
        ids = torch.tensor([5, -1, 7, -2], device="cuda")
        client.future_token_ids_map[:2] = torch.tensor([11, 12], device="cuda")
        assert client.resolve_future_token_ids(ids).tolist() == [5, 11, 7, 12]
    finally:
        client.shutdown()


# ---- speculative verify passes and mixtures of experts under real CUDA graphs ------------------------
def _engine_run(model_dir, prompts, **kw):
    """(outputs, trace events) of one three-process Engine on CUDA, float32, greedy."""
    from pipeline_helpers import assert_no_kv_leak, generate_traced

    from workbench import Engine

    sp = {"max_new_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    with Engine(
        model_path=str(model_dir), device="cuda", dtype="float32", max_total_tokens=8192, show_progress=False, **kw
    ) as engine:
        outs, events = generate_traced(engine, prompts, sp)
        assert_no_kv_leak(engine)
    return [o["output_ids"] for o in outs], events


def _repetitive_prompts(n: int) -> list[list[int]]:
    return [([10 + (7 * i + j) % 200 for j in range(2 + i % 4)] * 12)[: 6 + (i * 5) % 35] for i in range(n)]


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_verify_passes_replay_cuda_graphs_and_keep_the_output(tmp_path):
    """NGRAM on the triton backend: verify passes of up to 8 requests replay real CUDA graphs
    (5 rows per request), and the tokens equal decoding without drafts."""
    from tiny_models import make_tiny_llama
    from workbench.core.trace import events as ev

    model_dir = make_tiny_llama(tmp_path / "llama", tie_word_embeddings=False, seed=3)
    prompts = _repetitive_prompts(12)
    common = dict(attention_backend="triton", cuda_graph_max_bs=8)
    plain, _ = _engine_run(model_dir, prompts, **common)
    spec, events = _engine_run(
        model_dir, prompts, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4, **common
    )
    assert spec == plain
    steps = {(e.proc, e.step): e for e in events if isinstance(e, ev.BatchStep)}
    verify = [steps[(e.proc, e.step)] for e in events if isinstance(e, ev.SpecVerify) and not e.snapshot]
    assert any(s.cuda_graph for s in verify), "no verify pass replayed a graph"
    accepted = sum(r.accepted for e in events if isinstance(e, ev.SpecVerify) for r in e.reqs)
    assert accepted > 0


@pytest.mark.gpu
@needs_cuda
@needs_triton
def test_a_mixture_of_experts_replays_cuda_graphs(tmp_path):
    """Qwen3-MoE on CUDA: the Triton experts inside captured decode graphs give eager's tokens, and
    the trace's routing (the graph's static copy of the expert ids) counts each step's real tokens
    and adds up to eager's per expert."""
    from pipeline_helpers import assert_routing_counts_real_tokens, expert_totals
    from tiny_models import make_tiny_family
    from workbench.core.trace import events as ev

    model_dir = make_tiny_family(tmp_path / "qwen3_moe", "qwen3_moe", seed=7)
    prompts = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51]]
    eager, eager_events = _engine_run(model_dir, prompts, attention_backend="triton", disable_cuda_graph=True)
    graphed, events = _engine_run(model_dir, prompts, attention_backend="triton", cuda_graph_max_bs=4)
    assert graphed == eager
    assert any(e.cuda_graph for e in events if isinstance(e, ev.BatchStep))

    # Each step's routing covers its real tokens only (not the bucket's padding rows), and over the
    # run every expert got the tokens it got eagerly (steps may batch differently: arrival timing).
    assert_routing_counts_real_tokens(events, top_k=2)
    assert expert_totals(events) == expert_totals(eager_events)


# ---- workbench selftest -------------------------------------------------------------------------
def test_compare_greedy_passes_equal_tokens_and_near_ties_only():
    from workbench.selftest import Greedy, compare_greedy

    top2 = [
        [[(1, -0.1), (9, -2.0)], [(2, -0.50), (7, -0.52)], [(3, -0.1), (8, -3.0)]],
        [[(4, -0.1), (6, -3.0)], [(5, -0.2), (6, -4.0)]],
    ]
    ref = Greedy([[1, 2, 3], [4, 5]], top2)
    assert compare_greedy(ref, Greedy([[1, 2, 3], [4, 5]])) == (True, "tokens equal")
    ok, detail = compare_greedy(ref, Greedy([[1, 7, 0], [4, 5]]))  # 2 vs 7: 0.02 nats apart
    assert ok and "1 near-tie" in detail
    ok, detail = compare_greedy(ref, Greedy([[9, 2, 3], [4, 5]]))  # 1 vs 9: a real difference
    assert not ok and "request 0 diverges at token 0" in detail
    assert not compare_greedy(ref, Greedy([[1, 2], [4, 5]]))[0]  # wrong length
    assert not compare_greedy(ref, Greedy([[1, 2, 3]]))[0]  # missing request


def test_selftest_cuda_without_a_gpu_says_what_to_run(capsys):
    if HAS_CUDA:
        pytest.skip("this machine has a GPU")
    from workbench.cli import main

    assert main(["selftest", "--device", "cuda"]) == 2
    assert "selftest --device cpu" in capsys.readouterr().err


def test_forward_batch_moves_host_tensors_to_the_runner_device():
    """Device-neutral half of the GPU fix: host-built batch tensors move, device ones are kept as they are
    ("meta" stands in for the GPU)."""
    from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    ids = torch.tensor([3, 4])
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        batch_size=2,
        input_ids=ids,
        positions=torch.tensor([5, 6]),
        req_pool_indices=torch.tensor([1, 2]),
        seq_lens=torch.tensor([6, 7]),
        out_cache_loc=torch.tensor([9, 10]),
        seq_lens_cpu=[6, 7],
        extend_seq_lens_cpu=[1, 1],
        extend_prefix_lens_cpu=[5, 6],
    )
    assert fb.to("cpu").input_ids is ids
    fb.to(torch.device("meta"))
    assert all(
        getattr(fb, n).device.type == "meta"
        for n in ("input_ids", "positions", "req_pool_indices", "seq_lens", "out_cache_loc")
    )
