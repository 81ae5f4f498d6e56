"""``torchacc_ops``' layers: ``RMSNorm``, an ``nn.Module`` over ``torchacc_ops.rms_norm`` (the
fused kernel on the torchacc device, the eager formula elsewhere)."""

from __future__ import annotations

import torch
from torch import nn

from torchacc_ops.functional import rms_norm

__all__ = ["RMSNorm"]


class RMSNorm(nn.Module):
    """``torchacc_ops.rms_norm`` with a learned weight (initialised to ones)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
