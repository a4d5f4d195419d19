"""The host-memory KV pool of HiCache (L2): a second set of per-layer K/V tensors in CPU memory.

`MHATokenToKVPoolHost` mirrors a device `MHATokenToKVPool`'s layout (layers, kv heads, head dim,
dtype) with its own slot numbering and free list. Radix-tree nodes evicted from the device keep
their KV here (`hiradix_cache.py`); a later match copies it back instead of recomputing it.

Copies, and where they overlap with compute:
- On CPU the device pool is CPU memory too, but a distinct set of tensors: every copy is a real
  gather/scatter between them, synchronous (nothing overlaps; the step pays for it).
- On CUDA the host tensors are pinned and the copies run on their own stream. A load-back
  (host -> device) is queued there and the compute stream is made to wait on its event, so the CPU
  goes on scheduling while the copy runs, and the forward that reads the slots starts when it lands.
  A backup (device -> host) waits for the compute stream's pending writes to those slots, then the
  CPU waits for the copy before the device slots can be handed out again.

Slot 0 is never handed out, as in the device pool (kept symmetric; nothing writes it).
"""

from __future__ import annotations

import time

import torch

__all__ = ["MHATokenToKVPoolHost", "host_pool_size"]


def host_pool_size(device_pool_size: int, bytes_per_token: int, ratio: float, size_gb: int) -> int:
    """Host pool tokens: `size_gb` GB when given (SGLang's --hicache-size), else ratio x the device pool."""
    if size_gb > 0:
        return max(int(size_gb * (1 << 30) // max(bytes_per_token, 1)), 1)
    return max(int(device_pool_size * ratio), 1)


class MHATokenToKVPoolHost:
    """K and V of every layer for `size` host slots, plus the free list of those slots.

    Args:
        device_pool: the `MHATokenToKVPool` whose KV this pool backs up (layout and dtype follow it).
        size: host slots (tokens).
        pin_memory: page-lock the tensors (CUDA only: it makes the copies DMA-able and async).
    """

    def __init__(self, device_pool, size: int, pin_memory: bool | None = None, bytes_per_token: int = 0):
        self.device_pool = device_pool
        self.size = size
        # No device pool (the simulator's pool-only runner): slots and their bookkeeping only, no K/V
        # tensors; copies move nothing and take no time; `bytes_per_token` is then what the views report.
        self.has_data = device_pool is not None
        self.dtype = device_pool.dtype if self.has_data else torch.float32
        self.layer_num = device_pool.layer_num if self.has_data else 0
        self.head_num = device_pool.head_num if self.has_data else 0
        self.head_dim = device_pool.head_dim if self.has_data else 0
        self._bytes_per_token = bytes_per_token
        self.device_is_cuda = str(getattr(device_pool, "device", "cpu")).startswith("cuda")
        pin = self.device_is_cuda if pin_memory is None else pin_memory
        shape = (self.layer_num, size + 1 if self.has_data else 0, self.head_num, self.head_dim)
        self.k_buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.v_buffer = torch.zeros(shape, dtype=self.dtype, pin_memory=pin)
        self.copy_stream = torch.cuda.Stream() if self.device_is_cuda else None
        # Totals for the views and /metrics: bytes and time of each direction.
        self.bytes_written = 0
        self.bytes_loaded = 0
        self.bytes_prefetched = 0  # storage (L3) -> host, written by HiRadixCache's prefetch
        self.clear()

    # ---- slots ------------------------------------------------------------------

    def clear(self) -> None:
        self.free_slots = torch.arange(1, self.size + 1, dtype=torch.int64)

    def available_size(self) -> int:
        return int(self.free_slots.numel())

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """`need_size` host slots, or None when fewer are free (the caller evicts and retries)."""
        if need_size > self.free_slots.numel():
            return None
        out = self.free_slots[:need_size]
        self.free_slots = self.free_slots[need_size:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel():
            self.free_slots = torch.cat((self.free_slots, indices.to(torch.int64).cpu()))

    def bytes_per_token(self) -> int:
        if not self.has_data:
            return self._bytes_per_token
        return 2 * self.layer_num * self.head_num * self.head_dim * self.k_buffer.element_size()

    # ---- copies -----------------------------------------------------------------

    def backup_from_device(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> float:
        """Copy the K/V of `device_indices` (every layer) into `host_indices`; return the ms it took.

        Returns once the host copy is complete: the device slots may be freed right after."""
        t0 = time.perf_counter()
        dev = self.device_pool
        host_idx = host_indices.cpu()
        if not self.has_data:
            pass
        elif self.copy_stream is None:
            dev_idx = device_indices.cpu()
            for layer in range(self.layer_num):  # index_select/index_copy_: no advanced-indexing overhead
                self.k_buffer[layer].index_copy_(0, host_idx, dev.k_buffer[layer].index_select(0, dev_idx))
                self.v_buffer[layer].index_copy_(0, host_idx, dev.v_buffer[layer].index_select(0, dev_idx))
        else:
            stream = self.copy_stream
            stream.wait_stream(torch.cuda.current_stream())  # the forward that wrote the slots is done
            with torch.cuda.stream(stream):
                dev_idx = device_indices.to(dev.device, non_blocking=True)
                n = int(host_idx.numel())
                staged_k = torch.empty(
                    (self.layer_num, n, self.head_num, self.head_dim), dtype=self.dtype, pin_memory=True
                )
                staged_v = torch.empty(staged_k.shape, dtype=self.dtype, pin_memory=True)
                for layer in range(self.layer_num):
                    staged_k[layer].copy_(dev.k_buffer[layer][dev_idx], non_blocking=True)
                    staged_v[layer].copy_(dev.v_buffer[layer][dev_idx], non_blocking=True)
            stream.synchronize()  # the host scatter below reads the staged bytes
            self.k_buffer[:, host_idx] = staged_k
            self.v_buffer[:, host_idx] = staged_v
        self.bytes_written += int(host_idx.numel()) * self.bytes_per_token()
        return (time.perf_counter() - t0) * 1000.0

    def load_to_device(self, host_indices: torch.Tensor, device_indices: torch.Tensor) -> float:
        """Copy the K/V of `host_indices` (every layer) into device slots `device_indices`; return ms.

        On CUDA the copy is queued on `copy_stream` and the compute stream waits for it (no CPU
        wait); the returned ms is then the time to queue it. On CPU it is done when this returns."""
        t0 = time.perf_counter()
        dev = self.device_pool
        host_idx = host_indices.cpu()
        if not self.has_data:
            pass
        elif self.copy_stream is None:
            dev_idx = device_indices.cpu()
            for layer in range(self.layer_num):
                dev.k_buffer[layer].index_copy_(0, dev_idx, self.k_buffer[layer].index_select(0, host_idx))
                dev.v_buffer[layer].index_copy_(0, dev_idx, self.v_buffer[layer].index_select(0, host_idx))
        else:
            staged_k = self.k_buffer[:, host_idx].pin_memory()
            staged_v = self.v_buffer[:, host_idx].pin_memory()
            stream = self.copy_stream
            stream.wait_stream(torch.cuda.current_stream())  # the slots' previous users are done
            with torch.cuda.stream(stream):
                dev_idx = device_indices.to(dev.device, non_blocking=True)
                k = staged_k.to(dev.device, non_blocking=True)
                v = staged_v.to(dev.device, non_blocking=True)
                for layer in range(self.layer_num):
                    dev.k_buffer[layer][dev_idx] = k[layer]
                    dev.v_buffer[layer][dev_idx] = v[layer]
                done = torch.cuda.Event()
                done.record(stream)
            torch.cuda.current_stream().wait_event(done)
            # Pinned staging read by an async copy: PyTorch's host allocator keeps it until the copy
            # is done; holding the last one here as well costs nothing and makes that explicit.
            self._last_staged = (staged_k, staged_v, done)
        self.bytes_loaded += int(host_idx.numel()) * self.bytes_per_token()
        return (time.perf_counter() - t0) * 1000.0
