"""`python -m workbench.core.entrypoints.http_server` as a real process: start-up, --api-key, a busy
port, and SIGTERM draining in-flight requests and exiting 0 with no process left behind.

The other end-to-end HTTP server tests are in tests/e2e/test_http_server_e2e.py.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from workbench.core.entrypoints.server_process import ServerProcess  # noqa: E402

KEY = "sk-test-secret"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--api-key", KEY, "--max-total-tokens", "4096"])
    try:
        yield srv
    finally:
        srv.stop(timeout_s=60)


def test_startup_answers_503_until_ready(server):
    # The port is bound before the model loads (seconds: child processes import torch and
    # load weights), and answers 503 meanwhile; connection attempts before the bind are
    # not recorded.
    assert 503 in server.health_statuses
    assert set(server.health_statuses) == {503, 200} and server.health_statuses[-1] == 200


def test_api_key_guards_every_route_but_health(server):
    url = server.base_url
    assert httpx.get(url + "/health").status_code == 200
    assert httpx.get(url + "/health_generate", timeout=120).status_code == 200
    for method, path in [
        ("GET", "/v1/models"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/generate"),
        ("GET", "/metrics"),
        ("GET", "/get_server_info"),
        ("POST", "/flush_cache"),
    ]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
            r = httpx.request(method, url + path, headers=headers, json={} if method == "POST" else None)
            assert r.status_code == 401, (path, headers, r.text)
            assert set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0, timeout=120)
    r = good.chat.completions.create(
        model="smollm2-135m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, temperature=0
    )
    assert r.usage.completion_tokens == 2


def test_sigterm_drains_in_flight_requests_and_leaves_no_process(server):
    children = server.descendants()
    assert children, "the engine's processes should be children of the server"
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True}
    got: dict = {"events": [], "first": threading.Event()}

    def stream():
        with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=headers, timeout=120) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    got["events"].append(line[6:])
                    got["first"].set()

    t = threading.Thread(target=stream)
    t.start()
    assert got["first"].wait(120), "no first chunk"
    server.proc.send_signal(15)  # SIGTERM
    t.join(120)
    assert server.proc.wait(90) == 0, server.log()
    # The in-flight stream finished normally.
    assert got["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in got["events"][:-1]]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    # Nothing is left: the scheduler, detokenizer and helpers exited with the server.
    deadline = time.monotonic() + 15
    alive = children
    while alive and time.monotonic() < deadline:
        alive = [p for p in children if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert not alive, f"orphans: {alive}"
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.base_url + "/health")
