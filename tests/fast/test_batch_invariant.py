"""The batch-invariant ops of --enable-deterministic-inference (core/layers/batch_invariant.py).

A row's result must be bitwise the same whatever else shares the call: the linear at M = 1, 7 and
64 rows (any tile, any thread count), and attention for one query whether its sequence is
prefilled at once, over a cached prefix, in chunks, decoded token by token, or beside other
requests. The model-level checks through the Engine are in tests/e2e/test_deterministic_e2e.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch_helpers import torch_threads
from workbench.core.layers import cpu_ops

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the batch-invariant kernels cannot be built here", allow_module_level=True)

from workbench.core.layers import batch_invariant  # noqa: E402

if batch_invariant.unavailable_reason("cpu") is not None:
    pytest.skip(batch_invariant.unavailable_reason("cpu"), allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (37, 101)])  # the model's shapes; odd N and a K tail
def test_linear_row_is_the_same_at_any_batch_size(dtype, n, k):
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 0.05).to(dtype)
    bias = torch.randn(n, generator=g)
    x = torch.randn(64, k, generator=g).to(dtype)
    res = torch.randn(64, n, generator=g).to(dtype)
    alone = [batch_invariant.bi_linear(x[i : i + 1], w, bias, res[i : i + 1]) for i in (0, 5, 6)]
    for threads in (1, 2, 3):
        with torch_threads(threads):
            for m in (1, 7, 64):
                out = batch_invariant.bi_linear(x[:m], w, bias, res[:m])
                assert torch.equal(out[0], alone[0][0]), (threads, m)
                if m >= 7:
                    assert torch.equal(out[5], alone[1][0]) and torch.equal(out[6], alone[2][0]), (threads, m)
    # and it is the linear: float32 sums of the same products
    ref = x[:7].double() @ w.double().T + bias.double() + res[:7].double()
    assert torch.allclose(batch_invariant.bi_linear(x[:7], w, bias, res[:7]).double(), ref, atol=1e-3, rtol=1e-4)


def test_linear_row_does_not_depend_on_its_neighbours():
    """The same row beside other rows (any contents) gives the same bits: no cross-row state."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(300, 200, generator=g)
    row = torch.randn(1, 200, generator=g)
    ref = batch_invariant.bi_linear(row, w)
    for pos in range(4):
        x = torch.randn(5, 200, generator=g) * 1e3
        x[pos] = row[0]
        assert torch.equal(batch_invariant.bi_linear(x, w)[pos], ref[0]), pos


# ---- attention -----------------------------------------------------------------------------------
HQ, HK, D, L = 9, 3, 64, 41  # the default model's heads; one 41-token sequence


def _pools(dtype):
    from workbench.core.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

    return ReqToTokenPool(4, 128, "cpu"), MHATokenToKVPool(256, dtype, HK, D, 1, "cpu")


def _qkv(dtype, seed=0):
    """Per-position q, k, v: what a model would compute for the same tokens."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(L, h, D, generator=g).to(dtype) for h in (HQ, HK, HK))


def _run(backend, dtype, passes, other: int = 0, window: int | None = None):
    """Run the sequence through `passes` ((mode, n new tokens) each, in order), with `other` extra
    requests of random tokens in every pass beside it; returns its output rows [L, HQ, D]. `window`:
    a sliding-window layer (Mistral's)."""
    from workbench.core.layers.radix_attention import RadixAttention
    from workbench.core.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    r2t, pool = _pools(dtype)
    layer = RadixAttention(HQ, D, D**-0.5, HK, 0, sliding_window_size=window)
    q, k, v = _qkv(dtype)
    g = torch.Generator().manual_seed(99)
    rows = r2t.alloc(1 + other)
    slots = torch.randperm(250, generator=g)[: L * (1 + other)].view(1 + other, L) + 1
    for i, row in enumerate(rows):
        r2t.req_to_token[row, :L] = slots[i]
    outs, done = [], 0
    for mode, n in passes:
        lens = [n] * (1 + other)
        qs = [q[done : done + n]] + [torch.randn(n, HQ, D, generator=g).to(dtype) for _ in range(other)]
        ks = [k[done : done + n]] + [torch.randn(n, HK, D, generator=g).to(dtype) for _ in range(other)]
        vs = [v[done : done + n]] + [torch.randn(n, HK, D, generator=g).to(dtype) for _ in range(other)]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DECODE if mode == "decode" else ForwardMode.EXTEND,
            batch_size=1 + other,
            input_ids=torch.zeros(sum(lens), dtype=torch.int64),
            positions=torch.arange(done, done + n).repeat(1 + other),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor([done + n] * (1 + other), dtype=torch.int64),
            out_cache_loc=torch.cat([slots[i, done : done + n] for i in range(1 + other)]),
            seq_lens_cpu=[done + n] * (1 + other),
            extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[done] * (1 + other),
            req_to_token_pool=r2t,
            token_to_kv_pool=pool,
            attn_backend=backend,
        )
        backend.init_forward_metadata(fb)
        out = backend.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), layer, fb)
        outs.append(out[:n])
        done += n
    assert done == L
    return torch.cat(outs)


SPLITS = {
    "one prefill": [("extend", L)],
    "cached prefix": [("extend", 25), ("extend", L - 25)],
    "chunks of 8": [("extend", 8)] * 5 + [("extend", 1)],
    "prefill then decode": [("extend", 30)] + [("decode", 1)] * (L - 30),
    "decode only": [("decode", 1)] * L,
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_for_a_query_is_the_same_however_its_sequence_is_split(dtype):
    backend = batch_invariant.DeterministicCpuAttnBackend(group_size=HQ // HK)
    ref = _run(backend, dtype, SPLITS["one prefill"])
    for name, passes in SPLITS.items():
        for other in (0, 3):
            assert torch.equal(_run(backend, dtype, passes, other), ref), (name, other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_attention_is_split_invariant_and_windowed(dtype):
    """A window of 10 over the 41-token sequence: each split and batch gives the same bits, the
    rows are the masked reference's (keys p - 9 .. p), and differ from full attention past it."""
    from workbench.core.layers.attention.masked_attention import attend

    backend = batch_invariant.DeterministicCpuAttnBackend(group_size=HQ // HK)
    ref = _run(backend, dtype, SPLITS["one prefill"], window=10)
    for name, passes in SPLITS.items():
        for other in (0, 3):
            assert torch.equal(_run(backend, dtype, passes, other, window=10), ref), (name, other)
    q, k, v = _qkv(dtype)
    expect = attend(q, k, v, 0, D**-0.5, 10, 0.0)
    assert torch.allclose(ref.float(), expect, atol=2e-2 if dtype == torch.bfloat16 else 1e-5)
    full = _run(backend, dtype, SPLITS["one prefill"])
    assert torch.equal(full[:10], ref[:10]) and not torch.allclose(full[10:].float(), ref[10:].float(), atol=1e-3)


def test_the_default_backend_is_not_split_invariant_which_is_why_the_flag_exists():
    """The cpu_paged backend prefills with its blocked extend kernel and decodes with another: both are
    right, but the rows differ in the last bits. (If this ever holds, the docs should say so.)"""
    from workbench.core.layers.attention.cpu_paged_backend import CpuPagedAttnBackend

    backend = CpuPagedAttnBackend(group_size=HQ // HK)
    if not backend.use_extend_kernel:
        pytest.skip("this CPU prefills through SDPA")
    ref = _run(backend, torch.float32, SPLITS["one prefill"])
    other = _run(backend, torch.float32, SPLITS["prefill then decode"])
    assert torch.allclose(other, ref, atol=1e-5)
    assert not torch.equal(other, ref)


def test_flag_refuses_what_it_cannot_make_invariant():
    assert "CPU only" in batch_invariant.unavailable_reason("cuda")
    assert "float16" in batch_invariant.unavailable_reason("cpu", torch.float16)
    assert cpu_ops.unavailable_reason() is None


def test_server_args_refuse_what_has_no_batch_invariant_path():
    from workbench.core.args import ServerArgs

    with pytest.raises(ValueError, match="speculative"):
        ServerArgs(enable_deterministic_inference=True, speculative_algorithm="NGRAM")
    with pytest.raises(ValueError, match="torch-compile"):
        ServerArgs(enable_deterministic_inference=True, enable_torch_compile=True)
    assert ServerArgs(enable_deterministic_inference=True).enable_deterministic_inference
