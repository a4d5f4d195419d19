"""Shared fixtures: the real default model, loaded once per test session."""
from __future__ import annotations

import os

import pytest
import torch

# Tests run on 2 cores; keep torch from oversubscribing when several processes run.
torch.set_num_threads(min(2, os.cpu_count() or 1))
# Every scheduler the tests start checks its KV bookkeeping whenever it goes idle
# (core/managers/scheduler_kv_check.py); assert_no_kv_leak reads the outcome.
os.environ.setdefault("WORKBENCH_KV_INVARIANT_CHECK", "1")


@pytest.fixture(scope="session")
def default_prepared():
    from workbench.core.model_loader import prepare_model
    return prepare_model(None, progress=False)


@pytest.fixture(scope="session")
def tokenizer(default_prepared):
    from workbench.core.model_loader import load_tokenizer
    return load_tokenizer(default_prepared.model_dir)


@pytest.fixture(scope="session")
def runner_fp32(default_prepared):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner
    return ModelRunner(ServerArgs(dtype="float32", max_total_tokens=16384, show_progress=False),
                       prepared=default_prepared)


@pytest.fixture(scope="session")
def hf_model(default_prepared):
    """transformers' own Llama on the same (converted) weights: the reference."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(default_prepared.model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None   # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                        tokenize=True)
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


_HF_MEMO: dict = {}


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (memoized per session: several modules ask for the same)."""
    key = (id(model), tuple(prompt), max_new_tokens)
    if key not in _HF_MEMO:
        # A longer memoized continuation of the same prompt already contains this one.
        for (mid, p, n), toks in _HF_MEMO.items():
            if mid == id(model) and p == key[1] and n >= max_new_tokens:
                return toks[:max_new_tokens]
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
        _HF_MEMO[key] = out[0, len(prompt):].tolist()
    return _HF_MEMO[key]


def pytest_terminal_summary(terminalreporter):
    """The reliability suite's figures (collected in tests/reliability_helpers.py), when it ran."""
    import sys
    rel = sys.modules.get("reliability_helpers")
    if rel is None or not any(rel.STATS.values()):
        return
    failed = [r for key in ("failed", "error") for r in terminalreporter.stats.get(key, [])
              if any(f in r.nodeid for f in rel.RELIABILITY_FILES)]
    s = rel.STATS
    terminalreporter.write_sep("=", "Reliability")
    terminalreporter.write_line(
        f"requests {s['requests']} | faults injected {s['faults']} | fuzz cases {s['fuzz_cases']} | "
        f"unexpected outcomes {s['unexpected']} | failures {len(failed)}")
