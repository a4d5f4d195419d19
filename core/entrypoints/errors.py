"""OpenAI-style error responses for the HTTP server.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}`
with a status that says whose fault it is. The mapping (also in docs/http_server.md):

| what                                                        | status |
|-------------------------------------------------------------|--------|
| malformed JSON, bad values (empty messages, negative or     | 400    |
|   absurd max_tokens, prompt longer than the context, n too  |        |
|   large, invalid sampling parameters from the engine)       |        |
| missing or wrong API key                                    | 401    |
| unknown model name, unknown route                           | 404    |
| wrong HTTP method (with an `Allow` header)                  | 405    |
| request body not received within WORKBENCH_BODY_TIMEOUT_S  | 408    |
| request body over --max-request-body-bytes                  | 413    |
| wrong JSON types, missing required or unknown fields        | 422    |
| engine starting, shutting down or dead                      | 503    |

The weight-update routes (weights_api.py) add SGLang's `success: false` and `message` to
their 400s.

Anything else is a bug: the catch-all handler logs the traceback and answers a
plain 500 JSON error without it.
"""

from __future__ import annotations

import logging
import re
from http import HTTPStatus
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

logger = logging.getLogger(__name__)

# status -> OpenAI "type"
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


# Engine messages start with the parameter they are about ("top_p must be in (0, 1] ...").
_LEADING_NAME = re.compile(r"^([a-z_]+)\b")
_KNOWN_PARAMS = frozenset(
    (
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "max_new_tokens",
        "min_new_tokens",
        "n",
        "seed",
        "stop",
        "stop_token_ids",
        "input_ids",
        "top_logprobs_num",
        "sampling_params",
    )
)
_PARAM_ALIASES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


class APIError(Exception):
    """An error the server reports to the client as it is (status, message, param, code)."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        err_type: str | None = None,
    ):
        super().__init__(message)
        self.status = int(status)
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or _ERROR_TYPES.get(self.status, "invalid_request_error")

    def to_dict(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def response(self, headers: dict[str, str] | None = None) -> JSONResponse:
        return JSONResponse(self.to_dict(), status_code=self.status, headers=headers)


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The OpenAI error envelope."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    return APIError(status, message, param=param, code=code).response()


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def http_status_error(status: int, detail: Any = None, headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI-shaped body for a Starlette HTTPException (404 route, 405 method...); `headers`
    (a 405's `Allow`) are kept."""
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "error"
    message = detail if isinstance(detail, str) and detail else phrase
    code = {404: "not_found", 405: "method_not_allowed"}.get(status)
    return APIError(status, message, code=code).response(headers)


def parse_body(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON request body: not JSON is a 400 `invalid_json`, a body the model refuses
    (wrong types, missing or unknown fields) a 422 naming the first offending field."""
    try:
        return model.model_validate_json(body or b"")
    except ValidationError as e:
        errs = e.errors()
        if errs and errs[0].get("type") == "json_invalid":
            raise bad_request(f"Request body is not valid JSON: {errs[0].get('msg', '')}", code="invalid_json")
        raise validation_error(e) from None


def validation_error(exc: Exception) -> APIError:
    """A pydantic ValidationError as a 422 naming the first offending field."""
    errors = getattr(exc, "errors", None)
    items = errors() if callable(errors) else []
    if not items:
        return APIError(422, str(exc), code="invalid_request")
    first = items[0]
    loc = [str(p) for p in first.get("loc", ()) if p not in ("body",)]
    param = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        msg = f"Unrecognized request argument supplied: {param}"
    elif kind == "missing":
        msg = f"Missing required parameter: {param}"
    else:
        msg = f"Invalid value for {param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid")
    if len(items) > 1:
        others = sorted({".".join(str(p) for p in it.get("loc", ()) if p != "body") for it in items[1:]} - {""})
        named = f": {', '.join(others[:5])}" if others else ""
        msg += f" (and {len(items) - 1} more error{'s' if len(items) > 2 else ''}{named})"
    return APIError(422, msg, param=param, code=kind or "invalid_request")


def engine_error_to_api(exc: BaseException) -> APIError:
    """Map what the engine raises to a client error: ValueError -> 400, dead engine -> 503."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        msg = str(exc) or "invalid request"
        code = "context_length_exceeded" if "context length" in msg.lower() else "invalid_request"
        m = _LEADING_NAME.match(msg)
        param = _PARAM_ALIASES.get(m.group(1), m.group(1)) if m and m.group(1) in _KNOWN_PARAMS else None
        return APIError(400, msg, param=param, code=code)
    name = type(exc).__name__
    if type(exc).__module__.startswith("jinja2"):  # a chat template that fails on the request's messages
        return APIError(
            400, f"the chat template rejected the messages: {exc}", param="messages", code="invalid_request"
        )
    status = getattr(exc, "status_code", None)  # RequestFailedError: the scheduler's own answer
    if name == "RequestFailedError" and isinstance(status, int) and 400 <= status < 600:
        return APIError(status, str(exc), code="invalid_request" if status < 500 else "upstream_failed")
    if name == "EngineDeadError" or isinstance(exc, (ConnectionError,)):
        return APIError(503, f"The engine is unavailable: {exc}", code="engine_unavailable")
    logger.error("internal error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error ({name}); see the server log.", code="internal_error")
