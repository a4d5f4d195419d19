"""End-to-end part of tests/fast/test_gpu_only.py (what starts processes, engines or servers, or loads the
reference model).

GPU paths that need CUDA: real graph capture/replay, flashinfer, triton compiled for the GPU.

Without CUDA every test here except the device-neutral helper check skips, saying
why. With a GPU: `pytest -m gpu tests/fast/test_gpu_only.py` (and `workbench selftest
--device cuda` for the whole table on the default model).
"""

from __future__ import annotations

import importlib.util


def test_selftest_cpu_dry_run(capsys):
    """The CPU dry run on the default model: every row passes or is skipped with a reason.

    (--quick, and without the overlap row, which starts two Engines: tests/e2e/test_overlap.py
    checks the overlap loop against the normal loop far more thoroughly.)"""
    from workbench.cli import main

    rc = main(["selftest", "--device", "cpu", "--quiet", "--quick", "--checks", "cuda_graph,triton,flashinfer"])
    out = capsys.readouterr().out
    lines = {line.split("  ")[0].strip(): line for line in out.splitlines()}
    assert rc == 0, out
    assert "PASS" in lines["torch_native eager (float32, reference)"]
    assert "PASS" in lines["cuda graph runner, stand-in graph (torch_native)"]
    assert "replays bs1=" in lines["cuda graph runner, stand-in graph (torch_native)"]
    assert "overlap loop == normal loop (Engine)" not in lines
    flash = lines["flashinfer backend"]
    assert "SKIP" in flash and "CUDA only" in flash
    triton = lines["triton kernels (TRITON_INTERPRET=1, model head shapes)"]
    from workbench.core.layers.attention.triton_backend import triton_interpreter_unsupported_reason

    if importlib.util.find_spec("triton") is None or triton_interpreter_unsupported_reason():
        assert "SKIP" in triton
    else:
        assert "PASS" in triton and "Hq=9, Hk=3, D=64" in triton
    assert "cpu: " in out and " 0 failed" in out
