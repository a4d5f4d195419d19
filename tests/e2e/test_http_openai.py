"""The OpenAI-compatible and native routes on a real uvicorn server over the real default model.

One Engine per module, served over loopback from its own loop (`start_server`, the
same path `workbench serve` takes), driven with the official `openai` client; the
Engine object itself is the reference for greedy outputs.
"""

from __future__ import annotations

import json

import httpx
import pytest
from pipeline_helpers import served_engine

openai = pytest.importorskip("openai")

# Prompts whose greedy continuations have clear margins between the top two tokens
# (bf16 logits can tie; a near-tie could flip between the cached and uncached paths).
MSGS = [{"role": "user", "content": "Hi"}]
N = 5


@pytest.fixture(scope="module")
def served():
    with served_engine(max_total_tokens=8192) as pair:
        yield pair


@pytest.fixture(scope="module")
def engine(served):
    return served[0]


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def greedy_chat(engine):
    """The Engine's own greedy answer to MSGS (N tokens)."""
    ids = engine.apply_chat_template(MSGS)
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": N, "temperature": 0.0})
    return ids, out


def sse_events(resp: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in resp.iter_lines() if line.startswith("data: ")]


# ---------------------------------------------------------------- chat


def test_chat_greedy_equals_engine_and_usage_is_exact(client, greedy_chat):
    ids, ref = greedy_chat
    r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, max_tokens=N, temperature=0)
    assert r.object == "chat.completion" and len(r.choices) == 1
    ch = r.choices[0]
    assert ch.message.role == "assistant"
    assert ch.message.content == ref["text"]
    assert ch.finish_reason == ref["meta_info"]["finish_reason"]["type"]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref["output_ids"])
    assert r.usage.total_tokens == len(ids) + len(ref["output_ids"])
    # The engine already ran this prompt, so all but the last prompt token come from the cache.
    assert 0 < r.usage.prompt_tokens_details.cached_tokens < len(ids)


def test_chat_stream_concatenates_to_the_nonstreamed_text(client, url, greedy_chat):
    _, ref = greedy_chat
    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=MSGS,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref["text"]
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [ref["meta_info"]["finish_reason"]["type"]]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == len(ref["output_ids"])
    # The wire format itself: SSE content type, JSON events, [DONE] last.
    body = {"messages": MSGS, "max_tokens": 2, "temperature": 0, "stream": True}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert all(json.loads(e)["object"] == "chat.completion.chunk" for e in events[:-1])


def test_chat_n2_seed_and_extra_body_top_k(client, greedy_chat):
    ids, ref = greedy_chat
    a = client.chat.completions.create(
        model="smollm2-135m", messages=MSGS, max_tokens=4, temperature=1.0, n=2, logprobs=True
    )
    assert [c.index for c in a.choices] == [0, 1]
    # usage: the prompt counts once, every choice's tokens count
    assert a.usage.prompt_tokens == len(ids)
    assert a.usage.completion_tokens == sum(len(c.logprobs.content) for c in a.choices)
    # A seed makes sampling reproducible (one choice: seeded draws of requests batched
    # together are the engine's business, see its sampler tests).
    kw = dict(model="smollm2-135m", messages=MSGS, max_tokens=4, temperature=1.0, seed=1234)
    s1, s2 = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert s1.choices[0].message.content == s2.choices[0].message.content
    # top_k=1 through extra_body makes temperature 1.0 greedy: the engine's greedy text.
    g = client.chat.completions.create(
        model="smollm2-135m", messages=MSGS, max_tokens=N, temperature=1.0, extra_body={"top_k": 1}
    )
    assert g.choices[0].message.content == ref["text"]


def test_chat_stop_string_and_max_completion_tokens(client, greedy_chat):
    _, ref = greedy_chat
    full = ref["text"]
    words = full.split()
    assert len(words) >= 2, full
    stop = words[1]
    r = client.chat.completions.create(
        model="smollm2-135m", messages=MSGS, max_completion_tokens=N, temperature=0, stop=[stop, "zzzz-never"]
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]
    r = client.chat.completions.create(model="smollm2-135m", messages=MSGS, max_completion_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_chat_logprobs_and_top_logprobs(client, greedy_chat):
    _, ref = greedy_chat
    r = client.chat.completions.create(
        model="smollm2-135m", messages=MSGS, max_tokens=N, temperature=0, logprobs=True, top_logprobs=3
    )
    ch = r.choices[0]
    content = ch.logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(t.token for t in content) == ch.message.content == ref["text"]
    for t in content:
        assert len(t.top_logprobs) == 3
        lps = [x.logprob for x in t.top_logprobs]
        assert lps == sorted(lps, reverse=True) and all(lp <= 0 for lp in lps)
        # greedy: the chosen token is a most likely one (bf16 logits can tie)
        assert t.logprob == pytest.approx(lps[0], abs=1e-5)
        assert t.token in [x.token for x in t.top_logprobs if x.logprob == pytest.approx(lps[0], abs=1e-5)]
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token


# ---------------------------------------------------------------- completions


def test_completions_greedy_equals_engine_echo_and_logprobs(client, engine):
    prompt = "The capital of France is"
    ref = engine.generate(prompt=prompt, sampling_params={"max_new_tokens": 5, "temperature": 0.0})
    r = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=5, temperature=0)
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"]
    assert r.usage.prompt_tokens == ref["meta_info"]["prompt_tokens"]
    assert r.usage.completion_tokens == len(ref["output_ids"])
    e = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=5, temperature=0, echo=True, logprobs=2
    )
    ch = e.choices[0]
    assert ch.text == prompt + ref["text"]
    lp = ch.logprobs
    n_prompt = ref["meta_info"]["prompt_tokens"]
    assert len(lp.tokens) == n_prompt + len(ref["output_ids"]) == len(lp.token_logprobs) == len(lp.text_offset)
    assert "".join(lp.tokens) == ch.text
    assert lp.token_logprobs[0] is None and all(x is not None for x in lp.token_logprobs[1:])
    # a dict at every position but the first, prompt ones included (lm-eval reads them: issue #43)
    assert lp.top_logprobs[0] is None
    assert all(isinstance(t, dict) and len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_completions_stream_batch_and_token_ids(client, engine):
    prompts = ["One, two, three,", "Hello"]
    refs = engine.generate(prompt=prompts, sampling_params={"max_new_tokens": 4, "temperature": 0.0})
    ids = engine.tokenizer.encode("The capital of France is", add_special_tokens=False)
    r = client.completions.create(model="smollm2-135m", prompt=prompts, max_tokens=4, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == [x["text"] for x in refs]
    assert r.usage.prompt_tokens == sum(x["meta_info"]["prompt_tokens"] for x in refs)
    s = client.completions.create(
        model="smollm2-135m",
        prompt=prompts,
        max_tokens=4,
        temperature=0,
        stream=True,
        logprobs=1,
        stream_options={"include_usage": True},
    )
    texts, toks = {0: "", 1: ""}, {0: "", 1: ""}
    usage = None
    for c in s:
        for ch in c.choices:
            texts[ch.index] += ch.text
            if ch.logprobs:
                toks[ch.index] += "".join(ch.logprobs.tokens)
        usage = c.usage or usage
    assert [texts[0], texts[1]] == [x["text"] for x in refs] == [toks[0], toks[1]]
    assert usage.completion_tokens == sum(len(x["output_ids"]) for x in refs)
    t = client.completions.create(model="smollm2-135m", prompt=ids, max_tokens=3, temperature=0)
    ref_t = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 3, "temperature": 0.0})
    assert t.choices[0].text == ref_t["text"] and t.usage.prompt_tokens == len(ids)


# ---------------------------------------------------------------- native routes


def test_native_generate_health_and_info(url, engine):
    with httpx.Client(base_url=url, timeout=120) as h:
        assert h.get("/health").status_code == 200
        assert h.get("/health_generate").status_code == 200
        models = h.get("/v1/models").json()
        assert models["object"] == "list" and models["data"][0]["id"] == "smollm2-135m"
        mi = h.get("/get_model_info").json()
        assert mi["is_generation"] is True and mi["context_len"] == engine.context_len
        si = h.get("/get_server_info").json()
        assert si["served_model_name"] == "smollm2-135m" and "kv_used" in si["internal_state"]
        assert "api_key" not in si
        sp = {"max_new_tokens": 4, "temperature": 0.0}
        ref = engine.generate(prompt="Roses are", sampling_params=sp)
        got = h.post("/generate", json={"text": "Roses are", "sampling_params": sp}).json()
        assert got["text"] == ref["text"] and got["output_ids"] == ref["output_ids"]
        assert got["meta_info"]["finish_reason"]["type"] == "length"
        batch = h.post(
            "/generate",
            json={
                "input_ids": [ref["output_ids"][:2], [1, 2, 3]],
                "sampling_params": {"max_new_tokens": 2, "temperature": 0.0},
                "return_logprob": True,
                "top_logprobs_num": 2,
            },
        ).json()
        assert isinstance(batch, list) and len(batch) == 2
        assert all(len(b["meta_info"]["output_token_logprobs"]) == 2 for b in batch)
        with h.stream("POST", "/generate", json={"text": "Roses are", "sampling_params": sp, "stream": True}) as resp:
            events = sse_events(resp)
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert "".join(c["delta"] for c in chunks) == ref["text"] == chunks[-1]["text"]
        assert h.post("/flush_cache").status_code == 200
        assert h.post("/abort_request", json={"rid": "no-such-request"}).status_code == 200
