"""End-to-end part of tests/fast/test_security.py (what starts processes, engines or servers, or loads the
reference model).

Security properties of a real server (real engine, real sockets).

- `--api-key` is enforced on every route the app has (enumerated from the app itself,
  docs included) except the health checks, and on unknown paths too;
- the HTTP server and the trace publisher listen on loopback only, and nothing the
  engine starts listens anywhere else;
- no pickle is ever read from a socket: a pickle that would create a marker file when
  loaded is sent to the trace publisher, to the HTTP server (as a body and as raw
  bytes) and to every ipc:// socket of the engine, and the marker never appears
  (while the same bytes do create it when unpickled, so the check can fail);
- the ipc:// directory is private (0700, owned by us) and removed on shutdown.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import stat
import subprocess
import sys
import time

import httpx
import pytest
import zmq
from reliability_helpers import count, wait_for
from workbench.core.entrypoints.server_process import free_port

psutil = pytest.importorskip("psutil")

KEY = "sk-reliability-secret"
AUTH = {"Authorization": f"Bearer {KEY}"}
HEALTH = {"/health", "/health_generate"}
LOOPBACK = {"127.0.0.1", "::1"}


@pytest.fixture(scope="module")
def served():
    from workbench.core.engine import Engine
    from workbench.core.entrypoints.http_server import bind_socket, start_server

    engine = Engine(
        show_progress=False, max_total_tokens=2048, api_key=KEY, trace_publish=f"tcp://127.0.0.1:{free_port()}"
    )
    running = start_server(engine, engine.server_args, bind_socket(engine.server_args.host, 0))
    try:
        yield engine, running
    finally:
        running.stop(timeout_s=5)
        engine.shutdown()


def routes(app) -> list[tuple[str, str]]:
    """(method, concrete path) for every route of the app; path parameters filled in."""
    out = []
    for r in app.routes:
        path = re.sub(r"\{[^}]+\}", "smollm2-135m", r.path)
        for m in sorted(getattr(r, "methods", None) or {"GET"}):
            out.append((m, path))
    return out


def test_api_key_is_required_on_every_route_but_health(served):
    engine, running = served
    url = running.url
    table = routes(running.app)
    paths = {p for _, p in table}
    # Not vacuous: the OpenAI, native, weight, metrics and docs routes are all there.
    assert {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/models",
        "/generate",
        "/get_server_info",
        "/flush_cache",
        "/update_weights_from_disk",
        "/metrics",
        "/openapi.json",
        "/docs",
    } <= paths
    failures = []
    with httpx.Client(base_url=url, timeout=120) as c:
        for method, path in table + [("GET", "/no/such/route"), ("POST", "/v1/no-such-route")]:
            body = b"{}" if method in ("POST", "PUT", "PATCH") else None
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": KEY},
                {"Authorization": f"bearer {KEY}"},
                {"Authorization": f"Bearer {KEY}x"},
                {"X-API-Key": KEY},
            ):
                r = c.request(method, path, content=body, headers=dict(headers, **{"content-type": "application/json"}))
                count("requests")
                if path in HEALTH:
                    if r.status_code == 401:
                        failures.append(f"{method} {path} is a health check but asked for a key")
                elif r.status_code != 401:
                    failures.append(f"{method} {path} with {headers}: {r.status_code} {r.text[:120]}")
                elif method != "HEAD" and set(r.json()["error"]) != {"message", "type", "param", "code"}:
                    failures.append(f"{method} {path}: 401 without an OpenAI error body")
            if path == "/update_weights_from_disk" or path.startswith("/init_weights"):
                continue  # with the key these would act; an empty body is refused anyway (checked below)
            r = c.request(method, path, content=body, headers=dict(AUTH, **{"content-type": "application/json"}))
            count("requests")
            if r.status_code == 401:
                failures.append(f"{method} {path} refused the right key")
        # With the key, the acting routes refuse an empty body instead of acting.
        for path in ("/update_weights_from_disk", "/init_weights_update_group"):
            r = c.post(path, json={}, headers=AUTH)
            count("requests")
            if r.status_code != 422:  # a required field is missing
                failures.append(f"POST {path} with the key and an empty body: {r.status_code} {r.text[:120]}")
    assert not failures, "\n".join(failures)
    assert engine.is_healthy


def _listeners(pid: int) -> list[tuple[str, int]]:
    return [
        (c.laddr.ip, c.laddr.port)
        for c in psutil.Process(pid).net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN
    ]


def test_server_and_trace_publisher_listen_on_loopback_only(served):
    from workbench.core.args import ServerArgs

    engine, running = served
    assert ServerArgs().host == "127.0.0.1"
    http_port = int(running.url.rsplit(":", 1)[1])
    trace_port = int(engine.bus.publish_endpoint.rsplit(":", 1)[1])
    mine = _listeners(os.getpid())
    assert ("127.0.0.1", http_port) in mine and ("127.0.0.1", trace_port) in mine, mine
    everyone = mine + [lst for p in engine.procs.values() for lst in _listeners(p.pid)]
    assert all(ip in LOOPBACK for ip, _ in everyone), f"something listens beyond loopback: {everyone}"
    # The CLI's default is loopback too (what `workbench serve` binds without --host).
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    assert ServerArgs.from_cli_args(parser.parse_args([])).host == "127.0.0.1"


class _Evil:
    """Unpickling this creates the file at `path` (pickle calls open(path, "w"))."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_malicious_pickle_is_never_executed(served, tmp_path):
    engine, running = served
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Evil(str(marker)))
    # The payload is live: unpickled (in a throwaway process), it creates its marker.
    probe = tmp_path / "probe"
    live = pickle.dumps(_Evil(str(probe)))
    subprocess.run(
        [sys.executable, "-c", "import pickle, sys; pickle.loads(sys.stdin.buffer.read())"],
        input=live,
        check=True,
        timeout=60,
    )
    assert probe.exists()

    malformed_before = engine.bus.malformed
    ctx = zmq.Context()
    xsub = ctx.socket(zmq.XSUB)
    try:
        # 1. The trace publisher (tcp): as subscription messages of an XSUB peer, and as raw bytes.
        xsub.setsockopt(zmq.LINGER, 0)
        xsub.connect(engine.bus.publish_endpoint)
        xsub.send(payload)
        xsub.send(b"\x01" + payload)
        xsub.send(b"\x01")  # then a real subscription: the header comes back
        assert xsub.poll(30_000, zmq.POLLIN), "the publisher did not answer a subscription"
        xsub.recv()
        host, port = engine.bus.publish_endpoint.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(payload)
        # 2. Every ipc:// socket of the engine, from a local PUSH peer.
        pa = engine.port_args
        for endpoint in (
            pa.trace_ipc_name,
            pa.scheduler_input_ipc_name,
            pa.detokenizer_ipc_name,
            pa.tokenizer_ipc_name,
        ):
            push = ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.LINGER, 2000)  # bounded: close() delivers, then gives up
            push.connect(endpoint)
            push.send(payload)
            push.close()
        count("faults", 6)
    finally:
        xsub.close(linger=0)
        ctx.term()
    # 3. The HTTP server: as a body to every POST route, and as raw bytes on the port.
    posts = [
        p
        for m, p in routes(running.app)
        if m == "POST"
        and p not in ("/update_weights_from_disk", "/init_weights_update_group", "/update_weights_from_distributed")
    ]
    with httpx.Client(base_url=running.url, timeout=60, headers=AUTH) as c:
        for path in posts:
            for ctype in ("application/python-pickle", "application/octet-stream", "application/json"):
                r = c.post(path, content=payload, headers={"content-type": ctype})
                count("requests")
                # /flush_cache takes no body (it ignores one); every other route refuses the bytes.
                ok = r.status_code < 500 if path == "/flush_cache" else 400 <= r.status_code < 500
                assert ok, (path, ctype, r.status_code, r.text)
    http_host, http_port = running.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((http_host, int(http_port)), timeout=10) as s:
        s.sendall(payload + b"\r\n\r\n")
        s.settimeout(10)
        try:
            reply = s.recv(100)
        except (TimeoutError, ConnectionResetError):
            reply = b""
    assert not reply.startswith(b"HTTP/1.1 2"), reply
    count("faults", len(posts) * 3 + 1)

    # The bus saw the pickle on its ipc socket and counted it as malformed; the engine serves on.
    wait_for(lambda: engine.bus.malformed > malformed_before, 30, "the bus to reject the pickle")
    r = httpx.post(
        running.url + "/generate",
        headers=AUTH,
        timeout=120,
        json={"text": "Hello", "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
    )
    count("requests")
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2, r.text
    time.sleep(0.5)  # let anything that might still act on the bytes do so
    assert not marker.exists(), "a pickle from a socket was executed"
    assert engine.is_healthy and all(p.is_alive() for p in engine.procs.values())


def test_ipc_dir_is_private_and_removed_on_shutdown(served):
    engine, running = served
    d = engine.port_args.ipc_dir
    st = os.stat(d)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    names = set(os.listdir(d))
    assert {"tokenizer", "scheduler", "detokenizer", "trace"} <= names, names
    running.stop(timeout_s=5)
    engine.shutdown()  # the fixture's own shutdown is then a no-op
    assert not os.path.exists(d)
