"""Bessel functions XLA has no kernel for: J0, J1, Y0, Y1 (``special.bessel_*``), K0, K1 and
their exponentially scaled forms (``special.modified_bessel_k*``, ``scaled_modified_bessel_k*``),
and the Airy function Ai (from K_1/3 and J_+-1/3); plus the ones JAX has (I0, I1, I0e, I1e).

They are evaluated from their integral representations with fixed quadratures (Note [Bessel
quadrature]), switching to Hankel's asymptotic expansion where the integrands oscillate too fast.
Half floats compute in float32.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import jax.scipy.special as jsp
import numpy as np
import torch

from torchacc.lowering.dtypes import opmath
from torchacc.lowering.pointwise import float_dtype
from torchacc.lowering.registry import register

aten = torch.ops.aten
prims = torch.ops.prims

# Note [Bessel quadrature]
# J_n(x) = 1/(2 pi) * integral over one period of cos(n t - x sin t): the integrand is periodic
#   and analytic, so the trapezoid rule with N nodes is exact up to the integrand's Fourier
#   content, which dies off beyond |x| + n; N = 96 covers |x| <= _ASYMPTOTIC.
# Y_n(x) = 1/pi int_0^pi sin(x sin t - n t) dt - 1/pi int_0^inf (e^{nt} + (-1)^n e^{-nt})
#   e^{-x sinh t} dt: Gauss-Legendre on [0, pi] and on [0, T] with x sinh T = 60 (the tail
#   beyond is below e^-60).
# K_v(x) = int_0^inf e^{-x cosh t} cosh(v t) dt: an even integrand decaying doubly
#   exponentially, for which the trapezoid rule on [0, T] converges geometrically
#   (error ~ exp(-pi^2 / h)); T solves x (cosh T - 1) = 60 and the scaled form e^x K_v(x)
#   integrates e^{-x (cosh t - 1)} directly, so it neither under- nor overflows.
# For x > _ASYMPTOTIC, J and Y use Hankel's expansion (A&S 9.2.5-10) to (8x)^-6, whose
# truncation error there is below float64's resolution relative to the amplitude.
_N = 96
_ASYMPTOTIC = 25.0
_GL_T, _GL_W = np.polynomial.legendre.leggauss(_N)


def _f(x):
    dt = float_dtype(x.dtype)
    return opmath(x.astype(dt)), dt


def _hankel(n, x):
    """(P, Q, chi) of Hankel's expansion: J = sqrt(2/(pi x)) (P cos chi - Q sin chi),
    Y = sqrt(2/(pi x)) (P sin chi + Q cos chi)."""
    mu = 4.0 * n * n
    z = 8.0 * x
    p, q = jnp.ones_like(x), jnp.zeros_like(x)
    term = jnp.ones_like(x)
    for k in range(1, 13):  # term_k = prod_{j<k} (mu - (2j+1)^2) / (k! z^k)
        term = term * (mu - (2 * k - 1) ** 2) / (k * z)
        sign = (-1) ** (k // 2)
        if k % 2:
            q = q + sign * term
        else:
            p = p + sign * term
    return p, q, x - (n / 2 + 0.25) * math.pi


def _gl(a, b, fn, ndim):
    """Gauss-Legendre quadrature of fn over [a, b], for arrays of ``ndim`` dimensions."""
    t = jnp.asarray(_GL_T).reshape((_N,) + (1,) * ndim)
    w = jnp.asarray(_GL_W).reshape(t.shape)
    half = (b - a) / 2
    return half * jnp.sum(w * fn(a + half * (t + 1)), axis=0)


def _j(n, x):
    ax = jnp.abs(x)
    small = jnp.minimum(ax, _ASYMPTOTIC)
    t = jnp.arange(_N).reshape((_N,) + (1,) * x.ndim) * (2 * math.pi / _N)
    quad = jnp.mean(jnp.cos(n * t - small * jnp.sin(t)), axis=0)
    big = jnp.maximum(ax, _ASYMPTOTIC)
    p, q, chi = _hankel(n, big)
    asym = jnp.sqrt(2 / (math.pi * big)) * (p * jnp.cos(chi) - q * jnp.sin(chi))
    out = jnp.where(ax > _ASYMPTOTIC, asym, quad)
    return jnp.where(x < 0, -out, out) if n % 2 else out  # J_n(-x) = (-1)^n J_n(x)


def _y(n, x):
    pos = jnp.where(x > 0, x, 1.0)
    small = jnp.minimum(pos, _ASYMPTOTIC)
    first = _gl(0.0, math.pi, lambda t: jnp.sin(small * jnp.sin(t) - n * t), x.ndim) / math.pi
    top = jnp.arcsinh(60.0 / small)
    sign = 1 if n % 2 == 0 else -1
    second = _gl(
        jnp.zeros_like(small),
        top,
        lambda t: (jnp.exp(n * t) + sign * jnp.exp(-n * t)) * jnp.exp(-small * jnp.sinh(t)),
        x.ndim,
    )
    quad = first - second / math.pi
    big = jnp.maximum(pos, _ASYMPTOTIC)
    p, q, chi = _hankel(n, big)
    asym = jnp.sqrt(2 / (math.pi * big)) * (p * jnp.sin(chi) + q * jnp.cos(chi))
    out = jnp.where(x > _ASYMPTOTIC, asym, quad)
    out = jnp.where(x == 0, -jnp.inf, out)
    return jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out)


def _k_scaled(v, x):
    """e^x K_v(x) for x > 0 (inf at 0, NaN below)."""
    pos = jnp.where(x > 0, x, 1.0)
    top = jnp.arccosh(1.0 + 60.0 / pos)
    h = top / _N
    k = jnp.arange(_N + 1).reshape((_N + 1,) + (1,) * x.ndim)
    t = k * h
    w = jnp.where(k == 0, 0.5, 1.0)
    out = h * jnp.sum(w * jnp.exp(-pos * (jnp.cosh(t) - 1)) * jnp.cosh(v * t), axis=0)
    out = jnp.where(x == 0, jnp.inf, out)
    return jnp.where((x < 0) | jnp.isnan(x), jnp.nan, out)


def _j_frac(v, z):
    """J_v(z) for z > 0 and non-integer v: Bessel's integral plus its correction term
    -sin(v pi)/pi int_0^inf e^{-z sinh t - v t} dt; Hankel's expansion beyond _ASYMPTOTIC."""
    small = jnp.minimum(z, _ASYMPTOTIC)
    first = _gl(0.0, math.pi, lambda t: jnp.cos(v * t - small * jnp.sin(t)), z.ndim) / math.pi
    top = jnp.arcsinh(60.0 / small)
    tail = _gl(jnp.zeros_like(small), top, lambda t: jnp.exp(-small * jnp.sinh(t) - v * t), z.ndim)
    quad = first - math.sin(v * math.pi) / math.pi * tail
    big = jnp.maximum(z, _ASYMPTOTIC)
    p, q, chi = _hankel(v, big)
    asym = jnp.sqrt(2 / (math.pi * big)) * (p * jnp.cos(chi) - q * jnp.sin(chi))
    return jnp.where(z > _ASYMPTOTIC, asym, quad)


_AI0 = 0.35502805388781723926  # Ai(0) = 3^(-2/3) / Gamma(2/3)


def _airy_ai(x):
    """Ai(x) = sqrt(x/3)/pi K_{1/3}(zeta) for x > 0 and sqrt(y)/3 (J_{1/3} + J_{-1/3})(zeta) at
    x = -y < 0, with zeta = 2/3 |x|^{3/2}."""
    ax = jnp.where(x == 0, 1.0, jnp.abs(x))
    zeta = 2.0 / 3.0 * ax**1.5
    pos = jnp.sqrt(ax / 3) / math.pi * _k_scaled(1 / 3, zeta) * jnp.exp(-zeta)
    neg = jnp.sqrt(ax) / 3 * (_j_frac(1 / 3, zeta) + _j_frac(-1 / 3, zeta))
    out = jnp.where(x > 0, pos, neg)
    out = jnp.where(x == 0, _AI0, out)
    return jnp.where(jnp.isnan(x) | jnp.isinf(x), jnp.nan, out)  # torch: NaN at +-inf too


def _erfcx(x):
    """exp(x^2) erfc(x); JAX's float32 erfcx returns 0 near x = 9.3, so beyond 8 the asymptotic
    series 1/(x sqrt(pi)) (1 - 1/(2x^2) + 3/(4x^4) - 15/(8x^6)) (next term < 4e-7 relative)."""
    big = jnp.maximum(x, 8.0)
    r = 1 / (big * big)
    asym = (1 - r / 2 + 3 * r * r / 4 - 15 * r * r * r / 8) / (big * math.sqrt(math.pi))
    return jnp.where(x > 8, asym, jsp.erfcx(jnp.minimum(x, 8.0)))


def _unary(fn):
    def rule(self):
        x, dt = _f(self)
        return fn(x).astype(dt)

    return rule


for _ops, _fn in (
    ((aten.special_bessel_j0.default, prims.bessel_j0.default), lambda x: _j(0, x)),
    ((aten.special_bessel_j1.default, prims.bessel_j1.default), lambda x: _j(1, x)),
    ((aten.special_bessel_y0.default,), lambda x: _y(0, x)),
    ((aten.special_bessel_y1.default,), lambda x: _y(1, x)),
    ((aten.special_modified_bessel_k0.default,), lambda x: _k_scaled(0, x) * jnp.exp(-x)),
    ((aten.special_modified_bessel_k1.default,), lambda x: _k_scaled(1, x) * jnp.exp(-x)),
    ((aten.special_scaled_modified_bessel_k0.default,), lambda x: _k_scaled(0, x)),
    ((aten.special_scaled_modified_bessel_k1.default,), lambda x: _k_scaled(1, x)),
    ((aten.special_airy_ai.default,), _airy_ai),
    ((aten.special_modified_bessel_i0.default,), jsp.i0),
    ((aten.special_modified_bessel_i1.default, prims.bessel_i1.default), jsp.i1),
    ((prims.bessel_i0e.default,), jsp.i0e),
    ((prims.bessel_i1e.default,), jsp.i1e),
    ((prims.erfcx.default,), _erfcx),
    ((prims.ndtri.default,), jsp.ndtri),
):
    register(*_ops)(_unary(_fn))
