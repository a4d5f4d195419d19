"""Batch-1 decode through every decoder layer in one compiled call (decode_layers.c).

Checked against the op-by-op path it replaces (WORKBENCH_CPU_FUSED_DECODE=0) and against
transformers' greedy `generate`, on tiny random-weight models: Llama with an untied head,
Qwen2 with Q/K/V biases; and what the model dispatches where. A bfloat16 model takes the same
call (float32 arithmetic on its bfloat16 weights): checked bit for bit against the float32 model
whose weights are those bfloat16 values.
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


def _runner(model_dir, dtype_override: str = "float32", **kw):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    args = ServerArgs(model_path=str(model_dir), dtype=dtype_override, max_total_tokens=2048, show_progress=False, **kw)
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


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bfloat16_weights_take_the_call_and_equal_float32_on_their_values(tiny_dirs, arch, monkeypatch):
    """A bfloat16 model decodes through the same call: every call's output equals the float32 model's
    whose weights (and KV pool) hold the same bfloat16 values (bit for bit where the weights are
    widened as they are read; within the rounding of each projection's input where AVX512_BF16
    multiplies in bfloat16), and so do the greedy tokens. Prompts of at most FUSED_MAX_TOKENS, one at a
    time, so that the prefill takes the call too (a longer one runs op by op in bfloat16)."""
    from workbench.core.model_executor.offline_harness import OfflineHarness

    outputs: dict[str, list[torch.Tensor]] = {"bf16": [], "f32": []}
    real = cpu_ops.decode_layers_f32
    current = ["bf16"]

    def spy(x, *a, **k):
        out = real(x, *a, **k)
        outputs[current[0]].append(out.clone())
        return out

    monkeypatch.setattr(cpu_ops, "decode_layers_f32", spy)
    prompts = [p for p in PROMPTS if len(p) <= cpu_ops.FUSED_MAX_TOKENS]
    sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
    bf16 = _runner(tiny_dirs[arch], dtype_override="bfloat16")
    assert bf16.model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    tokens_bf16 = [OfflineHarness(bf16).generate([p], sp)[0].output_ids for p in prompts]

    current[0] = "f32"
    f32 = _runner(tiny_dirs[arch], kv_cache_dtype="bfloat16")
    with torch.no_grad():
        for param in f32.model.parameters():
            param.copy_(param.to(torch.bfloat16).to(torch.float32))
    f32.model.process_weights_after_loading(pack=True)
    tokens_f32 = [OfflineHarness(f32).generate([p], sp)[0].output_ids for p in prompts]

    assert len(outputs["bf16"]) == len(outputs["f32"]) == len(prompts) * 16  # the prefill and 15 decode steps
    if cpu_ops.gemv_bf16_rounds_x():
        # AVX512_BF16: each projection's input is rounded to bfloat16 (relative 2^-9), as oneDNN's
        # bfloat16 GEMM rounds it; the float32 model's residual streams within that, the same tokens
        for a, b in zip(outputs["bf16"], outputs["f32"]):
            assert float((a - b).norm() / b.norm()) < 1e-2
    else:  # widened weights: bit for bit
        for a, b in zip(outputs["bf16"], outputs["f32"]):
            assert torch.equal(a, b)
    assert tokens_bf16 == tokens_f32


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_team_of_threads_gives_the_bits_of_one_thread(tmp_path, dtype, monkeypatch):
    """On more than one thread a decode token runs every layer inside one parallel region, each
    thread its rows of every projection and its KV heads of the attention (decode_layers.c's
    decode_one_token_team); one thread (and a prompt piece of several tokens) runs the op-by-op loop.
    Every call's output is the same bits on 1, 2, 3 and 5 threads: shapes where the row blocks and
    the 3 KV heads split unevenly, a thread gets no head at all, and the intermediate size is not a
    multiple of the 8-row blocks."""
    from workbench.core.model_executor.offline_harness import OfflineHarness

    model_dir = make_tiny_llama(
        tmp_path / "wide",
        seed=21,
        hidden_size=192,
        intermediate_size=344,
        num_attention_heads=6,
        num_key_value_heads=3,
        num_hidden_layers=3,
        tie_word_embeddings=False,
    )
    runner = _runner(model_dir, dtype_override=dtype)
    h = OfflineHarness(runner)
    sp = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [p for p in PROMPTS if len(p) <= cpu_ops.FUSED_MAX_TOKENS]
    real = cpu_ops.decode_layers_f32
    seen: list[torch.Tensor] = []
    monkeypatch.setattr(cpu_ops, "decode_layers_f32", lambda x, *a, **k: seen.append(real(x, *a, **k).clone()) or x)
    runs = {}
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3, 5):
            torch.set_num_threads(n)
            seen.clear()
            tokens = [h.generate([p], sp)[0].output_ids for p in prompts]
            runs[n] = (tokens, list(seen))
    finally:
        torch.set_num_threads(threads)
    tokens1, outs1 = runs[1]
    assert len(outs1) == len(prompts) * 12  # the prefill and 11 decode steps each, all through the call
    for n in (2, 3, 5):
        tokens, outs = runs[n]
        assert tokens == tokens1
        assert len(outs) == len(outs1)
        for a, b in zip(outs, outs1):
            assert torch.equal(a, b), f"{n} threads differ from one by {float((a - b).abs().max())}"


def test_a_bfloat16_models_norm_weight_update_reaches_the_call(tiny_dirs):
    """A bfloat16 model's table points at float32 copies of its norm weights: a weight update must
    drop them (an update copies into the same storage, so the table's key would not change)."""
    from workbench.core.managers.weight_updater import update_weights_from_tensor
    from workbench.core.model_executor.offline_harness import OfflineHarness

    runner = _runner(tiny_dirs["llama"], dtype_override="bfloat16")
    h = OfflineHarness(runner)
    sp = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
    before = h.generate([PROMPTS[0]], sp, return_logprob=True)[0]
    name = "model.layers.0.post_attention_layernorm.weight"
    weight = runner.model.model.layers[0].post_attention_layernorm.weight
    update_weights_from_tensor(runner, [(name, weight.detach().float() * 3.0)])
    assert runner.model.model._decode_table is None
    after = h.generate([PROMPTS[0]], sp, return_logprob=True)[0]
    assert after.logprobs != before.logprobs  # the new norm weight took effect
    update_weights_from_tensor(runner, [(name, weight.detach().float() / 3.0)])
    assert (
        h.generate([PROMPTS[0]], sp, return_logprob=True)[0].logprobs == before.logprobs
    )  # and back: the same numbers


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
