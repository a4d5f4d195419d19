"""The llama.cpp side of `workbench bench engine --peer llamacpp`: a standalone driver for a separate venv.

The project's own venv never imports llama_cpp. The bench starts this file as a subprocess with the Python of
a venv that has `llama-cpp-python` (built from source with native CPU flags; `--peer-python PATH`) and talks to
it in line-delimited JSON, one object a line: requests on its stdin, one reply a request on its stdout.
llama.cpp's own logging goes to stderr (the bench captures it to a file and shows its tail on failure);
anything a library prints to stdout is sent to stderr too, so stdout carries nothing but replies.

Requests (every reply has "ok"; a failed request answers {"ok": false, "error", "traceback"}):
  {"op": "load", "gguf": FILE, "n_threads": 2, "n_ctx": 512, "seed": 0, "kv_type": null | "f32" | "f16" | "bf16"}
      builds one `llama_cpp.Llama` (n_threads and n_threads_batch both n_threads, logits_all=False, no GPU
      layers) and keeps it for every later `run`; a process loads once. kv_type null keeps llama.cpp's
      default KV cache type (f16).
      -> {"ok": true, "seconds": load time, "llama_cpp_version": "...", "system_info": "..."}
  {"op": "run", "prompt": [token ids], "max_new_tokens": 128, "greedy": true}
      the model state is reset (no prompt reuse from the previous run: the prompt is evaluated again),
      then exactly max_new_tokens tokens are generated from the token ids, greedy (temperature 0: argmax)
      unless greedy is false; EOS does not stop it (a fixed count is taken from the generator).
      -> {"ok": true, "seconds": wall time of prompt + generation, "output_tokens": N, "first_ids": [<=16 ids]}
  {"op": "quit"} -> {"ok": true}, and the process exits.

`python llamacpp_peer.py --check` imports llama_cpp and prints one reply ({"ok": true, "llama_cpp_version",
"system_info", "python"} or an error), exit status 0 or 1: the bench's test whether PATH can run the peer.

Only the standard library is imported at module level, so the project's tests import the protocol functions
below without llama.cpp.
"""

from __future__ import annotations

import sys
import time
from typing import Any

if __package__:
    from workbench.bench import peer_wire as wire
else:  # a script in the llama.cpp venv, where workbench is not installed: its folder is sys.path[0]
    import peer_wire as wire

KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # ggml_type values (ggml.h: GGML_TYPE_F32, _F16, _BF16)
CPU_FEATURES = ("AVX2", "FMA", "F16C")  # what a native build on this machine must report


# ---- protocol: pure functions, shared by the driver and the bench ---------------------------------
def load_request(gguf: str, n_threads: int, n_ctx: int = 512, seed: int = 0, kv_type: str | None = None) -> dict:
    """The `load` request: one llama.cpp model from a GGUF file, on n_threads threads."""
    return {
        "op": "load",
        "gguf": str(gguf),
        "n_threads": int(n_threads),
        "n_ctx": int(n_ctx),
        "seed": int(seed),
        "kv_type": kv_type,
    }


def run_request(prompt: list[int], max_new_tokens: int, greedy: bool = True) -> dict:
    """The `run` request: generate exactly max_new_tokens tokens after one token-id prompt."""
    return {
        "op": "run",
        "prompt": [int(t) for t in prompt],
        "max_new_tokens": int(max_new_tokens),
        "greedy": bool(greedy),
    }


def check_request(msg: dict) -> dict:
    """Validate a decoded request and return it; ProtocolError names the first bad field."""
    op = wire.check_op(msg)
    if op == "load":
        if not isinstance(msg.get("gguf"), str) or not msg["gguf"]:
            raise wire.ProtocolError("load needs 'gguf': a GGUF file")
        if not wire.is_int(msg.get("n_threads")) or msg["n_threads"] < 1:
            raise wire.ProtocolError("load needs 'n_threads': an integer >= 1")
        if not wire.is_int(msg.get("n_ctx")) or msg["n_ctx"] < 16:
            raise wire.ProtocolError("load needs 'n_ctx': an integer >= 16")
        if msg.get("kv_type") is not None and msg["kv_type"] not in KV_TYPES:
            raise wire.ProtocolError(f"load: 'kv_type' is null or one of {', '.join(KV_TYPES)}, not {msg['kv_type']!r}")
    elif op == "run":
        prompt = msg.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(wire.is_int(t) and t >= 0 for t in prompt):
            raise wire.ProtocolError("run needs 'prompt': a non-empty list of token ids")
        if not wire.is_int(msg.get("max_new_tokens")) or msg["max_new_tokens"] < 1:
            raise wire.ProtocolError("run needs 'max_new_tokens': an integer >= 1")
    return msg


def summarize_output(output_ids: list[int], seconds: float, first_n: int = wire.FIRST_IDS) -> dict:
    """The `run` reply from the output ids and the call's wall time."""
    return {
        "ok": True,
        "seconds": float(seconds),
        "output_tokens": len(output_ids),
        "first_ids": [int(t) for t in output_ids[:first_n]],
    }


def missing_cpu_features(system_info: str, wanted=CPU_FEATURES) -> list[str]:
    """The features of `wanted` that llama_print_system_info() does not report as on ("AVX2 = 1"; in
    newer builds, "CPU : SSE3 = 1 | AVX2 = 1 | ..."): an empty list for a native AVX2 build."""
    found = set()
    for part in system_info.replace("|", "\n").splitlines():
        name, _, value = part.partition("=")
        words = name.split()  # "CPU : SSE3 " -> the last word names the feature
        if words and value.strip() == "1":
            found.add(words[-1].upper())
    return [f for f in wanted if f.upper() not in found]


# ---- the driver (runs in the llama.cpp venv) ---------------------------------------------------------
def _system_info() -> str:
    import llama_cpp

    info = llama_cpp.llama_print_system_info()
    return info.decode(errors="replace") if isinstance(info, bytes) else str(info)


class _Driver:
    """Holds the one llama.cpp model of this process."""

    def __init__(self) -> None:
        self.llm: Any = None

    def load(self, msg: dict) -> dict:
        if self.llm is not None:
            raise RuntimeError("this process already loaded a model; start another for another configuration")
        t0 = time.perf_counter()
        import llama_cpp

        extra = {}
        if msg.get("kv_type"):
            extra["type_k"] = extra["type_v"] = KV_TYPES[msg["kv_type"]]
        n = msg["n_threads"]
        self.llm = llama_cpp.Llama(
            model_path=msg["gguf"],
            n_threads=n,
            n_threads_batch=n,
            n_ctx=msg["n_ctx"],
            n_batch=min(512, msg["n_ctx"]),
            seed=msg.get("seed", 0),
            n_gpu_layers=0,
            logits_all=False,
            verbose=False,
            **extra,
        )
        return {
            "ok": True,
            "seconds": time.perf_counter() - t0,
            "llama_cpp_version": llama_cpp.__version__,
            "system_info": _system_info(),
        }

    def run(self, msg: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("send 'load' before 'run'")
        want = msg["max_new_tokens"]
        sampling = {"temp": 0.0, "top_k": 1} if msg.get("greedy", True) else {"temp": 1.0}
        out: list[int] = []
        t0 = time.perf_counter()
        # reset(): the next generate evaluates the whole prompt again (it would otherwise reuse the KV of a
        # previous run's matching prefix). generate() never stops by itself, at EOS or anywhere: we take
        # exactly `want` tokens from it and then close it.
        self.llm.reset()
        gen = self.llm.generate(msg["prompt"], reset=True, repeat_penalty=1.0, **sampling)
        try:
            for token in gen:
                out.append(int(token))
                if len(out) >= want:
                    break
        finally:
            gen.close()
        return summarize_output(out, time.perf_counter() - t0)


def _check_import() -> dict:
    import llama_cpp

    return {"llama_cpp_version": llama_cpp.__version__, "system_info": _system_info()}


def main(argv: list[str] | None = None) -> int:
    """Serve requests from stdin until `quit` or end of input; `--check` only tests the import."""
    return wire.serve(_Driver(), check_request, _check_import, argv)


if __name__ == "__main__":
    sys.exit(main())
