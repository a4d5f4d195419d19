"""End-to-end part of tests/fast/test_cpu_prefix_attention.py (what starts processes, engines or servers, or loads the
reference model).

Grouped (cascade) decode attention: requests sharing a prefix of KV slots attend over it once.

The grouped kernel is checked against float32 attention computed request by request, over one
group, several groups with outsiders, a member sharing less than the others, GQA ratios, head
sizes and dtypes; the grouping rule against its stated contract; and the model end to end: greedy
tokens of a batch sharing a system prompt's slots equal transformers'.
"""

from __future__ import annotations

import os
import shutil

import pytest
from workbench.core.layers import cpu_ops
from workbench.core.layers.attention import cpu_paged_backend

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the cpu_paged kernels cannot be built here", allow_module_level=True)


def test_shared_system_prompt_batch_matches_transformers(runner_fp32, tokenizer, hf_model, monkeypatch):
    """16 requests whose rows share a 150-token system prompt's slots, decoded together: the
    backend forms one group each step and the greedy tokens equal transformers' per prompt."""
    from conftest import hf_greedy
    from workbench.core.model_executor.offline_harness import OfflineHarness
    from workbench.core.sampling.sampling_params import SamplingParams

    system = tokenizer.encode("You are a careful assistant. " * 30, add_special_tokens=False)[:150]
    questions = [f"Question {i}: what is {i} plus {2 * i}?" for i in range(16)]
    prompts = [system + tokenizer.encode(x, add_special_tokens=False) for x in questions]
    formed = []
    real = cpu_ops.decode_prefix_groups

    def spy(*args, **kwargs):
        groups = real(*args, **kwargs)
        formed.append(None if groups is None else (groups.count, int((groups.group_of >= 0).sum())))
        return groups

    monkeypatch.setattr(cpu_ops, "decode_prefix_groups", spy)
    monkeypatch.setattr(cpu_paged_backend, "SHARED_PREFIX_DECODE", True)
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    results = OfflineHarness(runner_fp32).generate(prompts, params, prefix_lens=[len(system)] * 16, share_prefix=True)
    assert formed and all(f == (1, 16) for f in formed)  # every decode step: one group of all 16
    outs = [r.output_ids for r in results]
    assert outs == [hf_greedy(hf_model, p, 6, hint=o) for p, o in zip(prompts, outs)]  # hint: 1 forward, not 6
