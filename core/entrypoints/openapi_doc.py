"""The OpenAPI description of the server's routes (`/openapi.json`, `/docs`).

The routes read their bodies themselves (`_parse` in http_server.py) so that a bad body gets an
OpenAI-style error, not FastAPI's validation shape; FastAPI therefore sees no body models. This
module puts them back into the document, generated from the same pydantic models that validate
the requests and build the answers: each POST route's request body, its JSON answer (and its SSE
stream where it has one), the plain-text answers, and the error envelope with the statuses each
route can answer (docs/http_server.md, "Errors").

The value checks the server makes in code (a 400: `messages` not empty, `top_p` in (0, 1],
`max_tokens` within the context, ...) are written into the request schemas too (CONSTRAINTS), with
this server's own limits (--max-n, --max-top-logprobs, the context length), so a body the
description accepts is one the server does not refuse for its shape or ranges.
"""

from __future__ import annotations

import json
from typing import Any, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from workbench.core.entrypoints.native_api import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfo,
)
from workbench.core.entrypoints.openai.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from workbench.core.entrypoints.weights_api import WEIGHT_ROUTES, WeightsErrorResponse


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error, on every route: OpenAI's envelope."""

    error: ErrorDetail


class GenerateOutput(BaseModel):
    """One answer of SGLang's /generate (a batch answers a list of them; a stream sends them as
    SSE events, each with the text so far and its `delta`)."""

    text: str
    output_ids: list[int]
    meta_info: dict[str, Any]
    delta: str | None = None


class AbortOutput(BaseModel):
    success: bool
    rid: str | None = None
    abort_all: bool = False


# (path, method) -> (request model, answer model or union, streams)
BODIES: dict[tuple[str, str], tuple[type, Any, bool]] = {
    ("/v1/chat/completions", "post"): (ChatCompletionRequest, ChatCompletionResponse, True),
    ("/v1/completions", "post"): (CompletionRequest, CompletionResponse, True),
    ("/generate", "post"): (GenerateReqInput, Union[GenerateOutput, list[GenerateOutput]], True),  # noqa: UP007
    ("/abort_request", "post"): (AbortReqInput, AbortOutput, False),
    ("/tokenize", "post"): (TokenizeRequest, TokenizeResponse, False),
    ("/v1/tokenize", "post"): (TokenizeRequest, TokenizeResponse, False),
    ("/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, False),
    ("/v1/detokenize", "post"): (DetokenizeRequest, DetokenizeResponse, False),
}
ANSWERS: dict[tuple[str, str], Any] = {
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model_id}", "get"): ModelCard,
    ("/tokenizer_info", "get"): TokenizerInfo,
}
TEXT_ANSWERS = {"/health", "/health_generate", "/metrics", "/flush_cache"}
OPEN_ROUTES = {"/health", "/health_generate"}  # no API key asked (middleware.py)
ERRORS = {
    400: "the request is invalid; `error.param` names the field",
    401: "missing or wrong `Authorization: Bearer` key (servers started with --api-key)",
    404: "unknown model",
    408: "the request body did not arrive within WORKBENCH_BODY_TIMEOUT_S",
    413: "the body is larger than --max-request-body-bytes",
    422: "the body has a wrong JSON type, misses a required field or has an unknown one; `error.param` names the field",
    503: "the server is starting, shutting down, or its engine is unavailable",
}
# One event of a stream (OpenAPI before 3.2: the `schema` of text/event-stream describes each event).
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {
        "data": {
            "type": "string",
            "description": "a JSON answer chunk; an error envelope if the request fails after the headers; "
            "`[DONE]` last",
        },
    },
    "description": "with `stream: true`: `data: <JSON answer chunk>` events, an error event if the request "
    "fails after the headers, then `data: [DONE]`",
}
# Routes that answer 400 without a body: /flush_cache while requests run.
BODYLESS_400 = {"/flush_cache"}

_FLOAT32_MAX = 3.4028234663852886e38  # the sampler's numbers are float32: larger ones are refused
_SEED = {"minimum": -(1 << 63), "maximum": (1 << 64) - 1}


def constraints(
    context_len: int, max_n: int, max_top_logprobs: int, vocab_size: int | None = None
) -> dict[str, dict[str, dict]]:
    """schema name -> field -> {JSON type: keywords}: the checks the serving code makes (a 400).
    "token": the keywords of each token id in an array of them."""
    token = {"minimum": 0, **({"maximum": vocab_size - 1} if vocab_size else {})}
    num = {"maximum": _FLOAT32_MAX, "minimum": -_FLOAT32_MAX}
    common = {
        "temperature": {"number": {"minimum": 0, "maximum": _FLOAT32_MAX}},
        "top_p": {"number": {"exclusiveMinimum": 0, "maximum": 1}},
        "top_k": {"integer": {"minimum": -1, "not": {"const": 0}}},
        "min_p": {"number": {"minimum": 0, "maximum": 1}},
        "frequency_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "presence_penalty": {"number": {"minimum": -2, "maximum": 2}},
        "repetition_penalty": {"number": {"exclusiveMinimum": 0, "maximum": 2}},
        "n": {"integer": {"minimum": 1, "maximum": max_n}},
        "stop_token_ids": {"token": token},
        "min_tokens": {"integer": {"minimum": 0, "maximum": context_len}},
        "seed": {"integer": _SEED},
        "stop": {"array": {"maxItems": 16}},
        "logit_bias": {"object": {"additionalProperties": {"type": "number", "minimum": -100, "maximum": 100}}},
        "json_schema": {"string": {"minLength": 1}},
        "regex": {"string": {"minLength": 1}},
        "ebnf": {"string": {"minLength": 1}},
    }
    chat = dict(
        common,
        messages={"array": {"minItems": 1}},
        max_tokens={"integer": {"minimum": 1, "maximum": context_len}},
        max_completion_tokens={"integer": {"minimum": 1, "maximum": context_len}},
        top_logprobs={"integer": {"minimum": 0, "maximum": max_top_logprobs}},
    )
    completion = dict(
        common,
        prompt={"string": {"minLength": 1}, "array": {"minItems": 1}, "token": token},
        max_tokens={"integer": {"minimum": 0, "maximum": context_len}},
        logprobs={"integer": {"minimum": 0, "maximum": max_top_logprobs}},
    )
    for fields in (chat, completion):
        for spec in fields.values():
            if "number" in spec:
                spec["number"] = {**num, **spec["number"]}
    return {"ChatCompletionRequest": chat, "CompletionRequest": completion}


def _constrain(prop: dict, by_type: dict[str, dict]) -> None:
    """Add `by_type`'s keywords to the branch of `prop` (or its anyOf branches) of each JSON type."""
    for branch in prop.get("anyOf", [prop]):
        kind = branch.get("type")
        extra = by_type.get(kind) or (by_type.get("number") if kind == "integer" else None)
        if extra:
            branch.update(extra)
        items = branch.get("items", {}) if kind == "array" else {}
        if items.get("type") == "array":  # a list of token lists: none of them empty
            items.update(by_type.get("array", {}))
            items = items.get("items", {})
        if items.get("type") == "integer" and "token" in by_type:
            items.update(by_type["token"])


def install(app: FastAPI, api_key: bool = False) -> None:
    """Make `app.openapi()` (and so /openapi.json) describe the bodies and errors; `api_key`: the
    server asks for one (then 401s are listed)."""
    bodies = dict(BODIES)
    for path, (_method, model, answer, http_methods) in WEIGHT_ROUTES.items():
        for m in http_methods:
            bodies[(path, m.lower())] = (model, answer, False)

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: Any) -> dict:
            if getattr(model, "__origin__", None) is not None:  # Union[...] / list[...]: inline, refs inside
                from pydantic import TypeAdapter

                js = TypeAdapter(model).json_schema(ref_template="#/components/schemas/{model}")
                schemas.update(js.pop("$defs", {}))
                return js
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, d in js.pop("$defs", {}).items():
                schemas.setdefault(name, d)
            schemas[model.__name__] = js
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
        weights_error = {"content": {"application/json": {"schema": ref(WeightsErrorResponse)}}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # FastAPI's validation shape: never sent (errors are 400s)
                ok = responses.setdefault("200", {"description": "Successful Response"})
                body = bodies.get((path, method))
                if body is not None:
                    request_model, answer, streams = body
                    op["requestBody"] = {
                        "required": True,
                        "content": {"application/json": {"schema": ref(request_model)}},
                    }
                    ok["content"] = {"application/json": {"schema": ref(answer)}}
                    if streams:
                        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
                elif (path, method) in ANSWERS:
                    ok["content"] = {"application/json": {"schema": ref(ANSWERS[(path, method)])}}
                elif path in TEXT_ANSWERS:
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                statuses = [503]
                if api_key and path not in OPEN_ROUTES:
                    statuses.append(401)
                if body is not None:
                    statuses += [400, 408, 413, 422]
                elif path in BODYLESS_400:
                    statuses.append(400)
                if path.startswith("/v1/") and (method == "post" or "{" in path):
                    statuses.append(404)
                for status in sorted(statuses):
                    shape = weights_error if status == 400 and path in WEIGHT_ROUTES else error
                    responses.setdefault(str(status), {"description": ERRORS[status], **shape})
        ctx = getattr(app.state, "ctx", None)
        if ctx is not None:
            for name, fields in constraints(ctx.context_len, ctx.max_n, ctx.max_top_logprobs, ctx.vocab_size).items():
                props = schemas.get(name, {}).get("properties", {})
                for field, by_type in fields.items():
                    if field in props:
                        _constrain(props[field], by_type)
        # FastAPI's validation-error schemas are unreferenced once its 422s are gone.
        for name in ("HTTPValidationError", "ValidationError"):
            if f"#/components/schemas/{name}" not in json.dumps([doc["paths"], schemas]):
                schemas.pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
