"""``torchacc.core``: AlibabaPAI/torchacc's device helpers, over torchacc's own device --
``lazy_device()``, ``is_lazy_device(device)``, ``is_lazy_tensor(tensor)`` and
``fetch_gradients(optimizer)`` (each is also ``ta.<name>``)."""

from __future__ import annotations

import torch

from torchacc.lazy.device import DEVICE_TYPE, device
from torchacc.lazy.tensor import LazyTensor

__all__ = ["fetch_gradients", "is_lazy_device", "is_lazy_tensor", "lazy_device"]


def lazy_device():
    """The lazy device this process drives (``torchacc.device()``)."""
    return device()


def is_lazy_device(dev) -> bool:
    """Whether ``dev`` (a ``torch.device`` or its name) is the lazy device's type."""
    return torch.device(dev).type == DEVICE_TYPE


def is_lazy_tensor(tensor) -> bool:
    """Whether ``tensor`` lives on the lazy device."""
    return isinstance(tensor, LazyTensor)


def fetch_gradients(optimizer):
    """The ``.grad`` tensors of every parameter ``optimizer`` updates that has one, in the
    optimizer's parameter order (for a hand-written gradient all-reduce)."""
    return [
        p.grad.data
        for group in optimizer.param_groups
        for p in group["params"]
        if isinstance(p, torch.Tensor) and p.grad is not None
    ]
