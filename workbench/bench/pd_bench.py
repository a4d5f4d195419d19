"""`workbench bench serve --pd`: disaggregated prefill/decode against one co-located engine, same cores.

Starts three `workbench serve` processes on this machine — one co-located, one `--disaggregation-mode
prefill` and one `--disaggregation-mode decode` — and SGLang's router in PD mode in front of the pair
(`python -m sglang_router.launch_router --pd-disaggregation`), then sends the same workload (this bench's
own client: the prompts, lengths and seed of `bench serve`) to the co-located server and to the router,
in rounds of A B B A, and prints TTFT and TPOT percentiles side by side. The idle side's CPU use is
measured while the other serves (it should be ~0).

What it shows on a CPU box: both sides share the same cores, so PD cannot add compute; what changes is
that a decode step never waits behind a long prefill (TPOT steadier) while every prompt's KV crosses a
socket and the first token waits for the handover (TTFT longer). DistServe's trade-off, measured.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

from workbench.bench.harness import bench_cpus, interleave, load_range, progress
from workbench.bench.serve_bench import PromptBuilder, build_requests, run_benchmark, summarize

SIDES = ("co-located", "1P1D")
QUANTILES = (("ttft_ms", "p50"), ("ttft_ms", "p99"), ("tpot_ms", "p50"), ("tpot_ms", "p99"))


@dataclass
class PDRow:
    side: str
    output_throughput: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    failed: int


def _router(prefill_url: str, bootstrap_port: int, decode_url: str) -> tuple[subprocess.Popen, str]:
    from workbench.core.entrypoints.server_process import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    cmd += ["--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port())]
    cmd += ["--policy", "round_robin", "--log-level", "warn"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    import httpx

    deadline = time.monotonic() + 120
    while True:  # ready once a request goes through both servers
        if proc.poll() is not None:
            raise RuntimeError(f"sglang_router exited: {proc.stderr.read().decode(errors='replace')[-2000:]}")
        try:
            body = {"text": "Hi", "sampling_params": {"max_new_tokens": 2}}
            if httpx.post(url + "/generate", json=body, timeout=30).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError("sglang_router did not pass a request to the PD pair within 120 s")
        time.sleep(0.5)


def _measure(args: argparse.Namespace, url: str, tokenizer, warmup: bool = False) -> dict:
    """One run of the workload against `url` (the same prompts every time: the seed is fixed)."""
    run = argparse.Namespace(**vars(args))
    run.base_url, run.model, run.disable_tqdm = url, "default", True
    if warmup:
        run.num_prompts, run.max_concurrency = min(4, args.num_prompts), min(4, args.max_concurrency or 4)
    rng = random.Random(args.seed)
    requests = build_requests(run, PromptBuilder(tokenizer, rng), rng)
    results, duration, _ = asyncio.run(run_benchmark(run, requests, rng))
    return summarize(results, duration)


def format_pd_table(rows: list[PDRow]) -> str:
    lines = [
        "| side | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.side} | {r.output_throughput:.1f} | {r.ttft_p50:.0f} | {r.ttft_p99:.0f} | {r.tpot_p50:.1f} "
            f"| {r.tpot_p99:.1f} | {r.failed} |"
        )
    return "\n".join(lines)


def run_pd_compare(args: argparse.Namespace) -> list[PDRow] | None:
    """The comparison; None (after saying what to install) without sglang-router."""
    try:
        import sglang_router  # noqa: F401 - only its launcher is run, as a process
    except ImportError:
        print("workbench: --pd fronts the pair with SGLang's router: pip install sglang-router", file=sys.stderr)
        return None
    from workbench.bench.serve_bench import load_bench_tokenizer
    from workbench.core.entrypoints.server_process import ServerProcess, free_port
    from workbench.core.simulation.calibration import cpu_model

    tokenizer = load_bench_tokenizer(args.tokenizer)
    common = ["--dtype", args.dtype, "--served-model-name", "default"]
    if args.kv_cache_memory_gb:
        common += ["--kv-cache-memory-gb", str(args.kv_cache_memory_gb)]
    bootstrap = free_port()
    servers: list[ServerProcess] = []
    router = None
    try:
        progress("starting the co-located server, the prefill server and the decode server")
        colo = ServerProcess(common, wait=False)
        prefill = ServerProcess(
            common + ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)], wait=False
        )
        decode = ServerProcess(common + ["--disaggregation-mode", "decode"], wait=False)
        servers = [colo, prefill, decode]
        for s in servers:
            s.wait_healthy(600)
        progress("starting sglang_router --pd-disaggregation in front of the pair")
        router, router_url = _router(prefill.base_url, bootstrap, decode.base_url)
        urls = {"co-located": colo.base_url, "1P1D": router_url}
        pids = {
            "co-located": [colo.proc.pid, *colo.descendants()],
            "1P1D": [router.pid] + [pid for s in (prefill, decode) for pid in (s.proc.pid, *s.descendants())],
        }
        for side, url in urls.items():
            progress(f"warm-up: {side}")
            _measure(args, url, tokenizer, warmup=True)

        def report(turn, res, load1, idle):
            progress(
                f"{turn.tag} {turn.side:<10} {res['output_throughput']:7.1f} out tok/s, TTFT p50 "
                f"{res['ttft_ms']['p50'] or 0:.0f} ms, TPOT p50 {res['tpot_ms']['p50'] or 0:.1f} ms, failed "
                f"{res['failed']}   (load 1m {load1:.2f}; idle {turn.other} used {idle or 0:.2f} cores)"
            )

        got = interleave(
            {side: (lambda url=url: _measure(args, url, tokenizer)) for side, url in urls.items()},
            args.repeats,
            report,
            pids,
        )
        rows = []
        for side in SIDES:
            samples = got.samples[side]
            med = {f"{k}_{q}": statistics.median(s[k][q] or 0.0 for s in samples) for k, q in QUANTILES}
            rows.append(
                PDRow(
                    side,
                    statistics.median(s["output_throughput"] for s in samples),
                    med["ttft_ms_p50"],
                    med["ttft_ms_p99"],
                    med["tpot_ms_p50"],
                    med["tpot_ms_p99"],
                    sum(s["failed"] for s in samples),
                )
            )
    finally:
        if router is not None:
            router.terminate()
        for s in servers:
            s.stop()
    print()
    print(format_pd_table(rows))
    c, p = rows
    print(
        f"ratios 1P1D / co-located: TTFT p50 {p.ttft_p50 / max(c.ttft_p50, 1e-9):.2f}x, TPOT p50 "
        f"{p.tpot_p50 / max(c.tpot_p50, 1e-9):.2f}x, out tok/s {p.output_throughput / max(c.output_throughput, 1e-9):.2f}x"
    )
    print(
        f"workload: {args.dataset}, input {args.random_input_len}, output {args.random_output_len}, "
        f"{args.num_prompts} prompts, concurrency {args.max_concurrency}, rate {args.request_rate}, seed {args.seed}; "
        f"A B B A x {args.repeats}, medians; {args.dtype}; CPU {cpu_model()} ({len(bench_cpus())} cores), "
        f"load 1m {load_range(got.loads)}; the three servers and the router share these cores"
    )
    return rows
