"""LoRAManager: the adapters a model runner serves, loaded, evicted and batched.

It lives beside the ModelRunner (one per tensor-parallel rank) and:
- knows adapters by name (--lora-paths, /load_lora_adapter) and holds at most --max-loaded-loras
  of them in memory; loading one more evicts the least recently used adapter no request is
  using (an evicted adapter is still known: a request naming it loads it again from its path);
- attaches a `LoRAHook` to every host linear of the model, and before each forward pass turns
  the batch's per-request adapter ids into per-adapter row groups (`prepare`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import torch
from workbench.core.lora.adapter import SUPPORTED_TARGETS, LoRAAdapter, LoRABusyError, LoRAError, read_adapter
from workbench.core.lora.layers import (
    FUSED,
    TARGET_HOSTS,
    HostDelta,
    LoRABatch,
    LoRAHook,
    LoRAState,
    build_host_delta,
    host_slices,
)

logger = logging.getLogger(__name__)

__all__ = ["LoRAManager", "LoRAError", "parse_lora_paths"]


def parse_lora_paths(items: list[str] | None) -> list[tuple[str, str]]:
    """--lora-paths entries (NAME=PATH or PATH, named after its directory) as (name, path)."""
    out = []
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep:
            path = item
            name = path.rstrip("/").rsplit("/", 1)[-1]
        out.append((name, path))
    return out


class LoRAManager:
    """Loaded adapters of one model (see the module doc).

    Args:
        model: the runner's model (a LlamaForCausalLM family member).
        server_args: for --lora-paths, --max-loaded-loras, --max-lora-rank, --lora-target-modules.
        dtype, device: where adapter weights live (the model's).
        tp_rank: this rank (each holds its shard of every adapter).
    """

    def __init__(self, model, server_args, dtype: torch.dtype, device, tp_rank: int = 0):
        self.dtype, self.device, self.tp_rank = dtype, device, tp_rank
        self.max_loaded = server_args.max_loaded_loras
        self.max_per_batch = server_args.max_loras_per_batch
        self.state = LoRAState()
        self.hosts = self._attach_hooks(model)
        self.num_layers = 1 + max((layer for layer, _ in self.hosts), default=-1)
        self.known: dict[str, str] = {}  # name -> path (loaded or evicted)
        self.loaded: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.in_use: Callable[[], set[str]] = lambda: set()  # the scheduler's: names of queued/running requests
        self._next_uid = 1
        initial = parse_lora_paths(server_args.lora_paths)
        self.max_rank = server_args.max_lora_rank
        targets = server_args.lora_target_modules
        if targets and "all" not in targets:
            bad = sorted(set(targets) - set(SUPPORTED_TARGETS))
            if bad:
                raise LoRAError(
                    f"--lora-target-modules {bad} unknown; choose from {' '.join(SUPPORTED_TARGETS)} or all"
                )
            self.allowed = set(targets)
        else:
            self.allowed = set(SUPPORTED_TARGETS)
        lacking = sorted(t for t in self.allowed if not self._model_has(t))
        if lacking and targets and "all" not in targets:
            raise LoRAError(
                f"--lora-target-modules {lacking}: this model has no such projection adapters can target "
                f"(it has {' '.join(t for t in SUPPORTED_TARGETS if self._model_has(t)) or 'none'})"
            )
        self.allowed -= set(lacking)
        for name, path in initial:
            self.load(name, path)
        if self.max_rank is None and self.loaded:
            self.max_rank = max(a.rank for a in self.loaded.values())
        if not targets and self.loaded:
            self.allowed = set().union(*(a.config.target_modules for a in self.loaded.values()))

    # ---- the model ---------------------------------------------------------------
    def _attach_hooks(self, model) -> dict[tuple[int, str], object]:
        from workbench.core.layers.linear import LinearBase

        hosts: dict[tuple[int, str], object] = {}
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        for i, layer in enumerate(layers):
            for path in {p for p, _ in TARGET_HOSTS.values()}:
                host = layer
                for part in path.split("."):
                    host = getattr(host, part, None)
                if isinstance(host, LinearBase):
                    host.lora_hook = LoRAHook(self.state, f"{i}.{path}")
                    hosts[(i, path)] = host
        return hosts

    def _model_has(self, target: str) -> bool:
        path = TARGET_HOSTS[target][0]
        return any(p == path for _, p in self.hosts)

    # ---- loading -----------------------------------------------------------------
    def load(self, name: str, path: str | None = None) -> LoRAAdapter:
        """Load (or reload) adapter `name` from `path` (default: where it was known from)."""
        if path is None:
            if name not in self.known:
                raise LoRAError(self.unknown_message(name))
            path = self.known[name]
        if name in self.loaded and self.loaded[name].path.rstrip("/") == str(path).rstrip("/"):
            self.loaded.move_to_end(name)
            return self.loaded[name]
        if name in self.loaded and name in self.in_use():
            raise LoRAError(f"LoRA adapter {name!r} is in use by running requests; unload it once they finish")
        adapter = read_adapter(name, path, self._next_uid, self.dtype, self.max_rank, self.allowed, self.num_layers)
        for target in adapter.config.target_modules:
            if not self._model_has(target):
                raise LoRAError(f"LoRA adapter {name!r} targets {target}, which this model lacks")
        adapter.hosts = self._host_deltas(adapter)
        self._next_uid += 1
        self.loaded.pop(name, None)
        self._make_room()
        self.loaded[name] = adapter
        self.known[name] = str(path)
        logger.info(
            "LoRA adapter %s loaded from %s (rank %d, %s)", name, path, adapter.rank, adapter.config.target_modules
        )
        return adapter

    def _host_deltas(self, adapter: LoRAAdapter) -> dict[str, HostDelta]:
        grouped: dict[tuple[int, str], dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for (layer, target), ab in adapter.weights.items():
            path, idx = TARGET_HOSTS[target]
            if (layer, path) not in self.hosts:
                raise LoRAError(f"LoRA adapter {adapter.name!r}: layer {layer} has no {target} (the model lacks it)")
            if idx == FUSED:  # one A, B over the whole fused output: each slice gets its rows of B
                grouped.setdefault((layer, path), {}).update(self._split_fused(adapter, layer, target, ab))
            else:
                grouped.setdefault((layer, path), {})[idx] = ab
        out = {}
        for (layer, path), parts in grouped.items():
            try:
                out[f"{layer}.{path}"] = build_host_delta(self.hosts[(layer, path)], parts, self.tp_rank, self.device)
            except ValueError as e:
                raise LoRAError(
                    f"LoRA adapter {adapter.name!r}, layer {layer} {path}: {e}; is it for this model?"
                ) from e
        adapter.weights = {}  # the stacked copies are what runs
        return out

    def _split_fused(self, adapter: LoRAAdapter, layer: int, target: str, ab) -> dict[int, tuple]:
        """A fused target's (A, B) as per-slice parts sharing A: B's rows cut at the host's full slice sizes."""
        a, b = ab
        host = self.hosts[(layer, TARGET_HOSTS[target][0])]
        tp = getattr(host, "tp_size", 1)
        sizes = [size * tp for _, (_, size, _, _) in sorted(host_slices(host, 0).items())]
        if b.shape[0] != sum(sizes):
            raise LoRAError(
                f"LoRA adapter {adapter.name!r}, layer {layer} {target}: B has {b.shape[0]} rows, the model's "
                f"{target} {sum(sizes)}; is it for this model?"
            )
        parts, off = {}, 0
        for i, size in enumerate(sizes):
            parts[i] = (a, b.narrow(0, off, size))
            off += size
        return parts

    def _make_room(self) -> None:
        if self.max_loaded is None:
            return
        busy = self.in_use()
        while len(self.loaded) >= self.max_loaded:
            victim = next((n for n in self.loaded if n not in busy), None)
            if victim is None:
                raise LoRABusyError(
                    f"all {len(self.loaded)} loaded LoRA adapters (--max-loaded-loras) are in use; "
                    "retry once requests finish, or restart with a larger --max-loaded-loras"
                )
            del self.loaded[victim]
            logger.info("LoRA adapter %s evicted (least recently used)", victim)

    def unload(self, name: str) -> None:
        """Forget adapter `name`; refuses while a request uses it."""
        if name not in self.known:
            raise LoRAError(self.unknown_message(name))
        if name in self.in_use():
            raise LoRAError(
                f"LoRA adapter {name!r} is in use by queued or running requests; unload it once they finish"
            )
        self.loaded.pop(name, None)
        del self.known[name]

    def unknown_message(self, name: str) -> str:
        have = ", ".join(sorted(self.known)) or "none"
        return f"unknown LoRA adapter {name!r} (loaded: {have}); load it with /load_lora_adapter or --lora-paths"

    def acquire(self, name: str) -> LoRAAdapter:
        """The adapter for a request naming it (loaded again from its path if it was evicted)."""
        if name in self.loaded:
            self.loaded.move_to_end(name)
            return self.loaded[name]
        return self.load(name)

    # ---- batches -----------------------------------------------------------------
    def prepare(self, names: list[str | None] | None, extend_lens: list[int], device) -> None:
        """Group the pass's rows by adapter (names: per request; extend_lens: its rows)."""
        if not names or all(n is None for n in names):
            self.state.batch = None
            return
        rows: dict[str, list[int]] = {}
        start = 0
        for name, n in zip(names, extend_lens):
            if name is not None:
                rows.setdefault(name, []).extend(range(start, start + n))
            start += n
        total = start
        segments = []
        for name, idx in rows.items():
            adapter = self.acquire(name)
            sel = None if len(idx) == total else torch.tensor(idx, dtype=torch.int64, device=device)
            segments.append((adapter.hosts, sel))
        self.state.batch = LoRABatch(segments)

    def finish(self) -> None:
        self.state.batch = None

    def info(self) -> list[dict]:
        """Loaded and known adapters (for /get_server_info and the load routes' replies)."""
        return [
            {
                "name": n,
                "path": p,
                "loaded": n in self.loaded,
                "rank": self.loaded[n].rank if n in self.loaded else None,
            }
            for n, p in self.known.items()
        ]
