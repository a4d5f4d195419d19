"""Load and KV pressure on a real server over loopback, the real default model.

- 1,000 requests at 64 concurrency (chat, completions and native /generate; streaming
  and not; 1-16 new tokens; greedy and seeded top-k sampling) against a
  `workbench serve` child process: zero failures, each answer equal to its reference
  (greedy: the prompt's continuation computed once, alone, before the load; seeded:
  a rerun of the same request after it), then every KV slot and request state free.
- A burst far beyond a tiny KV pool: every request completes (retraction) with the
  same tokens as alone; a request that can never fit is refused up front with a 400
  that states the pool size; no deadlock.
- `-m soak`: the same load for longer (WORKBENCH_SOAK_REQUESTS, default 10,000);
  deselected by default (pyproject addopts).
"""

from __future__ import annotations

import asyncio
import os
import random

import httpx
import pytest
from conftest import chat_ids
from reliability_helpers import (
    Outcome,
    Reference,
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
from workbench.core.entrypoints.server_process import ServerProcess

PROMPTS = [
    "Hi",
    "What is 2 + 2?",
    "Name three colors.",
    "Explain in a few words what a radix tree is.",
    "Translate 'good morning' into French and Spanish.",
    "Summarise this text: " + "The quick brown fox jumps over the lazy dog. " * 8,
]
MAX_K = 16
SEEDS = (11, 12)
SAMPLED = {"temperature": 0.8, "top_k": 20}


@pytest.fixture(scope="module")
def load_server():
    srv = ServerProcess(["--dtype", "float32", "--max-total-tokens", "12288"])
    try:
        yield srv
    finally:
        srv.stop(timeout_s=60)


# ---------------------------------------------------------------- the workload


def plan_requests(n: int, seed: int) -> list[dict]:
    """A reproducible mix: which prompt, which route, streamed or not, how many tokens, which seed."""
    rng = random.Random(seed)
    plan = []
    for _ in range(n):
        kind = rng.choice(("chat", "completions", "generate"))
        # /generate takes either form of the prompt; chat always goes through the template.
        form = "chat" if kind == "chat" else ("text" if kind == "completions" else rng.choice(("chat", "text")))
        plan.append(
            dict(
                kind=kind,
                form=form,
                p=rng.randrange(len(PROMPTS)),
                stream=rng.random() < 0.5,
                k=rng.randint(1, MAX_K),
                seed=rng.choice(SEEDS) if rng.random() < 0.3 else None,
            )
        )
    return plan


def request_body(item: dict, input_ids: list[int]) -> tuple[str, dict]:
    k, seed, prompt = item["k"], item["seed"], PROMPTS[item["p"]]
    sampling = {"temperature": 0.0} if seed is None else dict(SAMPLED, seed=seed)
    if item["kind"] == "generate":
        body = {"sampling_params": dict(sampling, max_new_tokens=k), "stream": item["stream"]}
        body.update({"input_ids": input_ids} if item["form"] == "chat" else {"text": prompt})
        return "/generate", body
    body = dict(sampling, model="smollm2-135m", max_tokens=k, stream=item["stream"])
    if item["stream"]:
        body["stream_options"] = {"include_usage": True}
    if item["kind"] == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        return "/v1/chat/completions", body
    body["prompt"] = prompt
    return "/v1/completions", body


def check(item: dict, out: Outcome, ref: Reference, tokenizer) -> str:
    """'' when `out` is complete and equal to what `ref` implies, else why not."""
    if out.status != 200:
        return f"status {out.status}: {out.error or out.body}"
    if item["stream"] and (not out.done or stream_errors(out.events)):
        return f"stream incomplete or in-band error: done={out.done} {stream_errors(out.events)}"
    want_ids, want_finish = ref.expect(item["k"])
    if item["kind"] == "generate":
        ids, finish = generate_result(out)
        if ids != want_ids or finish != want_finish:
            return f"/generate gave {ids} ({finish}), expected {want_ids} ({want_finish})"
        return ""
    text, finish, n_tokens = openai_text("chat" if item["kind"] == "chat" else "completions", out)
    want_text = tokenizer.decode(want_ids, skip_special_tokens=True)
    if text != want_text or finish != want_finish or n_tokens != len(want_ids):
        return (
            f"{item['kind']} gave {text!r} ({finish}, {n_tokens} tokens), expected {want_text!r} "
            f"({want_finish}, {len(want_ids)} tokens)"
        )
    return ""


def run_load(url: str, tokenizer, n: int, concurrency: int, seed: int) -> dict:
    """Send the planned requests; return figures and the list of failures."""
    forms = {
        "chat": [chat_ids(tokenizer, p) for p in PROMPTS],
        "text": [list(tokenizer.encode(p, add_special_tokens=False)) for p in PROMPTS],
    }
    plan = plan_requests(n, seed)
    # Greedy references: each distinct prompt sent alone, before the load.
    greedy: dict[tuple, Reference] = {}
    with httpx.Client(base_url=url) as c:
        for form in ("chat", "text"):
            for p in range(len(PROMPTS)):
                greedy[(form, p)] = fetch_reference(c, forms[form][p], {"max_new_tokens": MAX_K, "temperature": 0.0})
                count("requests")

    async def main():
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as client:
            outs = await gather_bounded(
                [post(client, *request_body(it, forms[it["form"]][it["p"]]), stream=it["stream"]) for it in plan],
                concurrency,
            )
            # Seeded references: a rerun of every seeded request at the longest length.
            keys = sorted({(it["form"], it["p"], it["seed"]) for it in plan if it["seed"] is not None})
            reruns = await gather_bounded(
                [
                    post(
                        client,
                        "/generate",
                        {"input_ids": forms[f][p], "sampling_params": dict(SAMPLED, seed=s, max_new_tokens=MAX_K)},
                        stream=False,
                    )
                    for f, p, s in keys
                ],
                concurrency,
            )
            return outs, dict(zip(keys, reruns))

    outs, reruns = asyncio.run(main())
    failures = []
    for i, (item, out) in enumerate(zip(plan, outs)):
        if item["seed"] is None:
            ref = greedy[(item["form"], item["p"])]
        else:
            rerun = reruns[(item["form"], item["p"], item["seed"])]
            assert rerun.status == 200, rerun.body
            ids, finish = generate_result(rerun)
            ref = Reference(tuple(ids), finish, MAX_K)
        why = check(item, out, ref, tokenizer)
        if why:
            failures.append(f"request {i} {item}: {why}")
    count("unexpected", len(failures))
    return {
        "requests": len(plan),
        "failures": failures,
        "streamed": sum(it["stream"] for it in plan),
        "seeded": sum(it["seed"] is not None for it in plan),
    }


def assert_load_ok(srv: ServerProcess, tokenizer, n: int, concurrency: int, seed: int) -> None:
    children = sorted(srv.descendants())
    figures = run_load(srv.base_url, tokenizer, n, concurrency, seed)
    assert not figures["failures"], f"{len(figures['failures'])} of {n} requests failed:\n" + "\n".join(
        figures["failures"][:10]
    )
    assert 0 < figures["streamed"] < n and 0 < figures["seeded"] < n
    assert_server_clean(srv.base_url)
    # Nothing died or was replaced along the way.
    assert srv.proc.poll() is None and sorted(srv.descendants()) == children
    assert server_info(srv.base_url)["is_healthy"] is True


def test_1000_mixed_requests_at_64_concurrency(load_server, tokenizer):
    assert_load_ok(load_server, tokenizer, n=1000, concurrency=64, seed=20261122)


@pytest.mark.soak
def test_soak(load_server, tokenizer):
    n = int(os.environ.get("WORKBENCH_SOAK_REQUESTS", "10000"))
    assert_load_ok(load_server, tokenizer, n=n, concurrency=64, seed=7)


# ---------------------------------------------------------------- KV pressure

POOL = 256
PRESSURE_PROMPTS = [
    "Once upon a time",
    "The capital of France is",
    "def fibonacci(n):",
    "Three facts about owls:",
    "Dear diary, today",
]
PRESSURE_K = 24


@pytest.fixture(scope="module")
def tiny_pool_url():
    from workbench.core.engine import Engine
    from workbench.core.entrypoints.http_server import bind_socket, start_server

    engine = Engine(show_progress=False, dtype="float32", max_total_tokens=POOL)
    running = start_server(engine, engine.server_args, bind_socket("127.0.0.1", 0))
    try:
        yield running.url
    finally:
        running.stop(timeout_s=5)
        engine.shutdown()


def test_burst_far_beyond_a_tiny_kv_pool_completes_or_is_refused_up_front(tiny_pool_url, tokenizer):
    url = tiny_pool_url
    sampling = {"max_new_tokens": PRESSURE_K, "temperature": 0.0, "ignore_eos": True}
    ids = [list(tokenizer.encode(p, add_special_tokens=False)) for p in PRESSURE_PROMPTS]
    with httpx.Client(base_url=url) as c:
        refs = [fetch_reference(c, i, sampling) for i in ids]
    count("requests", len(refs))
    burst = 40
    demand = sum(len(ids[j % len(ids)]) + PRESSURE_K for j in range(burst))
    assert demand > 4 * POOL  # the burst needs several times the pool

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=600) as client:
            reqs = []
            for j in range(burst):
                p, stream = j % len(ids), j % 3 == 0
                if j % 2:
                    body = {"input_ids": ids[p], "sampling_params": sampling, "stream": stream}
                    reqs.append(post(client, "/generate", body, stream))
                else:
                    body = {
                        "prompt": PRESSURE_PROMPTS[p],
                        "max_tokens": PRESSURE_K,
                        "temperature": 0,
                        "ignore_eos": True,
                        "stream": stream,
                    }
                    if stream:
                        body["stream_options"] = {"include_usage": True}
                    reqs.append(post(client, "/v1/completions", body, stream))
            return await asyncio.gather(*reqs)

    outs = asyncio.run(main())
    failures = []
    for j, out in enumerate(outs):
        item = {"kind": "generate" if j % 2 else "completions", "k": PRESSURE_K, "stream": j % 3 == 0}
        why = check(item, out, refs[j % len(ids)], tokenizer)
        if why:
            failures.append(f"burst request {j}: {why}")
    count("unexpected", len(failures))
    assert not failures, "\n".join(failures[:10])
    # The metric is folded from the scheduler's trace events, which travel their own socket.
    wait_for(
        lambda: server_info(url)["metrics"]["num_retracted_reqs"] > 0,
        30,
        "the retractions the burst should have forced (num_retracted_reqs)",
    )

    # A request that can never fit in the pool is refused before it is queued, saying why.
    never = [
        ("/v1/completions", {"prompt": "hello " * (POOL + 20), "max_tokens": 4}),
        ("/v1/completions", {"prompt": PRESSURE_PROMPTS[0], "max_tokens": POOL}),
        ("/generate", {"input_ids": [1] * (POOL + 1), "sampling_params": {"max_new_tokens": 1}}),
    ]
    for path, body in never:
        r = httpx.post(url + path, json=body, timeout=60)
        count("requests")
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert str(POOL) in msg and "--max-total-tokens" in msg, msg
    assert_server_clean(url)
