"""The triton attention backend against torch_native, under Triton's CPU interpreter.

`TRITON_INTERPRET=1` only takes effect if it is set before triton is first imported,
and other tests (torch.compile) may import triton in this process, so every
interpreted run happens in a fresh subprocess with the variable set; nothing in
this process is changed. Also here: choosing a backend per device, and the clear
errors for a backend the device cannot run.

The end-to-end tests of this module are in tests/e2e/test_triton_backend_e2e.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from tiny_models import make_tiny_llama
from triton_helpers import interpreted, needs_triton
from workbench.core.layers.attention.registry import create_attn_backend, default_attention_backend, unavailable_reason


def _case_ids():
    if importlib.util.find_spec("triton") is None:
        return []
    from workbench.triton_check import default_cases

    return [c.id for c in default_cases()]


@pytest.fixture(scope="module")
def kernel_results() -> dict:
    return {r["id"]: r for r in interpreted([])}


@needs_triton
@pytest.mark.parametrize("case_id", _case_ids())
def test_triton_kernels_match_torch_native(kernel_results, case_id):
    """Decode (split-KV + reduce) and extend (pool prefix + causal new tokens); GQA 1/3/4; ragged;
    float32 and float16 (bfloat16: see workbench.triton_check.default_cases)."""
    r = kernel_results[case_id]
    assert r["error"] == "", r["error"]
    assert r["ref_max_abs"] > 0.05  # the reference is not trivially zero
    from workbench.triton_check import TOLERANCE

    assert r["max_abs_diff"] < TOLERANCE[r["case"]["dtype"]], r


# ---- choosing a backend ----------------------------------------------------------------
def test_default_backend_per_device():
    from workbench.core.layers import cpu_ops

    assert default_attention_backend("cpu") == ("cpu_paged" if cpu_ops.unavailable_reason() is None else "torch_native")
    cuda_default = default_attention_backend("cuda")
    if importlib.util.find_spec("flashinfer") is not None:
        assert cuda_default == "flashinfer"
    elif importlib.util.find_spec("triton") is not None:
        assert cuda_default == "triton"


def test_unavailable_backends_say_what_to_do(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert unavailable_reason("torch_native", "cpu") is None
    msg = unavailable_reason("flashinfer", "cpu")
    assert "CUDA" in msg and "torch_native" in msg
    with pytest.raises(ValueError, match="torch_native"):
        create_attn_backend("flashinfer", "cpu", 9, 3, 64, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="torch_native"):
        create_attn_backend("triton", "cpu", 9, 3, 64, torch.float32, torch.float32)
    assert "unknown" in unavailable_reason("xformers", "cpu")


def test_a_requested_backend_is_kept_and_an_unknown_one_refused():
    from workbench.core.args import ServerArgs
    from workbench.core.layers.attention.registry import choose_attention_backend

    assert choose_attention_backend("torch_native", "cpu", torch.float32, 9, 3, 64) == "torch_native"
    assert choose_attention_backend("triton", "cpu", torch.float32, 9, 3, 64) == "triton"
    assert choose_attention_backend(None, "cpu", torch.float32, 9, 3, 64) == default_attention_backend("cpu")
    with pytest.raises(ValueError, match="attention-backend"):
        ServerArgs(attention_backend="xformers")


def test_model_runner_refuses_a_backend_the_device_cannot_run(tmp_path, monkeypatch):
    from workbench.core.args import ServerArgs
    from workbench.core.model_executor.model_runner import ModelRunner

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    model_dir = make_tiny_llama(tmp_path / "tiny", seed=1)
    with pytest.raises(ValueError, match="CUDA only"):
        ModelRunner(
            ServerArgs(
                model_path=str(model_dir),
                device="cpu",
                attention_backend="flashinfer",
                max_total_tokens=64,
                show_progress=False,
            )
        )
