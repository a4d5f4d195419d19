"""Batch-1 float32 decode through every decoder layer in one compiled call (decode_layers.c).

Checked against the op-by-op path it replaces (WORKBENCH_CPU_FUSED_DECODE=0) and against
transformers' greedy `generate`, on tiny random-weight models: Llama with an untied head,
Qwen2 with Q/K/V biases; and what the model dispatches where.
"""

from __future__ import annotations

import pytest
import torch

from tiny_models import make_tiny_llama, make_tiny_qwen2
from workbench.core.layers import cpu_ops
from workbench.core.layers.linear import can_pack_for_cpu
from workbench.core.sampling.sampling_params import SamplingParams

if cpu_ops.unavailable_reason() or not cpu_ops._gemv_ok:
    pytest.skip(
        "the compiled kernels' AVX2 + FMA path is not built here (decode keeps its ops)", allow_module_level=True
    )
if not can_pack_for_cpu(torch.empty(1)):
    pytest.skip("oneDNN packed GEMM unavailable: the CPU fast paths are off", allow_module_level=True)

PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77]]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decode_layers")
    return {
        "llama": make_tiny_llama(root / "llama", tie_word_embeddings=False, seed=13),
        "qwen2": make_tiny_qwen2(root / "qwen2", seed=14),
    }


def _runner(model_dir, **kw):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=2048, show_progress=False, **kw)
    return ModelRunner(args)


def _count_calls(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = cpu_ops.decode_layers_f32
    monkeypatch.setattr(cpu_ops, "decode_layers_f32", lambda x, *a, **k: calls.append(x.shape[0]) or real(x, *a, **k))
    return calls


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_fused_decode_equals_the_op_by_op_path(tiny_dirs, arch, monkeypatch):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    calls = _count_calls(monkeypatch)
    h = OfflineHarness(_runner(tiny_dirs[arch]))
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)

    def run():  # alone (prefill + 9 decode steps), then with half of the prompt cached (a short extend)
        alone = [h.generate([p], sp, return_logprob=True)[0] for p in PROMPTS]
        cached = [h.generate([p], sp, return_logprob=True, prefix_lens=[len(p) // 2])[0] for p in PROMPTS]
        return alone + cached

    fused = run()
    # one call per decode step, and per prompt piece of at most FUSED_MAX_TOKENS (the 12-token prompt
    # whole is longer: op by op)
    halves = [len(p) // 2 for p in PROMPTS]  # the harness computes the "cached" half in its own pass
    pieces = [len(p) for p in PROMPTS] + [n for n in halves if n] + [len(p) - n for p, n in zip(PROMPTS, halves)]
    pieces = [n for n in pieces if n <= cpu_ops.FUSED_MAX_TOKENS]
    assert sorted(calls) == sorted([1] * 2 * len(PROMPTS) * 9 + pieces)
    assert max(pieces) > 1  # extends of several tokens, some on a cached prefix, took the call
    n = len(calls)
    monkeypatch.setenv("WORKBENCH_CPU_FUSED_DECODE", "0")
    plain = run()
    assert len(calls) == n  # off: not called again
    for a, b in zip(fused, plain):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4


def test_fused_decode_matches_transformers_and_frees_every_slot(tiny_dirs, monkeypatch):
    from transformers import AutoModelForCausalLM

    from workbench.core.model_executor.offline_harness import OfflineHarness

    n = 24
    model = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        ref = [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist() for p in PROMPTS
        ]
    calls = _count_calls(monkeypatch)
    runner = _runner(tiny_dirs["llama"])
    free0 = runner.token_to_kv_pool_allocator.available_size()
    h = OfflineHarness(runner)
    greedy = SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True)
    assert [h.generate([p], greedy)[0].output_ids for p in PROMPTS] == ref
    assert calls  # batch 1 ran the fused path ...
    before = len(calls)
    assert [r.output_ids for r in h.generate(PROMPTS, greedy)] == ref
    assert len(calls) == before  # ... four at once (they finish together) run op by op
    assert runner.token_to_kv_pool_allocator.available_size() == free0


def test_the_pointer_table_follows_weight_reloads_and_a_new_pool(tiny_dirs):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    runner = _runner(tiny_dirs["qwen2"])
    inner = runner.model.model
    h = OfflineHarness(runner)
    sp = SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True)
    h.generate([PROMPTS[0]], sp)
    table = inner._decode_table[1]
    assert table.shape == (len(inner.layers), cpu_ops.DECODE_LAYER_FIELDS)
    layer = inner.layers[1]
    assert table[1, 1] == layer.self_attn.qkv_proj.weight.data_ptr()
    assert table[1, 2] == layer.self_attn.qkv_proj.bias.data_ptr()  # Qwen2's q/k/v bias
    assert table[1, 4] == 0  # no o_proj bias
    assert table[1, 10] == runner.token_to_kv_pool.get_key_buffer(1).data_ptr()
    runner.model.process_weights_after_loading(pack=True)
    assert inner._decode_table is None  # rebuilt at its next use


def test_bad_arguments_are_refused_before_the_kernel_runs():
    table = torch.zeros(2, cpu_ops.DECODE_LAYER_FIELDS, dtype=torch.int64)
    common = dict(
        hidden=8,
        num_q_heads=1,
        num_kv_heads=1,
        head_dim=16,
        intermediate=8,
        eps=1e-6,
        scale=0.25,
        cos=torch.ones(1, 1, 16),
        sin=torch.zeros(1, 1, 16),
        kv_dtype=torch.float32,
        out_cache_loc=torch.zeros(1, dtype=torch.int64),
        req_to_token=torch.zeros(1, 4, dtype=torch.int64),
        req_pool_indices=torch.zeros(1, dtype=torch.int64),
        seq_lens=torch.ones(1, dtype=torch.int64),
    )
    with pytest.raises(ValueError, match="one KV slot and one rope row per token"):
        cpu_ops.decode_layers_f32(torch.zeros(2, 8), table, **common)
    with pytest.raises(ValueError, match="x must be"):
        cpu_ops.decode_layers_f32(torch.zeros(cpu_ops.FUSED_MAX_TOKENS + 1, 8), table, **common)
    with pytest.raises(ValueError, match="x must be"):
        cpu_ops.decode_layers_f32(torch.zeros(1, 8, dtype=torch.bfloat16), table, **common)
    with pytest.raises(ValueError, match="layer table"):
        cpu_ops.decode_layers_f32(torch.zeros(1, 8), table[:, :5], **common)
