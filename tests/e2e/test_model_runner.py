"""The model executor against transformers on the same weights (float32, greedy)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from conftest import chat_ids, hf_greedy
from workbench.core.model_executor.offline_harness import OfflineHarness
from workbench.core.sampling.sampling_params import SamplingParams

NEW_TOKENS = 64
GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

STORY = (
    "The lighthouse keeper climbed the spiral stairs every evening, counting the steps as his "
    "father had taught him, and at the top he wound the great clockwork that turned the lamp. "
)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Eight prompts from 1 to ~1000 tokens."""
    out = [
        tokenizer.encode("Once", add_special_tokens=False)[:1],  # 1 token
        tokenizer.encode("def fibonacci(n):", add_special_tokens=False),
        chat_ids(tokenizer, "What is the capital of France?"),
        chat_ids(tokenizer, "Write a haiku about autumn leaves."),
        chat_ids(tokenizer, "Explain what a KV cache is in one paragraph."),
        tokenizer.encode(STORY * 3, add_special_tokens=False),
        chat_ids(tokenizer, "Summarize this story: " + STORY * 8),
        tokenizer.encode(STORY * 26, add_special_tokens=False)[:1000],
    ]
    assert len(out[0]) == 1 and 900 <= len(out[-1]) <= 1000
    return out


@pytest.fixture(scope="module")
def reference(prompts, hf_model):
    """reference(outs): transformers' greedy continuations of the eight prompts. The engine's tokens `outs`
    are hf_greedy's hint: one forward per prompt checks them (64 forwards of `generate` each took this
    file's set-up to 91 s in CI); tokens that are not transformers' argmax are replaced by its own."""

    def ref(outs: list[list[int]], first: int = 0) -> list[list[int]]:
        return [hf_greedy(hf_model, p, NEW_TOKENS, hint=o) for p, o in zip(prompts[first:], outs)]

    return ref


def test_one_at_a_time_matches_transformers(runner_fp32, prompts, reference):
    h = OfflineHarness(runner_fp32)
    for i, p in enumerate(prompts):
        out = h.generate([p], GREEDY)[0].output_ids
        assert [out] == reference([out], first=i)


def test_mixed_length_batch_matches_transformers(runner_fp32, prompts, reference):
    if shutil.which(os.environ.get("CC", "cc")):
        assert runner_fp32.attn_backend.name == "cpu_paged"  # the CPU default, when its kernel builds
    outs = [r.output_ids for r in OfflineHarness(runner_fp32).generate(prompts, GREEDY)]
    assert outs == reference(outs)


def test_torch_native_backend_matches_transformers(default_prepared, prompts, reference):
    # The CPU default is cpu_paged (its compiled decode kernel); torch_native is the reference
    # backend the others are checked against, so it must match transformers too.
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    runner = ModelRunner(
        ServerArgs(dtype="float32", max_total_tokens=16384, show_progress=False, attention_backend="torch_native"),
        prepared=default_prepared,
    )
    assert runner.attn_backend.name == "torch_native"
    results = OfflineHarness(runner).generate(prompts, GREEDY, prefix_lens=[len(p) // 3 for p in prompts])
    outs = [r.output_ids for r in results]
    assert outs == reference(outs)


def test_prefix_then_extension_matches_transformers(runner_fp32, prompts, reference):
    # Each prompt's first part is written to the pool first; the rest extends on top of it.
    prefix_lens = [len(p) // 2 for p in prompts]
    outs = [r.output_ids for r in OfflineHarness(runner_fp32).generate(prompts, GREEDY, prefix_lens=prefix_lens)]
    assert outs == reference(outs)


def test_logprobs_match_transformers(runner_fp32, prompts, hf_model):
    h = OfflineHarness(runner_fp32)
    prompt = prompts[2]
    res = h.generate(
        [prompt],
        SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True),
        return_logprob=True,
        top_logprobs_num=5,
    )[0]
    full = torch.tensor([prompt + res.output_ids])
    with torch.no_grad():
        logits = hf_model(full).logits[0].float()
    ref_lp = torch.log_softmax(logits, dim=-1)
    for i, tok in enumerate(res.output_ids):
        row = ref_lp[len(prompt) - 1 + i]
        assert abs(res.logprobs[i] - float(row[tok])) < 1e-3
        top_vals, top_ids = row.topk(5)
        assert [t for t, _ in res.top_logprobs[i]] == top_ids.tolist()
        assert max(abs(v - float(rv)) for (_, v), rv in zip(res.top_logprobs[i], top_vals)) < 1e-3


def test_kv_slots_all_returned(runner_fp32, prompts):
    before = runner_fp32.token_to_kv_pool_allocator.available_size()
    OfflineHarness(runner_fp32).generate(prompts[:3], SamplingParams(max_new_tokens=4, temperature=0.0))
    assert runner_fp32.token_to_kv_pool_allocator.available_size() == before
    assert runner_fp32.req_to_token_pool.available_size() == runner_fp32.req_to_token_pool.size


def test_seeded_sampling_is_reproducible(runner_fp32, prompts):
    h = OfflineHarness(runner_fp32)
    sp = SamplingParams(max_new_tokens=16, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = h.generate([prompts[3]], sp)[0].output_ids
    with_company = h.generate(
        [prompts[2], prompts[3], prompts[4]],
        [SamplingParams(max_new_tokens=16, temperature=1.0), sp, SamplingParams(max_new_tokens=16, temperature=0.7)],
    )[1].output_ids
    assert alone == with_company
