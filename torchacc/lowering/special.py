"""Special functions and float-classifying pointwise ops the OpInfo sweep found falling back:
polygamma, igamma/igammac, angle, nextafter, frexp, i0, zeta, spherical_bessel_j0, and the
orthogonal polynomial families. Half floats compute in float32. (Bessel functions: bessel.py.)
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch
from jax import lax

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.pointwise import float_dtype, result_type
from torchacc.lowering.registry import register

aten = torch.ops.aten
prims = torch.ops.prims


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


# --- orthogonal polynomials: special.{chebyshev,shifted_chebyshev}_polynomial_{t,u,v,w},
# hermite_polynomial_{h,he}, laguerre_polynomial_l, legendre_polynomial_p. The degree ``n`` is a
# tensor (truncated to an integer, as torch does; a negative degree gives 0), so the three-term
# recurrence runs in a ``while_loop`` up to the largest degree present, keeping each element's
# value at its own degree.


def _recurrence(p1, step):
    """Rule for a family with P_0 = 1, P_1 = p1(x), P_{k+1} = step(k, x, P_k, P_{k-1})."""

    def rule(x, n):
        dt = float_dtype(result_type(x, n))
        x = opmath(jnp.asarray(x).astype(dt))
        n = jnp.asarray(n)
        n = (jnp.trunc(n) if jnp.issubdtype(n.dtype, jnp.floating) else n).astype(jnp.int64)
        x, n = jnp.broadcast_arrays(x, n)
        prev, cur = jnp.ones_like(x), p1(x)
        out = jnp.where(n == 0, prev, jnp.where(n == 1, cur, jnp.zeros_like(x)))

        def body(state):
            k, prev, cur, out = state
            nxt = step(k.astype(x.dtype), x, cur, prev)
            return k + 1, cur, nxt, jnp.where(n == k + 1, nxt, out)

        top = jnp.max(n, initial=1)
        state = (jnp.asarray(1, jnp.int64), prev, cur, out)
        out = lax.while_loop(lambda s: s[0] < top, body, state)[3]
        return out.astype(dt)

    return rule


def _cheb(p1):
    return _recurrence(p1, lambda k, x, c, p: 2 * x * c - p)


_POLYNOMIALS = {
    "chebyshev_polynomial_t": _cheb(lambda x: x),
    "chebyshev_polynomial_u": _cheb(lambda x: 2 * x),
    "chebyshev_polynomial_v": _cheb(lambda x: 2 * x - 1),
    "chebyshev_polynomial_w": _cheb(lambda x: 2 * x + 1),
    "hermite_polynomial_h": _recurrence(lambda x: 2 * x, lambda k, x, c, p: 2 * x * c - 2 * k * p),
    "hermite_polynomial_he": _recurrence(lambda x: x, lambda k, x, c, p: x * c - k * p),
    "laguerre_polynomial_l": _recurrence(
        lambda x: 1 - x, lambda k, x, c, p: ((2 * k + 1 - x) * c - k * p) / (k + 1)
    ),
    "legendre_polynomial_p": _recurrence(
        lambda x: x, lambda k, x, c, p: ((2 * k + 1) * x * c - k * p) / (k + 1)
    ),
}
for _kind in "tuvw":
    _base = {"t": lambda x: x, "u": lambda x: 2 * x, "v": lambda x: 2 * x - 1}.get(
        _kind, lambda x: 2 * x + 1
    )
    _POLYNOMIALS[f"shifted_chebyshev_polynomial_{_kind}"] = _recurrence(
        lambda y, b=_base: b(2 * y - 1), lambda k, y, c, p: 2 * (2 * y - 1) * c - p
    )

for _name, _rule in _POLYNOMIALS.items():
    _packet = getattr(aten, f"special_{_name}")
    register(_packet.default, _packet.x_scalar, _packet.n_scalar)(_rule)


@register(prims.spherical_bessel_j0.default, aten.special_spherical_bessel_j0.default)
def spherical_bessel_j0(self):
    x, dt = _float(self)
    safe = jnp.where(x == 0, 1, x)
    out = jnp.where(x == 0, 1, jnp.sin(safe) / safe)
    return jnp.where(jnp.isinf(x), 0, out).astype(dt)


@register(prims.zeta.default)
def zeta(self, other):
    return _binary_float(jsp.zeta, self, other)
