"""``torch_xla.backends`` on torchacc: float32 mat-mul precision.

torchacc follows ``torch.get_float32_matmul_precision()`` when it lowers float32 matmuls
(``'highest'``: full float32; ``'high'``/``'medium'``: the device default, e.g. TF32 on GPUs).
torch_xla's levels map onto it: ``'highest'`` <-> ``'highest'``, ``'high'`` <-> ``'high'``,
``'default'`` <-> ``'medium'``. Setting it affects graphs compiled afterwards: the in-memory cache
of compiled steps is cleared when the level changes. As torch_xla's, every call of
:func:`set_mat_mul_precision` logs a warning (``logger``, ``_WARNING_MESSAGE``).
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
_WARNING_MESSAGE = (
    "Setting mat mul precision multiple times is not recommended: a change clears torchacc's "
    "in-memory cache of compiled steps, so every step compiles again. Set it once, before the "
    "first step."
)

__all__ = ["get_mat_mul_precision", "set_mat_mul_precision"]

_TO_TORCH = {"default": "medium", "high": "high", "highest": "highest"}
_FROM_TORCH = {"medium": "default", "high": "high", "highest": "highest"}


def set_mat_mul_precision(precision):
    if precision not in _TO_TORCH:
        raise ValueError(f"Invalid precision: {precision}. Must be one of default, high, highest.")
    logger.warning(_WARNING_MESSAGE)
    if get_mat_mul_precision() != precision:
        torch.set_float32_matmul_precision(_TO_TORCH[precision])
        from torchacc import program as _compile

        _compile.clear_memory_cache()  # compiled steps baked the old precision in


def get_mat_mul_precision():
    return _FROM_TORCH[torch.get_float32_matmul_precision()]
