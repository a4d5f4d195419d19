"""Model families beyond Llama/Qwen2, each against transformers' greedy `generate` on a tiny
random-weight model built from its config class (no download): Qwen3 (per-head q/k norm, explicit
head_dim), Qwen3-MoE (experts with a dense layer between), Mixtral, OLMoE (whole-vector q/k norm,
clip_qkv, no top-k renormalisation). One at a time, batched, and with half of each prompt already
in the pool; every KV slot returned after."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import hf_greedy_from_dir
from tiny_models import FAMILIES, make_tiny_family
from workbench.core.sampling.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], [77, 78]]
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {f: make_tiny_family(root / f, f, seed=20 + i) for i, f in enumerate(FAMILIES)}


def _runner(model_dir, **kw):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    args = ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=4096, show_progress=False, **kw)
    return ModelRunner(args)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_tokens_equal_transformers(family_dirs, family):
    from workbench.core.model_executor.offline_harness import OfflineHarness

    ref = hf_greedy_from_dir(family_dirs[family], PROMPTS, NEW_TOKENS)
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


@pytest.mark.parametrize("family", ["mistral_window", "gemma2", "gemma3"])
def test_windowed_layers_attend_within_their_window(family_dirs, family, monkeypatch):
    """Prompts and outputs run far past the 8-token window: the masked path must be what produced the
    tokens the family test compares (windows in the right layers, used), on torch_native as on the
    default backend, and the window must matter (full attention gives other tokens)."""
    import workbench.core.layers.attention.base_attn_backend as base
    from workbench.core.layers.attention import masked_attention as ma
    from workbench.core.model_executor.offline_harness import OfflineHarness

    ref = hf_greedy_from_dir(family_dirs[family], PROMPTS, NEW_TOKENS)
    runner = _runner(family_dirs[family], attention_backend="torch_native")
    windows = [layer.self_attn.attn.sliding_window_size for layer in runner.model.model.layers]
    config = runner.model.config
    expected = [
        8 if not getattr(config, "layer_types", None) or config.layer_types[i] == "sliding_attention" else None
        for i in range(config.num_hidden_layers)
    ]
    assert windows == expected and runner.model_config.context_len == config.max_position_embeddings
    calls = []

    def counted(q, k, v, layer, fb):
        calls.append(layer.layer_id)
        return ma.masked_attention(q, k, v, layer, fb)

    monkeypatch.setattr(base, "masked_attention", counted)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    h = OfflineHarness(runner)
    assert [r.output_ids for r in h.generate(PROMPTS, greedy, prefix_lens=[len(p) // 2 for p in PROMPTS])] == ref
    windowed = {i for i, w in enumerate(windows) if w}
    assert windowed <= set(calls)
    if not getattr(config, "attn_logit_softcapping", None):
        assert set(calls) == windowed  # full layers keep the fast path when nothing is capped

    full_dir = family_dirs[family].parent / f"{family}_full"
    if not full_dir.exists():
        shutil.copytree(family_dirs[family], full_dir)
        cfg = json.loads((full_dir / "config.json").read_text())
        cfg["sliding_window"] = 4096
        (full_dir / "config.json").write_text(json.dumps(cfg))
    assert hf_greedy_from_dir(full_dir, PROMPTS, NEW_TOKENS) != ref  # the window changes these outputs


def test_attend_masks_causally_and_by_window():
    """The explicit-score kernel against a brute-force loop over (query, key) pairs."""
    from workbench.core.layers.attention.masked_attention import attend

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(5, 4, 8, generator=g), torch.randn(11, 2, 8, generator=g), torch.randn(11, 2, 8, generator=g)
    out = attend(q, k, v, first_pos=6, scale=0.3, window=4, cap=2.0)
    for i in range(5):
        p = 6 + i
        for h in range(4):
            keys = [j for j in range(11) if j <= p and p - j < 4]
            s = torch.stack([torch.tanh(0.3 * (q[i, h] @ k[j, h // 2]) / 2.0) * 2.0 for j in keys])
            want = (torch.softmax(s, 0).unsqueeze(1) * v[keys, h // 2]).sum(0)
            torch.testing.assert_close(out[i, h], want)
