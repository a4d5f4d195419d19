"""conftest.hf_greedy, the transformers reference the e2e tests compare the engine's greedy tokens with: given
the engine's tokens as a hint it checks them in one forward (teacher forcing) and still returns exactly
transformers' `generate` output, whatever the hint holds (right, wrong from some token on, short, empty)."""

from __future__ import annotations

import pytest
import torch
from conftest import _HF_MEMO, _hf_greedy_uncached, hf_greedy
from tiny_models import TINY_VOCAB_SIZE as V
from tiny_models import make_tiny_llama
from transformers import AutoModelForCausalLM

PROMPTS = [[5, 17, 99, 3], [200, 201, 202, 203, 204, 205, 206, 207, 208, 209, 10, 11], [42]]
NEW = 12


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    m = AutoModelForCausalLM.from_pretrained(make_tiny_llama(tmp_path_factory.mktemp("m")), dtype=torch.float32)
    m.generation_config.eos_token_id = None  # generate exactly NEW tokens, as the hf_model fixture does
    m.generation_config.pad_token_id = 0
    yield m.eval()
    for key in [k for k in _HF_MEMO if k[0] == id(m)]:  # the memo is keyed by id(): a later model may reuse it
        del _HF_MEMO[key]


def generate(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        return model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()


def count_forwards(model) -> list[int]:
    calls: list[int] = []
    model.model.register_forward_hook(lambda *_: calls.append(1))
    return calls


def test_any_hint_gives_generates_tokens(model):
    for p in PROMPTS:
        ref = generate(model, p, NEW)
        assert len(ref) == NEW
        wrong_at_7 = ref[:7] + [(ref[7] + 1) % V] + ref[8:]
        hints = [ref, wrong_at_7]
        if p is PROMPTS[1]:
            hints += [[], ref[:5], [(t + 3) % V for t in ref], ref + [1, 2]]
        for hint in hints:
            assert _hf_greedy_uncached(model, p, NEW, hint[:NEW]) == ref, hint


def test_a_right_hint_costs_one_forward_and_a_wrong_one_falls_back_to_generate(model):
    p = PROMPTS[1]
    ref = generate(model, p, NEW)
    calls = count_forwards(model)
    assert _hf_greedy_uncached(model, p, NEW, ref) == ref
    assert len(calls) == 1
    calls.clear()
    assert _hf_greedy_uncached(model, p, NEW, ref[:3] + [(ref[3] + 1) % V] + ref[4:]) == ref
    assert len(calls) > 1  # generate finished it from the fourth token on


def test_memoized_per_model_and_prompt(model):
    p = PROMPTS[0]
    ref = generate(model, p, NEW)
    wrong = [(t + 1) % V for t in ref]
    assert hf_greedy(model, p, NEW, hint=wrong) == ref
    assert hf_greedy(model, p, NEW - 5, hint=wrong) == ref[: NEW - 5]  # a shorter one comes from the memo
