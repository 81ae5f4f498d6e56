"""Flat and indexed scatters with a reduction: put, index_reduce; and nonzero_static (a nonzero
whose output size is given, so it can be compiled). Negative indices wrap like torch's."""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten


@register(aten.put.default)
def put(self, index, source, accumulate=False):
    flat = self.reshape(-1)
    idx = index.reshape(-1) % max(flat.shape[0], 1)
    src = source.reshape(-1).astype(self.dtype)
    out = flat.at[idx].add(src) if accumulate else flat.at[idx].set(src)
    return out.reshape(self.shape)


_IDENTITY = {"prod": 1.0, "mean": 0.0, "amax": -jnp.inf, "amin": jnp.inf}


@register(aten.index_reduce.default)
def index_reduce(self, dim, index, source, reduce, *, include_self=True):
    if reduce not in _IDENTITY:
        raise ValueError(f"index_reduce: reduce={reduce!r}, expected one of {sorted(_IDENTITY)}")
    axis = dim % max(self.ndim, 1)
    x = jnp.moveaxis(opmath(self), axis, 0) if self.ndim else opmath(self)[None]
    src = jnp.moveaxis(opmath(source), axis, 0) if source.ndim else opmath(source)[None]
    idx = index.reshape(-1) % x.shape[0]
    touched = jnp.zeros(x.shape[0], bool).at[idx].set(True)
    touched = touched.reshape((-1,) + (1,) * (x.ndim - 1))
    base = x if include_self else jnp.where(touched, jnp.asarray(_IDENTITY[reduce], x.dtype), x)
    if reduce == "prod":
        out = base.at[idx].multiply(src)
    elif reduce == "amax":
        out = base.at[idx].max(src)
    elif reduce == "amin":
        out = base.at[idx].min(src)
    else:
        total = base.at[idx].add(src)
        count = jnp.zeros(x.shape[0], x.dtype).at[idx].add(1) + (1 if include_self else 0)
        count = count.reshape(touched.shape)
        out = jnp.where(count > 0, total / jnp.maximum(count, 1), x)
    out = jnp.moveaxis(out, 0, axis) if self.ndim else out[0]
    return out.astype(self.dtype)


@register(aten.nonzero_static.default)
def nonzero_static(self, *, size, fill_value=-1):
    if self.ndim == 0:
        return jnp.zeros((size, 0), jnp.int64)
    coords = jnp.nonzero(self, size=size, fill_value=fill_value)
    return jnp.stack(coords, axis=1).astype(jnp.int64)
