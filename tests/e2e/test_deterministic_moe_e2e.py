"""--enable-deterministic-inference on a mixture-of-experts model at TP 1 and TP 2, and with a sliding
window (issue #43 item 6).

A tiny random Mixtral (4 experts, top 2) in bfloat16: one prompt's greedy tokens and logprobs are
bitwise the same alone, inside a batch of 6 prompts of mixed lengths (so its experts' GEMMs have
other heights) and after a prefix-cache hit; a seeded sample the same alone and batched. At
`--tp-size 2` on CPU (gloo), where the experts' intermediate size and the attention heads are split
over the ranks and the all-reduce sums them in rank order, the same (in float32 there, equal to
transformers' greedy tokens too). Without the flag the batch
comparison differs (checked, so the tests above can fail). A tiny Mistral with an 8-token window
(the 40-token prompt and its 16 new tokens run well past it) gives the same bits alone, batched and
after a cache hit (without the flag this tiny model's comparisons happen to match too, so its
can-fail check is the op-level one: tests/fast/test_batch_invariant.py). The op-level checks are in
tests/fast/test_batch_invariant_moe.py; the dense model's in tests/e2e/test_deterministic_e2e.py.
"""

from __future__ import annotations

import pytest
from tiny_models import make_tiny_family
from workbench.core.engine import Engine

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
SEEDED = {"max_new_tokens": NEW, "temperature": 0.8, "seed": 1234, "ignore_eos": True}
TARGET = list(range(10, 50))
OTHERS = [[5, 17, 99, 3], [200 + i for i in range(25)], [42], [7] * 13, [100 + i for i in range(9)]]


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    return make_tiny_family(tmp_path_factory.mktemp("det_moe") / "mixtral", "mixtral", seed=31)


def _out(result) -> tuple[list[int], list[float]]:
    return result["output_ids"], [entry[0] for entry in result["meta_info"]["output_token_logprobs"]]


def _cases(model_dir, seeded: bool = True, dtype: str = "bfloat16", **kw) -> dict[str, tuple[list[int], list[float]]]:
    """The target's (tokens, logprobs) alone, in a batch of 6, after a prefix hit (and seeded alone/batched)."""
    got = {}
    with Engine(model_path=str(model_dir), dtype=dtype, max_total_tokens=2048, show_progress=False, **kw) as engine:
        engine.flush_cache()
        got["alone"] = _out(engine.generate(input_ids=TARGET, sampling_params=GREEDY, return_logprob=True))
        engine.flush_cache()
        batch = engine.generate(input_ids=[OTHERS[0], TARGET] + OTHERS[1:], sampling_params=GREEDY, return_logprob=True)
        got["in a batch of 6"] = _out(batch[1])
        engine.flush_cache()
        # another request with the target's first 20 tokens: the target then hits the cache
        engine.generate(input_ids=TARGET[:20] + [9, 9, 9], sampling_params={"max_new_tokens": 1})
        hit = engine.generate(input_ids=TARGET, sampling_params=GREEDY, return_logprob=True)
        assert hit["meta_info"]["cached_tokens"] >= 20, hit["meta_info"]
        got["after a prefix-cache hit"] = _out(hit)
        if seeded:
            engine.flush_cache()
            got["seeded alone"] = _out(engine.generate(input_ids=TARGET, sampling_params=SEEDED, return_logprob=True))
            engine.flush_cache()
            params = [GREEDY, SEEDED] + [GREEDY] * 4
            mixed = engine.generate(
                input_ids=[OTHERS[0], TARGET] + OTHERS[1:], sampling_params=params, return_logprob=True
            )
            got["seeded in a batch of 6"] = _out(mixed[1])
    return got


def _assert_invariant(got):
    alone = got["alone"]
    assert len(alone[0]) == NEW and len(alone[1]) == NEW
    for name in ("in a batch of 6", "after a prefix-cache hit"):
        assert got[name] == alone, name


def test_moe_outputs_do_not_depend_on_batch_or_cache(mixtral_dir):
    got = _cases(mixtral_dir, enable_deterministic_inference=True)
    _assert_invariant(got)
    assert got["seeded in a batch of 6"] == got["seeded alone"]
    assert got["seeded alone"][0] != got["alone"][0]  # it did sample


def test_moe_at_tp2_outputs_do_not_depend_on_batch_or_cache(mixtral_dir):
    """Two scheduler ranks on CPU: experts split by intermediate size, heads by rank, the all-reduce
    an all-gather summed in rank order (parallel_state.set_batch_invariant_all_reduce), the
    vocab-sharded head gathered. float32, so the tokens are also transformers' greedy ones."""
    from test_tensor_parallel import hf_tokens

    got = _cases(mixtral_dir, seeded=False, dtype="float32", enable_deterministic_inference=True, tp_size=2)
    _assert_invariant(got)
    assert got["alone"][0] == hf_tokens(mixtral_dir, [TARGET])[0]


def test_without_the_flag_the_moe_batch_comparison_differs(mixtral_dir):
    """bfloat16 without the flag: the target decoding alone takes the batch-1 paths (GEMV, the fused
    decode), in a batch the GEMMs; its logprobs move (why the tests above can fail)."""
    got = _cases(mixtral_dir, seeded=False)
    assert got["in a batch of 6"] != got["alone"], "without the flag the outputs matched bitwise too"


def test_sliding_window_outputs_do_not_depend_on_batch_or_cache(tmp_path):
    model_dir = make_tiny_family(tmp_path / "mistral", "mistral_window", seed=31)
    _assert_invariant(_cases(model_dir, seeded=False, enable_deterministic_inference=True))
