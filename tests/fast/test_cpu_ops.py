"""The compiled CPU elementwise kernels against the torch ops they replace.

Rotary embedding (rope.c) is bit-identical in every dtype, so the model's tokens do not
change with it. RMSNorm (rms_norm.c, 16-bit models only) rounds a correctly rounded scale;
it is at least as close to float64 as ATen's and differs from it in ~1e-5 of the values.

The end-to-end tests of this module are in tests/e2e/test_cpu_ops_e2e.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from workbench.core.layers import cpu_ops
from workbench.core.layers.rotary_embedding import RotaryEmbedding, apply_rotary

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip(
        "no C compiler: the compiled rope cannot be built here (the model uses apply_rotary)", allow_module_level=True
    )


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 32, 700])
def test_rope_is_bit_identical_to_apply_rotary(dtype, tokens):
    g = torch.Generator().manual_seed(tokens)
    rot = RotaryEmbedding(
        64,
        4096,
        10000.0,
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 1024,
        },
    )
    cos, sin = rot.get_cos_sin(torch.randint(0, 4096, (tokens,), generator=g), dtype)
    qkv = (torch.randn(tokens, 15 * 64, generator=g) * 4).to(dtype)
    view = qkv[:, : 12 * 64].view(tokens, 12, 64)  # q and k heads of a fused projection: strided rows
    expected = apply_rotary(view, cos, sin)
    untouched = qkv[:, 12 * 64 :].clone()
    out = cpu_ops.rope_inplace(view, cos, sin)
    assert out.data_ptr() == view.data_ptr()  # in place
    assert torch.equal(_bits(out.contiguous()), _bits(expected.contiguous()))
    assert torch.equal(qkv[:, 12 * 64 :], untouched)  # v is not touched


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rms_norm_is_as_accurate_as_aten(dtype):
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(500, 576, generator=g) * 3).to(dtype)
    w = torch.randn(576, generator=g).to(dtype)
    strided = torch.cat([x, x], dim=1)[:, :576]  # rows with a stride of 1152
    ours, aten = cpu_ops.rms_norm(strided, w, 1e-5), F.rms_norm(x, (576,), w, 1e-5)
    xd = x.double()
    exact = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert (ours.double() - exact).abs().mean() <= (aten.double() - exact).abs().mean() * (1 + 1e-6)
    if dtype != torch.float32:
        assert (ours == aten).float().mean() > 0.9999  # a last-bit difference in the scale rarely shows


def test_the_model_normalizes_16_bit_only_with_the_kernel(monkeypatch):
    from workbench.core.layers.layernorm import RMSNorm

    calls = []
    real = cpu_ops.rms_norm
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda x, w, eps: calls.append(x.dtype) or real(x, w, eps))
    for dtype in (torch.float32, torch.bfloat16):
        RMSNorm(64).to(dtype)(torch.randn(4, 64).to(dtype))
    assert calls == [torch.bfloat16]  # float32 keeps ATen's kernel: transformers' numerics exactly
