"""Mixed precision on the torchacc device: ``autocast``, ``GradScaler`` and ``syncfree`` optimizers.

::

    from torchacc.amp import autocast, GradScaler, syncfree

    scaler = GradScaler()                       # scale/unscale/inf-check/update stay on the device
    optimizer = syncfree.AdamW(model.parameters(), lr=1e-3)
    with autocast():                            # torchacc device, bfloat16 by default
        loss = loss_fn(model(x), y)
    scaler.scale(loss).backward()
    scaler.step(optimizer)                      # skips the update on the device if grads overflowed
    scaler.update()

Default autocast dtype: **bfloat16**. Override it per call (``autocast(dtype=torch.float16)``),
per process (:func:`set_default_dtype`) or by environment (``TORCHACC_AMP_DTYPE=fp16`` / ``bf16``).
``torch.autocast('torchacc', ...)`` works too once this package is imported (it registers the
autocast kernels; see :mod:`torchacc.amp.autocast_policy`), and so do ``torch.autocast('cuda')`` /
``torch.cuda.amp.autocast(...)`` regions, as on TorchAcc (:mod:`torchacc.amp.cuda_autocast`).
"""

from __future__ import annotations

import os

import torch

from torchacc.amp import autocast_policy, cuda_autocast
from torchacc.lazy.device import DEVICE_TYPE, register_backend

_DTYPE_NAMES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
_default_dtype: list = [None]


def _parse_dtype(value):
    if isinstance(value, torch.dtype):
        if value not in (torch.bfloat16, torch.float16):
            raise ValueError(f"autocast dtype must be bfloat16 or float16, got {value}")
        return value
    dtype = _DTYPE_NAMES.get(str(value).lower().replace("torch.", ""))
    if dtype is None:
        raise ValueError(
            f"unknown autocast dtype {value!r}: expected one of {sorted(_DTYPE_NAMES)}"
        )
    return dtype


def default_dtype():
    """The dtype ``autocast()`` uses when none is given (bf16 unless TORCHACC_AMP_DTYPE says so)."""
    if _default_dtype[0] is None:
        return _parse_dtype(os.environ.get("TORCHACC_AMP_DTYPE", "bf16"))
    return _default_dtype[0]


def set_default_dtype(dtype):
    """Set the dtype ``autocast()`` uses when none is given (``torch.bfloat16``/``'fp16'``...)."""
    _default_dtype[0] = None if dtype is None else _parse_dtype(dtype)


def _device_type(device):
    if device is None:
        return DEVICE_TYPE
    kind = device if isinstance(device, str) else torch.device(device).type
    kind = kind.split(":")[0]
    return DEVICE_TYPE if kind in (DEVICE_TYPE, "xla") else kind


class autocast(torch.amp.autocast_mode.autocast):
    """``torch.autocast`` for the torchacc device, callable the ways torch_xla/TorchAcc scripts do.

    ``autocast()``, ``autocast(xm.xla_device())``, ``autocast('xla', dtype=torch.float16)``,
    ``autocast(enabled=False)`` and the ``torch.cuda.amp.autocast(enabled, dtype, cache_enabled)``
    positional form all work. A device of another type (``'cpu'``, ``'cuda'``) gives plain
    ``torch.autocast`` for that device. Usable as a decorator too.
    """

    def __init__(self, device=None, enabled=True, dtype=None, cache_enabled=None):
        if isinstance(device, bool):  # torch.cuda.amp.autocast(enabled, dtype, cache_enabled)
            device, enabled, dtype, cache_enabled = None, device, enabled, dtype
            if dtype is True:  # the positional enabled slot carried no dtype
                dtype = None
        kind = _device_type(device)
        if kind == DEVICE_TYPE:
            register_backend()
            autocast_policy.install()
            dtype = default_dtype() if dtype is None else _parse_dtype(dtype)
        super().__init__(kind, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


autocast_policy.install()
cuda_autocast.install()  # torch.cuda.amp.autocast(...) casts torchacc tensors too (TorchAcc's way)

from torchacc.amp import syncfree  # noqa: E402
from torchacc.amp.grad_scaler import GradScaler  # noqa: E402

__all__ = [
    "GradScaler",
    "autocast",
    "autocast_policy",
    "default_dtype",
    "set_default_dtype",
    "syncfree",
]
