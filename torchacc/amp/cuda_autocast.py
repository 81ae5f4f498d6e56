"""``torch.autocast('cuda')`` / ``torch.cuda.amp.autocast(...)`` also cast torchacc tensors.

Note [CUDA autocast on the torchacc device]
TorchAcc's scripts wrap device code in ``torch.cuda.amp.autocast(dtype=torch.bfloat16)``. On
TorchAcc's build (torch_xla on GPU) that casts the device's tensors: PyTorch's CUDA autocast
kernels treat XLA tensors as eligible. torchacc tensors carry the ``AutocastPrivateUse1`` key
instead, which CUDA autocast never turns on, so such a region would silently run in float32.

:func:`install` makes every ``torch.amp.autocast`` region for ``'cuda'`` also set the torchacc
device's autocast state -- enabled flag and dtype, the region's own (``torch.cuda.amp.autocast()``
gives float16, as on CUDA) -- on entry and restore it on exit. The casts themselves are
:mod:`torchacc.amp.autocast_policy`'s (CUDA's op lists). ``enabled=False`` inside an outer region
switches the torchacc casts off too, as on TorchAcc. The CUDA region itself is left as torch makes
it: on a machine without CUDA torch disables it (no CUDA tensor can exist there), and the warning
it gives about that is dropped, since the region does cast the torchacc tensors.
``TORCHACC_PATCH_TORCH_AUTOCAST=0`` (TorchAcc's switch for its own autocast patch) turns this off
at ``import torchacc``. (``torch.autocast('xla')`` is torchacc's autocast already, through
torchacc's ``torch_xla``: torchacc/torch_xla/_xla_device.py.)

Not tested: regions inside a function traced by ``torchacc.compile`` / ``torch.compile`` (dynamo
records autocast regions itself; ``torch.autocast('torchacc')`` is the sure spelling there), and
TorchScript.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch

from torchacc.lazy.device import DEVICE_TYPE

MIRRORED = ("cuda",)
_NO_CUDA_WARNING = r"CUDA is not available or torch_xla is imported\. Disabling autocast\."
_autocast = torch.amp.autocast_mode.autocast


def _wanted():
    return os.environ.get("TORCHACC_PATCH_TORCH_AUTOCAST", "1").lower() in ("1", "true")


def install():
    """Mirror ``'cuda'`` autocast regions onto the torchacc device (idempotent)."""
    if getattr(_autocast, "_torchacc_mirrors", False) or not _wanted():
        return
    init, enter, exit_ = _autocast.__init__, _autocast.__enter__, _autocast.__exit__

    @functools.wraps(init)
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        mirror = device_type in MIRRORED and not torch._jit_internal.is_scripting()
        with warnings.catch_warnings():
            if mirror:
                warnings.filterwarnings("ignore", message=_NO_CUDA_WARNING)
            # without CUDA no CUDA tensor can exist: the CUDA side is off (torch would disable it
            # too, unless a torch_xla module is importable -- torchacc's alias is -- when it
            # refuses bfloat16 instead), and only the torchacc side casts
            on_cuda = enabled and not (mirror and not torch.cuda.is_available())
            init(self, device_type, dtype=dtype, enabled=on_cuda, cache_enabled=cache_enabled)
        # the region's request, before torch disabled it for want of a CUDA device
        self._torchacc_request = (bool(enabled), self.fast_dtype) if mirror else None

    @functools.wraps(enter)
    def __enter__(self):
        request = getattr(self, "_torchacc_request", None)
        if request is not None:
            self._torchacc_prev = (
                torch.is_autocast_enabled(DEVICE_TYPE),
                torch.get_autocast_dtype(DEVICE_TYPE),
            )
            torch.set_autocast_enabled(DEVICE_TYPE, request[0])
            torch.set_autocast_dtype(DEVICE_TYPE, request[1])
        return enter(self)

    @functools.wraps(exit_)
    def __exit__(self, exc_type, exc_val, exc_tb):
        try:
            return exit_(self, exc_type, exc_val, exc_tb)
        finally:
            prev = self.__dict__.pop("_torchacc_prev", None)
            if prev is not None:
                torch.set_autocast_enabled(DEVICE_TYPE, prev[0])
                torch.set_autocast_dtype(DEVICE_TYPE, prev[1])

    _autocast.__init__ = __init__
    _autocast.__enter__ = __enter__
    _autocast.__exit__ = __exit__
    _autocast._torchacc_mirrors = True
