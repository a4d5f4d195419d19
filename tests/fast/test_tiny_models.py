"""Tiny random-weight Llama, Qwen2 and Mistral HF directories: our executor equals transformers."""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama, make_tiny_llama_sharded, make_tiny_mistral, make_tiny_qwen2
from transformers import AutoModelForCausalLM
from workbench.core.args import ServerArgs
from workbench.core.model_executor.model_runner import ModelRunner
from workbench.core.model_executor.offline_harness import OfflineHarness
from workbench.core.sampling.sampling_params import SamplingParams

PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 10, 11], [42]]
NEW = 24


@pytest.mark.parametrize(
    "make",
    [make_tiny_llama, make_tiny_qwen2, make_tiny_mistral, make_tiny_llama_sharded],
    ids=["llama", "qwen2", "mistral", "llama-sharded"],
)
def test_tiny_model_matches_transformers(tmp_path, make):
    model_dir = make(tmp_path / "m")
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs = []
    for p in PROMPTS:
        out = ref_model.generate(
            torch.tensor([p]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
        )
        refs.append(out[0, len(p) :].tolist())
    runner = ModelRunner(
        ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=1024, show_progress=False)
    )
    sp = SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    h = OfflineHarness(runner)
    assert [r.output_ids for r in h.generate(PROMPTS, sp)] == refs
    assert [r.output_ids for r in h.generate(PROMPTS, sp, prefix_lens=[2, 6, 0])] == refs


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    model_dir = make_tiny_llama(tmp_path / "l3", rope_scaling=scaling, max_position_embeddings=512)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = list(range(3, 120))
    ref = ref_model.generate(
        torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0
    )[0, len(prompt) :].tolist()
    runner = ModelRunner(
        ServerArgs(model_path=str(model_dir), dtype="float32", max_total_tokens=1024, show_progress=False)
    )
    out = OfflineHarness(runner).generate(
        [prompt], SamplingParams(max_new_tokens=NEW, temperature=0.0, ignore_eos=True)
    )
    assert out[0].output_ids == ref
