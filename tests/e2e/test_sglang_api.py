"""What SGLang's users send (issue #17), on a real server over the default model:

- SGLang's own frontend client (`sglang` 0.5's RuntimeEndpoint: gen, select, fork, run_batch,
  streaming), and the native API's shapes it relies on (null sampling keys, logprob entries,
  /server_info and /model_info with the values in effect).
- logit_bias (OpenAI and native), echo with max_tokens 0 (scoring a prompt), typed empty bodies,
  and /openapi.json describing bodies, answers and errors.

The test tier installs `sglang` without its dependencies (Makefile): only its frontend, which needs
requests, aiohttp, orjson, pybase64 and pillow."""

from __future__ import annotations

import re

import httpx
import pytest
from pipeline_helpers import assert_no_kv_leak, served_engine

GREEDY = {"max_new_tokens": 6, "temperature": 0.0}


@pytest.fixture(scope="module")
def served():
    # float32: these tests compare logprobs of one prompt scored on different paths (batch 1 or not,
    # cached or not) to 1e-4, which bfloat16 kernels of different shapes do not promise
    with served_engine(max_total_tokens=8192, chunked_prefill_size=64, dtype="float32") as pair:
        yield pair


def test_native_shapes_sglang_clients_read(served):
    engine, url = served
    text = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(text, add_special_tokens=False)
    with httpx.Client(base_url=url, timeout=120) as h:
        # SGLang's client sends every key it knows, unset ones as null.
        body = {"text": text, "sampling_params": dict(GREEDY, regex=None, json_schema=None, stop_regex=None, n=None)}
        got = h.post("/generate", json=body)
        assert got.status_code == 200, got.text
        assert got.json()["output_ids"] == engine.generate(prompt=text, sampling_params=GREEDY)["output_ids"]
        # ... and a feature that is not there yet is refused by name, not ignored.
        bad = h.post("/generate", json={"text": text, "sampling_params": {"stop_regex": "[0-9]+"}})
        assert bad.status_code == 400 and "'stop_regex' is not supported" in bad.json()["error"]["message"]

        # Scoring a prompt: no new tokens, output_token_logprobs [] (present), prompt logprobs from
        # logprob_start_len on as [logprob, token_id, text].
        k = 3
        scored = h.post(
            "/generate",
            json={
                "text": text,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "logprob_start_len": k,
            },
        ).json()["meta_info"]
        assert scored["output_token_logprobs"] == []
        entries = scored["input_token_logprobs"]
        assert [e[1] for e in entries] == ids[k:]
        assert [e[2] for e in entries] == [engine.tokenizer.decode([t]) for t in ids[k:]]
        assert all(isinstance(e[0], float) and e[0] <= 0 for e in entries), entries
        # the same logprobs as a full scoring from position 0 (whose first entry nothing predicts)
        full = h.post(
            "/generate",
            json={
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": 0,
            },
        ).json()["meta_info"]["input_token_logprobs"]
        assert full[0][0] is None and [e[1] for e in full] == ids and full[0][2] is None
        for a, b in zip(entries, full[k:]):
            assert abs(a[0] - b[0]) < 1e-4

        # Generated tokens carry their text too when asked.
        out = h.post(
            "/generate",
            json={
                "text": text,
                "sampling_params": GREEDY,
                "return_logprob": True,
                "return_text_in_logprobs": True,
                "top_logprobs_num": 2,
            },
        ).json()
        m = out["meta_info"]
        assert [e[1] for e in m["output_token_logprobs"]] == out["output_ids"]
        assert "".join(e[2] for e in m["output_token_logprobs"]) == out["text"]
        assert all(len(row) == 2 and isinstance(row[0][2], str) for row in m["output_top_logprobs"])

        # SGLang 0.5's route names, with the values in effect.
        for path in ("/server_info", "/get_server_info"):
            si = h.get(path).json()
            assert si["context_length"] == engine.context_len and si["chunked_prefill_size"] == 64
            assert si["attention_backend"] in ("cpu_paged", "torch_native", "triton", "flashinfer")
            assert isinstance(si["max_running_requests"], int)
        for path in ("/model_info", "/get_model_info"):
            assert h.get(path).json()["context_len"] == engine.context_len

        # No body without a content type: the health routes are empty text (as SGLang's), abort JSON.
        for path in ("/health", "/health_generate"):
            r = h.get(path)
            assert r.status_code == 200 and r.text == "" and r.headers["content-type"].startswith("text/plain")
        r = h.post("/abort_request", json={"rid": "no-such-request"})
        assert r.json() == {"success": True, "rid": "no-such-request", "abort_all": False}
    assert_no_kv_leak(engine)


def test_sglang_frontend_gen_select_fork_batch_and_stream(served):
    sgl = pytest.importorskip("sglang", reason="the test tier installs sglang (frontend only): make test-full")
    from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

    engine, url = served
    backend = RuntimeEndpoint(url)

    @sgl.function
    def complete(s, prompt):
        s += prompt + sgl.gen("out", max_tokens=6, temperature=0)

    prompt = "Once upon a time"
    ref = engine.generate(prompt=prompt, sampling_params=GREEDY)["text"]
    state = complete.run(prompt=prompt, backend=backend)
    assert state["out"] == ref

    # streaming: the same text, in pieces
    stream = complete.run(prompt=prompt, backend=backend, stream=True)
    assert "".join(stream.text_iter(var_name="out")) == ref

    # run_batch: each state as its own run
    prompts = ["Once upon a time", "The capital of France is", "1, 2, 3,"]
    states = complete.run_batch([{"prompt": p} for p in prompts], backend=backend)
    assert [st["out"] for st in states] == [engine.generate(prompt=p, sampling_params=GREEDY)["text"] for p in prompts]

    # select: prompt logprobs of each choice (max_new_tokens 0, logprob_start_len, token texts)
    @sgl.function
    def choose(s):
        s += "Q: What colour is the sky on a clear day?\nA: The sky is"
        s += sgl.select("colour", choices=[" blue", " purple with green stripes"])

    picked = choose.run(backend=backend)
    assert picked["colour"] in (" blue", " purple with green stripes")
    meta = picked.get_meta_info("colour")
    assert len(meta["normalized_prompt_logprobs"]) == 2 and len(meta["input_token_logprobs"]) == 2

    # fork: two branches from one prefix, each generating
    @sgl.function
    def branches(s):
        s += "A list of fruits:"
        forks = s.fork(2)
        for i, f in enumerate(forks):
            f += f" {i + 1}." + sgl.gen("item", max_tokens=4, temperature=0)
        forks.join()
        s += "done"

    fb = branches.run(backend=backend)
    assert fb.text().endswith("done")

    # constrained gen: a regex and a dtype (which SGLang's client sends as a regex)
    @sgl.function
    def constrained(s):
        s += "The year the first moon landing happened:" + sgl.gen("year", max_tokens=8, regex=r"(19|20)[0-9]{2}")
        s += "\nHow many legs has a spider?" + sgl.gen("legs", max_tokens=6, dtype=int)

    got = constrained.run(backend=backend)
    assert re.fullmatch(r"(19|20)[0-9]{2}", got["year"]), got["year"]
    assert re.fullmatch(r"[-+]?[0-9]+", got["legs"].strip()), got["legs"]
    assert_no_kv_leak(engine)


def test_logit_bias_steers_greedy_choices_and_leaves_logprobs_unbiased(served):
    """logit_bias (OpenAI and native): +100 on a token makes greedy pick it; -100 on the greedy
    token makes it pick the runner-up, which is what the unbiased top-2 logprobs said."""
    openai = pytest.importorskip("openai")
    engine, url = served
    prompt = "The capital of France is"
    plain = engine.generate(
        prompt=prompt, sampling_params={"max_new_tokens": 1, "temperature": 0}, return_logprob=True, top_logprobs_num=2
    )
    (top1_lp, top1, _), (top2_lp, top2, _) = plain["meta_info"]["output_top_logprobs"][0]
    assert plain["output_ids"] == [top1] and top1_lp > top2_lp

    forced = 1234
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(
        model="smollm2-135m", prompt=prompt, max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    with httpx.Client(base_url=url, timeout=120) as h:
        native = h.post(
            "/generate",
            json={
                "text": prompt,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0, "logit_bias": {str(forced): 100}},
            },
        ).json()
        assert native["output_ids"] == [forced] * 3
        assert out.choices[0].text == native["text"]
        avoid = h.post(
            "/generate",
            json={
                "text": prompt,
                "return_logprob": True,
                "sampling_params": {"max_new_tokens": 1, "temperature": 0, "logit_bias": {str(top1): -100}},
            },
        ).json()
    assert avoid["output_ids"] == [top2]
    # the reported logprob is the model's own, not the biased one
    assert abs(avoid["meta_info"]["output_token_logprobs"][0][0] - top2_lp) < 1e-4
    # a batch mixing biased and plain rows: the plain row is untouched
    both = engine.generate(
        prompt=[prompt, prompt],
        sampling_params=[
            {"max_new_tokens": 1, "temperature": 0, "logit_bias": {forced: 100}},
            {"max_new_tokens": 1, "temperature": 0},
        ],
    )
    assert [b["output_ids"] for b in both] == [[forced], [top1]]
    assert_no_kv_leak(engine)


def test_echo_with_max_tokens_0_scores_the_prompt(served):
    """OpenAI completions, echo=true, max_tokens=0, logprobs (lm-eval's loglikelihood request):
    the prompt back with its tokens' logprobs, nothing generated; streamed too. Without echo,
    max_tokens 0 is still a 400 that says what 0 is for."""
    openai = pytest.importorskip("openai")
    engine, url = served
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    ref = engine.generate(
        input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
    )["meta_info"]["input_token_logprobs"]
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == prompt and len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    for got, (lp, _, _) in zip(choice.logprobs.token_logprobs[1:], ref[1:]):
        assert abs(got - lp) < 1e-4
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)

    chunks = list(
        client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0, echo=True, logprobs=1, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == prompt

    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="smollm2-135m", prompt=prompt, max_tokens=0)
    assert_no_kv_leak(engine)


def test_openapi_describes_bodies_answers_and_errors(served):
    """/openapi.json, generated from the models that validate the requests: each POST route's
    request body, its JSON and SSE answers, plain-text routes typed, the error envelope on the
    statuses a client can get, and every $ref resolving."""
    engine, url = served
    with httpx.Client(base_url=url, timeout=60) as h:
        doc = h.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]

    def resolve(node):
        if isinstance(node, dict):
            if "$ref" in node:
                name = node["$ref"].rsplit("/", 1)[-1]
                assert node["$ref"] == f"#/components/schemas/{name}" and name in schemas, node["$ref"]
            for v in node.values():
                resolve(v)
        elif isinstance(node, list):
            for v in node:
                resolve(v)

    resolve(doc)
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/ChatCompletionRequest")
    assert "messages" in schemas["ChatCompletionRequest"]["properties"]
    ok = chat["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ChatCompletionResponse") and "text/event-stream" in ok
    for status in ("400", "404", "408", "413", "422", "503"):  # 422: a wrong type, a missing or unknown field
        assert chat["responses"][status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "HTTPValidationError" not in schemas  # FastAPI's own 422 shape is never sent
    assert "401" not in chat["responses"]  # this server has no --api-key: it never answers 401
    assert schemas["ChatCompletionRequest"]["properties"]["messages"]["minItems"] == 1  # the ranges it checks
    gen = doc["paths"]["/generate"]["post"]
    assert gen["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/GenerateReqInput")
    assert "sampling_params" in schemas["GenerateReqInput"]["properties"]
    assert list(doc["paths"]["/health"]["get"]["responses"]["200"]["content"]) == ["text/plain"]
    assert "401" not in doc["paths"]["/health"]["get"]["responses"]
    models = doc["paths"]["/v1/models"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert models["$ref"].endswith("/ModelList")
