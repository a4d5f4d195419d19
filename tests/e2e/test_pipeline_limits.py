"""Chunked prefill, no radix cache, and KV pressure (retraction) give transformers' tokens (real model, one engine)."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from conftest import chat_ids, hf_greedy
from pipeline_helpers import assert_no_kv_leak, drain_events
from workbench.core.engine import Engine
from workbench.core.trace import events as ev

NEW = 12
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
LONG = (
    "The river carried the boats past the old mill, where the miller counted sacks of grain "
    "and sang to the turning wheel. "
) * 12


@pytest.fixture(scope="module")
def long_prompts(tokenizer):
    return [chat_ids(tokenizer, f"{LONG} Question {i}: what did the miller do?") for i in range(3)]


@pytest.fixture(scope="module")
def small_engine(default_prepared):
    """One engine for both areas: prompts cut in 64s, no radix cache, and a pool far too small
    for the pressure workload. (The scheduling rules themselves are tested in-process, in
    test_scheduler_inprocess.py; here the real model must give transformers' tokens through them.)"""
    with Engine(
        dtype="float32", max_total_tokens=640, chunked_prefill_size=64, disable_radix_cache=True, show_progress=False
    ) as e:
        yield e


def test_chunked_prefill_without_radix_cache(small_engine, long_prompts, hf_model):
    e = small_engine
    assert all(len(p) > 200 for p in long_prompts)
    sub = e.subscribe(with_snapshot=False)
    outs = e.generate(input_ids=long_prompts, sampling_params=GREEDY)
    events = drain_events(sub)
    sub.close()
    # transformers' greedy tokens; the engine's are hf_greedy's hint (one forward checks them, not NEW)
    reference = [hf_greedy(hf_model, p, NEW, hint=o["output_ids"]) for p, o in zip(long_prompts, outs)]
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in outs)
    again = e.generate(input_ids=long_prompts[0], sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] == 0 and again["output_ids"] == reference[0]
    chunks = [x for x in events if isinstance(x, ev.ReqScheduled)]
    assert max(c.extend_len for c in chunks) <= 64
    assert max(c.chunk_index for c in chunks) >= 3  # long prompts really were cut
    assert_no_kv_leak(e)


def test_kv_pressure_retracts_and_everything_completes(small_engine, tokenizer, hf_model):
    e = small_engine
    prompts = [chat_ids(tokenizer, f"Say something about the number {i}.") for i in range(16)]
    new = 40
    sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
    # ~16 * (40 + 40) tokens wanted at peak; the pool holds 640.
    sub = e.subscribe(with_snapshot=False)
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: e.generate(input_ids=p, sampling_params=sp), prompts))
    events = drain_events(sub)
    sub.close()
    assert all(o["meta_info"]["completion_tokens"] == new for o in outs)
    # transformers' greedy tokens; the engine's are hf_greedy's hint (one forward checks them, not 40)
    reference = [hf_greedy(hf_model, p, new, hint=o["output_ids"]) for p, o in zip(prompts[:4], outs)]
    assert [o["output_ids"] for o in outs[:4]] == reference
    assert any(isinstance(x, ev.ReqRetracted) for x in events), "expected retraction under KV pressure"
    too_big = None
    with pytest.raises(ValueError, match="KV pool"):
        too_big = e.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 700})
    assert too_big is None
    assert_no_kv_leak(e)
