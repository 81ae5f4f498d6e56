"""FFTs and complex construction: ``_fft_r2c`` / ``_fft_c2c`` / ``_fft_c2r`` (every
``torch.fft`` function and ``stft`` reach these), ``complex``, ``polar``, ``view_as_real``,
``view_as_complex`` and conjugation (``_conj``: a device tensor never carries torch's conjugate
bit; the view holds the conjugated values).

torch's FFT ops take a ``normalization`` code: 0 none, 1 by 1/sqrt(n), 2 by 1/n, n being the
product of the transformed sizes (the signal's, for ``c2r``). Each rule computes the unnormalized
transform and scales once. Half floats transform in float32 (XLA's FFT has no half types).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import torch
from jax import lax

from torchacc.lowering.registry import register

aten = torch.ops.aten


def _scale(x, n, normalization):
    if normalization == 1:
        return x * jnp.asarray(1 / math.sqrt(n), x.real.dtype)
    if normalization == 2:
        return x * jnp.asarray(1 / n, x.real.dtype)
    return x


def _real_in(x):
    return x.astype(jnp.float32) if x.dtype in (jnp.float16, jnp.bfloat16) else x


def _complex_in(x):
    return x if jnp.iscomplexobj(x) else _real_in(x).astype(jnp.complex64)


@register(aten._fft_r2c.default)
def fft_r2c(self, dim, normalization, onesided):
    x = _real_in(self)
    n = math.prod(x.shape[d] for d in dim)
    if onesided:
        out = jnp.fft.rfftn(x, axes=dim)
    else:
        out = jnp.fft.fftn(x.astype(jnp.result_type(x.dtype, jnp.complex64)), axes=dim)
    return _scale(out, n, normalization)


@register(aten._fft_c2c.default)
def fft_c2c(self, dim, normalization, forward):
    x = _complex_in(self)
    n = math.prod(x.shape[d] for d in dim)
    if not dim:
        return x
    out = jnp.fft.fftn(x, axes=dim) if forward else jnp.fft.ifftn(x, axes=dim, norm="forward")
    return _scale(out, n, normalization)


@register(aten._fft_c2r.default)
def fft_c2r(self, dim, normalization, last_dim_size):
    x = _complex_in(self)
    sizes = [x.shape[d] for d in dim[:-1]] + [last_dim_size]
    out = jnp.fft.irfftn(x, s=sizes, axes=dim, norm="forward")
    return _scale(out, math.prod(sizes), normalization)


@register(aten.complex.default)
def complex_(real, imag):
    return lax.complex(real, imag)


@register(aten.polar.default)
def polar(abs, angle):
    return lax.complex(abs * jnp.cos(angle), abs * jnp.sin(angle))


@register(aten.view_as_real.default)
def view_as_real(self):
    return jnp.stack([jnp.real(self), jnp.imag(self)], axis=-1)


@register(aten.view_as_complex.default)
def view_as_complex(self):
    return lax.complex(self[..., 0], self[..., 1])


@register(aten._conj.default, aten._conj_physical.default, aten.conj_physical.default)
def conj(self):
    return jnp.conj(self)
