"""The batch-1 float32 linear on the default model's shapes: oneDNN's packed path against the
compiled GEMV (core/layers/cpu_ops/gemv.c), microseconds per call and the weight bytes read per
second, on 1 and 2 threads (docs/design.md has a run):

    .venv/bin/python -m workbench.bench.gemv_probe

Each call repeats on the same weight, so the layers' weights (1-7 MB) sit in cache while the
LM head (113 MB) streams from memory, as every weight does in a real decode step.
"""

from __future__ import annotations

import time

import torch

from workbench.core.layers import cpu_ops
from workbench.core.layers.linear import pack_linear_weight, packed_linear

# SmolLM2-135M: hidden 576, 9 query + 3 KV heads of 64, intermediate 1536, vocabulary 49152
SHAPES = {"qkv": (960, 576), "o_proj": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}


def _time(fn, n: int) -> float:
    for _ in range(10):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def main() -> int:
    if cpu_ops.unavailable_reason() or not cpu_ops.gemv_ready(torch.zeros(1, 8), torch.zeros(8, 8)):
        print("the GEMV is not built here (no C compiler, no AVX2 + FMA, or WORKBENCH_CPU_GEMV=0)")
        return 1
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for name, (n, k) in SHAPES.items():
            w, x = torch.randn(n, k), torch.randn(1, k)
            packed = pack_linear_weight(w)
            reps = 30 if name == "lm_head" else 300
            a = _time(lambda: packed_linear(x, packed, None), reps) if packed is not None else float("nan")
            b = _time(lambda: cpu_ops.gemv(x, w), reps)
            gb = n * k * 4 / 1e9
            print(
                f"{threads} thread(s) {name:8s} [{n} x {k}]  oneDNN {a * 1e6:8.1f} us ({gb / a:5.1f} GB/s)"
                f"  GEMV {b * 1e6:8.1f} us ({gb / b:5.1f} GB/s)  {a / b:4.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
