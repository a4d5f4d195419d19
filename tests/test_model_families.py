"""Model families beyond Llama/Qwen2, each against transformers' greedy `generate` on a tiny
random-weight model built from its config class (no download): Qwen3 (per-head q/k norm, explicit
head_dim), Qwen3-MoE (experts with a dense layer between), Mixtral, OLMoE (whole-vector q/k norm,
clip_qkv, no top-k renormalisation). One at a time, batched, and with half of each prompt already
in the pool; every KV slot returned after."""

from __future__ import annotations

import pytest
import torch

from tiny_models import FAMILIES, make_tiny_family
from workbench.core.sampling.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77, 78]]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_family(root / f, f, seed=20 + i) for i, f in enumerate(FAMILIES)}


def _hf_greedy(model_dir, prompts, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        return [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False)[0, len(p) :].tolist() for p in prompts
        ]


def _runner(model_dir, **kw):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=4096, show_progress=False, **kw)
    return ModelRunner(args)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers(family_dirs, family):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    ref = _hf_greedy(family_dirs[family], PROMPTS, NEW_TOKENS)
    assert len({tuple(r) for r in ref}) > 1 and any(len(set(r)) > 4 for r in ref)  # not degenerate
    runner = _runner(family_dirs[family])
    assert type(runner.model).__name__ == FAMILIES[family][1]
    free0 = runner.token_to_kv_pool_allocator.available_size()
    h = OfflineHarness(runner)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [h.generate([p], greedy)[0].output_ids for p in PROMPTS] == ref
    assert [r.output_ids for r in h.generate(PROMPTS, greedy)] == ref
    halves = [len(p) // 2 for p in PROMPTS]
    assert [r.output_ids for r in h.generate(PROMPTS, greedy, prefix_lens=halves)] == ref
    assert runner.token_to_kv_pool_allocator.available_size() == free0


def test_the_supported_list_is_the_registry():
    from workbench.core.model_loader.resolve import SUPPORTED_ARCHITECTURES
    from workbench.core.models.registry import MODEL_REGISTRY

    assert set(SUPPORTED_ARCHITECTURES) == set(MODEL_REGISTRY)
    assert {arch for _, arch, _ in FAMILIES.values()} <= set(MODEL_REGISTRY)


def test_moe_routing_counts_every_assignment(family_dirs):
    """The experts count the (token, expert) assignments of the last call: T x top_k per sparse layer."""
    from workbench.core.layers.moe import FusedMoE
    from workbench.core.model_executor.offline_harness import OfflineHarness

    runner = _runner(family_dirs["qwen3_moe"])
    OfflineHarness(runner).generate([PROMPTS[2]], SamplingParams(max_new_tokens=1, temperature=0.0))
    moes = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
    assert len(moes) == 2  # layers 0 and 2; layer 1 is dense (mlp_only_layers)
    for m in moes:
        assert m.last_counts.shape == (8,) and int(m.last_counts.sum()) == len(PROMPTS[2]) * 2


def test_a_sliding_window_caps_the_context_length():
    """Windowed attention is not implemented; within the window full attention is the same thing."""
    from transformers import MistralConfig, Qwen2Config

    from workbench.core.model_executor.model_config import ModelConfig

    windowed = MistralConfig(sliding_window=64, max_position_embeddings=512, architectures=["MistralForCausalLM"])
    assert ModelConfig.from_hf(windowed).context_len == 64
    assert ModelConfig.from_hf(windowed, context_length=32).context_len == 32
    off = Qwen2Config(sliding_window=64, use_sliding_window=False, max_position_embeddings=512)
    assert ModelConfig.from_hf(off).context_len == 512
    assert ModelConfig.from_hf(MistralConfig(sliding_window=None, max_position_embeddings=512)).context_len == 512
