"""gemm.c, the packed-weight GEMM for batched rows (cpu_ops/gemm.py), against torch in float64 on the
same values, and its hook in the CPU linear path."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.nn.functional as F
from workbench.core.layers.cpu_ops import gemm as cpu_gemm
from workbench.core.layers.linear import ColumnParallelLinear, RowParallelLinear, gemm_ready

pytestmark = pytest.mark.skipif(not cpu_gemm.available(), reason=f"gemm.c: {cpu_gemm.unavailable_reason()}")

# The default model's linears (SmolLM2-135M: qkv, o, gate_up, down, a slice of the head) and odd
# shapes: N not a multiple of the panel width, K below one vector and K split into uneven blocks.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (37, 5), (50, 300), (17, 1000)]
# Both sides of gemm.c's SMALL_M (64: whole-K panels below, K blocks above), row tails of MR (6, 12).
ROWS = [1, 5, 8, 13, 64, 65, 150]


def _reference(x, w, bias=None, residual=None):
    """float64 sums of the float32 values the kernel sees (x and w widened first)."""
    out = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    return out if residual is None else out + residual.double()


def _tolerance(k: int) -> float:
    return 1e-5 * (k**0.5) * 4  # float32 sums of K products of unit-variance values


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_gemm_equals_torch_within_float32_tolerance(n, k, dtype):
    gen = torch.Generator().manual_seed(n * 7919 + k)
    w = torch.randn(n, k, generator=gen).to(dtype)
    packed = cpu_gemm.pack(w)
    for rows in ROWS if n * k <= 600_000 else [13, 150]:
        x = torch.randn(rows, k, generator=gen).to(dtype)
        got = cpu_gemm.gemm(x, packed)
        assert got.dtype == torch.float32 and got.shape == (rows, n)
        err = (got.double() - _reference(x, w)).abs().max().item()
        assert err <= _tolerance(k), f"{rows} rows of [{n} x {k}] {dtype}: max error {err}"


def test_bias_residual_and_strided_inputs():
    gen = torch.Generator().manual_seed(1)
    n, k, rows = 70, 600, 20
    w = torch.randn(n, k, generator=gen)
    wide = torch.randn(n, k + 9, generator=gen)[:, :k]  # row stride K + 9
    bias, residual = torch.randn(n, generator=gen), torch.randn(rows, n, generator=gen)
    x = torch.randn(rows, k + 3, generator=gen)[:, 3:]  # rows not contiguous
    for weight in (w, wide, w.to(torch.bfloat16)):
        got = cpu_gemm.gemm(x, cpu_gemm.pack(weight), bias, residual)
        err = (got.double() - _reference(x, weight.float(), bias, residual)).abs().max().item()
        assert err <= _tolerance(k)


def test_bfloat16_weights_give_the_float32_result_on_the_same_values():
    """Widening bfloat16 is exact, so the two storages give the same sums bit for bit."""
    gen = torch.Generator().manual_seed(2)
    w16 = torch.randn(200, 576, generator=gen).to(torch.bfloat16)
    x = torch.randn(40, 576, generator=gen)
    assert torch.equal(cpu_gemm.gemm(x, cpu_gemm.pack(w16)), cpu_gemm.gemm(x, cpu_gemm.pack(w16.float())))


def test_the_result_does_not_depend_on_threads_or_batch():
    gen = torch.Generator().manual_seed(3)
    w = cpu_gemm.pack(torch.randn(960, 1536, generator=gen))
    x = torch.randn(64, 1536, generator=gen)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu_gemm.gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    torch.set_num_threads(max(2, threads))
    try:
        many = cpu_gemm.gemm(x, w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, many)
    assert torch.equal(cpu_gemm.gemm(x[5:9], w), one[5:9])  # another row block, same sums


def test_choose_measures_per_row_bucket(tmp_path, monkeypatch):
    monkeypatch.delenv("WORKBENCH_CPU_GEMM", raising=False)  # tests/conftest.py forces the kernel elsewhere
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))  # measured here, not read from this machine's cache
    w = cpu_gemm.pack(torch.randn(64, 128))
    picks = cpu_gemm.choose(w, lambda x: F.linear(x, torch.zeros(64, 128)), budget_s=0.001)
    assert len(picks) == len(cpu_gemm.ROW_BUCKETS) and all(isinstance(p, bool) for p in picks)
    assert "64x128" in cpu_gemm.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_layers_take_gemm_for_batched_rows(monkeypatch, dtype):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "1")  # always: this checks the hook, not the speed
    gen = torch.Generator().manual_seed(4)
    col = ColumnParallelLinear(576, 960, bias=True)
    row = RowParallelLinear(1536, 576)
    for layer in (col, row):
        for p in layer.parameters():
            p.data = torch.randn(p.shape, generator=gen).to(dtype)
        layer.process_weights_after_loading(pack=True)
        assert layer.gemm_weight is not None and layer.packed_weight is None
    x = torch.randn(32, 576, generator=gen).to(dtype)
    assert gemm_ready(x, col.gemm_weight) and not gemm_ready(x[:1], col.gemm_weight)
    got = col(x)
    assert got.dtype == dtype
    want = _reference(x, col.weight, col.bias).to(dtype)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=_tolerance(576))
    h, res = torch.randn(32, 1536, generator=gen).to(dtype), torch.randn(32, 576, generator=gen).to(dtype)
    torch.testing.assert_close(
        row(h, res),
        _reference(h, row.weight, None, res).to(dtype),
        rtol=1e-5 if dtype == torch.float32 else 1e-2,
        atol=_tolerance(1536),
    )


def test_switched_off(monkeypatch):
    monkeypatch.setenv("WORKBENCH_CPU_GEMM", "0")
    layer = ColumnParallelLinear(64, 64)
    layer.weight.data = torch.randn(64, 64)
    layer.process_weights_after_loading(pack=True)
    assert layer.gemm_weight is None and "WORKBENCH_CPU_GEMM=0" in (cpu_gemm.unavailable_reason() or "")


def test_a_choice_measured_once_is_reused_by_the_next_start_on_this_machine(tmp_path, monkeypatch):
    """choose() keeps its per-shape picks in $WORKBENCH_CACHE_DIR/gemm/ (per machine and torch version):
    a second process (here: the memo cleared) takes them without measuring; a stale or foreign file is not read."""
    monkeypatch.setenv("WORKBENCH_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("WORKBENCH_CPU_GEMM", raising=False)
    monkeypatch.setattr(cpu_gemm, "_choices", {})
    w = torch.randn(48, 40)
    packed = cpu_gemm.pack(w)
    calls = []

    def torch_linear(x):
        calls.append(x.shape[0])
        return torch.nn.functional.linear(x, w)

    first = cpu_gemm.choose(packed, torch_linear, budget_s=0.001)
    assert calls and cpu_gemm._cache_file().exists()
    # the next start: a fresh memo, the file read instead of a measurement (the file's picks, flipped, are what it takes)
    key = (48, 40, torch.float32, False)
    flipped = [not p for p in first]
    path = cpu_gemm._cache_file()
    path.write_text(json.dumps({cpu_gemm._key_text(key): flipped}))
    monkeypatch.setattr(cpu_gemm, "_choices", {})
    calls.clear()
    assert cpu_gemm.choose(packed, torch_linear, budget_s=0.001) == tuple(flipped) and not calls
    # a file older than the limit is measured again
    old = time.time() - cpu_gemm.CACHE_MAX_AGE_S - 60
    os.utime(path, (old, old))
    monkeypatch.setattr(cpu_gemm, "_choices", {})
    cpu_gemm.choose(packed, torch_linear, budget_s=0.001)
    assert calls
