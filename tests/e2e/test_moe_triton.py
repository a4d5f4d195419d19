"""The Triton experts (core/layers/moe_triton.py, the CUDA path of FusedMoE) against the CPU loop,
run by Triton's interpreter on CPU in a fresh process (TRITON_INTERPRET must be set before triton
is imported): random layers with 1 to 40 tokens, top 1 to 3, and expert parallelism over 2 and 3
ranks (each rank's share equal to the loop's, the shares summing to the whole layer); then a tiny
Qwen3-MoE decoding through it, token for token against transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import make_tiny_family
from workbench.core.layers.attention.triton_backend import triton_interpreter_unsupported_reason

HERE = Path(__file__).parents[1]  # tests/, where the helper script lives

pytestmark = pytest.mark.skipif(
    triton_interpreter_unsupported_reason() is not None, reason=str(triton_interpreter_unsupported_reason())
)


def _interpreted(*args: str) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", PYTHONPATH=str(HERE))
    proc = subprocess.run(
        [sys.executable, str(HERE / "moe_triton_check.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_triton_experts_equal_the_loop_with_and_without_expert_parallelism():
    cases = _interpreted()
    assert len(cases) == 6 and {c["ep"] for c in cases} == {1, 2, 3}
    for c in cases:
        tol = 1e-5 * max(1.0, c["scale"])
        assert c["max_diff_vs_loop"] < tol and c["max_diff_sum_vs_layer"] < tol, c


def test_a_moe_model_decodes_through_the_triton_experts(tmp_path):
    model_dir = make_tiny_family(tmp_path / "qwen3_moe", "qwen3_moe", seed=20)
    (result,) = _interpreted(str(model_dir))
    assert result["equal"], result
