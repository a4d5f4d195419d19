"""The HTTP server's contract, without an engine: the OpenAPI description's value constraints agree
with the checks the serving code makes, and the --host warning.

For each constrained field a value just outside the documented range is refused by the same
functions the route handlers call (a 400), and the boundary value inside it passes them; so a body
the description accepts is not refused for its ranges. The live server is checked by
tests/e2e/test_http_contract_e2e.py and tests/e2e/test_schemathesis.py.
"""

from __future__ import annotations

import jsonschema
import pytest
from fastapi import FastAPI
from workbench.core.entrypoints import openapi_doc
from workbench.core.entrypoints.errors import APIError
from workbench.core.entrypoints.http_server import exposure_warning
from workbench.core.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from workbench.core.entrypoints.openai.serving_chat import chat_messages, check_chat_features
from workbench.core.entrypoints.openai.serving_common import ServingContext, sampling_params_from
from workbench.core.entrypoints.openai.serving_completions import normalize_prompts
from workbench.core.sampling.sampling_params import sampling_params_from_dict

CONTEXT, VOCAB, MAX_N, MAX_TOP = 512, 1000, 4, 5
CTX = ServingContext(
    engine=None,
    model_name="m",
    model_path="m",
    context_len=CONTEXT,
    vocab_size=VOCAB,
    max_n=MAX_N,
    max_top_logprobs=MAX_TOP,
)
M = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def doc() -> dict:
    app = FastAPI()
    app.state.ctx = CTX
    for path in ("/v1/chat/completions", "/v1/completions"):  # the doc is keyed by path

        async def route():
            return None

        app.add_api_route(path, route, methods=["POST"])
    openapi_doc.install(app)
    return app.openapi()


def description_accepts(doc: dict, name: str, body: dict) -> bool:
    schema = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    try:
        jsonschema.validate(body, schema)
    except jsonschema.ValidationError:
        return False
    return True


def server_accepts(name: str, body: dict) -> bool:
    """What the route handler checks before the engine (and the engine's own SamplingParams.verify)."""
    try:
        if name == "ChatCompletionRequest":
            req = ChatCompletionRequest.model_validate(body)
            check_chat_features(req, CTX)
            chat_messages(req)
            max_tokens = req.max_completion_tokens or req.max_tokens
            sp = sampling_params_from(req, CTX, max_tokens)
        else:
            req = CompletionRequest.model_validate(body)
            if req.logprobs is not None and not 0 <= req.logprobs <= CTX.max_top_logprobs:
                return False  # serving_completions' own check, before the prompts
            sp = sampling_params_from(req, CTX, req.max_tokens, allow_zero=bool(req.echo))
            normalize_prompts(CTX, req.prompt)
        sampling_params_from_dict(sp).normalize().verify(VOCAB, CONTEXT)
    except APIError as e:
        assert e.status == 400, e.message
        return False
    except ValueError:  # the engine's check: a 400 too
        return False
    return True


CHAT, CMPL = "ChatCompletionRequest", "CompletionRequest"
# (schema, a body the server refuses, the nearest body it takes)
CASES = [
    (CHAT, {"messages": []}, {"messages": M}),
    (CMPL, {"prompt": []}, {"prompt": [1]}),
    (CMPL, {"prompt": [[]]}, {"prompt": [[1]]}),
    (CMPL, {"prompt": [VOCAB]}, {"prompt": [VOCAB - 1]}),
    (CHAT, {"messages": M, "top_p": 0}, {"messages": M, "top_p": 1}),
    (CHAT, {"messages": M, "top_p": 1.01}, {"messages": M, "top_p": 0.01}),
    (CHAT, {"messages": M, "temperature": -0.1}, {"messages": M, "temperature": 0}),
    (CHAT, {"messages": M, "top_k": 0}, {"messages": M, "top_k": -1}),
    (CHAT, {"messages": M, "min_p": 1.5}, {"messages": M, "min_p": 1}),
    (CHAT, {"messages": M, "presence_penalty": -2.5}, {"messages": M, "presence_penalty": -2}),
    (CHAT, {"messages": M, "repetition_penalty": 0}, {"messages": M, "repetition_penalty": 2}),
    (CHAT, {"messages": M, "n": MAX_N + 1}, {"messages": M, "n": MAX_N}),
    (CHAT, {"messages": M, "max_tokens": 0}, {"messages": M, "max_tokens": 1}),
    (CHAT, {"messages": M, "max_tokens": CONTEXT + 1}, {"messages": M, "max_tokens": CONTEXT}),
    (CMPL, {"prompt": "x", "max_tokens": -1}, {"prompt": "x", "max_tokens": 0, "echo": True}),
    (
        CHAT,
        {"messages": M, "logprobs": True, "top_logprobs": MAX_TOP + 1},
        {"messages": M, "logprobs": True, "top_logprobs": MAX_TOP},
    ),
    (CMPL, {"prompt": "x", "logprobs": MAX_TOP + 1}, {"prompt": "x", "logprobs": MAX_TOP}),
    (CHAT, {"messages": M, "logit_bias": {"1": 101}}, {"messages": M, "logit_bias": {"1": 100}}),
    (CHAT, {"messages": M, "stop": ["s"] * 17}, {"messages": M, "stop": ["s"] * 16}),
    (CHAT, {"messages": M, "seed": 1 << 64}, {"messages": M, "seed": (1 << 64) - 1}),
]


@pytest.mark.parametrize("name, refused, taken", CASES, ids=[str(c[1])[:60] for c in CASES])
def test_the_description_refuses_what_the_server_refuses(doc, name, refused, taken):
    assert not server_accepts(name, refused), "the case no longer tests a refusal"
    assert server_accepts(name, taken)
    assert not description_accepts(doc, name, refused), f"the description accepts {refused}"
    assert description_accepts(doc, name, taken), f"the description refuses {taken}"


def test_every_status_a_body_route_answers_is_listed(doc):
    for path in ("/v1/chat/completions", "/v1/completions"):
        listed = set(doc["paths"][path]["post"]["responses"])
        assert {"200", "400", "404", "408", "413", "422", "503"} <= listed, (path, listed)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_hosts_get_no_warning(host):
    assert exposure_warning(host, False) is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.168.1.7", "example.org"])
def test_other_hosts_get_a_warning_that_says_what_to_do(host):
    bare = exposure_warning(host, False)
    assert bare and "--api-key" in bare and "/update_weights_from_disk" in bare and "/flush_cache" in bare
    keyed = exposure_warning(host, True)
    assert keyed and "reachable from the network" in keyed and "WITHOUT" not in keyed


def test_a_chat_template_that_fails_on_the_messages_is_a_400_not_a_500():
    import jinja2
    from workbench.core.entrypoints.errors import engine_error_to_api

    template = jinja2.Environment(undefined=jinja2.StrictUndefined).from_string("{{ messages[0].content.x }}")
    with pytest.raises(jinja2.TemplateError) as e:
        template.render(messages=[{}])
    err = engine_error_to_api(e.value)
    assert err.status == 400 and err.param == "messages" and "chat template" in err.message
