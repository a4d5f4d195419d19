"""`workbench bench engine --peer llamacpp --peer-python PATH`: the Engine beside llama.cpp at batch 1, in one run.

llama.cpp (`llama-cpp-python`, built from source with native CPU flags) lives in a separate venv; this process
never imports it. It starts `llamacpp_peer.py` (same folder) with PATH and drives it over line-delimited JSON (peers.py's LlamaCppPeer).

Both sides run the same weights: the engine serves the default model's GGUF dequantized into an HF directory
(the converted-model cache of core/model_loader); that directory is converted once more, by llama.cpp's own
`convert_hf_to_gguf.py`, into a float32 or bfloat16 GGUF, cached under `$WORKBENCH_CACHE_DIR/llamacpp/`
(default ~/.cache/workbench). The converter is taken from the llama-cpp-python sdist of the peer's version
(downloaded with pip once, its converter files kept in the same cache) and run with this project's Python,
which has torch and transformers.

Workload (iii) of peer_bench only: batch 1, the same 64-token prompt, decode tok/s = 127 / (time for 128 new -
time for 1 new), so the prefill and the first token are subtracted on both sides; greedy, EOS ignored, nothing
reused between runs (the engine's radix cache is flushed, llama.cpp's state is reset). For every dtype and
thread count N, one workbench Engine (num_threads=N) and one llama.cpp model (n_threads=N) stay up, measured
in rounds of A B B A (workbench, llama.cpp, llama.cpp, workbench), `--repeats` rounds; medians, with the
1-minute load average beside every measurement. The goal (issue #14): stay ahead of llama.cpp at equal dtype,
float32 included (ratio >= 1.0).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.bench import harness
from workbench.bench.llamacpp_peer import missing_cpu_features
from workbench.bench.peer_wire import FIRST_IDS
from workbench.bench.peers import LlamaCppPeer, LlamaCppPeerError, RunFn, measure, workbench_run
from workbench.bench.prompts import Workload, build_workloads

GOAL = 1.0  # workbench decode tok/s over llama.cpp's: stay ahead (printed, never asserted)
GOAL_TEXT = "stay ahead of llama.cpp at equal dtype (ratio >= 1.0×)"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> convert_hf_to_gguf.py --outtype
CONVERT_TIMEOUT_S = 1800


# ---- GGUF files of the engine's weights ---------------------------------------------------------------
def llamacpp_cache() -> Path:
    """`$WORKBENCH_CACHE_DIR/llamacpp` (default ~/.cache/workbench/llamacpp): converter and GGUF files."""
    base = os.environ.get("WORKBENCH_CACHE_DIR") or "~/.cache/workbench"
    return Path(base).expanduser() / "llamacpp"


def gguf_path_for(hf_dir: Path, dtype: str, cache: Path | None = None) -> Path:
    """The GGUF a conversion of `hf_dir` to `dtype` is (or will be) stored as. The converted-model directory's
    name carries its source's cache key, so a changed source gets a new file."""
    if dtype not in GGUF_TYPES:
        raise ValueError(f"llama.cpp GGUFs are made in {', '.join(GGUF_TYPES)}, not {dtype!r}")
    return (cache or llamacpp_cache()) / f"{Path(hf_dir).name}-{GGUF_TYPES[dtype]}.gguf"


def converter_dir(version: str, cache: Path | None = None) -> Path:
    return (cache or llamacpp_cache()) / f"llama.cpp-{version}"


def _converter_members(names: list[str]) -> dict[str, str]:
    """The sdist members the converter needs -> their paths relative to the converter directory:
    vendor/llama.cpp/convert_hf_to_gguf.py, its `conversion` package and the `gguf-py` it puts on sys.path."""
    wanted = {}
    for name in names:
        parts = name.split("/")
        try:
            i = parts.index("llama.cpp")
        except ValueError:
            continue
        if i < 1 or parts[i - 1] != "vendor":
            continue
        rel = "/".join(parts[i + 1 :])
        if rel == "convert_hf_to_gguf.py" or rel.startswith(("conversion/", "gguf-py/gguf/")):
            wanted[name] = rel
    return wanted


def ensure_converter(version: str, pip_python: str, cache: Path | None = None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py of llama-cpp-python `version`, from its sdist (pip download, once)."""
    target = converter_dir(version, cache)
    script = target / "convert_hf_to_gguf.py"
    if script.is_file():
        return script
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".sdist-") as tmp:
        harness.progress(
            f"downloading the llama-cpp-python {version} sdist for llama.cpp's convert_hf_to_gguf.py "
            f"(once; kept in {target})"
        )
        cmd = [
            pip_python,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            "llama-cpp-python",
            f"llama-cpp-python=={version}",
            "-d",
            tmp,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S)
        archives = sorted(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not archives:
            raise LlamaCppPeerError(
                f"pip download of llama-cpp-python=={version} failed "
                f"(status {proc.returncode}):\n{(proc.stdout + proc.stderr)[-2000:]}"
            )
        staging = Path(tmp) / "converter"
        with tarfile.open(archives[0]) as tar:
            members = _converter_members(tar.getnames())
            if "convert_hf_to_gguf.py" not in members.values():
                raise LlamaCppPeerError(f"{archives[0].name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
            for name, rel in members.items():
                info = tar.getmember(name)
                if not info.isfile():
                    continue
                dest = staging / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(info) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)
        try:
            os.replace(staging, target)  # published whole, or not at all
        except OSError:
            if not script.is_file():
                raise
    return script


def _sentencepiece_stub(cache: Path) -> Path | None:
    """A directory to put on the converter's PYTHONPATH when this Python has no `sentencepiece`.

    For a Llama model the converter tries a SentencePiece vocabulary first, importing `sentencepiece` before
    it looks for tokenizer.model; our HF directories have none (SmolLM2's tokenizer is BPE: tokenizer.json),
    so with the real package the converter gets FileNotFoundError and goes on to the BPE vocabulary. The stub
    lets the import succeed and fails the same way; nothing else of sentencepiece is used."""
    if importlib.util.find_spec("sentencepiece") is not None:
        return None
    stub = cache / "sentencepiece-stub"
    stub.mkdir(parents=True, exist_ok=True)
    (stub / "sentencepiece.py").write_text(
        '"""Stand-in for the converter (workbench/bench/llamacpp_bench.py): no tokenizer.model here."""\n'
        "class SentencePieceProcessor:\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise FileNotFoundError('no SentencePiece model (workbench stub)')\n"
    )
    return stub


def ensure_gguf(hf_dir: Path, dtype: str, version: str, pip_python: str, cache: Path | None = None) -> Path:
    """The `dtype` GGUF of the HF directory `hf_dir`, converted by llama.cpp's convert_hf_to_gguf.py once
    and reused afterwards (published by an atomic rename, so an interrupted conversion leaves no file)."""
    cache = cache or llamacpp_cache()
    out = gguf_path_for(hf_dir, dtype, cache)
    if out.is_file():
        harness.progress(f"GGUF {GGUF_TYPES[dtype]}: {out} (cached)")
        return out
    script = ensure_converter(version, pip_python, cache)
    tmp = out.with_name(f".{out.stem}.{uuid.uuid4().hex[:8]}.tmp.gguf")
    log = out.with_suffix(".convert.log")
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "PYTHONPATH")}
    stub = _sentencepiece_stub(cache)
    if stub is not None:
        env["PYTHONPATH"] = str(stub)
    harness.progress(
        f"converting {hf_dir} to a {GGUF_TYPES[dtype]} GGUF with llama.cpp's convert_hf_to_gguf.py "
        f"(once; log {log}) ..."
    )
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.run(
            [sys.executable, str(script), "--outtype", GGUF_TYPES[dtype], "--outfile", str(tmp), str(hf_dir)],
            stdout=fh,
            stderr=subprocess.STDOUT,
            env=env,
            timeout=CONVERT_TIMEOUT_S,
        )
    ok = proc.returncode == 0 and tmp.is_file() and tmp.open("rb").read(4) == b"GGUF"
    if not ok:
        tmp.unlink(missing_ok=True)
        raise LlamaCppPeerError(
            f"convert_hf_to_gguf.py failed (status {proc.returncode}); log {log}:\n"
            f"{log.read_text(errors='replace')[-2000:]}"
        )
    os.replace(tmp, out)
    harness.progress(
        f"GGUF {GGUF_TYPES[dtype]}: {out} ({out.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t0:.0f} s)"
    )
    return out


# ---- pure helpers (tested without llama.cpp) ------------------------------------------------------------
def thread_counts(text: str | None, ncpu: int) -> list[int]:
    """`--threads`: None or "both" -> [1, ncpu] (one thread, then every CPU); "all" -> [ncpu]; "1,2" -> [1, 2]."""
    if text is None or str(text).strip() in ("", "both"):
        return sorted({1, max(1, ncpu)})
    text = str(text).strip()
    if text == "all":
        return [max(1, ncpu)]
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--threads takes N, N,M, all or both, not {text!r}") from None
    if not counts or any(c < 1 for c in counts):
        raise ValueError(f"--threads takes thread counts >= 1, not {text!r}")
    return list(dict.fromkeys(counts))


@dataclass
class LlamaRow:
    dtype: str
    threads: int
    workbench_tok_s: float
    llamacpp_tok_s: float
    ratio: float
    first_equal: bool | None = None
    workbench_samples: list[float] = field(default_factory=list)
    llamacpp_samples: list[float] = field(default_factory=list)
    load_1m: list[float] = field(default_factory=list)
    # filled in after the run (apply_peak): each side's GEMM GFLOP/s (a row per token through every linear
    # and the LM head) against the compute peak, and the workbench's weight reads against the read bandwidth
    # (at batch 1 the weights stream from memory once a token: bandwidth, not arithmetic, is the limit)
    gemm_gflops: float | None = None
    llamacpp_gemm_gflops: float | None = None
    peak_gflops: float | None = None
    weight_gbs: float | None = None
    read_gbs: float | None = None


def apply_peak(rows: list[LlamaRow], shapes, peak) -> None:
    """Fill the rows' GEMM and weight-read rates from the model's shapes and this machine's `Peak`."""
    from workbench.bench.peak import peak_gflops

    flops = shapes.body_flops_per_token() + shapes.head_flops_per_token()
    for r in rows:
        r.gemm_gflops = r.workbench_tok_s * flops / 1e9 if r.workbench_tok_s == r.workbench_tok_s else None
        r.llamacpp_gemm_gflops = r.llamacpp_tok_s * flops / 1e9 if r.llamacpp_tok_s == r.llamacpp_tok_s else None
        r.peak_gflops = peak_gflops(peak, r.dtype, r.threads)
        if r.gemm_gflops:  # one weight element per multiply-add, 4 or 2 bytes
            r.weight_gbs = r.gemm_gflops / 2 * (4 if r.dtype == "float32" else 2)
        if peak is not None:
            r.read_gbs = (peak.read_core if r.threads == 1 else peak.read_all).get("huge")


def make_row(
    dtype: str, threads: int, wb: list[float], lc: list[float], loads: list[float], first_equal: bool | None = None
) -> LlamaRow:
    return LlamaRow(dtype, threads, *harness.median_ratio(wb, lc), first_equal, list(wb), list(lc), list(loads))


def format_table(rows: list[LlamaRow]) -> str:
    """The result as a Markdown table (paste-able into the README)."""
    header = ["dtype", "threads", "workbench tok/s", "llama.cpp tok/s", "ratio", f"goal ≥{GOAL:g}×"]
    header += ["GEMM GFLOP/s (% of peak)", "llama.cpp % of peak", "weights GB/s (% of read bandwidth)"]
    header += [f"first {FIRST_IDS} equal", "load 1m"]
    lines = []
    from workbench.bench.peak import fraction_text, gemm_text

    for r in rows:
        eq = {True: "yes", False: "no", None: ""}[r.first_equal]
        lines.append(
            [
                r.dtype,
                str(r.threads),
                f"{r.workbench_tok_s:.1f}",
                f"{r.llamacpp_tok_s:.1f}",
                f"**{harness.ratio_text(r.ratio)}**",
            ]
            + [
                harness.goal_text(r.ratio, GOAL),
                gemm_text(r.gemm_gflops, r.peak_gflops),
                fraction_text(r.llamacpp_gemm_gflops, r.peak_gflops),
                f"{r.weight_gbs:.1f} ({fraction_text(r.weight_gbs, r.read_gbs)})" if r.weight_gbs else "-",
                eq,
                harness.load_range(r.load_1m),
            ]
        )
    return harness.markdown_table(header, lines)


def summary_lines(rows: list[LlamaRow], repeats: int) -> list[str]:
    """The lines printed under the table: what the ratio is, and the goal per row."""
    out = [
        f"ratio = workbench decode tok/s / llama.cpp decode tok/s at batch 1, medians of {2 * repeats} "
        f"measurements each (A B B A × {repeats}); decode tok/s = 127 / (time for 128 new − time for 1 new)",
        f"goal: {GOAL_TEXT}",
    ]
    for r in rows:
        where = "ahead" if r.ratio >= GOAL else "behind" if r.ratio == r.ratio else "not measured"
        out.append(
            f"  {r.dtype}, {r.threads} thread{'s' if r.threads != 1 else ''}: {harness.ratio_text(r.ratio)} — "
            f"{where} ({harness.goal_text(r.ratio, GOAL)})"
        )
    return out


# ---- the run --------------------------------------------------------------------------------------------
def run_llamacpp_bench(args) -> int:
    """The llama.cpp comparison; exit status 0 when every configuration was measured. Without a usable peer
    it prints the install recipe and returns 1."""
    python, detail = LlamaCppPeer.locate(getattr(args, "peer_python", None))
    if python is None:
        print(f"workbench: no usable llama.cpp peer ({detail}); nothing measured", file=sys.stderr)
        return 1
    version = str(detail.get("llama_cpp_version"))
    info = str(detail.get("system_info", "")).strip()
    harness.progress(f"llama-cpp-python {version} at {python}")
    harness.progress(f"llama.cpp system info: {info}")
    missing = missing_cpu_features(info)
    if missing:
        harness.progress(
            f"WARNING: this llama.cpp build does not use {', '.join(missing)}: not a native build; "
            f"rebuild it as the recipe says"
        )

    from workbench.core.args import ServerArgs
    from workbench.core.engine import Engine
    from workbench.core.model_loader.resolve import prepare_model

    sa = ServerArgs.from_cli_args(args)
    sa.show_progress = False
    quick = getattr(args, "quick", False)
    repeats = max(1, int(getattr(args, "repeats", 2) or 1))
    dtypes = ["float32", "bfloat16"] if sa.dtype == "auto" else [sa.dtype]
    for dtype in dtypes:
        if dtype not in GGUF_TYPES:
            raise ValueError(f"--peer llamacpp compares float32 or bfloat16, not {dtype}")
    ncpu = len(harness.bench_cpus())
    counts = thread_counts(getattr(args, "threads", None), ncpu)

    prepared = prepare_model(sa.model_path, progress=True)
    hf_dir = prepared.model_dir
    from workbench.bench.gemm_work import LinearShapes
    from workbench.bench.peak import get_peak, peak_note

    peak = get_peak(ncpu)  # this machine's compute peak and read bandwidth (cached per machine)
    pip_python = python
    ggufs = {dtype: ensure_gguf(hf_dir, dtype, version, pip_python) for dtype in dtypes}

    log_dir = Path(tempfile.mkdtemp(prefix="workbench-llamacpp-peer-"))
    rows: list[LlamaRow] = []
    failures: list[str] = []
    workload: Workload | None = None

    def save() -> None:
        if getattr(args, "json", None):
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "peer": "llamacpp",
                        "llama_cpp_version": version,
                        "system_info": info,
                        "ggufs": {k: str(v) for k, v in ggufs.items()},
                        "rows": [asdict(r) for r in rows],
                        "table": format_table(rows),
                        "failures": failures,
                    },
                    f,
                    indent=2,
                )

    for dtype in dtypes:
        for n in counts:
            engine = peer = None
            with harness.attempt(failures, f"{dtype}, {n} thread(s)"):
                try:
                    harness.progress(f"{dtype}, {n} thread(s): starting the workbench Engine (num_threads={n})")
                    engine = Engine(server_args=ServerArgs(**{**asdict(sa), "dtype": dtype, "num_threads": n}))
                    if workload is None:
                        workload = next(w for w in build_workloads(engine.tokenizer, quick) if w.key == "iii")
                        harness.progress(f"workload {workload.label}")
                    log = log_dir / f"llamacpp-{dtype}-{n}t.log"
                    harness.progress(
                        f"{dtype}, {n} thread(s): loading {ggufs[dtype].name} in llama.cpp (n_threads={n}; log {log})"
                    )
                    peer = LlamaCppPeer(python, log)
                    n_ctx = -(-(len(workload.prompts[0]) + workload.new_tokens) // 256) * 256
                    reply = peer.start(ggufs[dtype], n, n_ctx=n_ctx, seed=sa.random_seed, kv_type=GGUF_TYPES[dtype])
                    harness.progress(f"llama.cpp ready in {reply['seconds']:.1f} s")
                    rows.append(
                        measure_pair(
                            {"workbench": workbench_run(engine), "llama.cpp": peer.run}, workload, dtype, n, repeats
                        )
                    )
                    save()
                finally:
                    if peer is not None:
                        peer.close()
                    if engine is not None:
                        engine.shutdown()

    apply_peak(rows, LinearShapes.from_config(prepared.config), peak)
    print()
    print(format_table(rows))
    print(peak_note(peak, sorted({(r.dtype, r.threads) for r in rows})))
    print(
        "weights GB/s: the linears' weights read once a decode token at the workbench's rate, over the read "
        "bandwidth with huge pages (`workbench bench peak`): at batch 1 memory, not arithmetic, bounds decode"
    )
    for line in summary_lines(rows, repeats):
        print(line)
    for r in rows:
        if r.first_equal is not None:
            print(
                f"first {FIRST_IDS} greedy tokens, workbench vs llama.cpp, {r.dtype}, {r.threads} thread(s): "
                f"{'equal' if r.first_equal else 'DIFFERENT'}"
            )
    print(f"llama-cpp-python {version}; GGUFs: " + ", ".join(f"{k} {v}" for k, v in ggufs.items()))
    print(f"llama.cpp logs: {log_dir}")
    harness.print_failures(failures)
    save()
    if failures:
        print(f"workbench: {len(failures)} configuration(s) not measured (above)", file=sys.stderr)
        return 1
    return 0


def measure_pair(sides: dict[str, RunFn], wl: Workload, dtype: str, n: int, repeats: int) -> LlamaRow:
    """`repeats` rounds of A B B A on workload (iii) (workbench first); the first-ids check from each
    side's first run."""
    for run in sides.values():  # warm-up, both sides
        run(wl.prompts, 4)

    def report(turn, value, load1, idle):
        harness.progress(
            f"(iii) {dtype} {n} thread(s) {turn.tag} {turn.side:<9} {value[0]:8.1f} tok/s   (load 1m {load1:.2f})"
        )

    got = harness.interleave({side: (lambda run=run: measure(run, wl)) for side, run in sides.items()}, repeats, report)
    wb, lc = ([tok_s for tok_s, _ in got.samples[side]] for side in sides)
    first = {side: got.samples[side][0][1][0][:FIRST_IDS] for side in sides}
    equal = list(first["workbench"]) == list(first["llama.cpp"])
    if not equal:
        harness.progress(f"first ids differ: workbench {first['workbench']} vs llama.cpp {first['llama.cpp']}")
    return make_row(dtype, n, wb, lc, got.loads, equal)
