"""Host <-> device for LazyTensors: uploads, reads (counted transfers) and deepcopy."""

from __future__ import annotations

import torch

from torchacc.engine import execute
from torchacc.engine.transfer import upload
from torchacc.lazy.record import fresh, value_of
from torchacc.lazy.tensor import LazyTensor


def to_device(host):
    if type(host) is LazyTensor:
        return host
    return fresh(upload(host.detach().contiguous()))


def to_cpu(t):
    """CPU copy of a LazyTensor (runs what it needs; counted as a transfer)."""
    if type(t) is not LazyTensor:
        return t
    return execute.fetch(value_of(t), t.dtype)


def deepcopy(t, memo):
    new = to_device(to_cpu(t))
    if t.requires_grad:
        new.requires_grad_(True)
    if getattr(t, "_is_param", False):
        new = torch.nn.Parameter(new, t.requires_grad)
    memo[id(t)] = new
    return new
