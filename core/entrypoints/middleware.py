"""ASGI middleware of the HTTP server: the request body size limit and the API key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send
from workbench.core.entrypoints.errors import error_response

HEALTH_EXEMPT = ("/health", "/health_generate")


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, before any handler sees them.

    The body is read here (bounded) and replayed to the app, so a handler never
    meets a half-read body; later receive() calls (disconnect) pass through."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return await self.app(scope, receive, send)
        too_big = error_response(
            413, f"Request body too large (limit {self.max_bytes} bytes)", code="request_too_large"
        )
        for k, v in scope.get("headers", ()):
            if k == b"content-length":
                try:
                    if int(v) > self.max_bytes:
                        return await too_big(scope, receive, send)
                except ValueError:
                    return await error_response(400, "bad Content-Length header")(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                return await too_big(scope, receive, send)
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every route except the health checks."""

    def __init__(self, app: ASGIApp, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in HEALTH_EXEMPT:
            return await self.app(scope, receive, send)
        got = b""
        for k, v in scope.get("headers", ()):
            if k == b"authorization":
                got = v
        if not hmac.compare_digest(got, self.expected):
            msg = "Missing API key (send Authorization: Bearer <key>)" if not got else "Incorrect API key provided"
            return await error_response(401, msg, code="invalid_api_key")(scope, receive, send)
        await self.app(scope, receive, send)
