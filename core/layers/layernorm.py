"""RMSNorm, optionally with the residual add fused into the same call."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from workbench.core.layers import cpu_ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Return norm(x) or, with a residual, (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        elif x.dim() == 2 and x.dtype != torch.float32 and cpu_ops.fused_ready(x):
            # 16-bit on CPU: one compiled pass instead of ATen's ~7-op composite (see
            # cpu_ops/rms_norm.c). float32 stays on ATen: it matches transformers bit for bit.
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        # ATen's fused kernel accumulates in float32 for bf16/fp16 inputs and rounds
        # once: bit-identical to upcasting first (checked), without the two casts.
        out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if residual is None else (out, residual)
