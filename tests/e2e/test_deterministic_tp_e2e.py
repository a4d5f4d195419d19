"""The tensor-parallel all-reduce under --enable-deterministic-inference (issue #43 item 6).

gloo's all-reduce (a ring) cuts a tensor into chunks by its size and starts each chunk's sum at
another rank, so at 3 ranks one row's sum takes another order when the tensor has more rows: the
same token gets other bits in another batch. Under the flag `tensor_model_parallel_all_reduce`
gathers the ranks' parts and sums them in rank order. Three gloo processes check both: the plain
reduce moves a row with the batch (so this test can fail), the ordered one does not, and it is
still the sum. (At 2 ranks both are invariant: a + b == b + a. The model-level TP 2 check is in
tests/e2e/test_deterministic_moe_e2e.py.)
"""

from __future__ import annotations

import torch
import torch.multiprocessing as mp
from test_weight_updates_e2e import free_port

RANKS = 3


def _rank(rank: int, port: int, path: str) -> None:
    import torch.distributed as dist
    from workbench.core.distributed import parallel_state as ps

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=RANKS)
    ps.set_tp_group(rank, RANKS, dist.group.WORLD)
    g = torch.Generator().manual_seed(rank)
    # values spread over many magnitudes, so the order of a sum shows in its last bits
    x = torch.randn(64, 576, generator=g) * 10 ** torch.randn(64, 576, generator=g)
    out = {}
    try:
        for ordered in (False, True):
            ps.set_batch_invariant_all_reduce(ordered)
            out[ordered] = {m: ps.tensor_model_parallel_all_reduce(x[:m].clone()) for m in (1, 7, 64)}
        parts = [torch.empty_like(x) for _ in range(RANKS)]
        dist.all_gather(parts, x)
    finally:
        ps.set_batch_invariant_all_reduce(False)
        dist.destroy_process_group()
    if rank == 0:
        torch.save((out, parts), path)


def test_ordered_all_reduce_gives_a_row_the_same_bits_at_any_batch(tmp_path):
    path = tmp_path / "rank0.pt"
    mp.start_processes(_rank, args=(free_port(), str(path)), nprocs=RANKS, start_method="spawn")
    out, parts = torch.load(path)

    def moved(res):
        return [m for m in (1, 7) if not torch.equal(res[m], res[64][:m])]

    assert moved(out[False]), "gloo's plain sum gave every row the same bits at every size: nothing to fix"
    assert moved(out[True]) == []
    assert torch.equal(out[True][64], (parts[0] + parts[1]) + parts[2])
