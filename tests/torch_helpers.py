"""Small torch settings the tests change for a block and put back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count `n` inside the block (kernels that split work by thread are checked
    at several counts), the previous count after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)
