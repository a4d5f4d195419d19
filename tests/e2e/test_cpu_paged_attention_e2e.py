"""End-to-end part of tests/fast/test_cpu_paged_attention.py (what starts processes, engines or servers, or loads the
reference model).

The cpu_paged backend's compiled decode kernel against the torch-native reference.

The kernel reads K/V in place through req_to_token; the reference gathers a padded
copy and runs SDPA. Both are checked against float32 attention over the same
(possibly low-precision) inputs, over ragged lengths, scattered slots, GQA ratios,
head sizes, dtypes and both ways the kernel splits work (by request, by KV head).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip(
        "no C compiler: the cpu_paged kernel cannot be built here (CPU default falls back to torch_native)",
        allow_module_level=True,
    )


def test_without_a_compiler_the_cpu_default_is_torch_native(tmp_path):
    # A fresh process with no usable compiler and an empty kernel cache.
    code = textwrap.dedent("""
        from workbench.core.layers import cpu_ops
        from workbench.core.layers.attention.registry import default_attention_backend, unavailable_reason
        print(cpu_ops.unavailable_reason())
        print(default_attention_backend("cpu"))
        print(unavailable_reason("cpu_paged", "cpu"))
    """)
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "WORKBENCH_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason, default, explicit = out.stdout.strip().splitlines()
    assert "no C compiler" in reason and "apt install gcc" in reason
    assert default == "torch_native"
    assert "--attention-backend torch_native" in explicit
