"""GGUF files of the newer families (Qwen3-MoE, Mixtral, OLMoE, Phi-3 with and without LongRoPE,
Gemma 2, Gemma 3), written the way llama.cpp's converter writes each (tests/tiny_models.py:
gguf-py's own tensor names, Q/K permuted for "llama" only, Gemma norms as 1 + w, stacked experts).

Three references: the HF checkpoint the GGUF was written from (the conversion gives back exactly its
tensors); transformers' own GGUF reader, an independent implementation of the same conventions
(where it knows the architecture); and transformers' greedy `generate` on the HF model against the
engine's on the converted one, which also checks the config rebuilt from the metadata."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_greedy_from_dir
from tiny_models import FAMILIES, GGUF_FAMILIES, make_tiny_family_gguf
from workbench.core.model_loader import prepare_model
from workbench.core.model_loader.hf_loader import iter_weights
from workbench.core.sampling.sampling_params import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9, 60, 61], [10, 11, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
NEW_TOKENS = 24
# general.architecture values transformers' GGUF reader also loads (it has no OLMoE, and reads a
# "llama" file with experts as a dense Llama)
TRANSFORMERS_READS = {"qwen3_moe", "phi3", "phi3_longrope", "gemma2", "gemma3"}


pytestmark = pytest.mark.usefixtures("cache_dir")  # a private converted-model cache (conftest.py)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-families")
    return {f: make_tiny_family_gguf(root / f"{f}.gguf", f, seed=30 + i) for i, f in enumerate(GGUF_FAMILIES)}


@pytest.mark.parametrize("family", list(GGUF_FAMILIES))
def test_a_gguf_converts_to_its_checkpoint_and_decodes_like_transformers(ggufs, family):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    from workbench.core.model_executor.offline_harness import OfflineHarness

    gguf_path, hf_dir = ggufs[family]
    prepared = prepare_model(str(gguf_path), progress=False)
    assert prepared.source == "gguf" and prepared.architecture == FAMILIES[family][1]
    ours = dict(iter_weights(prepared.model_dir, progress=False))
    reference = dict(iter_weights(hf_dir, progress=False))
    tied = {"lm_head.weight"} if prepared.config.tie_word_embeddings else set()
    assert set(ours) == set(reference) - tied
    for name, tensor in ours.items():
        assert torch.equal(tensor, reference[name]), name

    ref = hf_greedy_from_dir(hf_dir, PROMPTS, NEW_TOKENS)
    assert any(len(set(r)) > 4 for r in ref)  # not degenerate
    args = ServerArgs(model_path=str(gguf_path), dtype="float32", max_total_tokens=2048, show_progress=False)
    runner = ModelRunner(args)
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    assert [r.output_ids for r in OfflineHarness(runner).generate(PROMPTS, greedy)] == ref


@pytest.mark.parametrize("family", sorted(TRANSFORMERS_READS))
def test_transformers_own_gguf_reader_agrees_with_the_writer(ggufs, family):
    """The test GGUFs follow llama.cpp's conventions as transformers' reader understands them too (so
    the converter is not merely the writer's mirror)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_path, hf_dir = ggufs[family]
    kw = {}
    if family == "qwen3_moe":  # its reader skips qwen3moe.expert_feed_forward_length: give it the config
        kw["config"] = AutoConfig.from_pretrained(str(hf_dir))
    theirs = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32, **kw
    )
    expected = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).state_dict()
    got = theirs.state_dict()
    assert set(got) == set(expected)
    for name, tensor in got.items():
        torch.testing.assert_close(tensor, expected[name], rtol=0, atol=1e-6, msg=name)
