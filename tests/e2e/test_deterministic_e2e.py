"""--enable-deterministic-inference through the Engine (default model, bfloat16, issue #43 item 6).

One prompt's greedy tokens and logprobs must be bitwise the same alone, inside a batch of 8 prompts
of mixed lengths, after a prefix-cache hit (its first tokens computed by another request), and with
its prompt prefilled in small chunks; a seeded sample (temperature 0.8) must be the same alone and
batched. Without the flag the same comparisons differ in bfloat16 (the issue's report: a cache hit
moved a top-1 logprob), which the last test checks, so these tests can fail.
The op-level checks are in tests/fast/test_batch_invariant.py.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.usefixtures("default_prepared")

TARGET = (
    "Once upon a time in a land far away there lived a king who had three daughters, and each of them "
    "wanted to rule the kingdom after him. The eldest said"
)
OTHERS = [
    "Paris is the capital of",
    "def fibonacci(n):",
    "Write a poem about the sea and the wind that carries the ships home across the grey water at dusk",
    "1, 2, 3, 4,",
    "The best way to learn a new language is to",
    "Q: What is the boiling point of water at sea level? A:",
    "Explain in two sentences why the sky is blue during the day and red at sunset.",
]
NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": NEW, "temperature": 0.8, "seed": 1234, "ignore_eos": True}


def _engine(**kw):
    from workbench import Engine

    return Engine(dtype="bfloat16", show_progress=False, **kw)


def _out(result) -> tuple[list[int], list[float]]:
    lps = [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]
    return result["output_ids"], lps


def _cases(engine, tokenizer) -> dict[str, tuple[list[int], list[float]]]:
    """The target's (tokens, logprobs) alone, in a batch, after a prefix hit, and seeded alone/batched."""
    target = tokenizer.encode(TARGET)
    others = [tokenizer.encode(t) for t in OTHERS]
    got = {}
    engine.flush_cache()
    got["alone"] = _out(engine.generate(input_ids=target, sampling_params=GREEDY, return_logprob=True))
    engine.flush_cache()
    batch = engine.generate(
        input_ids=[others[0], others[1], target] + others[2:], sampling_params=GREEDY, return_logprob=True
    )
    got["in a batch of 8"] = _out(batch[2])
    engine.flush_cache()
    # another request with the target's first 20 tokens and its own ending: the target then hits the cache
    engine.generate(input_ids=target[:20] + others[6], sampling_params={"max_new_tokens": 1}, return_logprob=False)
    hit = engine.generate(input_ids=target, sampling_params=GREEDY, return_logprob=True)
    assert hit["meta_info"]["cached_tokens"] >= 20, hit["meta_info"]
    got["after a prefix-cache hit"] = _out(hit)
    engine.flush_cache()
    got["seeded alone"] = _out(engine.generate(input_ids=target, sampling_params=SEEDED, return_logprob=True))
    engine.flush_cache()
    params = [GREEDY, SEEDED] + [GREEDY] * 6
    mixed = engine.generate(input_ids=[others[0], target] + others[1:], sampling_params=params, return_logprob=True)
    got["seeded in a batch of 8"] = _out(mixed[1])
    return got


@pytest.fixture(scope="module")
def deterministic_cases(tokenizer):
    with _engine(enable_deterministic_inference=True) as engine:
        return _cases(engine, tokenizer)


def test_greedy_tokens_and_logprobs_do_not_depend_on_batch_or_cache(deterministic_cases):
    alone = deterministic_cases["alone"]
    assert len(alone[0]) == NEW and len(alone[1]) == NEW
    for name in ("in a batch of 8", "after a prefix-cache hit"):
        assert deterministic_cases[name] == alone, name


def test_seeded_sample_does_not_depend_on_the_batch(deterministic_cases):
    assert deterministic_cases["seeded in a batch of 8"] == deterministic_cases["seeded alone"]
    assert deterministic_cases["seeded alone"][0] != deterministic_cases["alone"][0]  # it did sample


def test_chunked_prefill_gives_the_same_bits(deterministic_cases, tokenizer):
    target = tokenizer.encode(TARGET)
    assert len(target) > 3 * 8
    with _engine(enable_deterministic_inference=True, chunked_prefill_size=8) as engine:
        chunked = _out(engine.generate(input_ids=target, sampling_params=GREEDY, return_logprob=True))
    assert chunked == deterministic_cases["alone"]


def test_without_the_flag_the_same_comparisons_differ(tokenizer):
    """bfloat16 without the flag: batch-1 decode takes other kernels than a batch, and a cached prefix
    another prefill split, so some logprob moves (why the tests above can fail)."""
    with _engine() as engine:
        got = _cases(engine, tokenizer)
    alone = got["alone"]
    differs = [name for name in ("in a batch of 8", "after a prefix-cache hit") if got[name] != alone]
    assert differs, "without the flag the outputs matched bitwise too: the tests above prove nothing here"
