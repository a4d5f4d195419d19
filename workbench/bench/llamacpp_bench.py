"""`workbench bench engine --peer llamacpp --peer-python PATH`: the Engine beside llama.cpp at batch 1, in one run.

llama.cpp (`llama-cpp-python`, built from source with native CPU flags) lives in a separate venv; this process
never imports it. It starts `llamacpp_peer.py` (same folder) with PATH and drives it over line-delimited JSON.

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
import queue
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from workbench.bench.llamacpp_peer import (
    FIRST_IDS,
    ProtocolError,
    encode_message,
    load_request,
    missing_cpu_features,
    parse_reply,
    quit_request,
    run_request,
)
from workbench.bench.peer_bench import Workload, goal_text, measure

DRIVER = Path(__file__).with_name("llamacpp_peer.py")
PEER_VERSION = "0.3.36"  # the llama-cpp-python release the recipe installs
GOAL = 1.0  # workbench decode tok/s over llama.cpp's: stay ahead (printed, never asserted)
GOAL_TEXT = "stay ahead of llama.cpp at equal dtype (ratio >= 1.0×)"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}  # --dtype -> convert_hf_to_gguf.py --outtype
LOAD_TIMEOUT_S = 600
RUN_TIMEOUT_S = 600
CONVERT_TIMEOUT_S = 1800


def install_recipe(python: str | None) -> str:
    """How to make a venv that can serve as `--peer-python`, as commands."""
    venv = "~/llama-venv"
    if python and Path(python).parent.name == "bin":
        root = Path(python).expanduser().parent.parent  # a venv to make, or one that is there
        if not Path(python).expanduser().exists() or (root / "pyvenv.cfg").is_file():
            venv = str(Path(python).parent.parent)
    return "\n".join(
        [
            "Build llama-cpp-python from source, with native CPU flags, in a separate venv (never the project's own):",
            f"  python3 -m venv {venv}",
            f"  {venv}/bin/pip install numpy",
            "  CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_BLAS=OFF' CMAKE_BUILD_PARALLEL_LEVEL=2 \\",
            f"    {venv}/bin/pip install --no-binary llama-cpp-python llama-cpp-python=={PEER_VERSION}",
            "  (a compile of 6-15 minutes on 2 cores; it needs cmake and a C/C++ compiler)",
            f"then: workbench bench engine --peer llamacpp --peer-python {venv}/bin/python --dtype float32",
            "(the GGUF files are made by the bench itself, with llama.cpp's convert_hf_to_gguf.py, on first use)",
        ]
    )


class LlamaCppPeerError(RuntimeError):
    """The llama.cpp driver failed, exited or did not answer, or a GGUF could not be made."""


def _progress(msg: str) -> None:
    print(f"[bench] {msg}", flush=True)


def check_peer(python: str | None) -> tuple[bool, dict | str]:
    """(True, the driver's --check reply) when `python` can import llama_cpp, else (False, why not)."""
    if not python:
        return False, "no --peer-python given (nor WORKBENCH_LLAMACPP_PYTHON)"
    exe = shutil.which(os.path.expanduser(python))
    if exe is None:
        return False, f"{python} is not an executable file"
    try:
        proc = subprocess.run([exe, str(DRIVER), "--check"], capture_output=True, text=True, timeout=300)
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
        return False, f"{python} cannot import llama_cpp ({reply['error']})"
    return True, reply


class LlamaCppPeer:
    """One driver process (one llama.cpp model): requests on its stdin, replies on its stdout."""

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
        """Send one request, wait for its reply; LlamaCppPeerError if it fails or does not come."""
        try:
            self.proc.stdin.write(encode_message(msg))
            self.proc.stdin.flush()
            line = self._lines.get(timeout=timeout)
        except (BrokenPipeError, OSError, queue.Empty) as exc:
            why = f"no reply in {timeout:.0f} s" if isinstance(exc, queue.Empty) else type(exc).__name__
            raise LlamaCppPeerError(
                f"llama.cpp driver: {msg['op']}: {why}; log {self.log_path}:\n{self.log_tail()}"
            ) from None
        if line is None:
            raise LlamaCppPeerError(
                f"llama.cpp driver exited (status {self.proc.wait()}) during {msg['op']}; "
                f"log {self.log_path}:\n{self.log_tail()}"
            )
        reply = parse_reply(line)
        if not reply["ok"]:
            raise LlamaCppPeerError(
                f"llama.cpp driver: {msg['op']} failed: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}log {self.log_path}:\n{self.log_tail()}"
            )
        return reply

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.request(quit_request(), timeout=60)
                self.proc.wait(timeout=60)
            except (LlamaCppPeerError, ProtocolError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()


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
        _progress(
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
        _progress(f"GGUF {GGUF_TYPES[dtype]}: {out} (cached)")
        return out
    script = ensure_converter(version, pip_python, cache)
    tmp = out.with_name(f".{out.stem}.{uuid.uuid4().hex[:8]}.tmp.gguf")
    log = out.with_suffix(".convert.log")
    env = {k: v for k, v in os.environ.items() if k not in ("NO_LOCAL_GGUF", "PYTHONPATH")}
    stub = _sentencepiece_stub(cache)
    if stub is not None:
        env["PYTHONPATH"] = str(stub)
    _progress(
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
    _progress(
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


def make_row(
    dtype: str, threads: int, wb: list[float], lc: list[float], loads: list[float], first_equal: bool | None = None
) -> LlamaRow:
    w, v = statistics.median(wb), statistics.median(lc)
    return LlamaRow(
        dtype, threads, w, v, w / v if v > 0 else float("nan"), first_equal, list(wb), list(lc), list(loads)
    )


def ratio_text(ratio: float) -> str:
    return f"{ratio:.2f}×" if ratio == ratio else "n/a"


def _goal(ratio: float) -> str:
    return goal_text(ratio if ratio == ratio else None, GOAL)  # NaN (a side measured nothing): n/a


def format_table(rows: list[LlamaRow]) -> str:
    """The result as a Markdown table (paste-able into the README)."""
    lines = [
        f"| dtype | threads | workbench tok/s | llama.cpp tok/s | ratio | goal ≥{GOAL:g}× | first {FIRST_IDS} equal "
        f"| load 1m |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        load = f"{min(r.load_1m):.2f}–{max(r.load_1m):.2f}" if r.load_1m else ""
        eq = {True: "yes", False: "no", None: ""}[r.first_equal]
        lines.append(
            f"| {r.dtype} | {r.threads} | {r.workbench_tok_s:.1f} | {r.llamacpp_tok_s:.1f} "
            f"| **{ratio_text(r.ratio)}** | {_goal(r.ratio)} | {eq} | {load} |"
        )
    return "\n".join(lines)


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
            f"  {r.dtype}, {r.threads} thread{'s' if r.threads != 1 else ''}: {ratio_text(r.ratio)} — "
            f"{where} ({_goal(r.ratio)})"
        )
    return out


# ---- the run --------------------------------------------------------------------------------------------
def _peer_run(peer: LlamaCppPeer):
    def run(prompts, new):
        if len(prompts) != 1:
            raise ValueError("the llama.cpp peer runs batch 1 only")
        reply = peer.request(run_request(prompts[0], new), timeout=RUN_TIMEOUT_S)
        return reply["seconds"], reply["output_tokens"], [reply["first_ids"]]

    return run


def run_llamacpp_bench(args) -> int:
    """The llama.cpp comparison; exit status 0 when every configuration was measured. Without a usable peer
    it prints the install recipe and returns 1."""
    python = getattr(args, "peer_python", None) or os.environ.get("WORKBENCH_LLAMACPP_PYTHON")
    _progress(f"checking the llama.cpp peer: {python or '(none)'} ...")
    ok, detail = check_peer(python)
    if not ok:
        print(f"\nllama.cpp peer unavailable: {detail}\n{install_recipe(python)}\n", flush=True)
        print(f"workbench: no usable llama.cpp peer ({detail}); nothing measured", file=sys.stderr)
        return 1
    python = shutil.which(os.path.expanduser(python))
    version = str(detail.get("llama_cpp_version"))
    info = str(detail.get("system_info", "")).strip()
    _progress(f"llama-cpp-python {version} at {python}")
    _progress(f"llama.cpp system info: {info}")
    missing = missing_cpu_features(info)
    if missing:
        _progress(
            f"WARNING: this llama.cpp build does not use {', '.join(missing)}: not a native build; "
            f"rebuild it as the recipe says"
        )

    from workbench.bench.peer_bench import _workbench_run, build_workloads
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
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    counts = thread_counts(getattr(args, "threads", None), ncpu)

    hf_dir = prepare_model(sa.model_path, progress=True).model_dir
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
            try:
                _progress(f"{dtype}, {n} thread(s): starting the workbench Engine (num_threads={n})")
                engine = Engine(server_args=ServerArgs(**{**asdict(sa), "dtype": dtype, "num_threads": n}))
                if workload is None:
                    workload = next(w for w in build_workloads(engine.tokenizer, quick) if w.key == "iii")
                    _progress(f"workload {workload.label}")
                log = log_dir / f"llamacpp-{dtype}-{n}t.log"
                _progress(
                    f"{dtype}, {n} thread(s): loading {ggufs[dtype].name} in llama.cpp (n_threads={n}; log {log})"
                )
                peer = LlamaCppPeer(python, log)
                n_ctx = -(-(len(workload.prompts[0]) + workload.new_tokens) // 256) * 256
                reply = peer.request(
                    load_request(str(ggufs[dtype]), n, n_ctx=n_ctx, seed=sa.random_seed, kv_type=GGUF_TYPES[dtype]),
                    timeout=LOAD_TIMEOUT_S,
                )
                _progress(f"llama.cpp ready in {reply['seconds']:.1f} s")
                rows.append(_measure(engine, peer, workload, dtype, n, repeats, _workbench_run))
                save()
            except Exception as exc:
                failures.append(f"{dtype}, {n} thread(s): {type(exc).__name__}: {exc}")
                _progress(f"FAILED {failures[-1]}")
            finally:
                if peer is not None:
                    peer.close()
                if engine is not None:
                    engine.shutdown()

    print()
    print(format_table(rows))
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
    for text in failures:
        print(f"not measured: {text}")
    save()
    if failures:
        print(f"workbench: {len(failures)} configuration(s) not measured (above)", file=sys.stderr)
        return 1
    return 0


def _measure(engine, peer: LlamaCppPeer, wl: Workload, dtype: str, n: int, repeats: int, workbench_run) -> LlamaRow:
    """`repeats` rounds of A B B A on workload (iii); the first-ids check from each side's first run."""
    sides = {"workbench": workbench_run(engine), "llama.cpp": _peer_run(peer)}
    for run in sides.values():  # warm-up, both sides
        run(wl.prompts, 4)
    samples: dict[str, list[float]] = {"workbench": [], "llama.cpp": []}
    first: dict[str, list[list[int]]] = {}
    loads: list[float] = []
    for r in range(repeats):
        for side in ("workbench", "llama.cpp", "llama.cpp", "workbench"):
            tok_s, ids = measure(sides[side], wl)
            load1 = os.getloadavg()[0]
            samples[side].append(tok_s)
            loads.append(load1)
            first.setdefault(side, ids)
            _progress(
                f"(iii) {dtype} {n} thread(s) [{r + 1}/{repeats}] {side:<9} {tok_s:8.1f} tok/s   (load 1m {load1:.2f})"
            )
    equal = list(first["workbench"][0][:FIRST_IDS]) == list(first["llama.cpp"][0][:FIRST_IDS])
    if not equal:
        _progress(
            f"first ids differ: workbench {first['workbench'][0][:FIRST_IDS]} vs "
            f"llama.cpp {first['llama.cpp'][0][:FIRST_IDS]}"
        )
    return make_row(dtype, n, samples["workbench"], samples["llama.cpp"], loads, equal)
