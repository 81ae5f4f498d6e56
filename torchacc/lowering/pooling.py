"""Lowering rules for pooling: max, average and adaptive pooling over the last two dims
(``(C, H, W)`` and ``(N, C, H, W)``), 3-d average pooling (fixed and adaptive) and fractional max
pooling (2-d and 3-d). Windows are gathered with static index math; half floats compute in float32
and round once, like the rest of the nn family. Their backward rules are in nn_backward.py.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.nn import _tuple
from torchacc.lowering.registry import register

aten = torch.ops.aten


def pool_out_size(size, k, s, p, d, ceil_mode):
    """torch's pooling_output_shape."""
    out = (size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)) // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def pool_args(kernel_size, stride, padding, dilation=1):
    k = _tuple(kernel_size, 2)
    s = _tuple(stride, 2) if stride else k
    return k, s, _tuple(padding, 2), _tuple(dilation, 2)


def pool_windows(x, k, s, p, d, out, fill):
    """Stack every kernel offset's strided slice: (KH*KW, ..., OH, OW), plus static validity."""
    lead = x.ndim - 2
    cfg = [(0, 0, 0)] * lead
    for i in range(2):
        hi = (out[i] - 1) * s[i] + d[i] * (k[i] - 1) + 1 - x.shape[lead + i] - p[i]
        cfg.append((p[i], hi, 0))
    xp = lax.pad(x, jnp.asarray(fill, x.dtype), cfg)
    slices, valid = [], []
    for kh in range(k[0]):
        for kw in range(k[1]):
            start = (0,) * lead + (kh * d[0], kw * d[1])
            limit = x.shape[:lead] + (
                kh * d[0] + (out[0] - 1) * s[0] + 1,
                kw * d[1] + (out[1] - 1) * s[1] + 1,
            )
            slices.append(lax.slice(xp, start, limit, (1,) * lead + tuple(s)))
            hs = np.arange(out[0]) * s[0] - p[0] + kh * d[0]
            ws = np.arange(out[1]) * s[1] - p[1] + kw * d[1]
            hv = (hs >= 0) & (hs < x.shape[lead])
            wv = (ws >= 0) & (ws < x.shape[lead + 1])
            valid.append(hv[:, None] & wv[None, :])
    return jnp.stack(slices), np.stack(valid)


def _masked_argmax(vals, valid, axis=0):
    """torch's max-pool choice: the first maximum in scan order among valid positions (nan wins)."""
    neg = jnp.asarray(-jnp.inf, vals.dtype)
    m = jnp.max(jnp.where(valid, vals, neg), axis=axis, keepdims=True)
    hit = valid & ((vals == m) | jnp.isnan(vals))
    return jnp.squeeze(m, axis), jnp.argmax(hit, axis=axis)


@register(aten.max_pool2d_with_indices.default)
def max_pool2d_with_indices(self, kernel_size, stride=(), padding=0, dilation=1, ceil_mode=False):
    k, s, p, d = pool_args(kernel_size, stride, padding, dilation)
    H, W = self.shape[-2:]
    out = tuple(pool_out_size(n, k[i], s[i], p[i], d[i], ceil_mode) for i, n in enumerate((H, W)))
    vals, valid = pool_windows(self, k, s, p, d, out, -jnp.inf)
    valid = valid.reshape(valid.shape[:1] + (1,) * (self.ndim - 2) + valid.shape[1:])
    m, arg = _masked_argmax(vals, valid)
    base, offs = pool_flat_offsets(k, s, p, d, out, W)
    return m, jnp.asarray(base) + jnp.asarray(offs)[arg]


def pool_flat_offsets(k, s, p, d, out, W):
    """Flat index (h * W + w) of each window's origin (OH, OW) and of each kernel offset (K,)."""
    base = (np.arange(out[0]) * s[0] - p[0])[:, None] * W + (np.arange(out[1]) * s[1] - p[1])
    offs = np.array([kh * d[0] * W + kw * d[1] for kh in range(k[0]) for kw in range(k[1])])
    return base.astype(np.int64), offs.astype(np.int64)


@register(aten.avg_pool2d.default)
def avg_pool2d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    k, s, p, _ = pool_args(kernel_size, stride, padding)
    H, W = self.shape[-2:]
    out = tuple(pool_out_size(n, k[i], s[i], p[i], 1, ceil_mode) for i, n in enumerate((H, W)))
    x = opmath(self)
    lead = x.ndim - 2
    cfg = [(0, 0, 0)] * lead
    for i in range(2):
        cfg.append((p[i], (out[i] - 1) * s[i] + k[i] - x.shape[lead + i] - p[i], 0))
    xp = lax.pad(x, jnp.asarray(0, x.dtype), cfg)
    total = lax.reduce_window(
        xp, np.zeros((), x.dtype), lax.add, (1,) * lead + k, (1,) * lead + s, "VALID"
    )
    if divisor_override:
        div = np.full(out, float(divisor_override))
    else:
        counts = []
        for i, n in enumerate((H, W)):
            start = np.arange(out[i]) * s[i] - p[i]
            end = np.minimum(start + k[i], n + p[i])
            size = end - start
            start, end = np.maximum(start, 0), np.minimum(end, n)
            counts.append(size if count_include_pad else end - start)
        div = counts[0][:, None] * counts[1][None, :]
    return (total / jnp.asarray(div, x.dtype)).astype(self.dtype)


def _adaptive_bins(n, out):
    start = (np.arange(out) * n) // out
    end = -((-(np.arange(out) + 1) * n) // out)  # ceil
    return start, end


def _bin_matrix(n, out):
    start, end = _adaptive_bins(n, out)
    pos = np.arange(n)
    return ((pos[None, :] >= start[:, None]) & (pos[None, :] < end[:, None])).astype(np.float32)


@register(aten._adaptive_avg_pool2d.default)
def adaptive_avg_pool2d(self, output_size):
    H, W = self.shape[-2:]
    OH, OW = _tuple(output_size, 2)
    x = opmath(self)
    if H % OH == 0 and W % OW == 0:
        x = x.reshape(x.shape[:-2] + (OH, H // OH, OW, W // OW))
        return jnp.mean(x, axis=(-3, -1)).astype(self.dtype)
    mh, mw = _bin_matrix(H, OH), _bin_matrix(W, OW)
    total = jnp.einsum(
        "...hw,oh,pw->...op",
        x,
        jnp.asarray(mh, x.dtype),
        jnp.asarray(mw, x.dtype),
        precision=lax.Precision.HIGHEST,
    )
    div = mh.sum(1)[:, None] * mw.sum(1)[None, :]
    return (total / jnp.asarray(div, x.dtype)).astype(self.dtype)


@register(aten.adaptive_max_pool2d.default)
def adaptive_max_pool2d(self, output_size):
    H, W = self.shape[-2:]
    OH, OW = _tuple(output_size, 2)
    idx, ok = [], []
    for n, o in ((H, OH), (W, OW)):
        start, end = _adaptive_bins(n, o)
        kmax = int((end - start).max())
        pos = start[:, None] + np.arange(kmax)[None, :]
        ok.append(pos < end[:, None])
        idx.append(np.minimum(pos, n - 1))
    # (..., OH, KH, W) -> (..., OH, KH, OW, KW) -> (..., OH, OW, KH, KW)
    v = jnp.take(self, jnp.asarray(idx[0].reshape(-1)), axis=-2)
    v = v.reshape(self.shape[:-2] + idx[0].shape + (W,))
    v = jnp.take(v, jnp.asarray(idx[1].reshape(-1)), axis=-1).reshape(v.shape[:-1] + idx[1].shape)
    v = jnp.moveaxis(v, -3, -2)
    kh, kw = idx[0].shape[1], idx[1].shape[1]
    v = v.reshape(v.shape[:-2] + (kh * kw,))
    valid = (ok[0][:, None, :, None] & ok[1][None, :, None, :]).reshape(OH, OW, kh * kw)
    m, arg = _masked_argmax(v, valid, axis=-1)
    flat = (idx[0][:, None, :, None] * W + idx[1][None, :, None, :]).reshape(OH, OW, kh * kw)
    flat = jnp.asarray(flat, jnp.int64)
    sel = jnp.take_along_axis(jnp.broadcast_to(flat, arg.shape + (kh * kw,)), arg[..., None], -1)
    return m, sel[..., 0]


# 3-d and fractional pooling


def _window_counts(n, k, s, p, out, count_include_pad):
    start = np.arange(out) * s - p
    end = np.minimum(start + k, n + p)
    size = end - start
    start, end = np.maximum(start, 0), np.minimum(end, n)
    return size if count_include_pad else end - start


@register(aten.avg_pool3d.default)
def avg_pool3d(
    self,
    kernel_size,
    stride=(),
    padding=0,
    ceil_mode=False,
    count_include_pad=True,
    divisor_override=None,
):
    k = _tuple(kernel_size, 3)
    s = _tuple(stride, 3) if stride else k
    p = _tuple(padding, 3)
    sizes = self.shape[-3:]
    outs = [pool_out_size(n, k_, s_, p_, 1, ceil_mode) for n, k_, s_, p_ in zip(sizes, k, s, p)]
    lead = self.ndim - 3
    # pad left by p, right by whatever the last (ceil-mode) window needs
    pads = [(0, 0)] * lead + [
        (p_, max((o - 1) * s_ + k_ - n - p_, 0)) for n, k_, s_, p_, o in zip(sizes, k, s, p, outs)
    ]
    x = jnp.pad(opmath(self), pads)
    total = lax.reduce_window(
        x, jnp.zeros((), x.dtype), lax.add, (1,) * lead + k, (1,) * lead + s, "VALID"
    )
    total = total[(...,) + tuple(slice(0, o) for o in outs)]
    if divisor_override:
        div = np.full(outs, divisor_override, np.float64)
    else:
        c = [_window_counts(*a, count_include_pad) for a in zip(sizes, k, s, p, outs)]
        div = c[0][:, None, None] * c[1][None, :, None] * c[2][None, None, :]
    return (total / jnp.asarray(div, x.dtype)).astype(self.dtype)


@register(aten._adaptive_avg_pool3d.default)
def adaptive_avg_pool3d(self, output_size):
    D, H, W = self.shape[-3:]
    OD, OH, OW = _tuple(output_size, 3)
    x = opmath(self)
    md, mh, mw = _bin_matrix(D, OD), _bin_matrix(H, OH), _bin_matrix(W, OW)
    total = jnp.einsum(
        "...dhw,od,ph,qw->...opq",
        x,
        jnp.asarray(md, x.dtype),
        jnp.asarray(mh, x.dtype),
        jnp.asarray(mw, x.dtype),
        precision=lax.Precision.HIGHEST,
    )
    div = md.sum(1)[:, None, None] * mh.sum(1)[None, :, None] * mw.sum(1)[None, None, :]
    return (total / jnp.asarray(div, x.dtype)).astype(self.dtype)


def _fractional_starts(sample, n_in, n_out, k):
    """Window starts along one axis from a uniform sample in [0, 1): pseudo-random steps of
    floor((i + u) * alpha) - floor(u * alpha), alpha = (n_in - k) / (n_out - 1), the last window
    ending at the edge; computed in the input's dtype like eager."""
    i = jnp.arange(n_out, dtype=sample.dtype)
    if n_out > 1:
        alpha = jnp.asarray(n_in - k, sample.dtype) / jnp.asarray(n_out - 1, sample.dtype)
        u = sample[..., None]
        starts = jnp.floor((i + u) * alpha).astype(jnp.int64) - jnp.floor(u * alpha).astype(
            jnp.int64
        )
    else:
        starts = jnp.zeros(sample.shape + (1,), jnp.int64)
    return jnp.where(i == n_out - 1, n_in - k, starts)


def _fractional_max_pool(x, kernel_size, output_size, samples):
    """Max over windows of ``kernel_size`` at pseudo-random starts; returns the values and each
    one's flat index in its input plane (the first maximum in window order; a NaN wins)."""
    nd = len(kernel_size)
    unbatched = x.ndim == nd + 1
    if unbatched:
        x = x[None]
    n, c, spatial = x.shape[0], x.shape[1], x.shape[2:]
    strides = [int(np.prod(spatial[a + 1 :])) for a in range(nd)]
    flat_idx = jnp.zeros((n, c) + (1,) * (2 * nd), jnp.int64)
    for a in range(nd):  # 2-d: samples (w, h); 3-d: samples (t, h, w), as eager reads them
        start = _fractional_starts(
            samples[..., 1 - a if nd == 2 else a], spatial[a], output_size[a], kernel_size[a]
        )
        shape = [n, c] + [1] * (2 * nd)
        shape[2 + a] = output_size[a]
        k_shape = [1] * (2 + 2 * nd)
        k_shape[2 + nd + a] = kernel_size[a]
        pos = start.reshape(shape) + jnp.arange(kernel_size[a]).reshape(k_shape)
        flat_idx = flat_idx + pos * strides[a]
    flat_idx = jnp.broadcast_to(flat_idx, (n, c) + tuple(output_size) + tuple(kernel_size))
    idx = flat_idx.reshape(n, c, int(np.prod(output_size)), -1)
    plane = x.reshape(n, c, -1)
    vals = jnp.take_along_axis(plane, idx.reshape(n, c, -1), axis=2).reshape(idx.shape)
    key = jnp.where(jnp.isnan(vals), jnp.inf, vals)
    best = jnp.argmax(key, axis=-1)[..., None]
    out = jnp.take_along_axis(vals, best, -1)[..., 0].reshape((n, c) + tuple(output_size))
    where = jnp.take_along_axis(idx, best, -1)[..., 0].reshape(out.shape)
    if unbatched:
        out, where = out[0], where[0]
    return out, where


@register(aten.fractional_max_pool2d.default, aten.fractional_max_pool3d.default)
def fractional_max_pool(self, kernel_size, output_size, random_samples):
    return _fractional_max_pool(self, kernel_size, output_size, random_samples.astype(self.dtype))


@register(aten.fractional_max_pool2d_backward.default, aten.fractional_max_pool3d_backward.default)
def fractional_max_pool_backward(grad_output, self, kernel_size, output_size, indices):
    """Each output's gradient added at its maximum's position in the input plane."""
    nd = len(kernel_size)
    lead = self.shape[: self.ndim - nd]
    plane = int(np.prod(self.shape[self.ndim - nd :]))
    g = grad_output.reshape(lead + (-1,))
    idx = indices.reshape(lead + (-1,))
    out = jnp.zeros(lead + (plane,), g.dtype)
    rows = jnp.indices(idx.shape)[:-1]
    out = out.at[(*rows, idx)].add(g)
    return out.reshape(self.shape)
