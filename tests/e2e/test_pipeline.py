"""The serving pipeline end to end: Engine -> TokenizerManager -> Scheduler -> Detokenizer, real model."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from conftest import chat_ids, hf_greedy
from pipeline_helpers import assert_no_kv_leak, drain_events
from reliability_helpers import wait_for
from workbench.core.engine import Engine
from workbench.core.trace import events as ev

NEW = 16
GREEDY = {"max_new_tokens": NEW, "temperature": 0.0, "ignore_eos": True}
TOPICS = [
    "the ocean",
    "volcanoes",
    "a robot",
    "tea",
    "chess",
    "winter",
    "bees",
    "the moon",
    "a library",
    "trains",
    "jazz",
    "mountains",
    "bread",
    "a lighthouse",
    "maps",
    "clocks",
]
SYSTEM = (
    "You are a careful assistant for a course on computer systems. Answer briefly and plainly. "
    "The course covers operating systems, memory hierarchies, caches, schedulers, networking, "
    "compilers, databases and the serving of large language models on many machines. "
) * 3


@pytest.fixture(scope="module")
def engine(default_prepared):
    with Engine(dtype="float32", max_total_tokens=8192, show_progress=False) as e:
        yield e


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [chat_ids(tokenizer, f"Write two sentences about {t}.") for t in TOPICS]


@pytest.fixture(scope="module")
def reference(prompts, hf_model):
    """reference(outs, first): transformers' greedy continuations of prompts[first:first + len(outs)]. The
    engine's tokens `outs` are hf_greedy's hint: one forward per prompt checks them instead of `generate`'s
    16 (this file's set-up took 54 s in CI); tokens that are not transformers' argmax are replaced by its own."""

    def ref(outs: list[list[int]], first: int = 0) -> list[list[int]]:
        return [hf_greedy(hf_model, p, NEW, hint=o) for p, o in zip(prompts[first:], outs)]

    return ref


def test_concurrent_requests_equal_alone_and_transformers(engine, prompts, reference):
    with cf.ThreadPoolExecutor(16) as pool:
        outs = list(pool.map(lambda p: engine.generate(input_ids=p, sampling_params=GREEDY), prompts))
    assert [o["output_ids"] for o in outs] == reference([o["output_ids"] for o in outs])
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts[:2]]
    assert alone == reference(alone)
    for o in outs:
        m = o["meta_info"]
        assert m["completion_tokens"] == NEW and m["finish_reason"]["type"] == "length"
        assert m["prompt_tokens"] > 0 and m["ttft"] is not None and m["e2e_latency"] >= m["ttft"]
    assert_no_kv_leak(engine)


def test_batch_api_and_n(engine, prompts, reference):
    outs = engine.generate(input_ids=prompts[:3], sampling_params=GREEDY)
    assert [o["output_ids"] for o in outs] == reference([o["output_ids"] for o in outs])
    # n copies get seeds 7, 8, 9. top_k keeps the draw away from the float-noise-sensitive tail,
    # so a rerun (different batch shapes, prefix now cached) reproduces the same tokens.
    sp = {"max_new_tokens": 8, "temperature": 1.0, "top_k": 20, "n": 3, "seed": 7}
    many = engine.generate(prompt="Tell me a color:", sampling_params=sp)
    assert len(many) == 3 and len({tuple(o["output_ids"]) for o in many}) >= 2
    again = engine.generate(prompt="Tell me a color:", sampling_params=sp)
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in many]
    assert_no_kv_leak(engine)


def test_shared_prefix_hits_the_radix_cache(engine, tokenizer):
    engine.flush_cache()
    sub = engine.subscribe(with_snapshot=False)
    try:
        a = engine.generate(input_ids=chat_ids_sys(tokenizer, "What is a cache?"), sampling_params=GREEDY)
        b_ids = chat_ids_sys(tokenizer, "What is a scheduler?")
        b = engine.generate(input_ids=b_ids, sampling_params=GREEDY)
        events = drain_events(sub)
    finally:
        sub.close()
    assert a["meta_info"]["cached_tokens"] == 0
    cached = b["meta_info"]["cached_tokens"]
    assert cached > 100, cached
    rid = b["meta_info"]["id"]
    scheduled = [e for e in events if isinstance(e, ev.ReqScheduled) and e.rid == rid]
    assert scheduled and scheduled[0].prefix_hit == cached
    assert sum(e.extend_len for e in scheduled) == len(b_ids) - cached  # only the rest is computed
    match = [e for e in events if isinstance(e, ev.CacheMatch) and e.rid == rid]
    assert match and match[0].matched == cached
    assert_no_kv_leak(engine)


def chat_ids_sys(tokenizer, question: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        add_generation_prompt=True,
        tokenize=True,
    )
    return list(ids["input_ids"] if not isinstance(ids, list) else ids)


def test_streaming_matches_non_streaming(engine, prompts, reference):
    chunks = list(engine.generate(input_ids=prompts[0], sampling_params=GREEDY, stream=True))
    assert [chunks[-1]["output_ids"]] == reference([chunks[-1]["output_ids"]])
    assert "".join(c["delta"] for c in chunks) == chunks[-1]["text"]
    whole = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)
    assert whole["text"] == chunks[-1]["text"]


def test_stop_string_and_stop_token(engine, tokenizer):
    base = engine.generate(prompt="1, 2, 3, 4,", sampling_params={"max_new_tokens": 12, "temperature": 0})
    text = base["text"]
    assert len(text) > 4
    stop = text[2:4]
    out = engine.generate(
        prompt="1, 2, 3, 4,", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop": [stop]}
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    tok = base["output_ids"][2]
    out2 = engine.generate(
        prompt="1, 2, 3, 4,", sampling_params={"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [tok]}
    )
    assert out2["output_ids"][-1] == tok and out2["meta_info"]["finish_reason"]["matched"] == tok


def test_abort_frees_kv(engine, prompts):
    stream = engine.generate(
        input_ids=prompts[1], sampling_params={"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}, stream=True
    )
    got = []
    for chunk in stream:
        got.append(chunk)
        if len(chunk["output_ids"]) >= 3:
            engine.abort_request(chunk["meta_info"]["id"])
    assert got[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(got[-1]["output_ids"]) < 400
    assert_no_kv_leak(engine)


def test_bad_input_is_rejected_and_others_unaffected(engine, prompts, reference):
    with pytest.raises(ValueError, match="temperature"):
        engine.generate(prompt="hi", sampling_params={"temperature": -1})
    with pytest.raises(ValueError, match="unknown sampling parameter"):
        engine.generate(prompt="hi", sampling_params={"max_tokens": 3})
    with pytest.raises(ValueError, match="context length"):
        engine.generate(input_ids=[1] * 9000, sampling_params={"max_new_tokens": 4})
    out = engine.generate(input_ids=prompts[0], sampling_params=GREEDY)["output_ids"]
    assert [out] == reference([out])


def test_logprobs_through_the_engine(engine, prompts):
    out = engine.generate(
        input_ids=prompts[0],
        sampling_params={"max_new_tokens": 4, "temperature": 0},
        return_logprob=True,
        top_logprobs_num=3,
        logprob_start_len=0,
    )
    m = out["meta_info"]
    assert len(m["output_token_logprobs"]) == len(out["output_ids"])
    for (lp, tid, _), top in zip(m["output_token_logprobs"], m["output_top_logprobs"]):
        assert top[0][1] == tid and abs(top[0][0] - lp) < 1e-5  # greedy: the chosen token is the top one
    assert len(m["input_token_logprobs"]) == len(prompts[0]) and m["input_token_logprobs"][0][0] is None
    tops = m["input_top_logprobs"]  # SGLang's: top_logprobs_num entries per prompt position, None at 0
    assert len(tops) == len(prompts[0]) and tops[0] is None and all(len(t) == 3 for t in tops[1:])
    for (lp, tid, _), top in zip(m["input_token_logprobs"][1:], tops[1:]):
        assert top[0][0] >= lp - 1e-5 and (top[0][1] != tid or abs(top[0][0] - lp) < 1e-5)


def test_max_new_tokens_zero_is_prefill_only_with_the_same_prompt_logprobs(engine, prompts):
    """Scoring a prompt (lm-eval style: max_tokens=0 + logprobs) generates nothing."""
    kw = dict(input_ids=prompts[1], return_logprob=True, logprob_start_len=0)
    scored = engine.generate(sampling_params={"max_new_tokens": 0}, **kw)
    assert scored["output_ids"] == [] and scored["text"] == ""
    m = scored["meta_info"]
    assert m["completion_tokens"] == 0 and m["finish_reason"]["type"] == "length"
    ref = engine.generate(sampling_params={"max_new_tokens": 1, "temperature": 0}, **kw)["meta_info"]
    assert len(m["input_token_logprobs"]) == len(prompts[1])
    for (a, ta, _), (b, tb, _) in zip(m["input_token_logprobs"][1:], ref["input_token_logprobs"][1:]):
        assert ta == tb and abs(a - b) < 1e-4
    assert_no_kv_leak(engine)


def test_step_gate_runs_exactly_one_iteration(engine, prompts):
    engine.step_gate("pause")
    try:
        fut = cf.ThreadPoolExecutor(1).submit(
            engine.generate, input_ids=prompts[2], sampling_params={"max_new_tokens": 5, "temperature": 0}
        )
        # Step only once the request is queued: a step with nothing to run is answered at once.
        wait_for(lambda: engine.get_internal_state()["num_waiting"] == 1, 30, "the request to reach the scheduler")
        first = engine.step_gate("step")
        second = engine.step_gate("step")
        assert second["step"] == first["step"] + 1 and second["paused"]
        assert engine.get_internal_state()["num_running"] == 1
    finally:
        engine.step_gate("resume")
    assert fut.result(timeout=60)["meta_info"]["completion_tokens"] == 5


def test_final_cache_tree_is_published_once_idle(engine, prompts):
    """Tree snapshots are rate-limited; the last change of a burst must still go out when idle."""
    assert engine.flush_cache()
    sub = engine.subscribe(with_snapshot=False, name="tree-watcher")
    try:
        prompt = prompts[5]
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 3, "temperature": 0})
        # While running, the prompt's nodes are locked (protected); only a snapshot taken after
        # the request finished shows them unlocked.
        events = drain_events(
            sub,
            until=lambda evs: any(
                isinstance(e, ev.CacheTree) and e.protected_size == 0 and e.evictable_size >= len(prompt) for e in evs
            ),
            timeout=15,
        )
    finally:
        sub.close()
    final = [e for e in events if isinstance(e, ev.CacheTree)]
    assert final and final[-1].protected_size == 0 and final[-1].evictable_size >= len(prompt)


def test_requests_sharing_an_uncached_prefix_compute_it_once(engine, tokenizer):
    """In-batch prefix caching: 8 requests (the same 512-token prefix + 32 tokens of their own) queued
    together; one computes the prefix, the other 7 wait a step and read it from the radix cache."""
    prefix = tokenizer.encode(SYSTEM * 4, add_special_tokens=False)[:512]
    assert len(prefix) == 512
    suffixes = [
        tokenizer.encode(
            f"{t.split()[-1].capitalize()}! Write two sentences about {t}, plainly and "
            f"briefly, for a curious reader who is new to the subject and wants the main "
            f"idea first, then one detail.",
            add_special_tokens=False,
        )[:32]
        for t in TOPICS[:8]
    ]
    assert all(len(s) == 32 for s in suffixes) and len({s[0] for s in suffixes}) == 8
    prompts = [prefix + s for s in suffixes]
    engine.flush_cache()
    alone = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
    engine.flush_cache()
    sub = engine.subscribe(with_snapshot=False)
    engine.step_gate("pause")  # queue all 8 before the scheduler admits any of them
    try:
        fut = cf.ThreadPoolExecutor(1).submit(engine.generate, input_ids=prompts, sampling_params=GREEDY)
        wait_for(lambda: engine.get_internal_state()["num_waiting"] == 8, 30, "the 8 requests to be queued")
    finally:
        engine.step_gate("resume")
    outs = fut.result(timeout=300)
    events = drain_events(sub)
    sub.close()
    assert [o["output_ids"] for o in outs] == alone
    # The first admitted matched nothing; each of the others matched the whole shared prefix (its
    # first own token differs from everyone else's, so the match stops exactly at 512).
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0] + [512] * 7
    assert sum(o["meta_info"]["cached_tokens"] for o in outs) == 7 * 512
    held = [e for e in events if isinstance(e, ev.QueueState) and e.held]
    assert held and len(held[0].held) == 7 and len({h.waits_for for h in held[0].held}) == 1
    first = held[0].held[0].waits_for
    assert {h.rid for h in held[0].held} | {first} == {o["meta_info"]["id"] for o in outs}
    assert all(h.shared_tokens == 512 for h in held[0].held)
    assert_no_kv_leak(engine)
