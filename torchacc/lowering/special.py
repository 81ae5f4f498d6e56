"""Special functions and float-classifying pointwise ops the OpInfo sweep found falling back:
polygamma, igamma/igammac, angle, nextafter, frexp, i0. Half floats compute in float32.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.pointwise import float_dtype, result_type
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _float(x):
    dt = float_dtype(x.dtype)
    return opmath(x.astype(dt)), dt


_SHIFT = 64  # negative arguments down to -63 are shifted into x > 0 exactly


@register(aten.polygamma.default)
def polygamma(n, self):
    """psi^(n)(x) = (-1)^(n+1) n! zeta(n+1, x). JAX's Hurwitz zeta is only right for x > 0, so
    for x < 0 the first terms of the series are summed explicitly (zeta(s, x) = sum_{k<m}
    (x+k)^-s + zeta(s, x+m)), as torch's Cephes zeta does; poles (0, -1, ...) give inf."""
    x, dt = _float(self)
    if n == 0:
        return jsp.digamma(x).astype(dt)
    s = n + 1
    m = jnp.where(x < 0, jnp.clip(jnp.ceil(-x), 0, _SHIFT), 0)
    k = jnp.arange(_SHIFT, dtype=x.dtype).reshape((_SHIFT,) + (1,) * x.ndim)
    head = jnp.sum(jnp.where(k < m, (x + k) ** -s, 0), axis=0)
    zeta = head + jsp.zeta(jnp.asarray(s, x.dtype), x + m)
    pole = (x <= 0) & (x == jnp.floor(x))
    sign = 1.0 if s % 2 == 0 else -1.0  # (-1)^(n+1)
    out = sign * math.factorial(n) * zeta
    return jnp.where(pole, jnp.inf, out).astype(dt)


def _binary_float(fn, self, other):
    dt = float_dtype(result_type(self, other))
    a, b = opmath(self.astype(dt)), opmath(other.astype(dt))
    return fn(a, b).astype(dt)


@register(aten.igamma.default)
def igamma(self, other):
    return _binary_float(jsp.gammainc, self, other)


@register(aten.igammac.default)
def igammac(self, other):
    return _binary_float(jsp.gammaincc, self, other)


@register(aten.angle.default)
def angle(self):
    """Real input: pi for negatives, 0 otherwise, NaN kept (ints/bools give the default float)."""
    x, dt = _float(self)
    out = jnp.where(x < 0, jnp.asarray(np.pi, x.dtype), jnp.zeros((), x.dtype))
    return jnp.where(jnp.isnan(x), x, out).astype(dt)


@register(aten.nextafter.default)
def nextafter(self, other):
    dt = result_type(self, other)
    return jnp.nextafter(self.astype(dt), other.astype(dt))


@register(aten.frexp.Tensor)
def frexp(self):
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


@register(aten.special_i0.default, aten.i0.default)
def i0(self):
    x, dt = _float(self)
    return jsp.i0(x).astype(dt)
