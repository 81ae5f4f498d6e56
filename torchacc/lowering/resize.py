"""Lowering rules for resizing images: nearest and bilinear upsampling (static scales; the
index math in float32 exactly as torch's UpSample.h) and antialiased bilinear resizing (its
forward and backward: one separable weight matrix per axis).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _scale_value(scale, n_in, n_out):
    if scale is not None and scale > 0:
        return np.float32(1.0 / scale)
    return np.float32(n_in) / np.float32(n_out)


def nearest_index(n_in, n_out, scale):
    if n_out == n_in:
        return np.arange(n_out)
    if n_out == 2 * n_in:
        return np.arange(n_out) >> 1
    sc = _scale_value(scale, n_in, n_out)
    src = np.floor(np.arange(n_out, dtype=np.float32) * sc).astype(np.int64)
    return np.minimum(src, n_in - 1)


def linear_weights(n_in, n_out, align_corners, scale):
    """(i0, i1, w0, w1) per output position for 1-d linear interpolation."""
    if align_corners:
        sc = np.float32(n_in - 1) / np.float32(n_out - 1) if n_out > 1 else np.float32(0)
        src = sc * np.arange(n_out, dtype=np.float32)
    else:
        sc = _scale_value(scale, n_in, n_out)
        src = sc * (np.arange(n_out, dtype=np.float32) + np.float32(0.5)) - np.float32(0.5)
        src = np.maximum(src, np.float32(0))
    i0 = src.astype(np.int64)
    i1 = i0 + (i0 < n_in - 1)
    w1 = (src - i0.astype(np.float32)).astype(np.float32)
    return i0, i1, np.float32(1) - w1, w1


def _spatial(x, output_size, scales):
    """(axis, output size, scale) for each trailing spatial axis."""
    first = x.ndim - len(output_size)
    return [(first + i, n, sc) for i, (n, sc) in enumerate(zip(output_size, scales, strict=True))]


def upsample_nearest(x, output_size, scales):
    for axis, n_out, sc in _spatial(x, output_size, scales):
        n_in = x.shape[axis]
        idx = nearest_index(n_in, n_out, sc)
        if n_out % n_in == 0 and (idx == np.arange(n_out) // (n_out // n_in)).all():
            x = jnp.repeat(x, n_out // n_in, axis=axis)  # its transpose is a reshape-sum
        else:
            x = jnp.take(x, jnp.asarray(idx), axis=axis)
    return x


def upsample_linear(x, output_size, align_corners, scales):
    dtype = x.dtype
    x = opmath(x)
    for axis, n_out, sc in _spatial(x, output_size, scales):
        i0, i1, w0, w1 = linear_weights(x.shape[axis], n_out, align_corners, sc)
        shape = [1] * x.ndim
        shape[axis] = n_out
        w0 = jnp.asarray(w0, x.dtype).reshape(shape)
        w1 = jnp.asarray(w1, x.dtype).reshape(shape)
        x = (
            jnp.take(x, jnp.asarray(i0), axis=axis) * w0
            + jnp.take(x, jnp.asarray(i1), axis=axis) * w1
        )
    return x.astype(dtype)


@register(aten.upsample_nearest2d.default, static=("scales_h", "scales_w"))
def upsample_nearest2d(self, output_size, scales_h=None, scales_w=None):
    return upsample_nearest(self, tuple(output_size), (scales_h, scales_w))


@register(aten.upsample_bilinear2d.default, static=("scales_h", "scales_w"))
def upsample_bilinear2d(self, output_size, align_corners, scales_h=None, scales_w=None):
    return upsample_linear(self, tuple(output_size), align_corners, (scales_h, scales_w))


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
