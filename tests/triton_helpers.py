"""The Triton attention tests' shared pieces (tests/fast/test_triton_backend.py and its e2e half).

`TRITON_INTERPRET=1` only takes effect if it is set before triton is first imported, and other tests
(torch.compile) may import triton in the test process, so every interpreted run happens in a fresh
subprocess with the variable set (`interpreted`)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

CHECK_MODULE = "workbench.triton_check"


def interpreter_skip_reason() -> str | None:
    """Why Triton's CPU interpreter cannot run here, or None."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (it comes with pip install -e '.[test]')"
    from workbench.core.layers.attention.triton_backend import triton_interpreter_unsupported_reason

    return triton_interpreter_unsupported_reason()


needs_triton = pytest.mark.skipif(interpreter_skip_reason() is not None, reason=str(interpreter_skip_reason()))


def interpreted(args: list[str], timeout: int = 600) -> list[dict]:
    """Run `python -m workbench.triton_check --json ARGS` under the interpreter; its JSON records."""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", CHECK_MODULE, "--json", *args], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
