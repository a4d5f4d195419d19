"""Grouped (cascade) decode attention: requests sharing a prefix of KV slots attend over it once.

The grouped kernel is checked against float32 attention computed request by request, over one
group, several groups with outsiders, a member sharing less than the others, GQA ratios, head
sizes and dtypes; the grouping rule against its stated contract; and the model end to end: greedy
tokens of a batch sharing a system prompt's slots equal transformers'.

The end-to-end tests of this module are in tests/e2e/test_cpu_prefix_attention_e2e.py.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from workbench.core.layers import cpu_ops

if shutil.which(os.environ.get("CC", "cc")) is None:
    pytest.skip("no C compiler: the cpu_paged kernels cannot be built here", allow_module_level=True)

from test_cpu_paged_attention import DTYPE_TOLERANCES, _exact  # noqa: E402  (the decode kernel tests' reference)


def _batch(groups, own, hq, hk, d, q_dtype, kv_dtype, seed=0):
    """groups: per request, (group id, shared length) or None; own: per request, own slot count.
    Group g's requests share the first slots of one random slot list; all other slots are distinct
    and scattered."""
    g = torch.Generator().manual_seed(seed)
    bs = len(groups)
    longest = max((n for x in groups if x for n in [x[1]]), default=0) + max(own) + 4
    total = 4 * longest * bs
    k_buf = torch.randn(total, hk, d, generator=g).to(kv_dtype)
    v_buf = torch.randn(total, hk, d, generator=g).to(kv_dtype)
    perm = (torch.randperm(total - 1, generator=g) + 1).tolist()
    shared = {}
    r2t = torch.zeros(bs + 3, longest + 8, dtype=torch.int64)
    rpi = torch.randperm(bs + 3, generator=g)[:bs]
    lens = []
    for b, (grp, n_own) in enumerate(zip(groups, own)):
        row = []
        if grp is not None:
            gid, n = grp
            if gid not in shared:
                shared[gid] = [perm.pop() for _ in range(longest)]
            row = shared[gid][:n]
        row += [perm.pop() for _ in range(n_own)]
        r2t[rpi[b], : len(row)] = torch.tensor(row)
        lens.append(len(row))
    q = torch.randn(bs, hq + hk, d, generator=g).to(q_dtype)[:, :hq]  # a strided view, as the model passes
    return q, k_buf, v_buf, r2t, rpi, torch.tensor(lens, dtype=torch.int64)


ONE_GROUP = [(0, 300)] * 20
TWO_GROUPS_AND_OUTSIDERS = [(0, 200)] * 7 + [None] + [(1, 129)] * 6 + [None, (0, 200)]
SHORT_MEMBER = [(0, 260)] * 9 + [(0, 140)]  # shares only 140 of the 260 slots


@pytest.mark.parametrize("q_dtype,kv_dtype,atol", DTYPE_TOLERANCES)
@pytest.mark.parametrize(
    "layout,hq,hk,d",
    [
        (ONE_GROUP, 9, 3, 64),  # the default model's heads
        (TWO_GROUPS_AND_OUTSIDERS, 8, 8, 128),  # MHA, head size 128
        (SHORT_MEMBER, 16, 4, 64),  # GQA 4
        ([(0, 700)] * 40, 9, 3, 64),  # many tiles, rows split into several blocks
    ],
)
def test_grouped_kernel_matches_float32_attention(q_dtype, kv_dtype, atol, layout, hq, hk, d):
    own = [1 + (7 * b) % 23 for b in range(len(layout))]
    q, k_buf, v_buf, r2t, rpi, seq_lens = _batch(layout, own, hq, hk, d, q_dtype, kv_dtype)
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=2)
    assert groups is not None
    out = cpu_ops.paged_decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5, groups=groups)
    exact = _exact(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5)
    torch.testing.assert_close(out.float(), exact, atol=atol, rtol=0)
    ungrouped = cpu_ops.paged_decode_attention(q, k_buf, v_buf, r2t, rpi, seq_lens, d**-0.5)
    torch.testing.assert_close(out.float(), ungrouped.float(), atol=atol, rtol=0)


def test_groups_follow_the_shared_slots():
    q, k_buf, v_buf, r2t, rpi, seq_lens = _batch(TWO_GROUPS_AND_OUTSIDERS, [5] * 16, 9, 3, 64, *[torch.float32] * 2)
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=2)
    assert groups.count == 2
    of, skip = groups.group_of.tolist(), groups.skip.tolist()
    assert of == [0] * 7 + [-1] + [1] * 6 + [-1, 0]
    assert skip == [200] * 7 + [0] + [129] * 6 + [0, 200]
    # the member sharing less: the group keeps the longer prefix for the nine and leaves it out
    # (9 x 260 slots not re-read beat 10 x 140)
    q, k_buf, v_buf, r2t, rpi, seq_lens = _batch(SHORT_MEMBER, [5] * 10, 9, 3, 64, *[torch.float32] * 2)
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=2)
    assert groups.group_of.tolist() == [0] * 9 + [-1] and groups.skip.tolist() == [260] * 9 + [0]


def test_groups_respect_their_minimums_and_keep_an_own_slot():
    q, k_buf, v_buf, r2t, rpi, seq_lens = _batch([(0, 100)] * 5, [1] * 5, 9, 3, 64, *[torch.float32] * 2)
    assert cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=101, min_members=2) is None
    assert cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=6) is None
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=5)
    assert groups.skip.tolist() == [100] * 5  # every request keeps its one own slot (this step's)
    # identical rows (no own slot beyond the prefix): the shared part stops one slot short
    r2t[rpi[1:], :101] = r2t[rpi[0], :101]
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens, min_prefix=64, min_members=5)
    assert groups.skip.tolist() == [100] * 5


@pytest.mark.parametrize("q_dtype,kv_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
def test_grouped_kernel_stores_this_steps_kv_and_ignores_thread_count(q_dtype, kv_dtype):
    layout = [(0, 300)] * 18
    q, k_buf, v_buf, r2t, rpi, seq_lens = _batch(layout, [3] * 18, 9, 3, 64, q_dtype, kv_dtype, seed=5)
    groups = cpu_ops.decode_prefix_groups(r2t, rpi, seq_lens)
    kv_new = torch.randn(18, 9, 64, generator=torch.Generator().manual_seed(6)).to(q_dtype)
    k_new, v_new = kv_new[:, 3:6], kv_new[:, 6:9]
    loc = torch.stack([r2t[rpi[b], seq_lens[b] - 1] for b in range(18)])
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    k_ref[loc], v_ref[loc] = k_new.to(kv_dtype), v_new.to(kv_dtype)
    expected = cpu_ops.paged_decode_attention(q, k_ref, v_ref, r2t, rpi, seq_lens, 0.125, groups=groups)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            k_b, v_b = k_buf.clone(), v_buf.clone()
            outs.append(
                cpu_ops.paged_decode_attention(
                    q, k_b, v_b, r2t, rpi, seq_lens, 0.125, k_new=k_new, v_new=v_new, out_cache_loc=loc, groups=groups
                )
            )
            assert torch.equal(k_b, k_ref) and torch.equal(v_b, v_ref)
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(o, expected) for o in outs)  # row blocks differ by thread count, rows do not
