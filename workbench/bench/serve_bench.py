"""`workbench bench serve`: a load generator for any OpenAI-compatible server.

Sends streaming requests to `/v1/completions` (or `/v1/chat/completions`) with
a Poisson request rate and/or a concurrency cap, over synthetic datasets:

- `random`: prompts of `--random-input-len` tokens (uniform in
  [len * ratio, len] with `--random-range-ratio` < 1), decoded from random
  token ids of a tokenizer (`--tokenizer`, default: the default model's; `none`
  uses random words, for servers whose tokenizer you lack);
- `shared-prefix`: `--gsp-num-groups` groups, each with its own system prompt of
  `--gsp-system-prompt-len` tokens, followed by a `--gsp-question-len`-token
  question (exercises the prefix cache).

Measures per request TTFT (first content chunk), ITL (gaps between content
chunks), E2E and TPOT; reports request throughput, input/output tokens/s and
mean/p50/p90/p99 of each latency; token counts come from the server's `usage`
(`stream_options.include_usage`) and fall back to counting content chunks.
Prints a table, saves JSON with `--output-json`, shows a progress bar (stderr).

    workbench bench serve --base-url http://127.0.0.1:30000 --num-prompts 64 --max-concurrency 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from workbench.bench.harness import progress_bar
from workbench.bench.prompts import PromptBuilder

# ---------------------------------------------------------------- CLI


def add_serve_bench_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `workbench bench serve` (SGLang bench_serving's names where they exist)."""
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:30000", help="server root (without /v1)")
    a(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions (raw prompts) or /v1/chat/completions",
    )
    a("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    a("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key (default: $OPENAI_API_KEY)")
    a("--num-prompts", type=int, default=100)
    a("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    a(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (default inf: send all at once, bounded by --max-concurrency)",
    )
    a("--dataset", "--dataset-name", dest="dataset", choices=("random", "shared-prefix"), default="random")
    a("--random-input-len", type=int, default=256)
    a("--random-output-len", type=int, default=64)
    a(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="lengths are uniform in [len * ratio, len]; 1.0 = fixed lengths",
    )
    a("--gsp-num-groups", type=int, default=4, help="shared-prefix: number of distinct system prompts")
    a("--gsp-system-prompt-len", type=int, default=512)
    a("--gsp-question-len", type=int, default=64)
    a("--tokenizer", default=None, help="tokenizer dir for building prompts; 'none' = random words")
    a("--temperature", type=float, default=0.0)
    a(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos (servers that reject unknown fields)",
    )
    a("--warmup-requests", type=int, default=1)
    a("--timeout", type=float, default=600.0, help="per-request timeout (s)")
    a("--seed", type=int, default=0)
    a("--output-json", default=None, help="write the results as JSON here")
    a("--disable-tqdm", action="store_true")
    g = parser.add_argument_group(
        "against vLLM-CPU (workbench/bench/served_peer.py): start both servers, run "
        "`vllm bench serve` against each, A B B A"
    )
    g.add_argument(
        "--peer",
        choices=("none", "vllm"),
        default="none",
        help="vllm: ignore --base-url, start `workbench serve` and `vllm serve` on the same model and "
        "compare them through vLLM's own client",
    )
    g.add_argument(
        "--peer-python",
        default=os.environ.get("WORKBENCH_VLLM_PYTHON"),
        metavar="PATH",
        help="python of a venv with vllm-cpu (default $WORKBENCH_VLLM_PYTHON); without one the "
        "install recipe is printed",
    )
    g.add_argument(
        "--peer-threads",
        choices=("default", "all", "both"),
        default="default",
        help="each server's default threads, every CPU for both, or both configurations",
    )
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="both servers' dtype")
    g.add_argument(
        "--kv-cache-memory-gb",
        type=float,
        default=None,
        help="KV budget of each server (default: workbench's CPU default, 0.5 GiB)",
    )
    g.add_argument("--repeats", type=int, default=1, help="rounds of A B B A (medians reported)")
    g.add_argument(
        "--pd",
        action="store_true",
        help="ignore --base-url: start one co-located `workbench serve`, a prefill and a decode server behind "
        "sglang_router --pd-disaggregation, and compare TTFT and TPOT on this workload (workbench/bench/pd_bench.py)",
    )


# ---------------------------------------------------------------- data


@dataclass
class BenchRequest:
    prompt: Any  # str, or chat messages
    input_len: int  # tokens, as built (the server's usage wins when it reports one)
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    input_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0


def _length(rng: random.Random, n: int, ratio: float) -> int:
    lo = max(1, int(n * ratio))
    return n if lo >= n else rng.randint(lo, n)


def build_requests(args, builder: PromptBuilder, rng: random.Random) -> list[BenchRequest]:
    """The dataset as a list of requests (deterministic for a seed)."""
    chat = args.endpoint == "chat"
    out = []
    if args.dataset == "random":
        for _ in range(args.num_prompts):
            n_in = _length(rng, args.random_input_len, args.random_range_ratio)
            n_out = _length(rng, args.random_output_len, args.random_range_ratio)
            text = builder.text(n_in)
            prompt = [{"role": "user", "content": text}] if chat else text
            out.append(BenchRequest(prompt, builder.count(text), n_out))
        return out
    groups = [builder.text(args.gsp_system_prompt_len) for _ in range(max(1, args.gsp_num_groups))]
    for i in range(args.num_prompts):
        system = groups[i % len(groups)]
        question = builder.text(args.gsp_question_len)
        if chat:
            prompt = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        else:
            prompt = system + "\n" + question
        n_out = _length(rng, args.random_output_len, args.random_range_ratio)
        out.append(BenchRequest(prompt, builder.count(system) + builder.count(question) + 1, n_out))
    rng.shuffle(out)
    return out


def poisson_delays(n: int, rate: float, rng: random.Random) -> list[float]:
    """Gaps before each request: exponential with mean 1/rate (all 0 for an infinite rate)."""
    if math.isinf(rate) or rate <= 0:
        return [0.0] * n
    return [rng.expovariate(rate) for _ in range(n)]


# ---------------------------------------------------------------- client


def _payload(args, model: str, req: BenchRequest) -> dict:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.endpoint == "chat":
        body["messages"] = req.prompt
    else:
        body["prompt"] = req.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    return body


async def send_request(client, url: str, body: dict, headers: dict, input_len: int) -> RequestResult:
    """One streaming request; never raises (failures are results)."""
    res = RequestResult(input_tokens=input_len)
    start = time.perf_counter()
    last = start
    usage = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                res.error = f"HTTP {resp.status_code}: {text[:300]}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    res.error = f"stream error: {obj['error']}"[:300]
                    return res
                usage = obj.get("usage") or usage
                for ch in obj.get("choices") or []:
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.perf_counter()
                        if res.chunks == 0:
                            res.ttft = now - start
                        else:
                            res.itl.append(now - last)
                        last = now
                        res.chunks += 1
    except Exception as e:  # noqa: BLE001 - a failed request is a data point
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.e2e = time.perf_counter() - start
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.input_tokens = int(usage.get("prompt_tokens") or input_len)
    else:
        res.output_tokens = res.chunks
    res.ok = res.chunks > 0 or res.output_tokens == 0
    if not res.ok:
        res.error = "no content received"
    return res


async def _discover_model(client, base_url: str, headers: dict, wait_s: float = 300.0) -> str:
    """The first model the server lists; waits (with a message) while the server is still starting."""
    import httpx

    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            r = await client.get(base_url + "/v1/models", headers=headers)
            if r.status_code != 503:
                break
        except httpx.TransportError as e:
            r = None
            if time.monotonic() > deadline:
                raise ConnectionError(f"cannot reach {base_url} ({e}); is the server running?") from None
        if time.monotonic() > deadline:
            raise ConnectionError(f"{base_url} still answers 503 after {wait_s:.0f} s; check the server's log")
        if not told:
            print(f"[bench] waiting for {base_url} to become ready ...", flush=True)
            told = True
        await asyncio.sleep(1.0)
    if r.status_code in (401, 403):
        raise ConnectionError(f"{base_url} refused the key ({r.status_code}); pass --api-key or set OPENAI_API_KEY")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def run_benchmark(
    args, requests: list[BenchRequest], rng: random.Random
) -> tuple[list[RequestResult], float, str]:
    """Send every request; returns (results in request order, duration in s, model)."""
    import httpx

    base = args.base_url.rstrip("/")
    url = base + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(
        max_connections=max(args.max_concurrency or len(requests), 1) + 4,
        max_keepalive_connections=max(args.max_concurrency or len(requests), 1) + 4,
    )
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=30), limits=limits) as client:
        model = args.model or await _discover_model(client, base, headers)
        for req in requests[: max(0, args.warmup_requests)]:
            warm = BenchRequest(req.prompt, req.input_len, min(req.output_len, 8))
            res = await send_request(client, url, _payload(args, model, warm), headers, warm.input_len)
            if not res.ok:
                raise RuntimeError(f"the warm-up request failed: {res.error}")
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = progress_bar(len(requests), args.disable_tqdm)
        results: list[RequestResult | None] = [None] * len(requests)

        async def one(i: int, req: BenchRequest):
            if sem is not None:
                async with sem:
                    results[i] = await send_request(client, url, _payload(args, model, req), headers, req.input_len)
            else:
                results[i] = await send_request(client, url, _payload(args, model, req), headers, req.input_len)
            bar.update(1)

        delays = poisson_delays(len(requests), args.request_rate, rng)
        start = time.perf_counter()
        tasks = []
        for i, (req, gap) in enumerate(zip(requests, delays)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.ensure_future(one(i, req)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return [r for r in results if r is not None], duration, model


# ---------------------------------------------------------------- statistics


def _dist(values: list[float]) -> dict[str, float | None]:
    """mean/p50/p90/p99 in milliseconds (None without samples)."""
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    import numpy as np

    arr = np.asarray(values, dtype=float) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p90": float(np.percentile(arr, 90)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.input_tokens for r in ok)
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    dur = max(duration, 1e-9)
    errors: dict[str, int] = {}
    for r in failed:
        errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "completed": len(ok),
        "failed": len(failed),
        "errors": [{"error": k, "count": v} for k, v in sorted(errors.items(), key=lambda kv: -kv[1])[:5]],
        "duration_s": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / dur,
        "input_throughput": in_tokens / dur,
        "output_throughput": out_tokens / dur,
        "ttft_ms": _dist([r.ttft for r in ok if r.chunks]),
        "itl_ms": _dist([x for r in ok for x in r.itl]),
        "tpot_ms": _dist(tpots),
        "e2e_ms": _dist([r.e2e for r in ok]),
    }


def format_table(res: dict[str, Any]) -> str:
    def f(v, nd=2):
        return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))

    rows = [
        ("Endpoint", res["url"]),
        ("Model", res["model"]),
        ("Dataset", res["dataset"]),
        ("Max concurrency", res["max_concurrency"] or "-"),
        ("Request rate (req/s)", f(res["request_rate"])),
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Duration (s)", f(res["duration_s"])),
        ("Total input tokens", res["total_input_tokens"]),
        ("Total output tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", f(res["request_throughput"])),
        ("Input throughput (tok/s)", f(res["input_throughput"])),
        ("Output throughput (tok/s)", f(res["output_throughput"])),
    ]
    width = max(len(k) for k, _ in rows) + 2
    lines = ["=" * 20 + " Serving Benchmark Result " + "=" * 20]
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    lines.append(f"{'':<{width}}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for name, key in (
        ("TTFT (ms)", "ttft_ms"),
        ("ITL (ms)", "itl_ms"),
        ("TPOT (ms)", "tpot_ms"),
        ("E2E latency (ms)", "e2e_ms"),
    ):
        d = res[key]
        lines.append(f"{name:<{width}}" + "".join(f"{f(d[q]):>10}" for q in ("mean", "p50", "p90", "p99")))
    for e in res["errors"]:
        lines.append(f"  error x{e['count']}: {e['error']}")
    lines.append("=" * 66)
    return "\n".join(lines)


# ---------------------------------------------------------------- entry point


def load_bench_tokenizer(spec: str | None):
    """The tokenizer prompts are built with: --tokenizer DIR, none (random words), or the default model's."""
    if spec and spec.lower() == "none":
        return None
    from workbench.core.model_loader import load_tokenizer, prepare_model

    if spec:
        return load_tokenizer(spec)
    return load_tokenizer(prepare_model(None, progress=False).model_dir)


def run_serve_bench(args: argparse.Namespace, tokenizer: Any = "auto") -> dict[str, Any]:
    """Run the benchmark described by `args` (see add_serve_bench_args); print the table and
    return the results (also written to --output-json). `tokenizer` overrides --tokenizer."""
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be at least 1")
    rng = random.Random(args.seed)
    tok = load_bench_tokenizer(args.tokenizer) if tokenizer == "auto" else tokenizer
    requests = build_requests(args, PromptBuilder(tok, rng), rng)
    results, duration, model = asyncio.run(run_benchmark(args, requests, rng))
    res = {
        "url": args.base_url,
        "endpoint": args.endpoint,
        "model": model,
        "dataset": args.dataset,
        "num_prompts": args.num_prompts,
        "max_concurrency": args.max_concurrency,
        "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "seed": args.seed,
        **summarize(results, duration),
    }
    print(format_table(res))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(res, f, indent=2)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench bench serve", description=__doc__.split("\n\n")[0])
    add_serve_bench_args(parser)
    res = run_serve_bench(parser.parse_args(argv))
    return 0 if res["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())

__all__ = [
    "add_serve_bench_args",
    "run_serve_bench",
    "summarize",
    "build_requests",
    "poisson_delays",
    "send_request",
    "RequestResult",
    "BenchRequest",
]
