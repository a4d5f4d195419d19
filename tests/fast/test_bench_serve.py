"""`workbench bench serve` against a small stub OpenAI server (written here, in-process):
the load generator's accounting (completions, failures, token counts, ITL samples),
its concurrency cap, the shared-prefix dataset, Poisson arrivals, JSON output and
the CLI wiring. The stub's fixed sleeps only give lower bounds, never timings."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from workbench.bench import serve_bench as sb  # noqa: E402

FIRST_TOKEN_DELAY = 0.02


class Stub:
    """An OpenAI-compatible stub: streams `max_tokens` one-token chunks, fails every 4th POST."""

    def __init__(self):
        self.posts = 0
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict] = []
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

        async def handle(request: Request, chat: bool):
            body = await request.json()
            self.posts += 1
            n = self.posts
            self.bodies.append(body)
            if n % 4 == 0:
                return JSONResponse(
                    {"error": {"message": "boom", "type": "x", "param": None, "code": None}}, status_code=500
                )
            prompt = body["messages"][-1]["content"] if chat else body["prompt"]

            async def gen():
                self.inflight += 1
                self.max_inflight = max(self.max_inflight, self.inflight)
                try:
                    await asyncio.sleep(FIRST_TOKEN_DELAY)
                    for i in range(body["max_tokens"]):
                        if i:
                            await asyncio.sleep(0.002)
                        choice = (
                            {"index": 0, "delta": {"content": "x"}, "finish_reason": None}
                            if chat
                            else {"index": 0, "text": "x", "finish_reason": None}
                        )
                        yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                    usage = {
                        "prompt_tokens": len(prompt.split()),
                        "completion_tokens": body["max_tokens"],
                        "total_tokens": 0,
                    }
                    yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    self.inflight -= 1

            return StreamingResponse(gen(), media_type="text/event-stream")

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, chat=True)

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])), daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.01)

    def reset(self):
        self.posts = self.max_inflight = 0
        self.bodies = []

    def close(self):
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def stub():
    s = Stub()
    yield s
    s.close()


def bench_args(**kw) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    sb.add_serve_bench_args(p)
    args = p.parse_args([])
    for k, v in kw.items():
        setattr(args, k, v)
    return args


def test_concurrency_failures_and_token_accounting(stub, tmp_path):
    stub.reset()
    out = tmp_path / "res.json"
    args = bench_args(
        base_url=stub.url,
        num_prompts=12,
        max_concurrency=3,
        tokenizer="none",
        random_input_len=20,
        random_output_len=5,
        output_json=str(out),
        disable_tqdm=True,
    )
    res = sb.run_serve_bench(args)
    # 1 warm-up + 12 requests; POSTs 4, 8, 12 fail
    assert stub.posts == 13
    assert res["completed"] == 9 and res["failed"] == 3
    assert res["errors"][0]["count"] == 3 and "HTTP 500" in res["errors"][0]["error"]
    assert res["total_output_tokens"] == 9 * 5 and res["total_input_tokens"] == 9 * 20
    assert res["model"] == "stub-model"
    assert 1 <= stub.max_inflight <= 3
    for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
        d = res[key]
        assert d["p50"] <= d["p90"] <= d["p99"]
    assert res["ttft_ms"]["p50"] >= FIRST_TOKEN_DELAY * 1000  # a lower bound from the stub's sleep
    assert res["e2e_ms"]["p50"] >= res["ttft_ms"]["p50"] * 0.99
    assert res["output_throughput"] > 0 and res["request_throughput"] > 0
    assert json.loads(out.read_text()) == json.loads(json.dumps(res))
    assert all(b["stream"] and b["stream_options"] == {"include_usage": True} and b["ignore_eos"] for b in stub.bodies)


def test_itl_samples_and_summary_from_results():
    rs = [
        sb.RequestResult(ok=True, ttft=0.1, e2e=0.5, itl=[0.1] * 4, input_tokens=10, output_tokens=5, chunks=5),
        sb.RequestResult(ok=True, ttft=0.3, e2e=0.7, itl=[0.2] * 2, input_tokens=10, output_tokens=3, chunks=3),
        sb.RequestResult(ok=False, error="HTTP 503: x"),
    ]
    s = sb.summarize(rs, duration=2.0)
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 4.0 and s["input_throughput"] == 10.0
    assert s["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["mean"] == pytest.approx((0.1 * 4 + 0.2 * 2) / 6 * 1000)
    assert s["tpot_ms"]["mean"] == pytest.approx(((0.4 / 4) + (0.4 / 2)) / 2 * 1000)
    assert s["e2e_ms"]["p50"] == pytest.approx(600.0)


def test_shared_prefix_chat_via_the_cli(stub, tmp_path):
    from workbench.cli import main

    stub.reset()
    out = tmp_path / "gsp.json"
    rc = main(
        [
            "bench",
            "serve",
            "--base-url",
            stub.url,
            "--endpoint",
            "chat",
            "--dataset",
            "shared-prefix",
            "--num-prompts",
            "8",
            "--gsp-num-groups",
            "2",
            "--gsp-system-prompt-len",
            "30",
            "--gsp-question-len",
            "5",
            "--random-output-len",
            "3",
            "--request-rate",
            "200",
            "--tokenizer",
            "none",
            "--warmup-requests",
            "0",
            "--disable-tqdm",
            "--output-json",
            str(out),
        ]
    )
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["dataset"] == "shared-prefix" and res["request_rate"] == 200
    assert res["completed"] + res["failed"] == 8 and res["failed"] == 2
    systems = {b["messages"][0]["content"] for b in stub.bodies}
    assert len(systems) == 2 and all(len(s.split()) == 30 for s in systems)
    assert all(b["messages"][0]["role"] == "system" and b["messages"][1]["role"] == "user" for b in stub.bodies)


def test_poisson_arrivals_have_the_requested_rate():
    gaps = sb.poisson_delays(20000, 8.0, random.Random(0))
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert sb.poisson_delays(5, float("inf"), random.Random(0)) == [0.0] * 5


def test_random_prompts_from_the_default_tokenizer(tokenizer):
    builder = sb.PromptBuilder(tokenizer, random.Random(0))
    args = bench_args(num_prompts=20, random_input_len=64, random_output_len=16, random_range_ratio=0.5)
    reqs = sb.build_requests(args, builder, random.Random(1))
    assert len(reqs) == 20
    assert all(8 <= r.output_len <= 16 for r in reqs)
    assert len({r.output_len for r in reqs}) > 1
    # decoding random ids and re-encoding them does not round-trip exactly; lengths stay close
    assert all(16 <= r.input_len <= 64 * 2 for r in reqs)
    assert all(r.input_len == len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in reqs)
