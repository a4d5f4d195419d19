"""RMSNorm with the residual add fused into the same call (one op fewer per norm)."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None):
        """Return norm(x) or, with a residual, (norm(x + residual), x + residual)."""
        if residual is not None:
            x = x + residual
            residual = x
        # Normalise in float32 like the reference implementation, then cast back.
        out = F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype) \
            if x.dtype != torch.float32 else F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return out if residual is None else (out, residual)
