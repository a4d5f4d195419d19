"""Faults that happen in practice, against `workbench serve` child processes and the real model.

- 100 clients that disconnect mid-stream, interleaved with good requests: the good ones
  are complete and correct, every disconnect is aborted, no KV or request state leaks.
- a client that reads slowly (tiny receive buffer, stalls, then sips): nobody else waits
  for it, the engine is not held by it, and it still gets the whole answer.
- a remote trace subscriber killed mid-run: serving is unaffected, the publisher lives on.
- a second server on a port in use: a one-line error and a non-zero exit.
- SIGTERM while busy: the in-flight requests finish, exit code 0, nothing left behind.
- kill -9 of the scheduler or the detokenizer: in-flight requests get an error, /health
  answers 503, the server exits non-zero instead of hanging, nothing left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from reliability_helpers import (
    BackgroundLoad,
    Outcome,
    assert_server_clean,
    count,
    fetch_reference,
    gather_bounded,
    generate_result,
    openai_text,
    post,
    server_info,
    stream_errors,
    wait_for,
)
from workbench.core.entrypoints.server_process import ServerProcess, free_port

psutil = pytest.importorskip("psutil")

PROMPTS = ["Once upon a time", "The capital of France is", "Three facts about owls:"]
K = 12


@pytest.fixture(scope="module")
def trace_addr():
    return f"tcp://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def server(trace_addr):
    srv = ServerProcess(["--dtype", "float32", "--max-total-tokens", "12288", "--trace-publish", trace_addr])
    try:
        yield srv
    finally:
        srv.stop(timeout_s=60)


@pytest.fixture(scope="module")
def refs(server, tokenizer):
    """Greedy continuations of PROMPTS, each computed alone, with their token ids."""
    ids = [list(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS]
    with httpx.Client(base_url=server.base_url) as c:
        out = [fetch_reference(c, i, {"max_new_tokens": K, "temperature": 0.0, "ignore_eos": True}) for i in ids]
    count("requests", len(out))
    return ids, out


def good_request(j: int, ids: list[list[int]]) -> tuple[str, dict, bool, int]:
    """(path, body, stream, prompt index) of the j-th good request: every route, streamed or not."""
    p, stream, route = j % len(PROMPTS), j % 2 == 0, (j // 2) % 2
    if route == 0:
        return (
            "/generate",
            {
                "input_ids": ids[p],
                "stream": stream,
                "sampling_params": {"max_new_tokens": K, "temperature": 0, "ignore_eos": True},
            },
            stream,
            p,
        )
    return (
        "/v1/completions",
        {"prompt": PROMPTS[p], "max_tokens": K, "temperature": 0, "ignore_eos": True, "stream": stream},
        stream,
        p,
    )


def good_ok(path: str, out: Outcome, ref, tokenizer) -> str:
    if out.status != 200 or (out.events and (not out.done or stream_errors(out.events))):
        return f"{path}: status {out.status} {out.error or out.body or stream_errors(out.events)}"
    want, _ = ref.expect(K)
    if path == "/generate":
        got = generate_result(out)[0]
        return "" if got == want else f"/generate gave {got}, expected {want}"
    text, finish, _ = openai_text("completions", out)
    want_text = tokenizer.decode(want, skip_special_tokens=True)
    return "" if (text, finish) == (want_text, "length") else f"{path} gave {text!r} ({finish}), expected {want_text!r}"


def metric(url: str, name: str) -> float:
    return server_info(url)["metrics"][name]


def ipc_dir_of(pid: int) -> str:
    """The private ipc:// directory of a server process (its bound unix sockets live there)."""
    paths = [c.laddr for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr]
    dirs = {os.path.dirname(p) for p in paths if "workbench-ipc-" in p}
    assert len(dirs) == 1, paths
    return dirs.pop()


def wait_no_orphans(pids: list[int], timeout: float = 20.0) -> None:
    def gone():
        return not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]

    wait_for(gone, timeout, f"the server's children {pids} to exit")


# ---------------------------------------------------------------- disconnects and slow readers


async def _disconnect_mid_stream(client: httpx.AsyncClient, j: int) -> bool:
    """Start a long streaming request, read its first event, then hang up. True if it streamed."""
    count("requests")
    route = j % 3
    long = {"temperature": 0, "ignore_eos": True, "stream": True}
    if route == 0:
        path, body = (
            "/v1/chat/completions",
            dict(long, messages=[{"role": "user", "content": f"Story {j}"}], max_tokens=256),
        )
    elif route == 1:
        path, body = "/v1/completions", dict(long, prompt=f"Chapter {j}.", max_tokens=256)
    else:
        path, body = (
            "/generate",
            {
                "text": f"Item {j}:",
                "stream": True,
                "sampling_params": {"max_new_tokens": 256, "temperature": 0, "ignore_eos": True},
            },
        )
    async with client.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            return False
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                break
        # Leaving the block closes a half-read response, which closes its connection.
    return True


def test_100_disconnects_mid_stream_interleaved_with_good_requests(server, refs, tokenizer):
    ids, references = refs
    url = server.base_url
    aborted_before = metric(url, "num_aborted_requests_total")

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            jobs = []
            good_specs = []
            for j in range(150):
                if j % 3 == 1:  # one good request after every two disconnects
                    spec = good_request(len(good_specs), ids)
                    good_specs.append(spec)
                    jobs.append(post(client, spec[0], spec[1], spec[2]))
                else:
                    jobs.append(_disconnect_mid_stream(client, j))
            results = await gather_bounded(jobs, 32)
            return good_specs, results

    good_specs, results = asyncio.run(main())
    hangups = [r for j, r in enumerate(results) if j % 3 != 1]
    goods = [r for j, r in enumerate(results) if j % 3 == 1]
    assert len(hangups) == 100 and all(hangups), "every disconnecting request should have streamed first"
    count("faults", 100)
    failures = [
        why for spec, out in zip(good_specs, goods) if (why := good_ok(spec[0], out, references[spec[3]], tokenizer))
    ]
    count("unexpected", len(failures))
    assert not failures, "\n".join(failures[:10])
    # Each hang-up aborted its request: none of them ran its 256 tokens to the end.
    wait_for(lambda: metric(url, "num_aborted_requests_total") - aborted_before >= 100, 60, "the aborts")
    assert metric(url, "num_aborted_requests_total") - aborted_before == 100
    assert_server_clean(url)


def _dechunk(raw: bytes) -> bytes:
    """The body of an HTTP/1.1 chunked response."""
    out, pos = bytearray(), 0
    while True:
        eol = raw.index(b"\r\n", pos)
        size = int(raw[pos:eol].split(b";")[0], 16)
        if size == 0:
            return bytes(out)
        out += raw[eol + 2 : eol + 2 + size]
        pos = eol + 2 + size + 2


def test_a_slow_reader_holds_nobody_up_and_gets_everything(server, refs, tokenizer):
    ids, references = refs
    url = server.base_url
    # Large chunks (20 top logprobs per token), read through a tiny receive window.
    body = {
        "prompt": PROMPTS[0],
        "max_tokens": 96,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 20,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Connection: close\r\nContent-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    count("requests")
    count("faults")
    try:
        # While it reads nothing, other requests (among them the same one, not streamed) complete.
        async def others():
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                specs = [good_request(j, ids) for j in range(6)]
                same = post(client, "/v1/completions", dict(body, stream=False), False)
                outs = await asyncio.gather(same, *(post(client, s[0], s[1], s[2]) for s in specs))
                return specs, outs

        specs, outs = asyncio.run(others())
        failures = [why for s, o in zip(specs, outs[1:]) if (why := good_ok(s[0], o, references[s[3]], tokenizer))]
        assert not failures, failures
        assert outs[0].status == 200, outs[0].body
        want = outs[0].body["choices"][0]
        # The engine is not held by the stalled client: its request finished generating.
        wait_for(lambda: server_info(url)["internal_state"]["num_running"] == 0, 60, "the engine to go idle")
        # Now sip the response in small pieces.
        raw = b""
        sock.settimeout(120)
        while True:
            piece = sock.recv(512)
            if not piece:
                break
            raw += piece
            time.sleep(0.001)
    finally:
        sock.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    events = [ln[6:] for ln in _dechunk(rest).decode().split("\n") if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not stream_errors(chunks)
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    tokens = sum(len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks if c["choices"])
    assert text == want["text"] and tokens == 96
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == ["length"]
    assert_server_clean(url)


# ---------------------------------------------------------------- trace subscriber, busy port

SUBSCRIBER = """
import sys
from workbench.core.trace.bus import RemoteSubscription
sub = RemoteSubscription(sys.argv[1])
while sub.header is None:
    sub.get(timeout=1.0)
print("attached", flush=True)
while True:
    sub.get(timeout=1.0)
"""


def test_a_trace_subscriber_dying_mid_run_does_not_disturb_serving(server, refs, trace_addr, tokenizer):
    from workbench.core.trace import events as ev
    from workbench.core.trace.bus import RemoteSubscription

    ids, references = refs
    url = server.base_url
    sub = subprocess.Popen([sys.executable, "-c", SUBSCRIBER, trace_addr], stdout=subprocess.PIPE, text=True)
    try:
        ready, _, _ = select.select([sub.stdout], [], [], 120)
        assert ready and sub.stdout.readline().strip() == "attached"
        specs = [good_request(j, ids) for j in range(8)]
        load = BackgroundLoad(url, specs)
        wait_for(lambda: server_info(url)["internal_state"]["num_running"] > 0, 60, "requests to run")
        sub.kill()  # SIGKILL: no goodbye to the publisher
        count("faults")
        outs = load.join(600)
        assert outs is not None, "the good requests hung after the subscriber died"
    finally:
        sub.kill()
        sub.wait(10)
    failures = [why for s, o in zip(specs, outs) if (why := good_ok(s[0], o, references[s[3]], tokenizer))]
    assert not failures, failures
    # The publisher lives on: a new subscriber attaches and sees the next request finish.
    with RemoteSubscription(trace_addr) as fresh:
        wait_for(lambda: fresh.get(timeout=0.5) is not None and fresh.header is not None, 60, "the header")
        r = httpx.post(
            url + "/generate",
            json={"text": "Hello", "rid": "after-subscriber-died", "sampling_params": {"max_new_tokens": 2}},
            timeout=120,
        )
        count("requests")
        assert r.status_code == 200, r.text
        seen: list = []

        def finished():
            seen.extend(fresh.drain())
            return any(isinstance(e, ev.ReqFinished) and e.rid == "after-subscriber-died" for e in seen)

        wait_for(finished, 60, "req.finished of the new request")
    assert httpx.get(url + "/health", timeout=30).status_code == 200
    assert_server_clean(url)


def test_a_second_server_on_a_port_in_use_fails_clearly(server):
    r = subprocess.run(
        [sys.executable, "-m", "workbench.core.entrypoints.http_server", "--port", str(server.port)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    count("faults")
    assert r.returncode != 0
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and "already in use" in lines[0] and str(server.port) in lines[0], lines
    # The first server did not notice.
    assert httpx.get(server.base_url + "/health", timeout=30).status_code == 200
    count("requests")


# ---------------------------------------------------------------- SIGTERM while busy (last: it stops the server)


def test_sigterm_while_busy_drains_in_flight_requests_and_exits_0(server, refs, tokenizer):
    ids, references = refs
    url = server.base_url
    children = server.descendants()
    ipc_dir = ipc_dir_of(server.proc.pid)
    specs = [good_request(j, ids) for j in range(12)]
    finished_before = metric(url, "num_requests_total")
    load = BackgroundLoad(url, specs)

    def all_admitted():
        # In flight now, or already finished: either way the server has every request.
        info = server_info(url)
        return info["num_inflight_requests"] + info["metrics"]["num_requests_total"] - finished_before == len(specs)

    wait_for(all_admitted, 120, "every request to reach the engine", interval=0.02)
    server.proc.send_signal(signal.SIGTERM)
    count("faults")
    outs = load.join(600)
    assert outs is not None, "in-flight requests hung during the drain"
    assert server.proc.wait(120) == 0, server.log()
    failures = [why for s, o in zip(specs, outs) if (why := good_ok(s[0], o, references[s[3]], tokenizer))]
    assert not failures, failures
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=10)
    wait_no_orphans(children)
    assert not os.path.exists(ipc_dir)


# ---------------------------------------------------------------- kill -9 of a child


@pytest.mark.parametrize("role", ["scheduler", "detokenizer"])
def test_kill_9_of_a_child_fails_in_flight_requests_and_exits_nonzero(role):
    srv = ServerProcess(["--max-total-tokens", "8192"])
    try:
        url = srv.base_url
        pid = server_info(url)["pids"][role]
        children = srv.descendants()
        assert pid in children
        ipc_dir = ipc_dir_of(srv.proc.pid)
        # Long enough that none finishes before the kill; short enough that all six are admitted.
        long = {"max_new_tokens": 1000, "temperature": 0, "ignore_eos": True}
        specs = [
            ("/generate", {"text": f"Story {j}:", "stream": j % 2 == 0, "sampling_params": long}, j % 2 == 0)
            for j in range(4)
        ] + [
            ("/v1/completions", {"prompt": "Once", "max_tokens": 1000, "ignore_eos": True, "stream": True}, True),
            (
                "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1000, "ignore_eos": True},
                False,
            ),
        ]
        load = BackgroundLoad(url, specs)
        wait_for(
            lambda: server_info(url)["internal_state"]["num_running"] == len(specs),
            120,
            "every request to run",
            interval=0.05,
        )
        health: list = []
        stop_polling = threading.Event()

        def poll_health():
            while not stop_polling.is_set():
                try:
                    health.append(httpx.get(url + "/health", timeout=5).status_code)
                except httpx.HTTPError:
                    health.append(None)
                time.sleep(0.05)

        poller = threading.Thread(target=poll_health)
        poller.start()
        os.kill(pid, signal.SIGKILL)
        count("faults")
        # Bounded waits: the requests fail and the server exits, instead of hanging.
        outs = load.join(60)
        assert outs is not None, "in-flight requests hung after the child died"
        code = srv.proc.wait(60)
        stop_polling.set()
        poller.join(10)
    finally:
        if srv.proc.poll() is None:
            srv.kill()
        srv.stop()
    assert code != 0, srv.log()
    for (path, _, stream), out in zip(specs, outs):
        if stream:
            assert out.status == 200 and out.done and stream_errors(out.events), (path, out)
            assert stream_errors(out.events)[0]["code"] == "engine_unavailable", out.events[-1]
        else:
            assert out.status == 503 and out.body["error"]["code"] == "engine_unavailable", (path, out)
    assert 503 in health, health
    assert f"the {role} process died (killed by SIGKILL)" in srv.log()  # not "exit code None"
    wait_no_orphans(children)
    assert not os.path.exists(ipc_dir)
