"""Bad requests, client disconnects and /metrics on a real server over the real default model.

Every error case answers its documented status with an OpenAI-shaped body while a
good streaming request runs alongside and still finishes; a client that goes away
(streaming or not) has its request aborted and its KV freed; /metrics parses with
prometheus_client and its counters move as requests complete.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from pipeline_helpers import served_engine

openai = pytest.importorskip("openai")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

BODY_LIMIT = 256 * 1024
M = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def served():
    with served_engine(max_total_tokens=12288, max_request_body_bytes=BODY_LIMIT) as pair:
        yield pair


@pytest.fixture(scope="module")
def url(served):
    return served[1]


def wait_for(cond, timeout=60.0, what="condition"):
    """Poll until cond() is truthy (bounds the wait; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def internal_state(url):
    return httpx.get(url + "/get_server_info", timeout=30).json()["internal_state"]


def scrape(url) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.labels.get("le"):
                out[s.name] = s.value
    return out


CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
LONG_TEXT = "hello " * 9000  # ~9000 tokens: longer than the 8192-token context

# (case, method, path, json body or raw bytes, status, param expected in the error or None)
ERROR_CASES = [
    ("malformed JSON", "POST", CHAT, b'{"messages": [', 400, None),
    ("empty body", "POST", CHAT, b"", 400, None),
    ("body is not an object", "POST", CHAT, b"[1, 2]", 422, None),
    ("messages wrong type", "POST", CHAT, {"messages": "hi"}, 422, "messages"),
    ("max_tokens wrong type", "POST", CHAT, {"messages": M, "max_tokens": "5"}, 422, "max_tokens"),
    ("stream wrong type", "POST", CHAT, {"messages": M, "stream": "yes"}, 422, "stream"),
    ("unknown field", "POST", CHAT, {"messages": M, "frobnicate": 1}, 422, "frobnicate"),
    ("missing messages", "POST", CHAT, {"model": "smollm2-135m"}, 422, "messages"),
    ("unknown role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "x"}]}, 422, None),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    (
        "image content part",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        None,
    ),
    ("negative max_tokens", "POST", CHAT, {"messages": M, "max_tokens": -1}, 400, "max_tokens"),
    ("absurd max_tokens", "POST", CHAT, {"messages": M, "max_tokens": 10**9}, 400, "max_tokens"),
    (
        "prompt longer than the context (chat)",
        "POST",
        CHAT,
        {"messages": [{"role": "user", "content": LONG_TEXT}], "max_tokens": 4},
        400,
        None,
    ),
    ("prompt longer than the context (text)", "POST", CMPL, {"prompt": LONG_TEXT, "max_tokens": 4}, 400, None),
    ("n too large", "POST", CHAT, {"messages": M, "n": 1000}, 400, "n"),
    (
        "top_logprobs too large",
        "POST",
        CHAT,
        {"messages": M, "logprobs": True, "top_logprobs": 99},
        400,
        "top_logprobs",
    ),
    ("negative temperature", "POST", CHAT, {"messages": M, "temperature": -1.0}, 400, "temperature"),
    ("top_p zero, streaming", "POST", CHAT, {"messages": M, "top_p": 0.0, "stream": True}, 400, "top_p"),
    ("unknown model", "POST", CHAT, {"messages": M, "model": "gpt-17"}, 404, "model"),
    ("unknown model (completions)", "POST", CMPL, {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("empty prompt list", "POST", CMPL, {"prompt": []}, 400, "prompt"),
    ("token id outside the vocabulary", "POST", CMPL, {"prompt": [1, 2, 10**7]}, 400, "prompt"),
    (
        "logit_bias on a token outside the vocabulary",
        "POST",
        CMPL,
        {"prompt": "x", "logit_bias": {"99999999": 5.0}},
        400,
        "logit_bias",
    ),
    ("logit_bias key not a token id", "POST", CMPL, {"prompt": "x", "logit_bias": {"a": 5.0}}, 400, "logit_bias"),
    ("logit_bias value out of range", "POST", CHAT, {"messages": M, "logit_bias": {"1": 500}}, 400, "logit_bias"),
    (
        "native: unknown sampling parameter",
        "POST",
        GEN,
        {"text": "x", "sampling_params": {"max_tokens": 3}},
        400,
        "sampling_params",
    ),
    ("native: text and input_ids", "POST", GEN, {"text": "x", "input_ids": [1]}, 400, None),
    ("native: unknown field", "POST", GEN, {"text": "x", "sampling": {}}, 422, "sampling"),
    ("abort without rid", "POST", "/abort_request", {}, 400, "rid"),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("body too large", "POST", CHAT, {"messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 10)}]}, 413, None),
]


async def _send(client: httpx.AsyncClient, method, path, body):
    if body is None:
        return await client.request(method, path)
    if isinstance(body, bytes):
        return await client.request(method, path, content=body, headers={"content-type": "application/json"})
    return await client.request(method, path, json=body)


def test_every_error_case_is_openai_shaped_while_a_good_request_streams(url):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)

        async def good():
            stream = await aclient.chat.completions.create(
                model="smollm2-135m",
                messages=M,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            chunks = [c async for c in stream]
            return chunks

        good_task = asyncio.ensure_future(good())
        async with httpx.AsyncClient(base_url=url, timeout=120) as h:
            responses = await asyncio.gather(*(_send(h, m, p, b) for _, m, p, b, _, _ in ERROR_CASES))
        return await good_task, responses

    chunks, responses = asyncio.run(main())
    failures = []
    for (case, _, _, _, status, param), r in zip(ERROR_CASES, responses):
        try:
            body = r.json()
        except ValueError:
            failures.append(f"{case}: not JSON: {r.text[:200]!r}")
            continue
        err = body.get("error") if isinstance(body, dict) else None
        if r.status_code != status:
            failures.append(f"{case}: status {r.status_code} != {status}: {body}")
        elif not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
            failures.append(f"{case}: not an OpenAI error body: {body}")
        elif not isinstance(err["message"], str) or not err["message"] or "Traceback" in err["message"]:
            failures.append(f"{case}: bad message {err['message']!r}")
        elif param is not None and err["param"] != param:
            failures.append(f"{case}: param {err['param']!r} != {param!r}")
    assert not failures, "\n".join(failures)
    # The good request was not disturbed.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert text


def test_official_client_raises_typed_errors(url):
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="no-such-model", messages=M, max_tokens=1)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="smollm2-135m", prompt="x", max_tokens=-5)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model="smollm2-135m", messages=M, extra_body={"not_a_field": 1})


def test_disconnecting_a_stream_aborts_it_and_frees_its_kv(url):
    before = scrape(url)
    body = {
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 400,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", url + CHAT, json=body, timeout=120) as resp:
        assert resp.status_code == 200
        # Keep the line iterator referenced: a generator abandoned by `break` is closed, and closing
        # it closes the connection, so the abort would race the check below.
        lines = resp.iter_lines()
        seen = 0
        while seen < 3:
            seen += next(lines).startswith("data: ")
        assert internal_state(url)["num_running"] == 1
    # Without the abort this request would run for 400 tokens; the wait is a bound, not a timing.
    wait_for(lambda: internal_state(url)["num_running"] == 0, what="the aborted request to leave the batch")
    st = internal_state(url)
    assert st["kv_used"] == 0 and st["num_waiting"] == 0
    wait_for(
        lambda: scrape(url)["sglang:num_aborted_requests_total"] > before.get("sglang:num_aborted_requests_total", 0),
        what="the abort in /metrics",
    )
    assert httpx.post(url + "/flush_cache", timeout=30).status_code == 200
    st = internal_state(url)
    assert st["kv_used"] == 0 and st["kv_evictable"] == 0 and st["kv_free"] == st["kv_total"]


def test_a_nonstreaming_client_that_times_out_is_aborted_too(url):
    before = scrape(url)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + CMPL, json=body, timeout=httpx.Timeout(30, read=1.5))

    def idle():
        st = internal_state(url)
        return st["num_running"] == 0 and st["num_waiting"] == 0 and st["kv_used"] == 0

    wait_for(idle, what="the abandoned request to be aborted and its KV freed")
    key = "sglang:num_aborted_requests_total"
    wait_for(lambda: scrape(url)[key] > before[key], what="the abort in /metrics")


REQUIRED = [
    "num_running_reqs",
    "num_queue_reqs",
    "token_usage",
    "num_used_tokens",
    "gen_throughput",
    "cache_hit_rate",
    "prompt_tokens_total",
    "generation_tokens_total",
    "cached_tokens_total",
    "num_requests_total",
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "num_retracted_reqs",
    "evicted_tokens_total",
]


def test_metrics_parse_and_counters_move(url):
    text = httpx.get(url + "/metrics", timeout=30).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for short in REQUIRED:
        name = "sglang:" + short.removesuffix("_total")
        assert name in families, f"{name} missing from /metrics"
        assert families[name].samples[0].labels["model_name"] == "smollm2-135m"
    assert families["sglang:prompt_tokens"].type == "counter"
    assert families["sglang:time_to_first_token_seconds"].type == "histogram"
    before = scrape(url)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(
        model="smollm2-135m", messages=M, max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
    )
    key = "sglang:num_requests_total"
    after = wait_for(lambda: (s := scrape(url))[key] > before[key] and s, what="the request in /metrics")
    assert after[key] == before[key] + 1
    assert after["sglang:prompt_tokens_total"] == before["sglang:prompt_tokens_total"] + r.usage.prompt_tokens
    assert after["sglang:generation_tokens_total"] == before["sglang:generation_tokens_total"] + 3
    assert after["sglang:cached_tokens_total"] == (
        before["sglang:cached_tokens_total"] + r.usage.prompt_tokens_details.cached_tokens
    )
    assert after["sglang:time_to_first_token_seconds_count"] == before["sglang:time_to_first_token_seconds_count"] + 1
    assert after["sglang:inter_token_latency_seconds_count"] == before["sglang:inter_token_latency_seconds_count"] + 2
    hit = after["sglang:cached_tokens_total"] / after["sglang:prompt_tokens_total"]
    assert after["sglang:cache_hit_rate"] == pytest.approx(hit)
    assert 0 <= after["sglang:token_usage"] <= 1


@pytest.mark.parametrize("path", [GEN, CHAT])
def test_a_disconnected_stream_leaves_no_request_state_even_without_garbage_collection(url, path):
    """A client hanging up mid-stream must release the request in the tokenizer manager at once,
    not when a garbage collection happens to free an orphaned task (the /generate stream used to
    leave one, its rid counted in num_inflight_requests, until the cycle collector ran)."""
    import gc

    body = (
        {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
        if path == GEN
        else {"messages": M, "max_tokens": 400, "ignore_eos": True}
    )
    gc.disable()  # the server runs in this process: nothing may depend on a collection
    try:
        with httpx.stream("POST", url + path, json=dict(body, stream=True), timeout=120) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            while seen < 3:
                seen += next(lines).startswith("data: ")

        def released():
            info = httpx.get(url + "/get_server_info", timeout=30).json()
            return info["num_inflight_requests"] == 0 and info["internal_state"]["num_running"] == 0

        wait_for(released, timeout=30, what="the hung-up request to leave the tokenizer manager and the batch")
    finally:
        gc.enable()
