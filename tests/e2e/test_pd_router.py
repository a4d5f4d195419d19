"""Disaggregated serving behind SGLang's own router (issue #38): a prefill server and a decode server
(`workbench serve --disaggregation-mode prefill|decode`, here as Engine + HTTP server in this process)
fronted by the real `sglang-router` in PD mode (`--pd-disaggregation --prefill URL BOOTSTRAP_PORT
--decode URL`), which sends each request to both with bootstrap_host/port/room added.

- greedy outputs through the pair equal one co-located engine's (float32) on /generate, chat through
  the openai client, and streaming;
- the bytes the decode side received equal the KV size of every prompt token (the decode side keeps
  no prefix of its own to skip: docs/disaggregation.md);
- many requests at once: none lost, no KV left held on either side;
- faults: an unreachable bootstrap port, a reused room, a transfer that times out, a decode server
  killed mid-transfer: that request gets an error, KV is freed on both sides, both keep serving.
The transport's own faults are tests/fast/test_pd_transfer.py."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
from pipeline_helpers import assert_no_kv_leak
from workbench.core.entrypoints.server_process import free_port

pytest.importorskip("sglang_router", reason="the test tier installs sglang-router")
openai = pytest.importorskip("openai")
pytestmark = pytest.mark.timeout(600)

COMMON = dict(show_progress=False, dtype="float32", max_total_tokens=8192, chunked_prefill_size=256)
PROMPTS = [
    "The capital of France is",
    "List three colours of the rainbow:",
    "def fibonacci(n):",
    "You are a railway timetable assistant. " * 12 + "The first train to Lyon leaves at",
]
GREEDY = {"max_new_tokens": 12, "temperature": 0}


@contextlib.contextmanager
def _server(**kw):
    """One `workbench serve` on loopback: yields (engine, base URL)."""
    from workbench.core.engine import Engine
    from workbench.core.entrypoints.http_server import bind_socket, start_server

    engine = Engine(**COMMON, **kw)
    try:
        running = start_server(engine, engine.server_args, bind_socket("127.0.0.1", 0))
        try:
            yield engine, running.url
        finally:
            running.stop(timeout_s=5)
    finally:
        engine.shutdown()


@contextlib.contextmanager
def _pd_router(prefill_url: str, bootstrap_port: int, decode_url: str, log_path, launcher=None):
    port = free_port()
    launcher = launcher or [sys.executable, "-m", "sglang_router.launch_router"]
    cmd = [*launcher, "--pd-disaggregation"]
    cmd += ["--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--policy", "round_robin", "--worker-startup-timeout-secs", "60", "--log-level", "warn"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 90
            while True:  # ready once a request goes through both workers
                assert proc.poll() is None, open(log_path).read()[-3000:]
                try:
                    r = httpx.post(url + "/generate", json={"text": "Hi", "sampling_params": GREEDY}, timeout=30)
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, open(log_path).read()[-3000:]
                time.sleep(0.5)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()


@pytest.fixture(scope="module")
def reference():
    """One co-located engine's greedy outputs: text per prompt, and a chat answer."""
    from workbench.core.engine import Engine

    with Engine(**COMMON) as engine:
        texts = [engine.generate(p, GREEDY)["text"] for p in PROMPTS]
        ids = engine.apply_chat_template([{"role": "user", "content": "Name a fruit."}], add_generation_prompt=True)
        chat = engine.generate(input_ids=list(ids), sampling_params=GREEDY)["text"]
    return texts, chat


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    bootstrap = free_port()
    with contextlib.ExitStack() as stack:
        prefill, p_url = stack.enter_context(
            _server(
                disaggregation_mode="prefill",
                disaggregation_bootstrap_port=bootstrap,
                disaggregation_transfer_timeout=8,
            )
        )
        decode, d_url = stack.enter_context(_server(disaggregation_mode="decode", disaggregation_transfer_timeout=8))
        router = stack.enter_context(_pd_router(p_url, bootstrap, d_url, tmp_path_factory.mktemp("pd") / "router.log"))
        yield dict(prefill=prefill, decode=decode, p_url=p_url, d_url=d_url, router=router, bootstrap=bootstrap)


def _pd_state(engine) -> dict:
    return engine.get_internal_state()["disaggregation"]


def _direct(pd, url: str, text: str, room: int, port: int | None = None, max_new_tokens: int = 4) -> httpx.Response:
    body = {"text": text, "sampling_params": dict(GREEDY, max_new_tokens=max_new_tokens)}
    body.update(bootstrap_host="127.0.0.1", bootstrap_port=port or pd["bootstrap"], bootstrap_room=room)
    return httpx.post(url + "/generate", json=body, timeout=60)


def test_outputs_through_the_pd_pair_equal_one_engines(pd, reference):
    texts, chat_ref = reference
    router = pd["router"]
    before = _pd_state(pd["decode"])["pd_received_bytes_total"]
    prompt_tokens = 0
    for prompt, want in zip(PROMPTS, texts):
        r = httpx.post(router + "/generate", json={"text": prompt, "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["text"] == want and want, prompt
        prompt_tokens += out["meta_info"]["prompt_tokens"]
    # Every prompt token's KV crossed, no more: 2 (k, v) x layers x kv heads x head_dim x 4 bytes (float32).
    per_token = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    received = _pd_state(pd["decode"])["pd_received_bytes_total"] - before
    assert received == per_token * prompt_tokens, (received, prompt_tokens)

    # Streaming through the router: the decode server's stream, chunk by chunk, adds up to the same text.
    with httpx.stream(
        "POST", router + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        chunks = [json.loads(line[5:]) for line in r.iter_lines() if line.startswith("data:") and "[DONE]" not in line]
    assert len(chunks) >= 2 and chunks[-1]["text"] == texts[0]

    client = openai.OpenAI(base_url=router + "/v1", api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": "Name a fruit."}]
    resp = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0)
    assert resp.choices[0].message.content == chat_ref
    stream = client.chat.completions.create(model="default", messages=msgs, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat_ref
    comp = client.completions.create(model="default", prompt=PROMPTS[1], max_tokens=12, temperature=0)
    assert comp.choices[0].text == texts[1]


def test_many_requests_at_once_none_lost_and_no_kv_left(pd):
    router = pd["router"]

    def send(i: int):
        body = {"text": f"Request {i}: the number {i * 37} is", "sampling_params": dict(GREEDY, max_new_tokens=4)}
        return httpx.post(router + "/generate", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(send, range(200)))
    assert [r.status_code for r in results] == [200] * 200, [r.text for r in results if r.status_code != 200][:3]
    assert all(r.json()["meta_info"]["completion_tokens"] == 4 for r in results)
    for side in ("decode", "prefill"):
        assert_no_kv_leak(pd[side])
    # The prefill side lets a room go when the decode side acknowledges its last byte: soon after.
    deadline = time.monotonic() + 10
    while _pd_state(pd["prefill"])["pd_held"]:
        assert time.monotonic() < deadline, _pd_state(pd["prefill"])
        time.sleep(0.1)
    assert _pd_state(pd["prefill"])["pd_failed_total"] == 0


def test_faults_fail_one_request_and_leave_both_serving(pd):
    prefill, decode, p_url, d_url = pd["prefill"], pd["decode"], pd["p_url"], pd["d_url"]
    failed = _pd_state(decode)["pd_failed_total"]

    # A bootstrap port nothing listens on: the decode side cannot reach a prefill server.
    r = _direct(pd, d_url, "Hello there", random.getrandbits(62), port=free_port())
    assert r.status_code >= 400 and "could not reach the prefill server" in r.json()["error"]["message"], r.text

    # A decode request without the router's fields says what to do.
    r = httpx.post(d_url + "/generate", json={"text": "Hi", "sampling_params": GREEDY}, timeout=30)
    assert r.status_code == 400 and "PD router" in r.json()["error"]["message"], r.text

    # A reused room: the second request naming a room in flight on the decode side is refused.
    room = random.getrandbits(62)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_direct, pd, d_url, "A room used twice", room)
        time.sleep(0.5)  # the first is waiting for its KV (nothing prefills it yet)
        second = _direct(pd, d_url, "A room used twice", room)
        assert second.status_code == 400 and "already in use" in second.json()["error"]["message"], second.text
        # Now the prefill side computes it, and the first goes through.
        assert _direct(pd, p_url, "A room used twice", room).status_code == 200
        assert first.result().status_code == 200, first.result().text

    # A transfer that never comes (no prefill for this room): the decode side times out (8 s here).
    t0 = time.monotonic()
    r = _direct(pd, d_url, "Nobody prefills this", random.getrandbits(62))
    assert r.status_code >= 400 and "within" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 30
    assert _pd_state(decode)["pd_failed_total"] >= failed + 2

    # Both still serve through the router, and nothing is held.
    r = httpx.post(pd["router"] + "/generate", json={"text": "Still there?", "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200
    for engine in (decode, prefill):
        assert_no_kv_leak(engine)


def test_a_decode_server_killed_mid_transfer_leaves_the_prefill_serving(pd):
    """A second decode server has reserved slots and asked for a prompt's KV when it is killed (kill -9 of
    its scheduler, which holds the socket): its client gets an error; the prefill computes the prompt
    anyway (it cannot know), holds the KV for its transfer timeout (8 s here), then drops it as failed,
    and goes on serving the pair behind the router. A connection cut with bytes in flight is
    tests/fast/test_pd_transfer.py's."""
    prefill, p_url = pd["prefill"], pd["p_url"]
    prompt = "The history of railways in Europe begins with horse-drawn wagonways. " * 20
    room = random.getrandbits(62)
    failed = _pd_state(prefill)["pd_failed_total"]
    with _server(disaggregation_mode="decode") as (victim, v_url):
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            doomed = pool.submit(_direct, pd, v_url, prompt, room, None, 16)
            deadline = time.monotonic() + 30
            while _pd_state(victim)["pd_transferring"] != 1:  # slots reserved, the pull is waiting on the prefill
                assert time.monotonic() < deadline and not doomed.done(), doomed.result().text
                time.sleep(0.05)
            pid = next(p.pid for name, p in victim.procs.items() if name.startswith("scheduler"))
            os.kill(pid, signal.SIGKILL)
            res = doomed.result()
            assert res.status_code >= 500 or "error" in res.text, res.text
        # The prefill computes the room now: the puller it would send to is gone.
        assert _direct(pd, p_url, prompt, room).status_code == 200
    deadline = time.monotonic() + 30
    while _pd_state(prefill)["pd_held"] or _pd_state(prefill)["pd_failed_total"] == failed:
        assert time.monotonic() < deadline, f"the prefill side still holds the killed server's KV: {_pd_state(prefill)}"
        time.sleep(0.2)
    r = httpx.post(pd["router"] + "/generate", json={"text": "And now?", "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200
    assert_no_kv_leak(prefill)


@pytest.mark.skipif(shutil.which("smg") is None, reason="SGLang's Model Gateway (`pip install smg`) is not installed")
def test_the_model_gateway_fronts_the_pair_too(pd, reference, tmp_path):
    """SGLang's Model Gateway (smg 1.13, `smg launch --pd-disaggregation`) in front of the same pair. It
    routes the OpenAI routes by model id, so a request names the served model (it answers 503 "No prefill
    workers available" for any other name)."""
    texts, chat_ref = reference
    with _pd_router(
        pd["p_url"], pd["bootstrap"], pd["d_url"], tmp_path / "smg.log", [shutil.which("smg"), "launch"]
    ) as url:
        r = httpx.post(url + "/generate", json={"text": PROMPTS[0], "sampling_params": GREEDY}, timeout=60)
        assert r.status_code == 200 and r.json()["text"] == texts[0], r.text
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        msgs = [{"role": "user", "content": "Name a fruit."}]
        resp = client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        assert resp.choices[0].message.content == chat_ref
