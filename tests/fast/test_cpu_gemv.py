"""The compiled GEMV (gemv.c) against F.linear, and where the model dispatches to it.

It sums each dot product in its own order (8-float lanes, reduced at the end), so it matches
F.linear within float32 rounding, not bit for bit. On bfloat16 weights it widens each weight as
it reads it, so it equals, bit for bit, its own float32 result on the widened weight.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from workbench.core.layers import cpu_ops

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the GEMV cannot be built here (the model keeps oneDNN)", allow_module_level=True)


def _reference(x, w, bias, residual):
    out = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    return out if residual is None else out + residual.double()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 5), (13, 8), (37, 29), (129, 131), (1001, 577), (300, 1536)])
def test_gemv_matches_linear_on_odd_shapes(threads, m, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g)
    for bias, residual in [
        (None, None),
        (torch.randn(n, generator=g), None),
        (None, torch.randn(m, n, generator=g)),
        (torch.randn(n, generator=g), torch.randn(m, n, generator=g)),
    ]:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            ours = cpu_ops.gemv(x, w, bias, residual)
        finally:
            torch.set_num_threads(before)
        exact = _reference(x, w, bias, residual)
        # A float32 sum of k + 2 terms in any order is within (k + 2) * 2^-24 of the sum of their
        # magnitudes (the classic bound); F.linear's own error sits far inside it.
        mags = _reference(
            x.abs(), w.abs(), None if bias is None else bias.abs(), None if residual is None else residual.abs()
        )
        bound = (k + 2) * 2.0**-24 * mags
        assert ours.shape == (m, n) and ours.dtype == torch.float32
        assert bool(((ours.double() - exact).abs() <= bound).all())
        typical = (ours.double() - exact).abs().mean() / mags.mean()
        assert typical < 1e-6  # and far inside it on average, as F.linear is


def test_gemv_reads_strided_rows_and_a_weight_prefix():
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(64, 200, generator=g)
    x = wide[:3, :99]  # rows at a stride of 200
    head = torch.randn(50, 99, generator=g)[:41]  # the LM head's [: vocab_size] view
    residual = torch.randn(3, 82, generator=g)[:, ::2]  # strided elements: copied first
    ours = cpu_ops.gemv(x, head, None, residual)
    assert torch.allclose(ours, F.linear(x, head) + residual, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 4, 5])
@pytest.mark.parametrize("n,k", [(1, 1), (7, 5), (13, 8), (37, 29), (129, 131), (1001, 577), (300, 1536)])
def test_bfloat16_weights_give_the_float32_sums_of_their_products(threads, m, n, k):
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    bias, residual = torch.randn(n, generator=g), torch.randn(m, n, generator=g)
    rounds = cpu_ops.gemv_bf16_rounds_x()  # AVX512_BF16: x rounded to bfloat16, VDPBF16PS
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for b, r in [(None, None), (bias, residual)]:
            ours = cpu_ops.gemv(x, w, b, r)
            assert ours.dtype == torch.float32
            if rounds:  # float32 sums of the bfloat16 products: float64 on the same values, to rounding
                exact = F.linear(x.bfloat16().double(), w.double(), None if b is None else b.double())
                exact = exact if r is None else exact + r.double()
                assert torch.allclose(ours.double(), exact, atol=1e-5 * k**0.5, rtol=1e-5)
            else:  # widened weights: the float32 result on the same values, bit for bit
                assert torch.equal(ours, cpu_ops.gemv(x, w.float(), b, r))
        # a bfloat16 x (a bfloat16 model's linears): the same values either way
        xb = x.to(torch.bfloat16)
        if rounds:
            assert torch.equal(cpu_ops.gemv(xb, w), cpu_ops.gemv(xb.float(), w))
        else:
            assert torch.equal(cpu_ops.gemv(xb, w), cpu_ops.gemv(xb.float(), w.float()))
    finally:
        torch.set_num_threads(before)
    tol = 1e-2 if rounds else 1e-4  # x's rounding to bfloat16 (relative 2^-9) is the larger error
    assert torch.allclose(cpu_ops.gemv(x, w), F.linear(x, w.float()), atol=tol * k**0.5, rtol=tol)


def test_gemv_ready_only_for_one_row_of_float32_or_bfloat16(monkeypatch):
    if cpu_ops.unavailable_reason() or not cpu_ops._gemv_ok:
        pytest.skip("the GEMV's AVX2 + FMA path is not built on this CPU")
    w = torch.randn(8, 16)
    assert cpu_ops.gemv_ready(torch.randn(1, 16), w)
    assert not cpu_ops.gemv_ready(torch.randn(cpu_ops.GEMV_MAX_ROWS + 1, 16), w)
    assert cpu_ops.gemv_ready(torch.randn(1, 16, dtype=torch.bfloat16), w.bfloat16())
    assert cpu_ops.gemv_ready(torch.randn(1, 16), w.bfloat16())
    assert not cpu_ops.gemv_ready(torch.randn(1, 16, dtype=torch.bfloat16), w)  # no narrowing of weights
    assert not cpu_ops.gemv_ready(torch.randn(1, 16, dtype=torch.float16), w.half())
    assert not cpu_ops.gemv_ready(torch.randn(1, 1, 16), w)
    monkeypatch.setattr(cpu_ops, "_gemv_ok", False)  # what WORKBENCH_CPU_GEMV=0 sets at load
    assert not cpu_ops.gemv_ready(torch.randn(1, 16), w)


def test_linear_layers_dispatch_one_row_to_the_gemv(monkeypatch):
    if cpu_ops.unavailable_reason() or not cpu_ops._gemv_ok:
        pytest.skip("the GEMV's AVX2 + FMA path is not built on this CPU")
    from workbench.core.layers.linear import RowParallelLinear

    layer = RowParallelLinear(37, 29, bias=True)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.process_weights_after_loading(pack=True)
    calls = []
    real = cpu_ops.gemv
    monkeypatch.setattr(cpu_ops, "gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    x, res = torch.randn(1, 37), torch.randn(1, 29)
    expected = F.linear(x, layer.weight, layer.bias) + res
    assert torch.allclose(layer(x, res), expected, atol=1e-4)
    assert calls == [(1, 37)]
    x2, res2 = torch.randn(2, 37), torch.randn(2, 29)  # two rows: oneDNN
    assert torch.allclose(layer(x2, res2), F.linear(x2, layer.weight, layer.bias) + res2, atol=1e-4)
    assert calls == [(1, 37)]

    layer.process_weights_after_loading(pack=False)  # the CPU fast paths off: F.linear
    assert torch.allclose(layer(x, res), expected, atol=1e-4)
    assert calls == [(1, 37)]


def test_bfloat16_linear_layers_take_the_gemv_at_one_row_even_unpacked(monkeypatch):
    """On a CPU without oneDNN bfloat16 GEMMs (AVX2) bfloat16 weights stay unpacked; one row still
    streams them through the GEMV, and the layer returns bfloat16."""
    if cpu_ops.unavailable_reason() or not cpu_ops._gemv_ok:
        pytest.skip("the GEMV's AVX2 + FMA path is not built on this CPU")
    from workbench.core.layers.linear import RowParallelLinear

    layer = RowParallelLinear(37, 29, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(layer.weight)
    torch.nn.init.normal_(layer.bias)
    layer.process_weights_after_loading(pack=True)
    calls = []
    real = cpu_ops.gemv
    monkeypatch.setattr(cpu_ops, "gemv", lambda *a: calls.append(a[0].shape) or real(*a))
    x, res = torch.randn(1, 37, dtype=torch.bfloat16), torch.randn(1, 29, dtype=torch.bfloat16)
    out = layer(x, res)
    assert calls == [(1, 37)] and out.dtype == torch.bfloat16
    expected = F.linear(x.float(), layer.weight.float(), layer.bias.float()) + res.float()
    assert torch.allclose(out.float(), expected, atol=0.05, rtol=0.01)  # rounded once, to bfloat16
