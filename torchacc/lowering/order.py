"""Order statistics and binning: median, nanmedian, kthvalue, searchsorted, bucketize, histc,
and the logcumsumexp scan.

Order statistics sort stably with NaN as the largest value (like torch's CPU kernels), so the
index returned for a value is that of its first occurrence among equals. ``median`` propagates a
NaN (value NaN, index of the first NaN); ``nanmedian`` skips them.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.pointwise import result_type
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _sorted_with_index(x, axis):
    """Values and original indices along ``axis``, ascending, stable, NaN last."""
    idx = lax.broadcasted_iota(jnp.int64, x.shape, axis)
    return lax.sort((x, idx), dimension=axis, num_keys=1, is_stable=True)


def _pick(values, indices, k, axis, keepdim):
    """Entry ``k`` (an int or an array broadcastable without ``axis``) along ``axis``."""
    k = jnp.broadcast_to(jnp.asarray(k), values.shape[:axis] + values.shape[axis + 1 :])
    k = jnp.expand_dims(k, axis)
    v = jnp.take_along_axis(values, k, axis=axis)
    i = jnp.take_along_axis(indices, k, axis=axis)
    if not keepdim:
        v, i = jnp.squeeze(v, axis), jnp.squeeze(i, axis)
    return v, i


def _median(x, axis, keepdim, skip_nan):
    n = x.shape[axis]
    values, indices = _sorted_with_index(x, axis)
    nans = jnp.isnan(x) if jnp.issubdtype(x.dtype, jnp.floating) else jnp.zeros(x.shape, bool)
    count = n - jnp.sum(nans, axis=axis)  # non-NaN entries per row
    if skip_nan:
        k = jnp.maximum(count - 1, 0) // 2
    else:
        k = jnp.full(count.shape, (n - 1) // 2)
    v, i = _pick(values, indices, k, axis, keepdim)
    if not skip_nan:  # any NaN: the result is NaN, at the first NaN's index
        first_nan = jnp.argmax(nans, axis=axis).astype(jnp.int64)
        has_nan = jnp.any(nans, axis=axis)
        if keepdim:
            first_nan, has_nan = first_nan[..., None], has_nan[..., None]
            first_nan, has_nan = jnp.moveaxis(first_nan, -1, axis), jnp.moveaxis(has_nan, -1, axis)
        v = jnp.where(has_nan, jnp.asarray(jnp.nan, x.dtype), v)
        i = jnp.where(has_nan, first_nan, i)
    return v, i


@register(aten.median.default)
def median(self):
    return _median(self.reshape(-1), 0, False, False)[0]


@register(aten.nanmedian.default)
def nanmedian(self):
    return _median(self.reshape(-1), 0, False, True)[0]


@register(aten.median.dim)
def median_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    return _median(self, dim % self.ndim, keepdim, False)


@register(aten.nanmedian.dim)
def nanmedian_dim(self, dim, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    return _median(self, dim % self.ndim, keepdim, True)


@register(aten.kthvalue.default)
def kthvalue(self, k, dim=-1, keepdim=False):
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = dim % self.ndim
    values, indices = _sorted_with_index(self, axis)
    return _pick(values, indices, k - 1, axis, keepdim)


@register(aten.logcumsumexp.default)
def logcumsumexp(self, dim):
    if self.ndim == 0:
        return self
    return lax.cumlogsumexp(opmath(self), axis=dim % self.ndim).astype(self.dtype)


def _searchsorted(seq, values, right, out_int32, sorter=None):
    if sorter is not None:
        seq = jnp.take_along_axis(seq, sorter, axis=-1)
    dt = result_type(seq, values)
    seq, values = seq.astype(dt), values.astype(dt)
    side = "right" if right else "left"
    if seq.ndim == 1:
        out = jnp.searchsorted(seq, values, side=side)
    else:  # one sorted row per leading index
        rows = seq.reshape(-1, seq.shape[-1])
        vals = values.reshape(rows.shape[0], -1)
        out = jnp.stack([jnp.searchsorted(r, v, side=side) for r, v in zip(rows, vals)])
        out = out.reshape(values.shape)
    return out.astype(jnp.int32 if out_int32 else jnp.int64)


@register(aten.searchsorted.Tensor)
def searchsorted(sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None):
    right = right or side == "right"
    return _searchsorted(sorted_sequence, self, right, out_int32, sorter)


@register(aten.searchsorted.Scalar)
def searchsorted_scalar(
    sorted_sequence, self, *, out_int32=False, right=False, side=None, sorter=None
):
    right = right or side == "right"
    value = jnp.asarray(self)
    return _searchsorted(sorted_sequence, value, right, out_int32, sorter)


@register(aten.bucketize.Tensor)
def bucketize(self, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, self, right, out_int32)


@register(aten.bucketize.Scalar)
def bucketize_scalar(self, boundaries, *, out_int32=False, right=False):
    return _searchsorted(boundaries, jnp.asarray(self), right, out_int32)


@register(aten.histc.default)
def histc(self, bins=100, min=0, max=0):
    """torch.histc: [min, max] (both 0: the data's range; equal: widened by 1) cut into ``bins``
    equal bins, ``max`` in the last; values outside (and NaN) are ignored."""
    x = opmath(self).reshape(-1)
    lo, hi = jnp.asarray(min, x.dtype), jnp.asarray(max, x.dtype)
    auto = (lo == 0) & (hi == 0)
    lo = jnp.where(auto, jnp.min(x, initial=jnp.inf), lo) if x.size else lo
    hi = jnp.where(auto, jnp.max(x, initial=-jnp.inf), hi) if x.size else hi
    same = lo == hi
    lo, hi = jnp.where(same, lo - 1, lo), jnp.where(same, hi + 1, hi)
    inside = (x >= lo) & (x <= hi)
    pos = jnp.floor((x - lo) * bins / (hi - lo)).astype(jnp.int64)
    pos = jnp.where(pos == bins, bins - 1, pos)
    pos = jnp.where(inside, pos, bins)  # out of range -> a dropped extra bin
    counts = jnp.zeros(bins + 1, x.dtype).at[pos].add(1)[:bins]
    return counts.astype(self.dtype)
