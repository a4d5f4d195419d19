"""The cpu_paged backend's compiled decode kernel against the torch-native reference.

The kernel reads K/V in place through req_to_token; the reference gathers a padded
copy and runs SDPA. Both are checked against float32 attention over the same
(possibly low-precision) inputs, over ragged lengths, scattered slots, GQA ratios,
head sizes, dtypes and both ways the kernel splits work (by request, by KV head).

The end-to-end tests of this module are in tests/e2e/test_cpu_paged_attention_e2e.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from workbench.core.layers import cpu_ops
from workbench.core.layers.attention.registry import (
    choose_attention_backend,
    create_attn_backend,
    default_attention_backend,
)
from workbench.core.layers.attention.torch_native_backend import build_decode_metadata, decode_attention

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip(
        "no C compiler: the cpu_paged kernel cannot be built here (CPU default falls back to torch_native)",
        allow_module_level=True,
    )


def test_the_kernel_builds_here():
    # A compiler is present, so a failure to build is a bug, not a skip.
    assert cpu_ops.unavailable_reason() is None
    assert cpu_ops.library_path().exists()


def _case(bs, hq, hk, d, lens, q_dtype, kv_dtype, seed=0):
    """A scattered pool: each request's slots are a random subset of the pool, in random order."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lens) + 7
    k_buf = torch.randn(total + 1, hk, d, generator=g).to(kv_dtype)
    v_buf = torch.randn(total + 1, hk, d, generator=g).to(kv_dtype)
    req_to_token = torch.zeros(2 * bs + 1, max(lens) + 5, dtype=torch.int64)
    req_pool_indices = torch.randperm(2 * bs + 1, generator=g)[:bs].to(torch.int64)
    perm = torch.randperm(total, generator=g) + 1  # slot 0 stays unused, like the real pool
    offset = 0
    for b, n in enumerate(lens):
        req_to_token[req_pool_indices[b], :n] = perm[offset : offset + n]
        offset += n
    # q as a view into a fused [B, Hq + Hk, D] tensor, as the model passes it (batch stride > Hq * D)
    q = torch.randn(bs, hq + hk, d, generator=g).to(q_dtype)[:, :hq]
    return q, k_buf, v_buf, req_to_token, req_pool_indices, torch.tensor(lens, dtype=torch.int64)


def _exact(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, scale):
    meta = build_decode_metadata(req_to_token, req_pool_indices, seq_lens, seq_lens.tolist(), k_buf.shape[1])
    return decode_attention(q.float(), k_buf.float(), v_buf.float(), meta, scale)


# (q dtype, pool dtype, tolerance against float32 attention): the kernels' dtype pairs
DTYPE_TOLERANCES = [
    (torch.float32, torch.float32, 1e-5),
    (torch.bfloat16, torch.bfloat16, 2e-2),  # output rounded to bf16 once
    (torch.float32, torch.bfloat16, 1e-5),  # a bf16 pool under a float32 model
    (torch.float16, torch.float16, 3e-3),
]


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", DTYPE_TOLERANCES)
@pytest.mark.parametrize(
    "bs,hq,hk,d",
    [
        (1, 9, 3, 64),  # one request: work split by KV head
        (5, 8, 8, 48),  # MHA, a head size with no specialized copy
        (12, 12, 3, 128),  # GQA 4
        (32, 9, 3, 64),  # the default model at batch 32: split by request
    ],
)
def test_kernel_matches_float32_attention(q_dtype, kv_dtype, atol, bs, hq, hk, d):
    lens = [1] + [int(x) for x in torch.randint(2, 300, (bs - 1,), generator=torch.Generator().manual_seed(bs))]
    q, k_buf, v_buf, r2t, rpi, seq_lens = _case(bs, hq, hk, d, lens[:bs], q_dtype, kv_dtype)
    scale = d**-0.5
    out = cpu_ops.paged_decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, scale)
    assert out.shape == (bs, hq, d) and out.dtype == q_dtype
    exact = _exact(q, k_buf, v_buf, r2t, rpi, seq_lens, scale)
    torch.testing.assert_close(out.float(), exact, atol=atol, rtol=0)
    # ... and it agrees with the torch-native backend on the same dtypes
    meta = build_decode_metadata(r2t, rpi, seq_lens, seq_lens.tolist(), hk)
    reference = decode_attention(q, k_buf, v_buf, meta, scale)
    torch.testing.assert_close(
        out.float(), reference.float(), atol=2 * atol + 1e-2 * (q_dtype != torch.float32), rtol=0
    )


@pytest.mark.parametrize(
    "q_dtype,kv_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
@pytest.mark.parametrize("bs", [1, 7])
def test_storing_this_steps_kv_in_the_same_call(q_dtype, kv_dtype, bs):
    # What set_kv_buffer + attention do in two steps, the kernel does in one call: the pools end up
    # bit-identical (same rounding as .to()) and so do the outputs.
    lens = [3, 40, 1, 77, 12, 5, 30][:bs]
    q, k_buf, v_buf, r2t, rpi, seq_lens = _case(bs, 8, 2, 64, lens, q_dtype, kv_dtype, seed=3)
    g = torch.Generator().manual_seed(4)
    kv_new = torch.randn(bs, 3 * 2, 64, generator=g).to(q_dtype)  # strided views, as the model passes them
    k_new, v_new = kv_new[:, 2:4], kv_new[:, 4:6]
    loc = torch.stack([r2t[rpi[b], lens[b] - 1] for b in range(bs)])
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    k_ref[loc], v_ref[loc] = k_new.to(kv_dtype), v_new.to(kv_dtype)
    expected = cpu_ops.paged_decode_attention(q, k_ref, v_ref, r2t, rpi, seq_lens, 0.125)
    out = cpu_ops.paged_decode_attention(
        q, k_buf, v_buf, r2t, rpi, seq_lens, 0.125, k_new=k_new, v_new=v_new, out_cache_loc=loc
    )
    assert torch.equal(k_buf, k_ref) and torch.equal(v_buf, v_ref)
    assert torch.equal(out, expected)


def test_one_token_context_returns_its_value_row():
    # softmax over a single key is 1: the output is exactly that token's V row (per query head's KV head)
    q, k_buf, v_buf, r2t, rpi, seq_lens = _case(3, 6, 2, 64, [1, 1, 1], torch.float32, torch.float32)
    out = cpu_ops.paged_decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, 0.125)
    for b in range(3):
        slot = int(r2t[rpi[b], 0])
        expected = v_buf[slot].repeat_interleave(3, dim=0)
        torch.testing.assert_close(out[b], expected, atol=1e-6, rtol=0)


def _on_one_and_two_threads(fn, *args):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fn(*args)
        torch.set_num_threads(2)
        return one, fn(*args)
    finally:
        torch.set_num_threads(before)


def test_thread_count_does_not_change_the_result():
    case = _case(8, 9, 3, 64, [5, 80, 200, 33, 1, 150, 64, 99], torch.float32, torch.float32)
    one, two = _on_one_and_two_threads(cpu_ops.paged_decode_attention, *case, 0.125)
    assert torch.equal(one, two)  # each (request, head) is summed by one thread, in one order


def test_head_shapes_the_kernel_cannot_run():
    assert cpu_ops.shape_unsupported_reason(9, 3, 64) is None
    assert "multiple of 16" in cpu_ops.shape_unsupported_reason(8, 8, 40)
    assert "divide" in cpu_ops.shape_unsupported_reason(9, 2, 64)
    # the default steps down; asking for cpu_paged by name is refused with what to use
    assert choose_attention_backend(None, "cpu", torch.float32, 8, 8, 40) == "torch_native"
    assert choose_attention_backend(None, "cpu", torch.float32, 9, 3, 64) == "cpu_paged"
    assert choose_attention_backend("torch_native", "cpu", torch.float32, 9, 3, 64) == "torch_native"
    with pytest.raises(ValueError, match="torch_native"):
        create_attn_backend("cpu_paged", "cpu", 8, 8, 40, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="CPU only"):
        create_attn_backend("cpu_paged", "cuda", 9, 3, 64, torch.bfloat16, torch.bfloat16)


def test_cpu_default_is_cpu_paged_when_the_kernel_builds():
    assert default_attention_backend("cpu") == "cpu_paged"
    assert default_attention_backend("cpu", "bfloat16") == "cpu_paged"


def test_bfloat16_store_rounds_like_torch_on_edge_values():
    # ties to even both ways, the largest finite float32, infinities and NaN (stays NaN)
    edge = torch.tensor(
        [
            1 + 2**-8,
            1 + 3 * 2**-8,
            -(1 + 2**-8),
            3.4028235e38,
            float("inf"),
            float("-inf"),
            float("nan"),
            1e-40,
            -0.0,
            2**-133,
            65504.0,
            0.1,
            1 / 3,
            -2.5,
            7.0,
            1e30,
        ],
        dtype=torch.float32,
    )
    k_new = edge.repeat(4).view(1, 1, 64)
    q, k_buf, v_buf, r2t, rpi, seq_lens = _case(1, 1, 1, 64, [1], torch.float32, torch.bfloat16)
    loc = r2t[rpi[0], :1]
    cpu_ops.paged_decode_attention(
        q, k_buf, v_buf, r2t, rpi, seq_lens, 0.125, k_new=k_new, v_new=k_new.clone(), out_cache_loc=loc
    )
    stored, expected = k_buf[loc[0], 0], k_new[0, 0].to(torch.bfloat16)
    same = (stored.view(torch.int16) == expected.view(torch.int16)) | (stored.isnan() & expected.isnan())
    assert bool(same.all()), (stored, expected)


# ---- extend (prefill) -------------------------------------------------------------------------
def _extend_case(prefixes, exts, hq, hk, d, q_dtype, kv_dtype, seed=0):
    """A pool holding each request's prefix and new tokens at scattered slots; q for the new tokens."""
    g = torch.Generator().manual_seed(seed)
    bs, total = len(exts), sum(prefixes) + sum(exts) + 3
    k_buf = torch.randn(total + 1, hk, d, generator=g).to(kv_dtype)
    v_buf = torch.randn(total + 1, hk, d, generator=g).to(kv_dtype)
    req_to_token = torch.zeros(bs + 3, max(p + e for p, e in zip(prefixes, exts)) + 4, dtype=torch.int64)
    req_pool_indices = torch.randperm(bs + 3, generator=g)[:bs].to(torch.int64)
    perm, offset = torch.randperm(total, generator=g) + 1, 0
    for b, (p, e) in enumerate(zip(prefixes, exts)):
        req_to_token[req_pool_indices[b], : p + e] = perm[offset : offset + p + e]
        offset += p + e
    q = torch.randn(sum(exts), hq + hk, d, generator=g).to(q_dtype)[:, :hq]
    starts = torch.tensor([0] + torch.tensor(exts).cumsum(0)[:-1].tolist(), dtype=torch.int64)
    return (
        q,
        k_buf,
        v_buf,
        req_to_token,
        req_pool_indices,
        torch.tensor(prefixes, dtype=torch.int64),
        torch.tensor(exts, dtype=torch.int64),
        starts,
    )


def _extend_exact(q, k_buf, v_buf, req_to_token, req_pool_indices, prefix_lens, extend_lens, starts, scale):
    """float32 SDPA per request over its gathered keys, with the causal mask offset by the prefix."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b in range(len(extend_lens)):
        p, e, s = int(prefix_lens[b]), int(extend_lens[b]), int(starts[b])
        idx = req_to_token[req_pool_indices[b], : p + e]
        k, v = k_buf[idx].float().transpose(0, 1), v_buf[idx].float().transpose(0, 1)
        mask = torch.arange(p + e).unsqueeze(0) <= (torch.arange(e) + p).unsqueeze(1)
        o = F.scaled_dot_product_attention(
            q[s : s + e].float().transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )
        out[s : s + e] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", DTYPE_TOLERANCES)
@pytest.mark.parametrize("hq,hk,d", [(9, 3, 64), (8, 8, 48), (12, 3, 128)])
def test_extend_kernel_matches_float32_attention(q_dtype, kv_dtype, atol, hq, hk, d):
    # fresh prompts (one token, one block, several blocks), prefixes, and one-token extends (a mixed batch's
    # decode rows)
    prefixes, exts = [0, 0, 0, 37, 100, 5, 16], [1, 16, 70, 20, 1, 33, 1]
    case = _extend_case(prefixes, exts, hq, hk, d, q_dtype, kv_dtype)
    scale = d**-0.5
    out = cpu_ops.paged_extend_attention(*case, scale)
    assert out.shape == case[0].shape and out.dtype == q_dtype
    torch.testing.assert_close(out.float(), _extend_exact(*case, scale), atol=atol, rtol=0)


def test_extend_kernel_result_does_not_depend_on_threads():
    case = _extend_case([0, 40], [130, 77], 9, 3, 64, torch.float32, torch.float32, seed=1)
    one, two = _on_one_and_two_threads(cpu_ops.paged_extend_attention, *case, 0.125)
    assert torch.equal(one, two)  # each block of new tokens is computed by one thread
