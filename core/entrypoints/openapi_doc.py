"""The OpenAPI description of the server's routes (`/openapi.json`, `/docs`).

The routes read their bodies themselves (`_parse` in http_server.py) so that a bad body gets an
OpenAI-style error, not FastAPI's validation shape; FastAPI therefore sees no body models. This
module puts them back into the document, generated from the same pydantic models that validate
the requests and build the answers: each POST route's request body, its JSON answer (and its SSE
stream where it has one), the plain-text answers, and the error envelope with the statuses a
client can get (docs/http_server.md, "Errors").
"""

from __future__ import annotations

import json
from typing import Any, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
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
}
ANSWERS: dict[tuple[str, str], Any] = {
    ("/v1/models", "get"): ModelList,
    ("/v1/models/{model_id}", "get"): ModelCard,
}
TEXT_ANSWERS = {"/health", "/health_generate", "/metrics", "/flush_cache"}
OPEN_ROUTES = {"/health", "/health_generate"}  # no API key asked (middleware.py)
ERRORS = {
    400: "the request is invalid; `error.param` names the field",
    401: "missing or wrong `Authorization: Bearer` key (servers started with --api-key)",
    404: "unknown model or route",
    413: "the body is larger than --max-request-body-bytes",
    503: "the server is starting, shutting down, or its engine is unavailable",
}


def install(app: FastAPI) -> None:
    """Make `app.openapi()` (and so /openapi.json) describe the bodies and errors."""

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
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)  # FastAPI's validation shape: never sent (errors are 400s)
                ok = responses.setdefault("200", {"description": "Successful Response"})
                body = BODIES.get((path, method))
                if body is not None:
                    request_model, answer, streams = body
                    op["requestBody"] = {
                        "required": True,
                        "content": {"application/json": {"schema": ref(request_model)}},
                    }
                    ok["content"] = {"application/json": {"schema": ref(answer)}}
                    if streams:
                        ok["content"]["text/event-stream"] = {
                            "schema": {
                                "type": "string",
                                "description": "with `stream: true`: `data: <JSON answer chunk>` events, an error "
                                "event if the request fails after the headers, then `data: [DONE]`",
                            }
                        }
                elif (path, method) in ANSWERS:
                    ok["content"] = {"application/json": {"schema": ref(ANSWERS[(path, method)])}}
                elif path in TEXT_ANSWERS:
                    ok["content"] = {"text/plain": {"schema": {"type": "string"}}}
                statuses = [503]
                if path not in OPEN_ROUTES:
                    statuses.append(401)
                if method == "post":
                    statuses += [400, 413]
                if path.startswith("/v1/"):
                    statuses.append(404)
                for status in sorted(statuses):
                    responses.setdefault(str(status), {"description": ERRORS[status], **error})
        # FastAPI's validation-error schemas are unreferenced once its 422s are gone.
        for name in ("HTTPValidationError", "ValidationError"):
            if f"#/components/schemas/{name}" not in json.dumps([doc["paths"], schemas]):
                schemas.pop(name, None)
        app.openapi_schema = doc
        return doc

    app.openapi = openapi
