"""End-to-end part of tests/fast/test_triton_backend.py (what starts processes, engines or servers, or loads the
reference model).

The triton attention backend against torch_native, under Triton's CPU interpreter.

`TRITON_INTERPRET=1` only takes effect if it is set before triton is first imported,
and other tests (torch.compile) may import triton in this process, so every
interpreted run happens in a fresh subprocess with the variable set; nothing in
this process is changed. Also here: choosing a backend per device, and the clear
errors for a backend the device cannot run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from tiny_models import make_tiny_llama

CHECK_MODULE = "workbench.triton_check"


def _interpreter_skip_reason():
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with pip install -e '.[test]')"
    from workbench.core.layers.attention.triton_backend import triton_interpreter_unsupported_reason

    return triton_interpreter_unsupported_reason()


needs_triton = pytest.mark.skipif(_interpreter_skip_reason() is not None, reason=str(_interpreter_skip_reason()))


def _interpreted(args: list[str], timeout: int = 600) -> list[dict]:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", CHECK_MODULE, "--json", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@needs_triton
def test_triton_backend_runs_a_model_like_torch_native(tmp_path):
    """Greedy tokens of a tiny Llama: torch_native == triton == triton replayed by the stand-in graph."""
    model_dir = make_tiny_llama(tmp_path / "tiny", seed=7, tie_word_embeddings=False)
    (out,) = _interpreted(["--model-check", str(model_dir)])
    res = out["model_check"]
    assert res["torch_native"] == res["triton"] == res["triton+graph"]
    assert [len(t) for t in res["triton"]] == [7, 5, 3, 6]
    assert len({tuple(t) for t in res["triton"]}) > 1  # not a degenerate model
    # 4 rows -> bucket 4, then 3 (bucket 4), 2 (bucket 2), 1 (bucket 1): every bucket replayed
    assert all(res["graph_replays"][str(b)] > 0 for b in (1, 2, 4)), res["graph_replays"]
