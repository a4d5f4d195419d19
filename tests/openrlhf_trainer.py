"""A trainer's weight-sync side written the way OpenRLHF and SGLang's own tests write it.

Deliberately independent of `workbench`: it uses torch only, so the tests show that an
engine meets a trainer that never heard of this project. The recipe (OpenRLHF's
`init_process_group` helper, SGLang's `init_custom_process_group`): rendezvous on a TCP
URL, prefix the store with the group name, let torch's process-group helper build and
register the group, then `dist.broadcast(t, src=0, group=pg)` for every tensor.
"""

from __future__ import annotations

import datetime
from pathlib import Path


def init_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str, timeout_s: float):
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    timeout = datetime.timedelta(seconds=timeout_s)
    store, rank, world_size = next(dist.rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], dist.Backend(backend), store, group_name=group_name, timeout=timeout
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def trainer_main(
    model_dir: str, port: int, world_size: int, group_name: str, perturb: str, timeout_s: float, result_q, done
) -> None:
    """Rank 0: build the group, broadcast every weight of `model_dir` (some perturbed), report.

    `perturb` names a function `module:function(state) -> {name: tensor}` giving the new
    values, so the test process can compute the same ones. Puts ("ok", seconds) or
    ("error", message) on `result_q`, then keeps the store up until `done` is set.
    """
    import importlib
    import time

    import torch
    import torch.distributed as dist
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    try:
        module, fn = perturb.split(":")
        state = load_file(str(Path(model_dir) / "model.safetensors"))
        state.update(getattr(importlib.import_module(module), fn)(state))
        pg = init_process_group("gloo", f"tcp://127.0.0.1:{port}", world_size, 0, group_name, timeout_s)
        t0 = time.perf_counter()
        for _, tensor in sorted(state.items()):
            dist.broadcast(tensor.contiguous(), src=0, group=pg)
        result_q.put(("ok", time.perf_counter() - t0))
    except Exception as exc:  # noqa: BLE001 - reported to the test
        result_q.put(("error", f"{type(exc).__name__}: {exc}"))
    done.wait(120)
