"""torch <-> JAX dtype mapping and small dtype helpers shared by lowering rules."""

from __future__ import annotations

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


def jdtype(dtype):
    """JAX dtype for a torch dtype (None -> torch's default float dtype)."""
    if dtype is None:
        dtype = torch.get_default_dtype()
    try:
        return TORCH_TO_JAX[dtype]
    except KeyError:
        raise TypeError(f"torchacc: dtype {dtype} is not supported on the device") from None


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
