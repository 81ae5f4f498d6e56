"""Less common nn ops the OpInfo sweep found falling back: pairwise distances (cdist, pdist),
bilinear's ``_trilinear``, 3-d average pooling (fixed and adaptive), antialiased bilinear resize.
Half floats compute in float32 and round once, like the rest of the nn family.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.nn import _bin_matrix, _tuple, pool_out_size
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _pnorm(diff, p):
    """p-norm over the last axis (torch.cdist's p: 0 counts non-zeros, inf is the max)."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum(a != 0, axis=-1).astype(diff.dtype)
    if p == float("inf"):
        return jnp.max(a, axis=-1, initial=0)
    if p == 1:
        return jnp.sum(a, axis=-1)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=-1))
    return jnp.sum(a**p, axis=-1) ** (1.0 / p)


@register(aten._cdist_forward.default, static=("p",))
def cdist_forward(x1, x2, p, compute_mode=None):
    """Exact differences (torch switches to a matmul form for large p=2 inputs; this is the
    value that form approximates)."""
    a, b = opmath(x1), opmath(x2)
    return _pnorm(a[..., :, None, :] - b[..., None, :, :], p).astype(x1.dtype)


@register(aten._pdist_forward.default, static=("p",))
def pdist_forward(self, p=2.0):
    n = self.shape[0]
    i, j = np.triu_indices(n, 1)
    x = opmath(self)
    return _pnorm(x[i] - x[j], p).astype(self.dtype)


@register(aten._trilinear.default)
def trilinear(i1, i2, i3, expand1, expand2, expand3, sumdim, unroll_dim=1):
    def expand(x, dims):
        for d in sorted(dims):
            x = jnp.expand_dims(x, d)
        return opmath(x)

    prod = expand(i1, expand1) * expand(i2, expand2) * expand(i3, expand3)
    return jnp.sum(prod, axis=tuple(sumdim)).astype(i1.dtype)


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


def _aa_weights(n_in, n_out, align_corners, scale):
    """(n_out, n_in) weights of antialiased linear resampling along one axis: a triangle filter
    stretched by the downscale factor (so every input pixel contributes when shrinking),
    normalized per output pixel; for upscaling it is plain linear interpolation."""
    if align_corners:
        sc = (n_in - 1) / (n_out - 1) if n_out > 1 else 0.0
    else:
        sc = 1.0 / scale if scale is not None and scale > 0 else n_in / n_out
    support, inv = (sc, 1.0 / sc) if sc >= 1.0 else (1.0, 1.0)
    w = np.zeros((n_out, n_in))
    for i in range(n_out):  # pixel centers at i + 0.5 (align_corners only changes the scale)
        center = sc * (i + 0.5)
        lo = max(int(center - support + 0.5), 0)
        hi = min(int(center + support + 0.5), n_in)
        j = np.arange(lo, hi)
        row = np.maximum(0.0, 1.0 - np.abs((j - center + 0.5) * inv))
        total = row.sum()
        w[i, lo:hi] = row / total if total else row
    return w


def _aa_pair(in_hw, out_hw, align_corners, scales):
    return [
        _aa_weights(n_in, n_out, align_corners, sc)
        for n_in, n_out, sc in zip(in_hw, out_hw, scales, strict=True)
    ]


@register(aten._upsample_bilinear2d_aa.default, static=("scales_h", "scales_w"))
def upsample_bilinear2d_aa(self, output_size, align_corners, scales_h=None, scales_w=None):
    """``F.interpolate(mode="bilinear", antialias=True)``: two small matrix products."""
    x = opmath(self)
    wh, ww = _aa_pair(self.shape[-2:], output_size, align_corners, (scales_h, scales_w))
    out = jnp.einsum("oh,nchw,pw->ncop", jnp.asarray(wh, x.dtype), x, jnp.asarray(ww, x.dtype))
    return out.astype(self.dtype)


@register(aten._upsample_bilinear2d_aa_backward.default, static=("scales_h", "scales_w"))
def upsample_bilinear2d_aa_backward(
    grad_output, output_size, input_size, align_corners, scales_h=None, scales_w=None
):
    g = opmath(grad_output)
    wh, ww = _aa_pair(input_size[-2:], output_size, align_corners, (scales_h, scales_w))
    out = jnp.einsum("oh,ncop,pw->nchw", jnp.asarray(wh, g.dtype), g, jnp.asarray(ww, g.dtype))
    return out.astype(grad_output.dtype)


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
