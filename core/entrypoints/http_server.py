"""The HTTP server: OpenAI-compatible routes, SGLang's native routes and /metrics.

`create_app(engine, server_args)` builds the FastAPI app on top of a running
Engine; `launch_server(server_args)` is `workbench serve`: it binds the port
first (a port in use is a one-line error before any model loads), answers 503
while the engine starts, then runs uvicorn ON THE ENGINE'S LOOP
(`engine.loop`, the thread that owns the TokenizerManager) so handlers await
`engine.async_generate` with no cross-thread bridging. The main thread only
waits for signals: SIGTERM/SIGINT stop accepting ("draining N request(s)"),
let in-flight requests finish for `DRAIN_S` (env WORKBENCH_DRAIN_S, default
20 s; a second signal ends the wait), then stop the ones still running with an
error (an in-band SSE error event for streams, a 503 otherwise; KV freed), shut
the engine down and exit 0 when every request finished, 3 when some were stopped. If a child process dies, in-flight requests fail
with 503 `engine_unavailable`, /health answers 503 for `ENGINE_DEAD_GRACE_S`,
and the process exits 1.

Run: `python -m workbench.core.entrypoints.http_server --port 30000 [--model PATH] [--api-key K]`
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from workbench.core.args import ServerArgs
from workbench.core.entrypoints import openapi_doc
from workbench.core.entrypoints.errors import (
    APIError,
    bad_request,
    engine_error_to_api,
    error_response,
    http_status_error,
    parse_body,
    validation_error,
)
from workbench.core.entrypoints.metrics import ServerMetrics
from workbench.core.entrypoints.middleware import APIKeyMiddleware, BodyLimitMiddleware
from workbench.core.entrypoints.native_api import add_tokenizer_routes, finite_json, native_generate
from workbench.core.entrypoints.openai.protocol import (
    AbortReqInput,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateReqInput,
    ModelCard,
    ModelList,
)
from workbench.core.entrypoints.openai.serving_chat import create_chat_completion
from workbench.core.entrypoints.openai.serving_common import ServingContext, new_rid
from workbench.core.entrypoints.openai.serving_completions import create_completion
from workbench.core.entrypoints.weights_api import add_weight_routes

logger = logging.getLogger(__name__)

GRACEFUL_TIMEOUT_S = 30.0
# How long a shutdown waits for in-flight requests before stopping them (WORKBENCH_DRAIN_S); below
# uvicorn's own limit, so uvicorn never cancels a handler mid-stream.
DRAIN_S = min(float(os.environ.get("WORKBENCH_DRAIN_S", "20")), GRACEFUL_TIMEOUT_S - 5)
EXIT_REQUESTS_STOPPED = 3  # exit code when the drain window ended with requests unfinished
ENGINE_DEAD_GRACE_S = 2.0  # after a child process dies: answer 503 this long, then exit 1


# ---------------------------------------------------------------- helpers


_parse = parse_body


def _served_names(engine: Any, server_args: ServerArgs) -> tuple[str, frozenset]:
    from workbench.core.model_loader import DEFAULT_MODEL_NAME

    path = server_args.model_path
    name = (
        server_args.served_model_name
        or getattr(engine, "served_model_name", None)
        or (path if path else DEFAULT_MODEL_NAME)
    )
    aliases = {name}
    if path:
        aliases |= {path, os.path.basename(path.rstrip("/"))}
    else:
        aliases |= {DEFAULT_MODEL_NAME, "smollm2-135m-instruct", "default"}
    return name, frozenset(aliases)


def _make_abort(engine: Any):
    """abort(rid) that is safe to call anywhere, the engine loop included: never blocks it."""

    def abort(rid: str) -> None:
        if not rid:  # "" would abort every request in the engine
            return
        loop = getattr(engine, "loop", None)
        tm = getattr(engine, "tokenizer_manager", None)
        try:
            if tm is not None and loop is not None and _running_loop() is loop:
                loop.create_task(tm.abort_request(rid))
            elif loop is not None and loop.is_running() and _running_loop() is not None:
                _running_loop().run_in_executor(None, engine.abort_request, rid)
            else:
                engine.abort_request(rid)
        except Exception:  # noqa: BLE001 - abort is best effort (engine may be gone)
            logger.debug("abort_request(%s) failed", rid, exc_info=True)

    return abort


def _running_loop():
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# ---------------------------------------------------------------- the app


def create_app(engine: Any, server_args: ServerArgs | None = None) -> FastAPI:
    """The FastAPI app over a started Engine (routes, errors, metrics; see the module
    docstring). `app.state.metrics.close()` unsubscribes the metrics from the trace bus."""
    server_args = server_args or getattr(engine, "server_args", None) or ServerArgs()
    context_len = getattr(engine, "context_len", None)
    if context_len is None:  # an engine-like object without the attribute: ask it
        context_len = engine.get_server_info().get("context_len") or 2048
    name, aliases = _served_names(engine, server_args)
    try:
        vocab = len(engine.tokenizer)
    except Exception:  # noqa: BLE001 - then token ids are checked by the engine only
        vocab = None
    model_path = str(getattr(engine, "model_path", None) or server_args.model_path or name)
    ctx = ServingContext(
        engine=engine,
        model_name=name,
        model_path=model_path,
        context_len=int(context_len),
        vocab_size=vocab,
        max_n=server_args.max_n,
        max_top_logprobs=server_args.max_top_logprobs,
        tool_call_parser=server_args.tool_call_parser,
        aliases=aliases,
        abort=_make_abort(engine),
    )
    deployment = getattr(engine, "deployment", None)  # scheduler_contract.Deployment (a stand-in engine: none)
    metrics = ServerMetrics(name, labels=dict(deployment.metric_labels) if deployment is not None else None)
    metrics.attach(engine)

    app = FastAPI(title="Serving Workbench", version="0.1.0", docs_url="/docs", redoc_url=None)
    app.state.ctx, app.state.metrics, app.state.draining = ctx, metrics, False
    app.state.server_args = server_args

    app.add_middleware(BodyLimitMiddleware, max_bytes=server_args.max_request_body_bytes)
    if server_args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=server_args.api_key)
    if server_args.enable_cors:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware, allow_origins=["*"], allow_methods=["*"], allow_headers=["*"], allow_credentials=False
        )
    _install_error_handlers(app)

    def ensure_serving() -> None:
        if app.state.draining:
            raise APIError(503, "The server is shutting down", code="shutting_down")
        if not getattr(engine, "is_healthy", True):
            raise APIError(503, "The engine is not healthy", code="engine_unavailable")

    # ---- OpenAI ------------------------------------------------------------

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = _parse(ChatCompletionRequest, await request.body())
        ensure_serving()
        return await create_chat_completion(ctx, request, req)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = _parse(CompletionRequest, await request.body())
        ensure_serving()
        return await create_completion(ctx, request, req)

    @app.get("/v1/models")
    async def list_models():
        card = ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.context_len)
        return JSONResponse(ModelList(data=[card]).model_dump(mode="json"))

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        ctx.check_model(model_id)
        return JSONResponse(
            ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.context_len).model_dump(mode="json")
        )

    # ---- native ------------------------------------------------------------

    @app.post("/generate")
    async def generate(request: Request):
        req = _parse(GenerateReqInput, await request.body())
        ensure_serving()
        return await native_generate(ctx, request, req)

    add_tokenizer_routes(app, ctx)  # /tokenize, /detokenize (SGLang's), /tokenizer_info (vLLM's, for lm-eval)

    # /health also fails when every process lives but the scheduler's loop is stuck: requests in flight
    # and nothing from it for this long (WORKBENCH_STALL_S; above the slowest honest step, a long prefill).
    stall_limit_s = float(os.environ.get("WORKBENCH_STALL_S", "60"))

    @app.get("/health")
    async def health():
        if app.state.draining or not getattr(engine, "is_healthy", True):
            return error_response(
                503, "unhealthy" if not app.state.draining else "shutting down", code="engine_unavailable"
            )
        stalled = getattr(engine, "stall_reason", None)
        reason = stalled(stall_limit_s) if stalled is not None else None
        if isinstance(reason, str):
            return error_response(503, reason, code="engine_stalled")
        # SGLang answers an empty 200 (routers read only the status); the content type says so.
        return PlainTextResponse("")

    @app.get("/health_generate")
    async def health_generate():
        ensure_serving()
        if server_args.disaggregation_mode == "decode":
            # A decode server generates only with a prefill server's KV: ask its scheduler loop instead.
            try:
                await asyncio.wait_for(asyncio.to_thread(engine.get_internal_state), timeout=30.0)
            except Exception as e:  # noqa: BLE001 - any failure means unhealthy
                raise APIError(503, f"the decode scheduler did not answer: {e}", code="engine_unavailable") from e
            return PlainTextResponse("")
        try:
            await asyncio.wait_for(
                engine.async_generate(
                    input_ids=[0], sampling_params={"max_new_tokens": 1, "temperature": 0.0}, rid=new_rid("health")
                ),
                timeout=30.0,
            )
        except Exception as e:  # noqa: BLE001 - any failure means unhealthy
            raise APIError(503, f"health generation failed: {type(e).__name__}: {e}", code="engine_unavailable") from e
        return PlainTextResponse("")

    # SGLang 0.5 names them /server_info and /model_info; the older /get_* names stay as aliases.
    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        info = await asyncio.to_thread(engine.get_server_info)
        return JSONResponse(finite_json(_jsonable(dict(info, served_model_name=name, metrics=metrics.snapshot()))))

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return JSONResponse(
            {
                "model_path": ctx.model_path,
                "tokenizer_path": ctx.model_path,
                "served_model_name": name,
                "is_generation": True,
                "context_len": ctx.context_len,
                "vocab_size": ctx.vocab_size,
            }
        )

    @app.get("/get_load")
    async def get_load():
        # sglang-router's power_of_two policy polls this (a list, one entry per DP rank)
        return JSONResponse(metrics.loads())

    @app.post("/flush_cache", operation_id="flush_cache_post")
    @app.get("/flush_cache", operation_id="flush_cache_get")
    async def flush_cache():
        ok = await asyncio.to_thread(engine.flush_cache)
        if not ok:
            return error_response(400, "Cache not flushed: requests are running; retry when idle.", code="cache_busy")
        return PlainTextResponse("Cache flushed.\n")

    @app.post("/abort_request")
    async def abort_request(request: Request):
        req = _parse(AbortReqInput, await request.body())
        if not req.rid and not req.abort_all:
            raise bad_request("give a rid, or abort_all: true", "rid")
        await asyncio.to_thread(engine.abort_request, "" if req.abort_all else req.rid)
        return JSONResponse({"success": True, "rid": None if req.abort_all else req.rid, "abort_all": req.abort_all})

    add_weight_routes(app, engine)

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    openapi_doc.install(
        app, api_key=bool(server_args.api_key)
    )  # request and answer bodies, errors (the routes parse bodies themselves)
    return app


def _jsonable(obj: Any) -> Any:
    try:
        json.dumps(obj)
        return obj
    except (TypeError, ValueError):
        return json.loads(json.dumps(obj, default=str))


def _allowed_methods(app: FastAPI, scope: dict) -> list[str]:
    """Every method some route of `app` answers at the scope's path (for a 405's `Allow`)."""
    from starlette.routing import Match

    methods: set[str] = set()
    for route in app.router.routes:
        match, _ = route.matches(scope)
        if match in (Match.PARTIAL, Match.FULL):
            methods |= set(getattr(route, "methods", None) or ())
    return sorted(methods)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(req: Request, exc: StarletteHTTPException):
        headers = dict(exc.headers or {})
        if exc.status_code == 405:  # Starlette names one route's methods; a path may have several routes
            headers["Allow"] = ", ".join(_allowed_methods(req.app, req.scope))
        return http_status_error(exc.status_code, exc.detail, headers or None)

    @app.exception_handler(RequestValidationError)
    async def _validation(_req, exc: RequestValidationError):
        return validation_error(exc).response()

    # ValueError/RuntimeError are handled here (not by the catch-all) so the
    # server log is not flooded with tracebacks of ordinary bad requests.
    @app.exception_handler(ValueError)
    async def _value_error(_req, exc: ValueError):
        return engine_error_to_api(exc).response()

    @app.exception_handler(RuntimeError)
    async def _runtime_error(_req, exc: RuntimeError):
        return engine_error_to_api(exc).response()

    @app.exception_handler(Exception)
    async def _catch_all(_req, exc: Exception):
        return engine_error_to_api(exc).response()


# ---------------------------------------------------------------- launching


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now, so a busy port fails before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        reason = "is already in use" if e.errno in (98, 48, 10048) else f"cannot be bound ({e.strerror})"
        raise SystemExit(f"error: port {port} on {host} {reason}; pick another with --port") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class _StartupInterrupted(BaseException):
    """SIGTERM/SIGINT while the engine was starting."""


class _StartupResponder:
    """Answers 503 on the bound socket while the engine loads (own loop, own thread)."""

    BODY = json.dumps(
        {
            "error": {
                "message": "The server is starting; the model is loading.",
                "type": "service_unavailable",
                "param": None,
                "code": "starting",
            }
        }
    ).encode()

    def __init__(self, sock: socket.socket):
        self._sock = socket.socket(fileno=os.dup(sock.fileno()))  # closing the dup keeps `sock` listening
        self._loop = asyncio.new_event_loop()
        self._server = None
        self._thread = threading.Thread(target=self._run, name="startup-503", daemon=True)
        self._ready = threading.Event()
        self._thread.start()
        self._ready.wait(5)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
            try:
                await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
                writer.write(
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                    b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
                    + str(len(self.BODY)).encode()
                    + b"\r\n\r\n"
                    + self.BODY
                )
                await writer.drain()
            except Exception:  # noqa: BLE001 - a broken probe is not our problem
                pass
            finally:
                writer.close()

        async def start():
            self._server = await asyncio.start_server(handle, sock=self._sock)
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def stop(self) -> None:
        async def close():
            self._server.close()

        if self._server is not None:
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class RunningServer:
    """A uvicorn server running on an engine's loop (see `start_server`)."""

    def __init__(self, app: FastAPI, server: Any, future, url: str):
        self.app, self.server, self.future, self.url = app, server, future, url

    @property
    def running(self) -> bool:
        return not self.future.done()

    def stop(self, timeout_s: float = GRACEFUL_TIMEOUT_S, force: bool = False) -> None:
        """Stop accepting, let in-flight requests finish (at most `timeout_s`), unsubscribe
        the metrics. The engine keeps running: shut it down yourself."""
        self.app.state.draining = True
        self.server.should_exit = True
        if force:
            self.server.force_exit = True
        try:
            self.future.result(timeout_s + 5)
        except Exception:  # noqa: BLE001 - a server that failed is stopped too
            pass
        self.app.state.metrics.close()


def start_server(
    engine: Any, server_args: ServerArgs | None = None, sock: socket.socket | None = None, timeout_s: float = 30.0
) -> RunningServer:
    """Serve an already started Engine over HTTP from its own loop, in the background.

    Works in any process that holds an Engine (a script, a notebook, a test); `sock`
    is a bound, listening socket (default: bind server_args.host/port). Returns once
    uvicorn accepts connections."""
    import uvicorn

    server_args = server_args or getattr(engine, "server_args", None) or ServerArgs()
    if sock is None:
        sock = bind_socket(server_args.host, server_args.port)
    app = create_app(engine, server_args)
    level = server_args.log_level.lower()
    from workbench.core.entrypoints.header_timeout import HeaderTimeoutH11Protocol

    config = uvicorn.Config(
        app,
        log_level=level,
        access_log=level in ("info", "debug", "trace"),
        lifespan="off",
        timeout_graceful_shutdown=int(GRACEFUL_TIMEOUT_S),
        timeout_keep_alive=5,
        http=HeaderTimeoutH11Protocol,
    )
    server = uvicorn.Server(config)
    fut = asyncio.run_coroutine_threadsafe(server.serve(sockets=[sock]), engine.loop)
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if fut.done():
            fut.result()  # raises what stopped it
            raise RuntimeError("the HTTP server stopped during start-up")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server did not start in {timeout_s:.0f} s")
        time.sleep(0.02)
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    return RunningServer(app, server, fut, f"http://{host}:{port}")


def _in_flight(engine: Any) -> int:
    """Requests the engine is still answering (len() of a dict is atomic: no lock needed)."""
    tm = getattr(engine, "tokenizer_manager", None)
    return len(getattr(tm, "rid_to_state", ())) if tm is not None else 0


def _drain(engine: Any, running: RunningServer, signals: dict, announce: bool) -> int:
    """The drain window of a shutdown; returns how many requests were stopped unfinished."""
    running.app.state.draining = True  # new requests get 503 shutting_down
    n = _in_flight(engine)
    if announce:
        print(
            f"draining {n} request(s) for up to {DRAIN_S:g} s (Ctrl-C again to stop now)"
            if n
            else "shutting down (no requests in flight)",
            flush=True,
        )
    seen = signals["count"]
    deadline = time.monotonic() + DRAIN_S
    while _in_flight(engine) and time.monotonic() < deadline and signals["count"] == seen:
        time.sleep(0.05)
    cut = _in_flight(engine)
    if cut:
        engine.loop.call_soon_threadsafe(running.app.state.ctx.stopping.set)
        deadline = time.monotonic() + 5.0  # the handlers send their errors and abort
        while _in_flight(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        print(
            f"stopped {cut} unfinished request(s): each client got an error (`server_shutdown`, "
            f"in-band for streams); exit code {EXIT_REQUESTS_STOPPED}",
            flush=True,
        )
    elif n and announce:
        print(f"all {n} request(s) finished", flush=True)
    return cut


def exposure_warning(host: str, has_api_key: bool) -> str | None:
    """The warning `workbench serve` prints when it listens beyond this machine (None on loopback)."""
    try:
        loopback = ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if loopback:
        return None
    where = "every interface" if host in ("0.0.0.0", "::", "") else host
    if has_api_key:
        return (
            f"warning: listening on {where} (--host {host}): the server is reachable from the network; "
            "every route but /health and /health_generate asks for the API key, which travels in clear "
            "text over plain HTTP: put a TLS proxy in front of it on an untrusted network"
        )
    return (
        f"warning: listening on {where} (--host {host}) WITHOUT --api-key: anyone who can reach this port can "
        "generate, replace the model's weights (/update_weights_from_disk, /init_weights_update_group, "
        "/update_weights_from_distributed) and empty the cache (/flush_cache). Set --api-key KEY, or serve "
        "on --host 127.0.0.1"
    )


def launch_server(server_args: ServerArgs) -> int:
    """`workbench serve`: start the engine, serve until SIGTERM/SIGINT, shut down. Returns the exit code."""
    from workbench.core.engine import Engine

    if server_args.node_rank > 0:  # multi-node: this node serves only its TP ranks (no HTTP)
        from workbench.core.distributed.launch import run_worker_node

        return run_worker_node(server_args)
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID` dumps every thread's stack
    logging.basicConfig(
        level=getattr(logging, server_args.log_level.upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    sock = bind_socket(server_args.host, server_args.port)
    warning = exposure_warning(server_args.host, bool(server_args.api_key))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    # The handler only counts: taking a lock in a signal handler (Event.set) can deadlock
    # against the main thread waiting on that same lock.
    signals = {"count": 0, "starting": True}

    def on_signal(signum, _frame):
        signals["count"] += 1
        if signals["starting"]:
            raise _StartupInterrupted()  # Engine() cleans up its children on the way out

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    starting = _StartupResponder(sock)
    engine = None
    try:
        try:
            engine = Engine(server_args=server_args)
        except _StartupInterrupted:
            print("interrupted during start-up; the engine's processes were stopped", file=sys.stderr, flush=True)
            return 0
        finally:
            signals["starting"] = False
            starting.stop()
        running = start_server(engine, server_args, sock)
        print(
            f"Serving {running.app.state.ctx.model_name} on {running.url} (OpenAI API at /v1, metrics at /metrics)",
            flush=True,
        )
        code = 0
        while not signals["count"]:
            time.sleep(0.2)
            if not running.running:
                exc = running.future.exception()
                print(f"error: the HTTP server stopped: {exc}", file=sys.stderr, flush=True)
                code = 1
                break
            if not getattr(engine, "is_healthy", True):
                print("error: the engine died; shutting down", file=sys.stderr, flush=True)
                code = 1
                # Keep the port open a moment longer: in-flight clients get their error
                # responses and health checks see a 503 rather than a refused connection.
                deadline = time.monotonic() + ENGINE_DEAD_GRACE_S
                while time.monotonic() < deadline and not signals["count"]:
                    time.sleep(0.1)
                break
        # Stop accepting and let in-flight requests finish for the drain window; a second signal
        # ends the window. Requests still running then end with an error (in-band for streams,
        # before the stream closes) and their KV is freed; only then does uvicorn stop, so it
        # never has to cancel a handler.
        cut = _drain(engine, running, signals, announce=code == 0)
        seen = signals["count"]
        stopper = threading.Thread(target=running.stop, name="http-stop", daemon=True)
        stopper.start()
        while stopper.is_alive():
            stopper.join(0.1)
            if signals["count"] > seen:
                running.server.force_exit = True
                seen = signals["count"]
        return code or (EXIT_REQUESTS_STOPPED if cut else 0)
    finally:
        if engine is not None:
            engine.shutdown()
        sock.close()
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="workbench serve", description="OpenAI-compatible server over the workbench engine"
    )
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        server_args = ServerArgs.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    return launch_server(server_args)


if __name__ == "__main__":
    sys.exit(main())
