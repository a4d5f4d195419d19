"""Hostile and malformed input: property-based fuzz of /v1/chat/completions, /v1/completions and
/generate, plus the limits table, on a real server over the real default model.

Whatever the body (wrong types, huge or negative numbers, NaN/Infinity, deep nesting,
enormous strings, invalid UTF-8, unknown fields, truncated or empty bodies), the answer
is never a 5xx: a 4xx with an OpenAI-shaped error, or a complete answer. Meanwhile a
canary keeps sending a good request whose answer must not change, and afterwards no
process has died and no KV slot or request state is left behind.

Hypothesis runs derandomized (the same examples every run) with a moderate budget;
every length-controlling field is either invalid or tiny, so valid cases generate at
most a few tokens.
"""

from __future__ import annotations

import json
import math
import threading

import httpx
import pytest
from pipeline_helpers import served_engine

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from reliability_helpers import assert_server_clean, count, fetch_reference, stream_errors  # noqa: E402

BODY_LIMIT = 128 * 1024
POOL = 4096
CHAT, CMPL, GEN = "/v1/chat/completions", "/v1/completions", "/generate"
FUZZ = settings(
    max_examples=120,
    derandomize=True,
    deadline=None,
    database=None,
    print_blob=True,
    suppress_health_check=[
        HealthCheck.too_slow,
        HealthCheck.data_too_large,
        HealthCheck.large_base_example,
        HealthCheck.function_scoped_fixture,
    ],
)


@pytest.fixture(scope="module")
def served():
    with served_engine(max_total_tokens=POOL, max_request_body_bytes=BODY_LIMIT) as pair:
        yield pair


@pytest.fixture(scope="module")
def url(served):
    return served[1]


@pytest.fixture(scope="module")
def http(url):
    with httpx.Client(base_url=url, timeout=300) as c:
        yield c


# ---------------------------------------------------------------- the canary and the after-check

CANARY_IDS = [504, 3458, 282, 4649, 314]  # any valid token ids make a prompt
CANARY_SP = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


class Canary:
    """Sends one good request after another while a test runs; every answer must equal the reference."""

    def __init__(self, url: str, reference):
        self.url, self.ref = url, reference
        self.sent, self.failures = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=300) as c:
            while not self._stop.is_set():
                r = c.post(GEN, json={"input_ids": CANARY_IDS, "sampling_params": CANARY_SP})
                self.sent += 1
                if r.status_code != 200 or tuple(r.json()["output_ids"]) != self.ref.output_ids:
                    self.failures.append(f"{r.status_code} {r.text[:300]}")

    def __enter__(self) -> Canary:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(300)
        count("requests", self.sent)


@pytest.fixture
def canary(served, url, http):
    ref = fetch_reference(http, CANARY_IDS, CANARY_SP)
    with Canary(url, ref) as c:
        yield c
    engine = served[0]
    assert not c.failures, c.failures[:5]
    assert c.sent > 0
    # Nothing crashed, nothing leaked.
    assert engine.is_healthy and all(p.is_alive() for p in engine.procs.values())
    assert_server_clean(url)


# ---------------------------------------------------------------- checking one answer

ERROR_KEYS = {"message", "type", "param", "code"}


def check_response(r: httpx.Response, stream_requested: bool) -> None:
    count("requests")
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    ctype = r.headers.get("content-type", "")
    if r.status_code >= 400:
        body = r.json()
        assert set(body["error"]) == ERROR_KEYS, body
        msg = body["error"]["message"]
        assert isinstance(msg, str) and msg and "Traceback" not in msg, body
        return
    if "text/event-stream" in ctype:
        assert stream_requested
        lines = [ln[6:] for ln in r.text.split("\n") if ln.startswith("data: ")]
        assert lines and lines[-1] == "[DONE]", r.text[-300:]
        events = [json.loads(x) for x in lines[:-1]]
        assert not stream_errors(events), stream_errors(events)
        return
    body = r.json()
    assert "choices" in body or "output_ids" in body or isinstance(body, list), body


def send(http: httpx.Client, path: str, content: bytes) -> httpx.Response:
    return http.post(path, content=content, headers={"content-type": "application/json"})


# ---------------------------------------------------------------- strategies

HUGE_TEXT = "hello " * 9000  # ~9000 tokens: over the 8192-token context
HOSTILE_NUMBERS = [
    0,
    -1,
    -7,
    2**31,
    -(2**31),
    2**63 - 1,
    2**63,
    2**64,
    -(2**63) - 1,
    10**30,
    -(10**30),
    1e308,
    -1e308,
    1e39,
    3.5e38,
    1e-45,
    1e-300,
    5e-324,
    0.5,
    -0.5,
    math.nan,
    math.inf,
    -math.inf,
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from(HOSTILE_NUMBERS),
    st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["", "\x00", "\ud800", "\u202e", "🙂" * 50, "x" * 20000]),
)
values = st.recursive(
    scalars,
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=6), kids, max_size=4),
    max_leaves=8,
)
# Anything that sets how much is generated: invalid, or at most 3 tokens. Never null or absent
# (null max_tokens means "up to the context length").
lengths = st.one_of(
    st.integers(-2, 3),
    st.sampled_from([2**31, 2**63, 10**30, -(2**63), 1e308, 0.5, math.nan, math.inf, "2", True, [], {}]),
)
prompts = st.one_of(st.text(max_size=40), st.sampled_from(["Hi", "", " ", "\x00\x01", HUGE_TEXT, "🙂🙃"]))

CHAT_FIELDS = [
    "model",
    "messages",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "stream",
    "stream_options",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
    "logit_bias",
    "user",
    "response_format",
    "tools",
    "metadata",
    "add_generation_prompt",
    "continue_final_message",
    "skip_special_tokens",
    "rid",
    "frobnicate",
    "",
]
CMPL_FIELDS = [
    f
    for f in CHAT_FIELDS
    if f
    not in ("messages", "top_logprobs", "response_format", "tools", "add_generation_prompt", "continue_final_message")
] + ["prompt", "echo", "suffix", "best_of"]
GEN_FIELDS = [
    "text",
    "input_ids",
    "sampling_params",
    "stream",
    "return_logprob",
    "top_logprobs_num",
    "logprob_start_len",
    "return_text_in_logprobs",
    "rid",
    "frobnicate",
]
SP_FIELDS = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "n",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "skip_special_tokens",
    "no_stop_trim",
    "max_tokens",
    "unknown_param",
]
LENGTH_KEYS = {"max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "max_new_tokens", "min_new_tokens"}

messages = st.one_of(
    st.builds(lambda c: [{"role": "user", "content": c}], prompts),
    st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "user", "assistant", "tool", "wizard", 1]),
                "content": st.one_of(prompts, values),
            }
        ),
        max_size=3,
    ),
    values,
)


@st.composite
def mutated(draw, base: dict, fields: list[str], nested=None) -> dict:
    """`base` with a few fields set to hostile values (length fields stay invalid-or-tiny)."""
    body = dict(base)
    for key in draw(st.lists(st.sampled_from(fields), max_size=3, unique=True)):
        if key in LENGTH_KEYS:
            body[key] = draw(lengths)
        elif nested and key in nested:
            body[key] = draw(nested[key])
        else:
            body[key] = draw(values)
    return body


def sampling_params():
    base = st.fixed_dictionaries({"max_new_tokens": lengths, "temperature": st.sampled_from([0, 0.7])})
    return base.flatmap(lambda b: mutated(b, SP_FIELDS + ["min_new_tokens"]))


def chat_bodies():
    base = st.fixed_dictionaries(
        {"messages": messages, "max_tokens": lengths, "temperature": st.sampled_from([0, 0.7]), "stream": st.booleans()}
    )
    return base.flatmap(lambda b: mutated(b, CHAT_FIELDS + ["max_completion_tokens"], {"messages": messages}))


def completion_bodies():
    prompt = st.one_of(
        prompts,
        st.lists(prompts, max_size=3),
        st.lists(st.integers(-5, 60000), max_size=6),
        st.lists(st.lists(st.integers(0, 49151), max_size=4), max_size=2),
        values,
    )
    base = st.fixed_dictionaries({"prompt": prompt, "max_tokens": lengths, "stream": st.booleans()})
    return base.flatmap(lambda b: mutated(b, CMPL_FIELDS, {"prompt": prompt}))


def generate_bodies():
    ids = st.one_of(
        st.lists(st.sampled_from([0, 1, 2, 504, 49151, 49152, -1, 2**63]), max_size=6),
        st.lists(st.lists(st.integers(0, 1000), max_size=3), max_size=3),
        values,
    )
    base = st.fixed_dictionaries(
        {
            "text": st.one_of(prompts, st.lists(prompts, max_size=3)),
            "sampling_params": st.one_of(sampling_params(), st.lists(sampling_params(), max_size=3)),
            "stream": st.booleans(),
        }
    )
    return base.flatmap(lambda b: mutated(b, GEN_FIELDS, {"input_ids": ids, "sampling_params": sampling_params()}))


@st.composite
def encoded(draw, bodies) -> tuple[bytes, bool]:
    """A body as bytes: plain JSON (NaN/Infinity allowed), or broken on purpose."""
    body = draw(bodies)
    stream = isinstance(body, dict) and body.get("stream") is True
    raw = json.dumps(body, allow_nan=True).encode()
    how = draw(st.sampled_from(["json"] * 6 + ["invalid_utf8", "deep", "truncated", "empty", "not_object"]))
    if how == "invalid_utf8":
        at = raw.find(b'"', 1)
        raw = (
            raw[: at + 1]
            + draw(st.sampled_from([b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf8\x88\x80"]))
            + raw[at + 1 :]
            if at > 0
            else b"\xff" + raw
        )
    elif how == "deep":
        depth = draw(st.sampled_from([200, 5_000, 30_000]))  # 30,000 "[" still fits the body limit
        nest = draw(st.sampled_from([b"[", b'{"a":']))
        close = b"]" if nest == b"[" else b"}"
        raw = (
            raw[:-1]
            + b', "'
            + draw(st.sampled_from([b"messages", b"prompt", b"sampling_params", b"x"]))
            + b'": '
            + nest * depth
            + b"1"
            + close * depth
            + b"}"
        )
    elif how == "truncated":
        raw = raw[: draw(st.integers(0, max(0, len(raw) - 1)))]
    elif how == "empty":
        raw = b""
    elif how == "not_object":
        raw = draw(st.sampled_from([b"[]", b"null", b"123", b'"x"', b"true", b"NaN", b"{}"]))
    return raw, stream


def run_case(http: httpx.Client, path: str, case: tuple[bytes, bool]) -> None:
    count("fuzz_cases")
    raw, stream = case
    check_response(send(http, path, raw), stream)


# ---------------------------------------------------------------- the fuzz tests


@FUZZ
@given(case=encoded(chat_bodies()))
def test_fuzz_chat_completions(http, canary, case):
    run_case(http, CHAT, case)


@FUZZ
@given(case=encoded(completion_bodies()))
def test_fuzz_completions(http, canary, case):
    run_case(http, CMPL, case)


@FUZZ
@given(case=encoded(generate_bodies()))
def test_fuzz_generate(http, canary, case):
    run_case(http, GEN, case)


# ---------------------------------------------------------------- values that overflow the sampler

# Each is a JSON number the API's types accept; several do not survive float32 (inf or 0).
EXTREME_SAMPLING = (
    [("temperature", v) for v in (1e308, 1e39, 3.5e38, 1e-30, 5e-324)]
    + [("top_p", v) for v in (1e-300, 1e-45, 5e-324)]
    + [("min_p", v) for v in (1e-300, 5e-324, 1.0)]
    + [("repetition_penalty", v) for v in (1e-300, 1e-45, 1e-39, 5e-324, 2.0)]
    + [("frequency_penalty", v) for v in (-2.0, 2.0)]
    + [("presence_penalty", v) for v in (-2.0, 2.0)]
    + [("top_k", v) for v in (1, 2**31, 2**63 - 1, 2**63)]
    + [("seed", v) for v in (2**63, 2**64 - 1, -(2**63), 2**64)]
)


@pytest.mark.parametrize("field,value", EXTREME_SAMPLING, ids=[f"{f}={v!r}" for f, v in EXTREME_SAMPLING])
def test_extreme_sampling_values_never_break_the_engine(served, http, field, value):
    engine = served[0]
    sp = {"max_new_tokens": 3, "temperature": 1.0, "min_new_tokens": 1, "ignore_eos": True, field: value}
    for path, body in (
        (GEN, {"input_ids": CANARY_IDS, "sampling_params": sp}),
        (
            CHAT,
            {
                "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 3,
                "min_tokens": 1,
                "temperature": 1.0,
                "repetition_penalty": 1.0,
                "stream": True,
                field: value,
            },
        ),
    ):
        count("fuzz_cases")
        r = http.post(path, json=body)
        check_response(r, bool(body.get("stream")))
        if r.status_code == 200 and path == GEN and not body.get("stream"):
            out = r.json()
            assert len(out["output_ids"]) == 3 and all(0 <= t < len(engine.tokenizer) for t in out["output_ids"])
    assert engine.is_healthy and all(p.is_alive() for p in engine.procs.values())


# ---------------------------------------------------------------- limits


def test_body_size_limit_is_413_with_and_without_content_length(http):
    big = json.dumps({"messages": [{"role": "user", "content": "x" * BODY_LIMIT}]}).encode()
    r = send(http, CHAT, big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
    assert str(BODY_LIMIT) in r.json()["error"]["message"]

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 16384):
            yield big[i : i + 16384]

    r = http.post(CMPL, content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413, r.text
    count("requests", 2)


def test_prompt_longer_than_the_context_is_400_stating_the_limit(served, http):
    limit = str(served[0].context_len)
    for path, body in (
        (CHAT, {"messages": [{"role": "user", "content": HUGE_TEXT}], "max_tokens": 1}),
        (CMPL, {"prompt": HUGE_TEXT, "max_tokens": 1}),
        (CMPL, {"prompt": [1] * 8200, "max_tokens": 1}),
        (GEN, {"text": HUGE_TEXT, "sampling_params": {"max_new_tokens": 1}}),
    ):
        r = http.post(path, json=body)
        count("requests")
        assert r.status_code == 400, (path, r.text)
        assert limit in r.json()["error"]["message"], r.text


M = [{"role": "user", "content": "Hi"}]
BOUNDS = [
    # (path, body, expected status, param named in the error or None)
    (CHAT, {"messages": M, "max_tokens": 1, "n": 0}, 400, "n"),
    (CHAT, {"messages": M, "max_tokens": 1, "n": 17}, 400, "n"),
    (CMPL, {"prompt": "Hi", "max_tokens": 1, "n": 10**6}, 400, "n"),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": 17}}, 400, None),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": 0}}, 400, None),
    (CHAT, {"messages": M, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"messages": M, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"messages": M, "max_tokens": 8193}, 400, "max_tokens"),
    (CMPL, {"prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    (CMPL, {"prompt": "Hi", "max_tokens": 2**63}, 400, "max_tokens"),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": -1}}, 400, None),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 10**9}}, 400, None),
    (CHAT, {"messages": M, "max_tokens": 1, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    (CHAT, {"messages": M, "max_tokens": 1, "logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    (CMPL, {"prompt": "Hi", "max_tokens": 1, "logprobs": 21}, 400, "logprobs"),
    (
        GEN,
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "top_logprobs_num": 21},
        400,
        None,
    ),
    (
        GEN,
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True, "top_logprobs_num": -1},
        400,
        None,
    ),
    # values that once reached a 500 or leaked a request state
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": []}}, 400, "sampling_params"),
    (GEN, b'{"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": Infinity}}', 400, "sampling_params"),
    (
        GEN,
        {"text": "Hi", "sampling_params": {"max_new_tokens": 1}, "logprob_start_len": 10**30},
        400,
        "logprob_start_len",
    ),
    (GEN, {"text": ["Hi"] * 300, "sampling_params": {"max_new_tokens": 1}}, 400, "text"),
    ("/get_weights_by_name", b"[" * 20_000 + b"]" * 20_000, 400, None),
    # the largest allowed values work
    (CHAT, {"messages": M, "max_tokens": 1, "n": 16}, 200, None),
    (CHAT, {"messages": M, "max_tokens": 1, "logprobs": True, "top_logprobs": 20}, 200, None),
    (CMPL, {"prompt": "Hi", "max_tokens": 1, "logprobs": 20}, 200, None),
    (GEN, {"text": "Hi", "sampling_params": {"max_new_tokens": 1, "n": 16}}, 200, None),
]


def test_n_max_tokens_and_top_logprobs_bounds(http, url):
    failures = []
    for path, body, status, param in BOUNDS:
        r = send(http, path, body) if isinstance(body, bytes) else http.post(path, json=body)
        count("requests")
        if r.status_code != status:
            failures.append(f"{path} {str(body)[:200]}: {r.status_code} != {status}: {r.text[:300]}")
        elif status == 400 and param is not None and r.json()["error"]["param"] != param:
            failures.append(f"{path} {str(body)[:200]}: param {r.json()['error']['param']!r} != {param!r}")
        elif status == 200 and path == CHAT and body.get("n"):
            assert len(r.json()["choices"]) == body["n"]
        elif status == 200 and body.get("top_logprobs"):
            assert len(r.json()["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == body["top_logprobs"]
        elif status == 200 and path == CMPL and body.get("logprobs"):
            assert len(r.json()["choices"][0]["logprobs"]["top_logprobs"][0]) == body["logprobs"]
    assert not failures, "\n".join(failures)
    assert_server_clean(url)
