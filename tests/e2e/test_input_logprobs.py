"""Prompt (input) logprobs as SGLang returns them, checked against transformers (issue #43, item 1).

/generate's meta_info `input_token_logprobs` and `input_top_logprobs` (return_logprob,
logprob_start_len, top_logprobs_num) and /v1/completions' `echo` with a top-logprobs dict per
prompt position, on a real server over the default model in float32, with a small chunk size so a
prompt is prefilled in several chunks, and with part of the prompt already in the prefix cache.
The reference is one transformers forward over the same prompt on the same weights."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from pipeline_helpers import assert_no_kv_leak, served_engine

CHUNK = 16  # --chunked-prefill-size: the prompts below take 3+ chunks
TOL = 2e-3  # float32 on both sides; different kernels and reduction orders
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press adapted from winemaking."
)


@pytest.fixture(scope="module")
def served():
    with served_engine(max_total_tokens=8192, chunked_prefill_size=CHUNK, dtype="float32") as pair:
        yield pair


def reference(hf_model, ids: list[int], k: int) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """transformers' logprob of each prompt token given those before it, and each position's top k."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    token = [None] + [float(lp[p - 1, ids[p]]) for p in range(1, len(ids))]
    vals, top_ids = torch.topk(lp, k, dim=-1)
    tops = [None] + [list(zip(top_ids[p - 1].tolist(), vals[p - 1].tolist())) for p in range(1, len(ids))]
    return token, tops


def check_against(meta: dict, ids: list[int], start: int, ref_token: list, ref_tops: list, k: int) -> None:
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert len(entries) == len(ids) - start and len(tops) == len(ids) - start
    assert [e[1] for e in entries] == ids[start:]
    for p, (entry, top) in enumerate(zip(entries, tops), start):
        if p == 0:
            assert entry[0] is None and top is None  # nothing predicts the first token
            continue
        assert abs(entry[0] - ref_token[p]) < TOL, (p, entry, ref_token[p])
        assert len(top) == k
        # the same top ids (a near tie may swap two neighbours) with the same values
        for (v, tid, _), (ref_id, ref_v) in zip(top, ref_tops[p]):
            assert abs(v - ref_v) < TOL, (p, top, ref_tops[p])
            assert tid == ref_id or abs(v - ref_v) < TOL
        assert max(v for v, _, _ in top) >= entry[0] - 1e-6  # the top-1 is at least the token's own


def test_prompt_logprobs_in_chunks_equal_transformers(served, hf_model):
    """A prompt of 3+ chunks, scored from position 0 and from a later position: each position's
    logprob and top-k equal transformers' (the logprob at each chunk's first token comes from the
    previous chunk's last position)."""
    engine, url = served
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) > 2 * CHUNK + 1
    k = 3
    ref_token, ref_tops = reference(hf_model, ids, k)
    with httpx.Client(base_url=url, timeout=120) as h:
        for start in (0, CHUNK + 3):
            engine.flush_cache()
            got = h.post(
                "/generate",
                json={
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 2, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": start,
                    "top_logprobs_num": k,
                },
            )
            assert got.status_code == 200, got.text
            meta = got.json()["meta_info"]
            check_against(meta, ids, start, ref_token, ref_tops, k)
            assert len(meta["output_token_logprobs"]) == 2 and len(meta["output_top_logprobs"]) == 2
    assert_no_kv_leak(engine)


def test_prompt_logprobs_with_a_cached_prefix_equal_transformers(served, hf_model):
    """Part of the prompt is in the prefix cache: positions from logprob_start_len on are computed
    anyway (the cache is used only before them), so the values equal an uncached run's; with
    logprob_start_len past the cached part the cache is still used."""
    engine, url = served
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    k = 2
    ref_token, ref_tops = reference(hf_model, ids, k)
    body = {"sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    with httpx.Client(base_url=url, timeout=120) as h:
        for start in (0, 30):
            engine.flush_cache()
            warm = h.post("/generate", json=dict(body, input_ids=ids[:24]))  # caches the first 23+ tokens
            assert warm.status_code == 200, warm.text
            got = h.post(
                "/generate",
                json=dict(body, input_ids=ids, return_logprob=True, logprob_start_len=start, top_logprobs_num=k),
            ).json()["meta_info"]
            check_against(got, ids, start, ref_token, ref_tops, k)
            if start == 30:
                assert got["cached_tokens"] >= 16, got["cached_tokens"]  # the prefix was still reused
            else:
                assert got["cached_tokens"] == 0
    assert_no_kv_leak(engine)


def test_completions_echo_gives_a_top_logprobs_dict_per_prompt_position(served, hf_model):
    """lm-eval's loglikelihood request (echo, logprobs=1, max_tokens=1) and max_tokens 0: the text
    starts with the prompt; tokens, token_logprobs, top_logprobs and text_offset cover the prompt
    (first: None) and then the completion; every top_logprobs entry after the first is a dict."""
    openai = pytest.importorskip("openai")
    engine, url = served
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    ref_token, ref_tops = reference(hf_model, ids, 2)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    for max_tokens, prompt in ((1, ids), (0, TEXT), (1, TEXT)):
        out = client.completions.create(
            model="smollm2-135m", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2, temperature=0
        )
        choice = out.choices[0]
        lp = choice.logprobs
        assert choice.text.startswith(TEXT)
        n = len(ids) + max_tokens
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
        assert "".join(lp.tokens) == choice.text
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        for p in range(1, n):
            top = lp.top_logprobs[p]
            assert isinstance(top, dict) and 1 <= len(top) <= 2, (p, top)
            if p < len(ids):
                assert abs(lp.token_logprobs[p] - ref_token[p]) < TOL
                assert abs(max(top.values()) - ref_tops[p][0][1]) < TOL
        # lm-eval's greedy check: the token equals its top-1 where the model would have picked it
        greedy = [p for p in range(1, len(ids)) if ref_tops[p][0][0] == ids[p]]
        assert greedy and all(lp.token_logprobs[p] == max(lp.top_logprobs[p].values()) for p in greedy)
        # streamed: the same entries, the prompt's in the first chunk that has any
        chunks = client.completions.create(
            model="smollm2-135m",
            prompt=prompt,
            max_tokens=max_tokens,
            echo=True,
            logprobs=2,
            temperature=0,
            stream=True,
        )
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert sum((s.tokens for s in streamed), []) == lp.tokens
        assert sum((s.text_offset for s in streamed), []) == lp.text_offset
        assert sum((s.top_logprobs for s in streamed), []) == lp.top_logprobs
    assert_no_kv_leak(engine)


def test_in_a_batch_only_the_asking_request_gets_prompt_logprobs(served, hf_model):
    """Two requests prefilled in one pass, one asking for prompt logprobs: its values equal
    transformers' (the LM head ran over its rows only) and the other's greedy tokens equal
    transformers' generate, with no prompt logprobs in its answer."""
    from conftest import hf_greedy

    engine, url = served
    asks = engine.tokenizer.encode("The quick brown fox jumps over", add_special_tokens=False)
    plain = engine.tokenizer.encode("Once upon a time", add_special_tokens=False)
    assert len(asks) + len(plain) <= CHUNK  # both fit in one prefill pass
    ref_token, ref_tops = reference(hf_model, asks, 2)
    greedy = {"max_new_tokens": 3, "temperature": 0}
    bodies = [
        {
            "input_ids": asks,
            "sampling_params": greedy,
            "return_logprob": True,
            "logprob_start_len": 0,
            "top_logprobs_num": 2,
        },
        {"input_ids": plain, "sampling_params": greedy},
    ]
    engine.flush_cache()
    with httpx.Client(base_url=url, timeout=120) as h, ThreadPoolExecutor(2) as pool:
        engine.step_gate("pause")  # both wait, then one step admits both
        try:
            futures = [pool.submit(h.post, "/generate", json=b) for b in bodies]
            time.sleep(1.0)
        finally:
            engine.step_gate("resume")
        got = [f.result().json() for f in futures]
    check_against(got[0]["meta_info"], asks, 0, ref_token, ref_tops, 2)
    assert "input_token_logprobs" not in got[1]["meta_info"]
    assert got[1]["output_ids"] == hf_greedy(hf_model, plain, 3)
    assert_no_kv_leak(engine)


def test_the_overlap_loop_gives_the_same_prompt_logprobs(hf_model):
    """The overlap scheduler (the next step scheduled while this one computes) over a chunked
    prompt: the same values as transformers'."""
    with served_engine(
        max_total_tokens=4096, chunked_prefill_size=CHUNK, dtype="float32", disable_overlap_schedule=False
    ) as (engine, url):
        ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
        ref_token, ref_tops = reference(hf_model, ids, 2)
        with httpx.Client(base_url=url, timeout=120) as h:
            got = h.post(
                "/generate",
                json={
                    "input_ids": ids,
                    "sampling_params": {"max_new_tokens": 3, "temperature": 0},
                    "return_logprob": True,
                    "logprob_start_len": 0,
                    "top_logprobs_num": 2,
                },
            ).json()["meta_info"]
        check_against(got, ids, 0, ref_token, ref_tops, 2)
        assert_no_kv_leak(engine)
