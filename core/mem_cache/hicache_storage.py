"""HiCache's storage tier (L3): KV pages as files, keyed by a hash of the token prefix.

`--hicache-storage-backend file` keeps pages of `STORAGE_PAGE_SIZE` tokens under
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (default /tmp/hicache), one file per page. A page's key
chains hashes from the first token (SGLang's scheme): key(p) = sha256(key(p-1) + tokens of page
p), starting from a namespace hash of the model, its dtype and the KV layout, so two prompts
share a page file only when their whole prefix up to its end is equal, and different models,
dtypes or layouts never read each other's pages. Only whole pages are stored.

Writes: when HiCache backs a node up to host, the pages that end inside it are written too (the
whole path is on the device then, so a page that starts in an ancestor is read from there).
Reads (prefetch) for a match that misses the device and host tiers, per
`--hicache-storage-prefetch-policy`:
- wait_complete: the match reads every consecutive page found, synchronously.
- timeout: the same, but stops at a deadline (PREFETCH_TIMEOUT_BASE_S + per page); what was read
  by then counts.
- best_effort: the match starts a background read of the pages and takes only those already read
  (none at first); a later match of the same prefix (the request is re-matched at each admission
  attempt, or the next request with that prefix) finds more.
Everything here is synchronous file I/O on the scheduler's thread except best_effort's reads.

`SimStorage` is the simulator's storage tier (no K/V anywhere): it remembers which page keys were
written during the run and hands out empty placeholders for the pages a match finds, so the tree's
bookkeeping and the transfer events are those of a real run; the simulated worker charges the
prefetched bytes at the hardware's `storage_bw` (simulation/cost_model.py).
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import torch

__all__ = [
    "HiCacheFile",
    "SimStorage",
    "STORAGE_DIR_ENV",
    "STORAGE_PAGE_SIZE",
    "page_keys",
    "storage_namespace",
]

STORAGE_DIR_ENV = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"
DEFAULT_STORAGE_DIR = "/tmp/hicache"
STORAGE_PAGE_SIZE = 32  # tokens per page file
PREFETCH_TIMEOUT_BASE_S = 0.5
PREFETCH_TIMEOUT_PER_PAGE_S = 0.02


def storage_namespace(model: str, dtype: torch.dtype, layer_num: int, head_num: int, head_dim: int, tp: str) -> str:
    """The hash every page key of this model, dtype and KV layout starts from."""
    ident = f"{model}|{dtype}|layers={layer_num}|kv_heads={head_num}|head_dim={head_dim}|{tp}|page={STORAGE_PAGE_SIZE}"
    return hashlib.sha256(ident.encode()).hexdigest()


def page_keys(namespace: str, tokens: Sequence[int], num_pages: int) -> list[str]:
    """Keys of the first `num_pages` whole pages of `tokens` (each hashes the whole prefix)."""
    keys, prev = [], namespace.encode()
    for p in range(num_pages):
        page = tokens[p * STORAGE_PAGE_SIZE : (p + 1) * STORAGE_PAGE_SIZE]
        h = hashlib.sha256(prev)
        h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in page))
        prev = h.digest()
        keys.append(h.hexdigest())
    return keys


class HiCacheFile:
    """Pages as files: `<dir>/<namespace[:16]>/<key>.pt` holding {"k", "v"}: [layers, page, heads, dim].

    Args:
        namespace: `storage_namespace(...)` of the engine's model and KV layout.
        prefetch_policy: best_effort | wait_complete | timeout (see the module doc).
        storage_dir: default: SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR or /tmp/hicache.
    """

    def __init__(self, namespace: str, prefetch_policy: str = "best_effort", storage_dir: str | None = None):
        self.namespace = namespace
        self.prefetch_policy = prefetch_policy
        base = storage_dir or os.environ.get(STORAGE_DIR_ENV) or DEFAULT_STORAGE_DIR
        self.dir = Path(base) / namespace[:16]
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(
                f"--hicache-storage-backend file: cannot create {self.dir} ({exc}); set {STORAGE_DIR_ENV} "
                "to a writable directory"
            ) from exc
        # best_effort: pages read in the background, waiting for a match to take them.
        self._staged: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._lock = threading.Lock()
        self._inflight: set[str] = set()
        self.pages_written = 0
        self.pages_read = 0

    def _path(self, key: str) -> Path:
        return self.dir / f"{key}.pt"

    def exists(self, key: str) -> bool:
        return self._path(key).exists()

    def set(self, key: str, k: torch.Tensor, v: torch.Tensor) -> bool:
        """Write one page unless it is there already (written atomically: temp file, then rename)."""
        path = self._path(key)
        if path.exists():
            return False
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        torch.save({"k": k.contiguous().cpu(), "v": v.contiguous().cpu()}, tmp)
        os.replace(tmp, path)
        self.pages_written += 1
        return True

    def get(self, key: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        try:
            data = torch.load(self._path(key), weights_only=True)
        except (OSError, RuntimeError, EOFError):
            return None  # gone or half-written by someone else: a miss
        self.pages_read += 1
        return data["k"], data["v"]

    def prefetch(self, keys: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The consecutive pages of `keys` (from the first) this match gets, per the policy."""
        if self.prefetch_policy == "best_effort":
            return self._take_staged(keys)
        deadline = None
        if self.prefetch_policy == "timeout":
            deadline = time.monotonic() + PREFETCH_TIMEOUT_BASE_S + PREFETCH_TIMEOUT_PER_PAGE_S * len(keys)
        out = []
        for key in keys:
            if deadline is not None and time.monotonic() > deadline:
                break
            page = self.get(key)
            if page is None:
                break
            out.append(page)
        return out

    def _take_staged(self, keys: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        out = []
        with self._lock:
            for key in keys:
                page = self._staged.pop(key, None)
                if page is None:
                    break
                out.append(page)
            missing = [k for k in keys[len(out) :] if k not in self._inflight and k not in self._staged]
            self._inflight.update(missing)
        if missing and self.exists(missing[0]):
            threading.Thread(target=self._read_ahead, args=(missing,), name="hicache-prefetch", daemon=True).start()
        elif missing:
            with self._lock:
                self._inflight.difference_update(missing)
        return out

    def _read_ahead(self, keys: list[str]) -> None:
        try:
            for key in keys:
                page = self.get(key)
                if page is None:
                    break
                with self._lock:
                    self._staged[key] = page
                    del_keys = list(self._staged)[:-256]  # bounded: unclaimed pages go
                    for k in del_keys:
                        self._staged.pop(k, None)
        finally:
            with self._lock:
                self._inflight.difference_update(keys)


_NO_KV = torch.empty(0)  # a SimStorage page: no K/V, only its place in the chain of keys


class SimStorage:
    """The simulator's storage tier: the page keys written this run (in memory), no K/V.

    Same methods as `HiCacheFile` where HiRadixCache calls them. Reads are always whole (as
    wait_complete): their time is the simulated worker's to charge, at the hardware's storage_bw.
    """

    def __init__(self, namespace: str, prefetch_policy: str = "wait_complete"):
        self.namespace = namespace
        self.prefetch_policy = prefetch_policy
        self._keys: set[str] = set()
        self.pages_written = 0
        self.pages_read = 0

    def exists(self, key: str) -> bool:
        return key in self._keys

    def set(self, key: str, k: torch.Tensor = _NO_KV, v: torch.Tensor = _NO_KV) -> bool:
        """Note page `key` as written (its K/V, if any, are dropped); False if it was already."""
        if key in self._keys:
            return False
        self._keys.add(key)
        self.pages_written += 1
        return True

    def prefetch(self, keys: list[str]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A placeholder for each consecutive page of `keys` (from the first) that was written."""
        out = []
        for key in keys:
            if key not in self._keys:
                break
            out.append((_NO_KV, _NO_KV))
        self.pages_read += len(out)
        return out
