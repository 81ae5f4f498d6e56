"""torch <-> JAX dtype mapping and small dtype helpers shared by lowering rules."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import torch

TORCH_TO_JAX = {
    torch.float32: jnp.float32,
    torch.float64: jnp.float64,
    torch.float16: jnp.float16,
    torch.bfloat16: jnp.bfloat16,
    torch.int64: jnp.int64,
    torch.int32: jnp.int32,
    torch.int16: jnp.int16,
    torch.int8: jnp.int8,
    torch.uint8: jnp.uint8,
    torch.uint16: jnp.uint16,
    torch.uint32: jnp.uint32,
    torch.uint64: jnp.uint64,
    torch.bool: jnp.bool_,
    torch.complex64: jnp.complex64,
    torch.complex128: jnp.complex128,
    torch.float8_e5m2: jnp.float8_e5m2,
    torch.float8_e4m3fn: jnp.float8_e4m3fn,
}
JAX_TO_TORCH = {np.dtype(v): k for k, v in TORCH_TO_JAX.items()}
# the element type names of HLO text (torch_xla prints tensors as "f32[2,3]")
HLO_NAMES = {
    torch.float32: "f32",
    torch.float64: "f64",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "s64",
    torch.int32: "s32",
    torch.int16: "s16",
    torch.int8: "s8",
    torch.uint8: "u8",
    torch.uint16: "u16",
    torch.uint32: "u32",
    torch.uint64: "u64",
    torch.bool: "pred",
    torch.complex64: "c64",
    torch.complex128: "c128",
}

# Note [Device dtypes]
# torch_xla's environment flags store some torch dtypes narrower on the device, while tensors
# keep their torch dtype (``t.dtype``, meta shapes, what ``.cpu()`` returns):
#   XLA_USE_BF16=1       float32 and float64 are bfloat16 on the device;
#   XLA_DOWNCAST_BF16=1  float32 is bfloat16 and float64 is float32;
#   XLA_USE_32BIT_LONG=1 int64 is int32 and uint64 is uint32.
# As in torch_xla, each flag is read once, when a dtype it affects is first put on the device or
# lowered (setting it later has no effect). ``jdtype`` returns the stored dtype, so every program
# input (engine/transfer.upload narrows the host copy), every node output (program/build casts
# each result to ``jdtype`` of its torch dtype) and every dtype a rule names follow the flags;
# reads widen back to the torch dtype. Without the flags the stored dtype is the torch dtype.
# ``jdtype`` runs when programs are built and at uploads, never per recorded op.
_FLAGGED = (torch.float64, torch.float32, torch.int64, torch.uint64)
_STORED = {t: t for t in TORCH_TO_JAX if t not in _FLAGGED}  # torch dtype -> stored torch dtype
_JAX = {t: TORCH_TO_JAX[t] for t in _STORED}  # torch dtype -> stored JAX dtype
_flags = {}


def _flag(name):
    if name not in _flags:
        _flags[name] = os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")
    return _flags[name]


def _narrowed(dtype):
    if dtype is torch.float64:
        if _flag("XLA_USE_BF16"):
            return torch.bfloat16
        return torch.float32 if _flag("XLA_DOWNCAST_BF16") else dtype
    if dtype is torch.float32:
        return torch.bfloat16 if _flag("XLA_USE_BF16") or _flag("XLA_DOWNCAST_BF16") else dtype
    if dtype is torch.int64:
        return torch.int32 if _flag("XLA_USE_32BIT_LONG") else dtype
    if dtype is torch.uint64:
        return torch.uint32 if _flag("XLA_USE_32BIT_LONG") else dtype
    raise TypeError(f"torchacc: dtype {dtype} is not supported on the device")


def stored_dtype(dtype):
    """The torch dtype a tensor of ``dtype`` is stored as on the device (Note [Device dtypes])."""
    stored = _STORED.get(dtype)
    if stored is None:
        stored = _STORED[dtype] = _narrowed(dtype)
    return stored


def jdtype(dtype):
    """JAX dtype a tensor of torch dtype ``dtype`` has on the device (None -> torch's default
    float dtype; Note [Device dtypes])."""
    if dtype is None:
        dtype = torch.get_default_dtype()
    j = _JAX.get(dtype)
    if j is None:
        j = _JAX[dtype] = TORCH_TO_JAX[stored_dtype(dtype)]
    return j


def tdtype(jax_dtype):
    """torch dtype for a JAX/numpy dtype."""
    return JAX_TO_TORCH[np.dtype(jax_dtype)]


def like(scalar, x):
    """Cast a (possibly traced) scalar to the dtype of array ``x`` (torch's scalar promotion)."""
    return jnp.asarray(scalar).astype(x.dtype)


def is_float(x):
    return jnp.issubdtype(x.dtype, jnp.floating)


def opmath(x):
    """Upcast half-precision floats to float32 for accurate intermediate math (torch opmath_t)."""
    if x.dtype in (jnp.float16, jnp.bfloat16):
        return x.astype(jnp.float32)
    return x


def wrapped_number_dtype(kind, partner):
    """JAX dtype of a Python number (``kind``: bool, int or float) standing in a Tensor slot next to
    a tensor of torch dtype ``partner`` (or None): the partner's dtype when both are of the same
    category (torch's wrapped-number promotion), else torch's default for the number."""
    import torch

    if kind is bool:
        same = partner == torch.bool
        return jdtype(partner if same else torch.bool)
    if kind is float:
        same = partner is not None and partner.is_floating_point
        return jdtype(partner if same else torch.get_default_dtype())
    same = partner is not None and not partner.is_floating_point and partner != torch.bool
    return jdtype(partner if same else torch.int64)
