"""End-to-end part of tests/fast/test_model_perf_paths.py (what starts processes, engines or servers, or loads the
reference model).

The model executor's CPU fast paths: each one checked against a plain reference.

Buckets and padding for static-shape decode, oneDNN packed linears, the fused
rotary embedding, both decode-attention kernels, tiny real models (Llama with an
untied head, Qwen2 with Q/K/V biases) against transformers, the compiled decode
step against eager, and a smoke run of `bench model`.
"""

from __future__ import annotations

import os


def test_glibc_malloc_tuning_applies_once_and_can_be_turned_off():
    """The scheduler keeps activation pages warm across passes (cpu_allocator.py); opt-out by env."""
    import platform
    import subprocess
    import sys

    code = "from workbench.core.model_executor.cpu_allocator import tune_glibc_malloc as t; print(t(), t())"

    def run(env_value):
        env = dict(os.environ, WORKBENCH_MALLOC_TUNING=env_value)
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        ).stdout.split()

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert run("1") == ([str(glibc)] * 2)
    assert run("0") == ["False", "False"]
