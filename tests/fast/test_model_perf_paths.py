"""The model executor's CPU fast paths: each one checked against a plain reference.

Buckets and padding for static-shape decode, oneDNN packed linears, the fused
rotary embedding, both decode-attention kernels, tiny real models (Llama with an
untied head, Qwen2 with Q/K/V biases) against transformers, the compiled decode
step against eager, and a smoke run of `bench model`.

The end-to-end tests of this module are in tests/e2e/test_model_perf_paths_e2e.py.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_llama, make_tiny_qwen2
from workbench.core.layers.attention.torch_native_backend import (
    SMALL_DECODE_KV_ELEMENTS,
    decode_attention,
    decode_metadata_from_slots,
)
from workbench.core.layers.linear import RowParallelLinear, can_pack_for_cpu, pack_linear_weight, packed_linear
from workbench.core.layers.rotary_embedding import RotaryEmbedding, apply_rotary
from workbench.core.model_executor.cuda_graph_runner import get_batch_size_buckets, pad_decode_batch, pick_bucket
from workbench.core.sampling.sampling_params import SamplingParams

needs_onednn = pytest.mark.skipif(not can_pack_for_cpu(torch.empty(1)), reason="oneDNN packed GEMM unavailable")


# ---- buckets and padding --------------------------------------------------------------
def test_batch_size_buckets():
    assert get_batch_size_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert get_batch_size_buckets(1) == [1]
    assert get_batch_size_buckets(6) == [1, 2, 4, 6]
    assert get_batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert get_batch_size_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    assert get_batch_size_buckets(50) == [1, 2, 4, 8, 16, 24, 32, 48, 50]
    with pytest.raises(ValueError):
        get_batch_size_buckets(0)


def test_pick_bucket():
    buckets = get_batch_size_buckets(32)
    assert [pick_bucket(bs, buckets) for bs in (1, 2, 3, 5, 8, 9, 17, 24, 25, 32)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        24,
        32,
        32,
    ]
    assert pick_bucket(33, buckets) is None  # too big: the caller runs eagerly
    with pytest.raises(ValueError):
        pick_bucket(0, buckets)


def test_pad_decode_batch_pads_to_scratch_slot():
    slots = torch.tensor([[3, 4, 5], [6, 7, 0]])
    p = pad_decode_batch(4, torch.tensor([11, 12]), torch.tensor([2, 1]), torch.tensor([5, 7]), [3, 2], slots)
    assert (p.bucket, p.real_bs) == (4, 2)
    assert p.input_ids.tolist() == [11, 12, 0, 0]
    assert p.positions.tolist() == [2, 1, 0, 0]
    assert p.out_cache_loc.tolist() == [5, 7, 0, 0]  # padding writes to slot 0 only
    assert p.seq_lens.tolist() == p.seq_lens_cpu == [3, 2, 1, 1]
    assert p.slot_table.tolist() == [[3, 4, 5], [6, 7, 0], [0, 0, 0], [0, 0, 0]]
    same = pad_decode_batch(2, torch.tensor([11, 12]), torch.tensor([2, 1]), torch.tensor([5, 7]), [3, 2], slots)
    assert same.input_ids.tolist() == [11, 12] and same.slot_table.shape == (2, 3)
    with pytest.raises(ValueError):
        pad_decode_batch(1, torch.tensor([11, 12]), torch.tensor([2, 1]), torch.tensor([5, 7]), [3, 2], slots)


# ---- kernels ---------------------------------------------------------------------------
def test_bf16_packs_only_where_onednn_has_bf16_kernels():
    """On an AVX2-only CPU oneDNN's bf16 reorder raises: such weights must stay unpacked, and still run."""
    w = torch.randn(32, 16, dtype=torch.bfloat16)
    supported = torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert can_pack_for_cpu(w) == (supported and can_pack_for_cpu(torch.empty(1)))
    layer = RowParallelLinear(16, 32, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(32, 16) / 4)
    layer.process_weights_after_loading(pack=True)  # never raises: packs where it can
    assert (layer.packed_weight is not None) == can_pack_for_cpu(layer.weight)
    x = torch.randn(3, 16, dtype=torch.bfloat16)
    assert torch.allclose(layer(x).float(), F.linear(x.float(), layer.weight.float()), atol=5e-2)


@needs_onednn
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("rows", [1, 7])
def test_packed_linear_matches_f_linear(dtype, tol, rows):
    if not can_pack_for_cpu(torch.empty(1, dtype=dtype)):
        pytest.skip(f"oneDNN has no {dtype} kernels on this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT)")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(96, 80, generator=g) / 9).to(dtype)
    b = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(rows, 80, generator=g).to(dtype)
    r = torch.randn(rows, 96, generator=g).to(dtype)
    packed = pack_linear_weight(w)
    ref = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(packed_linear(x, packed, b).double(), ref, rtol=tol, atol=tol)
    assert torch.allclose(packed_linear(x, packed, b, residual=r).double(), ref + r.double(), rtol=tol, atol=tol)


@needs_onednn
def test_row_parallel_linear_fuses_the_residual(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "0")  # oneDNN's copy (gemm.c, which may replace it: test_cpu_gemm.py)
    layer = RowParallelLinear(32, 16, bias=True)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(16, 32))
        layer.bias.copy_(torch.randn(16))
    x, res = torch.randn(3, 32), torch.randn(3, 16)
    plain = layer(x, res)
    layer.process_weights_after_loading(pack=True)
    assert layer.packed_weight is not None
    assert torch.allclose(layer(x, res), plain, atol=1e-5)
    assert torch.allclose(layer(x), F.linear(x, layer.weight, layer.bias), atol=1e-5)


def test_apply_rotary_matches_rotate_half_bit_for_bit():
    rope = RotaryEmbedding(head_dim=16, max_position=64, base=10000.0)
    positions = torch.tensor([0, 5, 63])
    qkv = torch.randn(3, 7 * 16)  # 4 q heads + 3 k heads, rotated together, as the model does
    qk = qkv.view(3, 7, 16)
    cos, sin = rope.get_cos_sin(positions, torch.float32)
    out = apply_rotary(qk, cos, sin)
    # The HF formulation: x * cos + rotate_half(x) * sin with cat(freqs, freqs) tables.
    inv = 1.0 / (10000.0 ** (torch.arange(0, 16, 2, dtype=torch.int64).float() / 16))
    emb = torch.cat([positions.float()[:, None] * inv[None]] * 2, dim=-1)
    c, s = emb.cos()[:, None], emb.sin()[:, None]
    ref = qk * c + torch.cat((-qk[..., 8:], qk[..., :8]), dim=-1) * s
    assert torch.equal(out, ref)


def _reference_attention(q, k_buf, v_buf, slot_rows, scaling):
    """Per request, in float64: softmax(q k^T * scale) v over its own slots, GQA by head // group."""
    out = []
    group = q.shape[1] // k_buf.shape[1]
    for i, slots in enumerate(slot_rows):
        k = k_buf[slots].double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v_buf[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[i].double(), k) * scaling
        out.append(torch.einsum("hl,lhd->hd", scores.softmax(-1), v))
    return torch.stack(out)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("lens", [[1, 5, 17, 9], [300, 64, 517, 200, 1, 450]], ids=["small", "large"])
def test_decode_attention_matches_reference(dtype, tol, lens):
    g = torch.Generator().manual_seed(1)
    hq, hk, d = 6, 2, 32
    slots_total = sum(lens) + 1
    k_buf = torch.randn(slots_total, hk, d, generator=g).to(dtype)
    v_buf = torch.randn(slots_total, hk, d, generator=g).to(dtype)
    q = torch.randn(len(lens), hq, d, generator=g).to(dtype)
    perm = (torch.randperm(slots_total - 1, generator=g) + 1).tolist()  # scattered slots, never 0
    rows, start = [], 0
    for n in lens:
        rows.append(perm[start : start + n])
        start += n
    table = torch.zeros(len(lens), max(lens), dtype=torch.int64)
    for i, r in enumerate(rows):
        table[i, : len(r)] = torch.tensor(r)
    meta = decode_metadata_from_slots(table, torch.tensor(lens), lens, hk)
    if dtype == torch.bfloat16:  # both low-precision kernels are covered
        large = len(lens) * hk * max(lens) * d > SMALL_DECODE_KV_ELEMENTS
        assert large == (max(lens) > 100)
    out = decode_attention(q, k_buf, v_buf, meta, d**-0.5)
    assert out.shape == q.shape and out.dtype == dtype
    ref = _reference_attention(q, k_buf, v_buf, rows, d**-0.5)
    assert torch.allclose(out.double(), ref, atol=tol, rtol=tol)


# ---- tiny real models vs transformers ---------------------------------------------------
TINY_PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77]]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("perf_paths")
    return {
        "llama": make_tiny_llama(root / "llama", tie_word_embeddings=False, seed=3),
        "qwen2": make_tiny_qwen2(root / "qwen2", seed=4),
    }


def _runner(model_dir, dtype="float32", **kw):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    return ModelRunner(
        ServerArgs(model_path=str(model_dir), dtype=dtype, max_total_tokens=2048, show_progress=False, **kw)
    )


def _hf_greedy(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]


@needs_onednn
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_model_greedy_matches_transformers(tiny_dirs, arch):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    n = 12
    ref = _hf_greedy(tiny_dirs[arch], TINY_PROMPTS, n)
    assert len({tuple(r) for r in ref}) > 1 and any(len(set(r)) > 2 for r in ref)  # not degenerate
    runner = _runner(tiny_dirs[arch])
    down = runner.model.model.layers[0].mlp.down_proj
    assert down.packed_weight is not None or down.gemm_weight is not None  # a packed path ran (oneDNN or gemm.c)
    h = OfflineHarness(runner)
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert [h.generate([p], greedy)[0].output_ids for p in TINY_PROMPTS] == ref
    assert [r.output_ids for r in h.generate(TINY_PROMPTS, greedy)] == ref
    halves = [len(p) // 2 for p in TINY_PROMPTS]
    assert [r.output_ids for r in h.generate(TINY_PROMPTS, greedy, prefix_lens=halves)] == ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_and_plain_weights_agree(tiny_dirs, dtype):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    runner = _runner(tiny_dirs["qwen2"], dtype)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    packed = OfflineHarness(runner).generate(TINY_PROMPTS, sp, return_logprob=True)
    runner.model.process_weights_after_loading(pack=False)
    plain = OfflineHarness(runner).generate(TINY_PROMPTS, sp, return_logprob=True)
    tol = 1e-4 if dtype == "float32" else 0.25  # bf16: one rounding per GEMM output either way
    for a, b in zip(packed, plain):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < tol
        if dtype == "float32":
            assert a.output_ids == b.output_ids


def _compile_available() -> bool:
    try:
        import torch._inductor  # noqa: F401
    except Exception:
        return False
    return bool(shutil.which("g++") or shutil.which("c++") or shutil.which("clang++"))


@pytest.mark.skipif(not _compile_available(), reason="torch.compile (inductor + a C++ compiler) unavailable")
def test_compiled_decode_matches_eager(tmp_path):
    """One bucket (4) for three ragged requests: the padded row must not disturb the real ones."""
    from workbench.core.model_executor.offline_harness import OfflineHarness

    model_dir = make_tiny_llama(tmp_path / "one_layer", tie_word_embeddings=False, seed=5, num_hidden_layers=1)
    prompts = TINY_PROMPTS[:3]
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    eager = OfflineHarness(_runner(model_dir)).generate(prompts, sp, return_logprob=True)
    runner = _runner(model_dir, enable_torch_compile=True, torch_compile_max_bs=4)
    assert runner.decode_runner is not None and runner.decode_runner.buckets == [1, 2, 4]
    runner.decode_runner.buckets = [4]  # one compile keeps the test fast
    compiled = OfflineHarness(runner).generate(prompts, sp, return_logprob=True)
    assert list(runner.decode_runner.compile_time_s) == [4]
    for a, b in zip(eager, compiled):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


# ---- the benchmark -----------------------------------------------------------------------
def test_bench_model_quick_runs_end_to_end(tiny_dirs, tmp_path):
    from workbench.bench.model_bench import _cli_main, add_parser, format_table, run_model_bench

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="cmd")
    add_parser(sub)
    out = tmp_path / "bench.json"
    args = parser.parse_args(
        ["model", "--quick", "--quiet", "--dtype", "float32", "--model", str(tiny_dirs["llama"]), "--json", str(out)]
    )
    rows = run_model_bench(args)
    assert [r.metric for r in rows] == ["decode bs=1", "decode bs=4", "prefill 32"]
    for r in rows:
        assert r.dtype == "float32"
        assert r.workbench_tok_s > 0 and r.transformers_tok_s > 0
        assert math.isclose(r.ratio, r.workbench_tok_s / r.transformers_tok_s)
    # the batched row carries the linears-alone diagnostic; the others do not
    assert [r.linears_only_tok_s is not None for r in rows] == [False, True, False]
    assert rows[1].linears_only_tok_s > 0
    # every row: GEMM GFLOP/s from the shapes and tok/s on both sides (the peak is this machine's probe)
    assert all(r.gemm_gflops > 0 and r.transformers_gemm_gflops > 0 for r in rows)
    assert math.isclose(rows[0].gemm_gflops / rows[0].transformers_gemm_gflops, rows[0].ratio)
    table = format_table(rows)
    assert "decode bs=1" in table and "ratio" in table and "linears alone" in table and "% of peak" in table
    args.no_reference = True
    assert args.func(args) == 0 and args.func is _cli_main
    data = json.loads(out.read_text())
    assert len(data["rows"]) == 3 and data["quick"] is True
    assert all(r["workbench_tok_s"] > 0 and r["transformers_tok_s"] is None for r in data["rows"])
    assert data["environment"]["threads"] >= 1


def test_bench_model_cuda_flags(tiny_dirs):
    """`--device cuda` without a GPU, or with the CPU clock, is a clear error (the GPU run itself is in
    docs/gpu.md's H100 table; it needs a GPU)."""
    from workbench.bench.model_bench import add_parser, run_model_bench

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="cmd"))
    args = parser.parse_args(
        ["model", "--quick", "--quiet", "--device", "cuda", "--clock", "cpu", "--model", str(tiny_dirs["llama"])]
    )
    assert args.device == "cuda" and args.disable_cuda_graph is False
    import torch

    with pytest.raises(ValueError, match="no CUDA GPU" if not torch.cuda.is_available() else "wall clock"):
        run_model_bench(args)
