"""The mixture-of-experts ops of --enable-deterministic-inference (core/layers/batch_invariant.py).

A token's routing (softmax, top k) and its experts' output must be bitwise the same whatever other
tokens share the call, and how many of them went to each expert; and they must still be the
router and the experts (close to the plain float64 computation). The model-level checks through
the Engine are in tests/e2e/test_deterministic_moe_e2e.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the batch-invariant kernels cannot be built here", allow_module_level=True)

from torch_helpers import torch_threads
from workbench.core.layers import batch_invariant  # noqa: E402

if batch_invariant.unavailable_reason("cpu") is not None:
    pytest.skip(batch_invariant.unavailable_reason("cpu"), allow_module_level=True)

E, K, H, I = 8, 2, 96, 40  # experts, top k, hidden, expert intermediate (odd sizes: K tails)


@pytest.mark.parametrize("renormalize", [True, False])
def test_router_row_is_the_same_at_any_batch_size_and_is_softmax_topk(renormalize):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(300, E, generator=g) * 4
    w_all, ids_all = batch_invariant.bi_topk_softmax(logits, K, renormalize)
    for m in (1, 7, 300):
        w, ids = batch_invariant.bi_topk_softmax(logits[:m], K, renormalize)
        assert torch.equal(w, w_all[:m]) and torch.equal(ids, ids_all[:m]), m
    # any row alone, and beside rows of another scale
    for row in (0, 17, 299):
        noisy = torch.randn(5, E, generator=g) * 100
        noisy[2] = logits[row]
        w, ids = batch_invariant.bi_topk_softmax(noisy, K, renormalize)
        assert torch.equal(w[2], w_all[row]) and torch.equal(ids[2], ids_all[row]), row
    ref_w, ref_ids = torch.topk(torch.softmax(logits.double(), -1), K, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    assert torch.equal(ids_all, ref_ids)
    assert torch.allclose(w_all.double(), ref_w, rtol=1e-6, atol=1e-7)


def test_router_ties_go_to_the_lower_expert():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0]])
    w, ids = batch_invariant.bi_topk_softmax(logits, 2, True)
    assert ids.tolist() == [[1, 2]] and w.tolist() == [[0.5, 0.5]]


def _experts(dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(dtype)
    x = torch.randn(64, H, generator=g).to(dtype)
    weights, ids = batch_invariant.bi_topk_softmax(torch.randn(64, E, generator=g), K, True)
    return w13, w2, x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_row_is_the_same_whatever_shares_the_call(dtype):
    """Token 0 alone, among 7 or 64 tokens (so its experts run GEMMs of other heights), and among
    tokens all routed elsewhere; on 1 to 3 threads."""
    w13, w2, x, weights, ids = _experts(dtype)
    alone = batch_invariant.bi_experts(x[:1], w13, w2, weights[:1], ids[:1])
    for threads in (1, 2, 3):
        with torch_threads(threads):
            full = batch_invariant.bi_experts(x, w13, w2, weights, ids)
            assert torch.equal(full[0], alone[0]), threads
            assert torch.equal(batch_invariant.bi_experts(x[:7], w13, w2, weights[:7], ids[:7]), full[:7]), threads
    # the same token again, beside tokens routed to its own experts in other mixes
    order = torch.randperm(64, generator=torch.Generator().manual_seed(9))
    shuffled = batch_invariant.bi_experts(x[order], w13, w2, weights[order], ids[order])
    assert torch.equal(shuffled, full[order])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_experts_compute_the_mixture(dtype):
    w13, w2, x, weights, ids = _experts(dtype)
    got = batch_invariant.bi_experts(x, w13, w2, weights, ids)
    xd, ref = x.double(), torch.zeros(64, H, dtype=torch.float64)
    for t in range(64):
        for j in range(K):
            e = ids[t, j]
            h = F.linear(xd[t], w13[e].double())
            ref[t] += weights[t, j].double() * F.linear(F.silu(h[:I]) * h[I:], w2[e].double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2  # bfloat16: the gate/up output is rounded, as the plain path
    assert torch.allclose(got.double(), ref, atol=tol, rtol=tol)


def test_experts_of_another_rank_are_skipped():
    """Expert parallel: a rank holding experts 4..7 adds only those; the two halves sum to the whole."""
    w13, w2, x, weights, ids = _experts(torch.float32)
    full = batch_invariant.bi_experts(x, w13, w2, weights, ids)
    low = batch_invariant.bi_experts(x, w13[:4], w2[:4], weights, ids, first_expert=0)
    high = batch_invariant.bi_experts(x, w13[4:], w2[4:], weights, ids, first_expert=4)
    assert torch.allclose(low + high, full, atol=1e-6)
    only_high = (ids >= 4).all(dim=1)
    assert torch.equal(low[only_high], torch.zeros_like(low[only_high]))


def test_mixture_of_experts_models_are_accepted_and_patched():
    """A SparseMoeBlock passes model_unsupported_reason and, once patched, routes through the
    batch-invariant router and experts (its forward equals bi_topk_softmax + bi_experts)."""
    from workbench.core.layers.linear import ColumnParallelLinear
    from workbench.core.layers.moe import SparseMoeBlock

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = ColumnParallelLinear(H, H)
            self.mlp = SparseMoeBlock(H, E, K, I, renormalize=True)

    model = Tiny()
    w13, w2, x, _, _ = _experts(torch.float32)
    model.mlp.experts.w13_weight.data.copy_(w13)
    model.mlp.experts.w2_weight.data.copy_(w2)
    model.mlp.gate.weight.data.copy_(torch.randn(E, H, generator=torch.Generator().manual_seed(2)))
    assert batch_invariant.model_unsupported_reason(model) is None
    batch_invariant.enable_batch_invariant_mode(model)
    weights, ids = batch_invariant.bi_topk_softmax(batch_invariant.bi_linear(x, model.mlp.gate.weight), K, True)
    expect = batch_invariant.bi_experts(x, w13, w2, weights, ids)
    assert torch.equal(model.mlp(x), expect)
    assert torch.equal(model.mlp(x[3:4]), expect[3:4])
    assert torch.equal(model.mlp.experts.last_topk_ids, ids[3:4])
