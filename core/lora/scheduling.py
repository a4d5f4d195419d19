"""The scheduler's side of multi-LoRA: naming a request's adapter, admitting adapters per batch,
and loading/unloading adapters while serving (the Scheduler calls these; core/managers/scheduler.py).

- A request naming an adapter gets its load's uid (`Req.lora_uid`), which keys its radix-cache
  namespace; an unknown adapter, or one that cannot be loaded, aborts it with a 400 saying why. One
  that is known but not loaded while every loaded adapter is in use (--max-loaded-loras) waits in the
  queue, without a uid, until an adapter goes idle: admission loads it then (`settle`).
- A batch holds at most --max-loras-per-batch distinct adapters (the base model counts as none):
  a waiting request whose adapter would be one too many stays queued, in order, for a later step.
- Load and unload run between steps; unloading an adapter a queued or running request names is
  refused, and nothing else changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from workbench.core.io_struct import LoadLoRAAdapterReq, LoRAUpdateOutput, UnloadLoRAAdapterReq
from workbench.core.lora.adapter import LoRABusyError, LoRAError

if TYPE_CHECKING:
    from workbench.core.lora.manager import LoRAManager
    from workbench.core.managers.schedule_batch import Req


def lora_in_use(sched) -> set[str]:
    """Names of the adapters any queued, running, chunked or in-flight request runs under."""
    reqs = list(sched.waiting_queue) + list(sched.running_batch.reqs)
    if sched.chunked_req is not None:
        reqs.append(sched.chunked_req)
    inflight = getattr(sched, "inflight", None)
    if inflight is not None:
        reqs += inflight.batch.reqs
    return {r.lora_path for r in reqs if r.lora_path is not None and not r.finished()}


def attach_lora(manager: LoRAManager | None, req: Req, tree_cache) -> str | None:
    """Give `req` its adapter's load uid (loading it again if it was evicted); an error message or None."""
    if req.lora_path is None:
        return None
    if manager is None:
        return f"lora_path {req.lora_path!r} names a LoRA adapter, but this server runs without LoRA (--enable-lora)"
    try:
        adapter = manager.acquire(req.lora_path)
    except LoRABusyError:
        return None  # no room to load it now: it waits in the queue (settle() retries at admission)
    except LoRAError as e:
        return str(e)
    req.lora_uid = adapter.uid
    if hasattr(tree_cache, "namespace_root") and not getattr(tree_cache, "disable", True):
        tree_cache.namespace_root(adapter.uid, label=f"LoRA {adapter.name}")  # the tree view names the branch
    return None


def settle(manager: LoRAManager, req: Req, tree_cache) -> str:
    """At admission: "" when `req` may be considered (no adapter, or its adapter loaded), "wait" while its
    adapter still cannot be loaded (every loaded one in use), else why it cannot run at all."""
    if req.lora_path is None or req.lora_uid is not None:
        return ""
    error = attach_lora(manager, req, tree_cache)
    if error is not None:
        return error
    return "" if req.lora_uid is not None else "wait"


def batch_adapters(reqs) -> set[str]:
    return {r.lora_path for r in reqs if r.lora_path is not None}


def admits(req: Req, adapters: set[str], max_per_batch: int) -> bool:
    """Whether `req` may join a batch whose requests already run under `adapters`."""
    return req.lora_path is None or req.lora_path in adapters or len(adapters) < max_per_batch


def handle_lora_request(manager: LoRAManager | None, msg, in_use: set[str]) -> LoRAUpdateOutput:
    """/load_lora_adapter and /unload_lora_adapter on this rank."""
    if manager is None:
        return LoRAUpdateOutput(
            success=False, message="this server runs without LoRA: restart it with --enable-lora to load adapters"
        )
    try:
        if isinstance(msg, LoadLoRAAdapterReq):
            adapter = manager.load(msg.lora_name, msg.lora_path)
            message = (
                f"LoRA adapter {adapter.name!r} loaded (rank {adapter.rank}, {' '.join(adapter.config.target_modules)})"
            )
        elif isinstance(msg, UnloadLoRAAdapterReq):
            manager.unload(msg.lora_name)
            message = f"LoRA adapter {msg.lora_name!r} unloaded"
        else:
            raise TypeError(type(msg).__name__)
    except LoRAError as e:
        return LoRAUpdateOutput(success=False, message=str(e), loaded_adapters=dict(manager.known))
    return LoRAUpdateOutput(success=True, message=message, loaded_adapters=dict(manager.known))
