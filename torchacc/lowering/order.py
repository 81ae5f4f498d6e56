"""Order statistics and binning: median, nanmedian, kthvalue, mode, searchsorted, bucketize,
histc, histogram, and the logcumsumexp scan.

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


@register(aten.mode.default)
def mode(self, dim=-1, keepdim=False):
    """The most frequent value along ``dim`` (ties: the smallest value) and the index of its last
    occurrence, as eager CPU: a stable sort, then the length of each run of equal values."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    axis = dim % self.ndim
    x = jnp.moveaxis(self, axis, -1)
    n = x.shape[-1]
    values, indices = _sorted_with_index(x, x.ndim - 1)
    pos = lax.broadcasted_iota(jnp.int64, values.shape, values.ndim - 1)
    starts = jnp.concatenate(
        [jnp.ones(values.shape[:-1] + (1,), bool), values[..., 1:] != values[..., :-1]], -1
    )
    ends = jnp.concatenate(
        [values[..., 1:] != values[..., :-1], jnp.ones(values.shape[:-1] + (1,), bool)], -1
    )
    run_start = lax.cummax(jnp.where(starts, pos, 0), axis=values.ndim - 1)
    length = jnp.where(ends, pos - run_start + 1, -1)
    best = jnp.argmax(length, axis=-1)[..., None]  # first longest run = smallest value
    v = jnp.take_along_axis(values, best, -1)[..., 0]
    i = jnp.take_along_axis(indices, best, -1)[..., 0]
    if n == 0:
        raise ValueError("torchacc: mode of an empty dimension")
    if keepdim:
        v, i = jnp.expand_dims(v, axis), jnp.expand_dims(i, axis)
    return v, i


def _histogram(x, edges, weight, density):
    """Counts (or weight sums) of ``x`` in the bins between ``edges``; the last bin is closed."""
    bins = edges.shape[0] - 1
    pos = jnp.searchsorted(edges, x, side="right") - 1
    pos = jnp.where(x == edges[-1], bins - 1, pos)
    inside = (x >= edges[0]) & (x <= edges[-1])
    pos = jnp.where(inside, pos, bins)
    w = jnp.ones_like(x) if weight is None else opmath(weight).reshape(-1)
    hist = jnp.zeros(bins + 1, w.dtype).at[pos].add(w)[:bins]
    if density:
        hist = hist / (jnp.sum(hist) * (edges[1:] - edges[:-1]))
    return hist


@register(aten.histogram.bin_ct, static=("range",))
def histogram(self, bins=100, range=None, weight=None, density=False):
    """torch.histogram with ``bins`` equal bins over ``range`` (default: the data's min and max;
    an empty range is widened by 0.5 each side, as eager). The edges are computed on the device:
    the shapes are static, only the values depend on the data."""
    x = opmath(self).reshape(-1)
    if range is not None:
        lo, hi = jnp.asarray(range[0], x.dtype), jnp.asarray(range[1], x.dtype)
    elif x.size:
        lo, hi = jnp.min(x), jnp.max(x)
    else:
        lo, hi = jnp.zeros((), x.dtype), jnp.zeros((), x.dtype)
    same = lo == hi
    lo, hi = jnp.where(same, lo - 0.5, lo), jnp.where(same, hi + 0.5, hi)
    edges = jnp.linspace(lo, hi, bins + 1).astype(x.dtype)
    return _histogram(x, edges, weight, density).astype(self.dtype), edges.astype(self.dtype)


@register(aten.histogram.bins_tensor)
def histogram_bins(self, bins, weight=None, density=False):
    x = opmath(self).reshape(-1)
    edges = opmath(bins)
    return _histogram(x, edges, weight, density).astype(self.dtype), bins
