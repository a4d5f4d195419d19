"""`workbench bench serve --peer vllm --peer-python PATH`: both servers, one client, one run.

Starts `workbench serve` and `vllm serve` (vLLM from its own venv, through `vllm_cli.py`) on the same
HF directory (the default model converted from its GGUF), the same dtype and KV budget, prefix caching
on in both, then runs vLLM's own load generator, `vllm bench serve` (random dataset, `--ignore-eos`,
the same seed, so the same prompts), against each server in rounds of A B B A. Both servers stay up
for the whole run; the idle one's CPU use is measured while the other serves (it should be ~0).
The table gives medians of output tok/s, TTFT and TPOT, the ratio workbench / vLLM, and each side's
GEMM GFLOP/s (prompt tokens through the layers' linears, output tokens through them and the LM head,
at the measured rates) as a share of this machine's compute peak (`workbench bench peak`).

Thread configurations as `bench engine --peer vllm`: "default" (each server's own default) and
"all N" (workbench `--num-threads N`, vLLM `VLLM_CPU_OMP_THREADS_BIND` = every CPU).
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.bench.gemm_work import LinearShapes
from workbench.bench.harness import attempt, bench_cpus, goal_text, interleave, load_range, print_failures, progress
from workbench.bench.peak import fraction_text, gemm_text, get_peak, peak_gflops, peak_note
from workbench.bench.peer_bench import GOAL
from workbench.bench.peers import PeerError, VllmPeer, thread_configs

VLLM_CLI = Path(__file__).with_name("vllm_cli.py")
SERVED_NAME = "bench-model"
START_TIMEOUT_S = 1800  # vLLM compiles the model at start: minutes on a busy 2-core machine
METRICS = (
    "output_throughput",
    "request_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "median_itl_ms",
    "completed",
)


def vllm_serve_command(
    python: str, model_dir: str, port: int, dtype: str, max_model_len: int, kv_gib: float, seed: int
) -> list[str]:
    return [
        python,
        str(VLLM_CLI),
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--enable-prefix-caching",
        "--kv-cache-memory-bytes",
        str(int(kv_gib * 2**30)),
        "--seed",
        str(seed),
        "--served-model-name",
        SERVED_NAME,
        "--generation-config",
        "vllm",
    ]


def bench_serve_command(python: str, base_url: str, tokenizer: str, args, result_dir: str, name: str) -> list[str]:
    """`vllm bench serve` with this run's dataset: the same seed, so the same prompts for both servers."""
    return [
        python,
        str(VLLM_CLI),
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        tokenizer,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.random_input_len),
        "--random-output-len",
        str(args.random_output_len),
        "--random-range-ratio",
        str(args.random_range_ratio),
        "--num-prompts",
        str(args.num_prompts),
        "--max-concurrency",
        str(args.max_concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(args.seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        result_dir,
        "--result-filename",
        name,
        "--ready-check-timeout-sec",
        "0",
    ]


def read_result(path: Path) -> dict:
    """The metrics this bench reports, from `vllm bench serve --save-result`'s JSON."""
    data = json.loads(Path(path).read_text())
    missing = [k for k in METRICS if k not in data]
    if missing:
        raise PeerError(f"{path}: `vllm bench serve` result lacks {missing}")
    out = {k: float(data[k]) for k in METRICS}
    out["failed"] = float(data.get("num_prompts", data["completed"]) - data["completed"])
    # prompt + output tokens a second (vLLM's client writes it; NaN where an older one does not)
    out["total_token_throughput"] = float(data.get("total_token_throughput", float("nan")))
    return out


def served_gemm_gflops(metrics: dict, shapes: LinearShapes) -> float | None:
    """A side's GEMM GFLOP/s: prompt tokens a second through the layers' linears (no prefix shared:
    random prompts) plus output tokens a second through them and the LM head."""
    out, total = metrics.get("output_throughput"), metrics.get("total_token_throughput")
    if not out or total is None or total != total:
        return None
    body, head = shapes.body_flops_per_token(), shapes.head_flops_per_token()
    return (max(0.0, total - out) * body + out * (body + head)) / 1e9


@dataclass
class ServedRow:
    threads: str
    dtype: str
    concurrency: int
    workbench: dict  # metric -> median
    vllm: dict
    ratio: float  # output tok/s, workbench / vLLM
    samples: dict = field(default_factory=dict)  # side -> list of result dicts
    load_1m: list = field(default_factory=list)
    idle_cores: dict = field(default_factory=dict)  # side -> mean cores its server used while idle
    gemm_gflops: dict = field(default_factory=dict)  # side -> GEMM GFLOP/s at its median rates
    peak_gflops: float | None = None  # the machine's compute peak for the dtype on the bench's cores


def median_metrics(results: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in results) for k in results[0]}


def format_served_table(rows: list[ServedRow]) -> str:
    lines = [
        f"| threads | dtype | concurrency | workbench out tok/s | vLLM out tok/s | ratio | goal {GOAL:g}× "
        "| workbench GEMM GFLOP/s (% of peak) | vLLM % of peak "
        "| TTFT p50 ms (wb / vLLM) | TPOT p50 ms (wb / vLLM) | failed (wb / vLLM) | idle server's CPU (wb, vLLM) "
        "| load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        w, v = r.workbench, r.vllm
        load = load_range(r.load_1m)
        idle = ", ".join(f"{r.idle_cores.get(s, float('nan')):.2f}" for s in ("workbench", "vLLM"))
        lines.append(
            f"| {r.threads} | {r.dtype} | {r.concurrency} | {w['output_throughput']:.1f} "
            f"| {v['output_throughput']:.1f} | {r.ratio:.2f}× | {goal_text(r.ratio, GOAL)} "
            f"| {gemm_text(r.gemm_gflops.get('workbench'), r.peak_gflops)} "
            f"| {fraction_text(r.gemm_gflops.get('vLLM'), r.peak_gflops)} "
            f"| {w['median_ttft_ms']:.0f} / {v['median_ttft_ms']:.0f} "
            f"| {w['median_tpot_ms']:.1f} / {v['median_tpot_ms']:.1f} "
            f"| {w['failed']:.0f} / {v['failed']:.0f} | {idle} | {load} |"
        )
    return "\n".join(lines)


def wait_ready(base_url: str, proc: subprocess.Popen, timeout_s: float, log_path: Path) -> None:
    """Poll GET /v1/models until it answers; PeerError with the log's tail if the server exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise PeerError(
                f"the server exited (status {proc.returncode}) while starting; "
                f"log {log_path}:\n{log_path.read_text(errors='replace')[-3000:]}"
            )
        try:
            with urllib.request.urlopen(base_url + "/v1/models", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(2)
    raise PeerError(f"{base_url} not ready in {timeout_s:.0f} s; log {log_path}")


def _stop(proc: subprocess.Popen | None) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_served_peer(args) -> list[ServedRow] | None:
    """The served comparison; None (after printing the install recipe) when the peer cannot run."""
    python, reply = VllmPeer.locate(args.peer_python)
    if python is None:
        return None
    detail = str(reply.get("vllm_version"))
    from workbench.core.entrypoints.server_process import ServerProcess, free_port
    from workbench.core.model_executor.model_runner import DEFAULT_CPU_KV_GB
    from workbench.core.model_loader import prepare_model

    prepared = prepare_model(None, progress=True)
    model_dir, shapes = str(prepared.model_dir), LinearShapes.from_config(prepared.config)
    dtype = args.dtype if args.dtype != "auto" else "float32"
    kv_gib = args.kv_cache_memory_gb or DEFAULT_CPU_KV_GB
    max_len = -(-(args.random_input_len + args.random_output_len + 64) // 256) * 256
    cpus = bench_cpus()
    peak = get_peak(len(cpus))  # this machine's compute peak (cached per machine): the GEMM columns' yardstick
    work = Path(tempfile.mkdtemp(prefix="workbench-served-peer-"))
    rows: list[ServedRow] = []
    failures: list[str] = []

    def save() -> None:
        if args.output_json:
            Path(args.output_json).write_text(
                json.dumps(
                    {
                        "peer": "vllm",
                        "vllm_version": detail,
                        "rows": [asdict(r) for r in rows],
                        "table": format_served_table(rows),
                        "failures": failures,
                    },
                    indent=2,
                )
            )

    for tc in thread_configs(args.peer_threads, cpus):
        server = vproc = None
        with attempt(failures, f"threads {tc.name}"):
            try:
                wb_args = ["--dtype", dtype, "--served-model-name", SERVED_NAME, "--kv-cache-memory-gb", str(kv_gib)]
                if tc.workbench_threads:
                    wb_args += ["--num-threads", str(tc.workbench_threads)]
                progress(f"threads {tc.name}: starting workbench serve {' '.join(wb_args)}")
                server = ServerProcess(wb_args, start_timeout_s=START_TIMEOUT_S)
                port = free_port()
                log = work / f"vllm-serve-{tc.name.replace(' ', '')}.log"
                env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
                if tc.vllm_bind:
                    env["VLLM_CPU_OMP_THREADS_BIND"] = tc.vllm_bind
                progress(f"threads {tc.name}: starting vllm serve (log {log}; it compiles the model: minutes)")
                with open(log, "w") as logf:
                    vproc = subprocess.Popen(
                        vllm_serve_command(python, model_dir, port, dtype, max_len, kv_gib, args.seed),
                        stdout=logf,
                        stderr=subprocess.STDOUT,
                        env=env,
                        start_new_session=True,
                    )
                vurl = f"http://127.0.0.1:{port}"
                wait_ready(vurl, vproc, START_TIMEOUT_S, log)
                sides = {"workbench": (server.base_url, [server.proc.pid]), "vLLM": (vurl, [vproc.pid])}
                progress(f"threads {tc.name}: warm-up, both servers")
                for side, (url, _) in sides.items():
                    _run_client(python, url, model_dir, args, work, f"warmup-{side}", warmup=True)

                runs = itertools.count()  # names each result file: round, place in the round, side

                def client(side: str) -> dict:
                    i = next(runs)
                    name = f"{tc.name.replace(' ', '')}-{i // 4}-{i % 4}-{side}.json"
                    return _run_client(python, sides[side][0], model_dir, args, work, name)

                def report(turn, res, load1, idle):
                    progress(
                        f"threads {tc.name} {turn.tag} {turn.side:<9} "
                        f"{res['output_throughput']:8.1f} out tok/s, TTFT p50 {res['median_ttft_ms']:.0f} ms, "
                        f"TPOT p50 {res['median_tpot_ms']:.1f} ms, failed {res['failed']:.0f}   "
                        f"(load 1m {load1:.2f}; idle {turn.other} used {idle:.2f} cores)"
                    )

                got = interleave(
                    {side: (lambda side=side: client(side)) for side in sides},
                    args.repeats,
                    report,
                    {side: pids for side, (_, pids) in sides.items()},
                )
                results, loads, idle = got.samples, got.loads, got.idle_cores
                w, v = median_metrics(results["workbench"]), median_metrics(results["vLLM"])
                rows.append(
                    ServedRow(
                        tc.name,
                        dtype,
                        args.max_concurrency,
                        w,
                        v,
                        w["output_throughput"] / v["output_throughput"],
                        results,
                        loads,
                        {k: statistics.mean(x) for k, x in idle.items()},
                        {"workbench": served_gemm_gflops(w, shapes), "vLLM": served_gemm_gflops(v, shapes)},
                        peak_gflops(peak, dtype, len(cpus)),
                    )
                )
                save()
            finally:
                _stop(vproc)
                if server is not None:
                    server.stop()
    print()
    print(format_served_table(rows))
    print(peak_note(peak, [(dtype, len(cpus))]))
    print(
        f"client: `vllm bench serve` (random, input {args.random_input_len}, output {args.random_output_len}, "
        f"range ratio {args.random_range_ratio}, {args.num_prompts} prompts, --ignore-eos, seed {args.seed}) "
        f"against each server, A B B A x {args.repeats}, medians; ratio = output tok/s workbench / vLLM; "
        f"KV budget {kv_gib:g} GiB each; results and logs in {work}"
    )
    print_failures(failures)
    save()
    if failures:
        raise PeerError(f"{len(failures)} configuration(s) not measured (above); the table holds the rest")
    return rows


def _run_client(
    python: str, base_url: str, tokenizer: str, args, work: Path, name: str, warmup: bool = False
) -> dict | None:
    """One `vllm bench serve` run against `base_url`; its metrics (None for a warm-up)."""
    if warmup:  # a few prompts, so both servers have compiled and cached what they need
        args = type(args)(
            **{**vars(args), "num_prompts": min(8, args.num_prompts), "max_concurrency": min(8, args.max_concurrency)}
        )
    cmd = bench_serve_command(python, base_url, tokenizer, args, str(work), name)
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=3600, env=dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    )
    if proc.returncode != 0:
        raise PeerError(
            f"`vllm bench serve` against {base_url} failed (status {proc.returncode}):\n"
            f"{proc.stdout[-1500:]}\n{proc.stderr[-1500:]}"
        )
    return None if warmup else read_result(work / name)
