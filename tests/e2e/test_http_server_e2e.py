"""End-to-end part of the HTTP server tests (with tests/e2e/test_http_server_process_e2e.py) (what starts processes, engines or servers, or loads the
reference model).

`python -m workbench.core.entrypoints.http_server` as a real process: a busy port, and a SIGTERM
that stops unfinished requests. Start-up (503 until ready), --api-key and the SIGTERM drain share one
server in tests/e2e/test_http_server_process_e2e.py (one start-up fewer in the full tier)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
from workbench.core.entrypoints.server_process import ServerProcess  # noqa: E402


def test_port_in_use_is_a_one_line_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "workbench.core.entrypoints.http_server", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "already in use" in lines[0] and str(port) in lines[0], lines


def test_shutdown_stops_unfinished_requests_with_an_error_event_and_says_so():
    """(After the header-read timeout's check.) A stream and a plain request longer than the drain window: SIGTERM announces the drain, then the
    stream ends with an in-band `server_shutdown` error event before [DONE], the plain request gets a
    503 with the same code, no traceback is printed, and the exit code (3) says requests were stopped."""
    srv = ServerProcess(
        ["--max-total-tokens", "4096", "--dtype", "float32"],
        env={"WORKBENCH_DRAIN_S": "1", "WORKBENCH_HEADER_TIMEOUT_S": "1"},
    )
    try:
        # first, the header-read timeout: a client that never finishes its headers is cut off after ~1 s,
        # and one that sends a whole request in time is answered
        with socket.create_connection((srv.host, srv.port), timeout=10) as slow:
            slow.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")  # no blank line: headers unfinished
            t0 = time.monotonic()
            assert slow.recv(100) == b"" and time.monotonic() - t0 < 5  # closed by the server
        with socket.create_connection((srv.host, srv.port), timeout=10) as ok:
            ok.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok.recv(100).startswith(b"HTTP/1.1 200")
        body = {"prompt": "Once upon a time", "max_tokens": 1800, "temperature": 0, "ignore_eos": True}
        got: dict = {"events": [], "first": threading.Event(), "plain": None}

        def stream():
            with httpx.stream(
                "POST", srv.base_url + "/v1/completions", json={**body, "stream": True}, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        got["events"].append(line[6:])
                        got["first"].set()

        def plain():
            got["plain"] = httpx.post(srv.base_url + "/v1/completions", json=body, timeout=120)

        threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
        for t in threads:
            t.start()
        assert got["first"].wait(120), "no first chunk"
        time.sleep(0.5)
        srv.proc.send_signal(15)  # SIGTERM
        for t in threads:
            t.join(120)
        code = srv.proc.wait(90)
        log = srv.log()
    finally:
        srv.stop(timeout_s=30)
    assert code == 3, log
    assert got["events"][-1] == "[DONE]"
    last = json.loads(got["events"][-2])
    assert last["error"]["code"] == "server_shutdown" and "send it again" in last["error"]["message"]
    assert got["plain"].status_code == 503 and got["plain"].json()["error"]["code"] == "server_shutdown"
    assert "draining 2 request(s)" in log and "stopped 2 unfinished request(s)" in log, log
    assert "Traceback" not in log and "Cancel" not in log, log
