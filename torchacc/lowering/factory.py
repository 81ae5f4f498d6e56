"""Factories and random ops.

Factories use ``out_meta=True``: the output shape and dtype come from PyTorch's meta kernel
(``out=[(shape, dtype)]``), so dtype defaults and ``*_like``/``new_*`` rules need no re-deriving.
``empty*`` produce zeros. ``layout``/``device``/``pin_memory``/``memory_format``/``generator`` are
accepted and ignored (the core owns placement; randomness comes from ``rng``).

Random ops use ``rng=True`` and draw from the JAX key the core threads through the step; results
follow torch's distributions but not its bit streams.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchacc.lowering.pointwise import cast, is_floating, opmath_dtype
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _meta(out):
    shape, dtype = out[0]
    return tuple(shape), np.dtype(dtype)


def _filled(value, out):
    shape, dt = _meta(out)
    return jnp.broadcast_to(cast(value, dt), shape)


# ----------------------------------------------------------------------------------------------
# Deterministic factories


@register(
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
    aten.zeros.default,
    aten.zeros_like.default,
    aten.new_zeros.default,
    aten.zero.default,
    aten._efficientzerotensor.default,
    out_meta=True,
)
def zeros(*_args, out, **_kwargs):
    return _filled(0, out)


@register(aten.ones.default, aten.ones_like.default, aten.new_ones.default, out_meta=True)
def ones(*_args, out, **_kwargs):
    return _filled(1, out)


@register(
    aten.full.default, aten.full_like.default, aten.fill.Scalar, aten.fill.Tensor, out_meta=True
)
def full(_size_or_self, fill_value, *, out, **_kwargs):
    return _filled(fill_value, out)


@register(aten.new_full.default, out_meta=True)
def new_full(self, size, fill_value, *, out, **_kwargs):
    return _filled(fill_value, out)


@register(aten.scalar_tensor.default, out_meta=True)
def scalar_tensor(s, *, out, **_kwargs):
    return _filled(s, out)


@register(
    aten.arange.default,
    aten.arange.start,
    aten.arange.start_step,
    static=("start", "end", "step"),
    out_meta=True,
)
def arange(start, end=None, step=1, *, out, **_kwargs):
    """``start``/``end``/``step`` are static: they decide the length. Values as torch's CPU
    kernel: ``start + i * step`` in double (int64 for integer dtypes), then cast."""
    if end is None:
        start, end = 0, start
    shape, dt = _meta(out)
    if is_floating(dt) or any(isinstance(v, float) for v in (start, step)):
        i = jnp.arange(shape[0], dtype=jnp.float64)
        return (float(start) + i * float(step)).astype(dt)
    return (start + jnp.arange(shape[0], dtype=jnp.int64) * step).astype(dt)


@register(
    aten.linspace.default,
    aten.linspace.Tensor_Tensor,
    aten.linspace.Tensor_Scalar,
    aten.linspace.Scalar_Tensor,
    out_meta=True,
)
def linspace(start, end, steps, *, out, **_kwargs):
    """torch's CPU kernel: in the result dtype (double for integers), ends read in the result
    dtype, the two halves filled from either end."""
    shape, dt = _meta(out)
    n = shape[0]
    ct = dt if is_floating(dt) else np.dtype(np.float64)
    s = cast(cast(start, dt), ct)
    e = cast(cast(end, dt), ct)
    if n <= 1:
        return jnp.broadcast_to(s, shape).astype(dt)
    step = (e - s) / (n - 1)
    i = jnp.arange(n, dtype=ct)
    return jnp.where(i < n // 2, s + step * i, e - step * (n - 1 - i)).astype(dt)


@register(
    aten.logspace.default,
    aten.logspace.Tensor_Tensor,
    aten.logspace.Tensor_Scalar,
    aten.logspace.Scalar_Tensor,
    out_meta=True,
)
def logspace(start, end, steps, base=10.0, *, out, **_kwargs):
    shape, dt = _meta(out)
    n = shape[0]
    s = cast(start, jnp.float64)
    e = cast(end, jnp.float64)
    i = jnp.arange(n, dtype=jnp.float64)
    step = (e - s) / max(n - 1, 1)
    exponent = jnp.where(i < n // 2, s + step * i, e - step * (n - 1 - i))
    return jnp.power(cast(base, jnp.float64), exponent).astype(dt)


@register(aten.eye.default, aten.eye.m, out_meta=True)
def eye(n, m=None, *, out, **_kwargs):
    shape, dt = _meta(out)
    return jnp.eye(shape[0], shape[1], dtype=dt)


# ----------------------------------------------------------------------------------------------
# Random


def _uniform(rng, shape, dt):
    """U[0, 1) in a float dtype (halves drawn natively so rounding never reaches 1.0)."""
    dt = dt if is_floating(dt) else np.dtype(np.float32)
    return jax.random.uniform(rng, shape, dt)


@register(
    aten.rand.default,
    aten.rand.generator,
    aten.rand_like.default,
    aten.rand_like.generator,
    rng=True,
    out_meta=True,
)
def rand(*_args, out, rng, **_kwargs):
    shape, dt = _meta(out)
    return _uniform(rng, shape, dt).astype(dt)


@register(
    aten.randn.default,
    aten.randn.generator,
    aten.randn_like.default,
    aten.randn_like.generator,
    rng=True,
    out_meta=True,
)
def randn(*_args, out, rng, **_kwargs):
    shape, dt = _meta(out)
    return jax.random.normal(rng, shape, dt if is_floating(dt) else jnp.float32).astype(dt)


def _randint(rng, low, high, out):
    shape, dt = _meta(out)
    low = jnp.asarray(low).astype(jnp.int64)
    high = jnp.asarray(high).astype(jnp.int64)
    return jax.random.randint(rng, shape, low, high, dtype=jnp.int64).astype(dt)


@register(aten.randint.default, aten.randint.generator, rng=True, out_meta=True)
def randint(high, size, *, out, rng, **_kwargs):
    return _randint(rng, 0, high, out)


@register(aten.randint.low, aten.randint.low_generator, rng=True, out_meta=True)
def randint_low(low, high, size, *, out, rng, **_kwargs):
    return _randint(rng, low, high, out)


@register(
    aten.randint_like.default,
    aten.randint_like.Tensor,
    aten.randint_like.generator,
    aten.randint_like.Tensor_generator,
    rng=True,
    out_meta=True,
)
def randint_like(self, high, *, out, rng, **_kwargs):
    return _randint(rng, 0, high, out)


@register(
    aten.randint_like.low_dtype, aten.randint_like.low_generator_dtype, rng=True, out_meta=True
)
def randint_like_low(self, low, high, *, out, rng, **_kwargs):
    return _randint(rng, low, high, out)


@register(aten.randperm.default, aten.randperm.generator, rng=True, out_meta=True)
def randperm(n, *, out, rng, **_kwargs):
    shape, dt = _meta(out)
    return jax.random.permutation(rng, shape[0]).astype(dt)


def _bernoulli(rng, p, out):
    shape, dt = _meta(out)
    p = jnp.asarray(p)
    ct = opmath_dtype(p.dtype) if is_floating(p.dtype) else np.dtype(np.float32)
    u = jax.random.uniform(rng, shape, ct)
    return (u < jnp.broadcast_to(p.astype(ct), shape)).astype(dt)


@register(aten.bernoulli.default, rng=True, out_meta=True)
def bernoulli(self, *, out, rng, **_kwargs):
    return _bernoulli(rng, self, out)


@register(aten.bernoulli.p, aten.bernoulli.Tensor, rng=True, out_meta=True)
def bernoulli_p(self, p, *, out, rng, **_kwargs):
    return _bernoulli(rng, p, out)


def _float_sample(rng, out, fn):
    """``fn(key, shape, compute_dtype)`` in the output's opmath dtype, cast to the output."""
    shape, dt = _meta(out)
    ct = opmath_dtype(dt) if is_floating(dt) else np.dtype(np.float32)
    return fn(rng, shape, ct).astype(dt)


@register(aten.uniform.default, rng=True, out_meta=True)
def uniform(self, from_=0.0, to=1.0, *, out, rng, **kwargs):
    lo = kwargs.get("from", from_)
    return _float_sample(
        rng, out, lambda k, s, ct: cast(lo, ct) + (cast(to, ct) - cast(lo, ct)) * _uniform(k, s, ct)
    )


@register(aten.normal_functional.default, rng=True, out_meta=True)
def normal_functional(self, mean=0.0, std=1.0, *, out, rng, **_kwargs):
    return _float_sample(
        rng, out, lambda k, s, ct: cast(mean, ct) + cast(std, ct) * jax.random.normal(k, s, ct)
    )


@register(
    aten.normal.Tensor_float,
    aten.normal.float_Tensor,
    aten.normal.Tensor_Tensor,
    aten.normal.float_float,
    rng=True,
    out_meta=True,
)
def normal(mean=0.0, std=1.0, size=None, *, out, rng, **_kwargs):
    return normal_functional(None, mean, std, out=out, rng=rng)


@register(aten.exponential.default, rng=True, out_meta=True)
def exponential(self, lambd=1.0, *, out, rng, **_kwargs):
    return _float_sample(
        rng, out, lambda k, s, ct: jax.random.exponential(k, s, ct) / cast(lambd, ct)
    )


@register(aten.geometric.default, rng=True, out_meta=True)
def geometric(self, p, *, out, rng, **_kwargs):
    def sample(k, s, ct):
        u = jax.random.uniform(k, s, ct, minval=jnp.finfo(ct).tiny)
        return jnp.ceil(jnp.log(u) / jnp.log1p(-cast(p, ct)))

    return _float_sample(rng, out, sample)


@register(aten.cauchy.default, rng=True, out_meta=True)
def cauchy(self, median=0.0, sigma=1.0, *, out, rng, **_kwargs):
    return _float_sample(
        rng, out, lambda k, s, ct: cast(median, ct) + cast(sigma, ct) * jax.random.cauchy(k, s, ct)
    )


@register(aten.log_normal.default, rng=True, out_meta=True)
def log_normal(self, mean=1.0, std=2.0, *, out, rng, **_kwargs):
    return _float_sample(
        rng,
        out,
        lambda k, s, ct: jnp.exp(cast(mean, ct) + cast(std, ct) * jax.random.normal(k, s, ct)),
    )


def _random_upper(dt):
    """Exclusive upper bound of torch's ``random_()`` without ``to``."""
    if dt == np.bool_:
        return 2
    if is_floating(dt):
        return 2 ** (jnp.finfo(dt).nmant + 1) + 1  # [0, 2**digits] inclusive
    if dt.itemsize < 8:
        return int(jnp.iinfo(dt).max) + 1
    return None  # int64: the whole non-negative range


@register(
    aten.random.default, aten.random.to, getattr(aten.random, "from"), rng=True, out_meta=True
)
def random(self, *args, out, rng, **kwargs):
    """random(self), random.to(self, to), random.from(self, from, to): integers in [lo, hi)."""
    bounds = list(args) + [kwargs[k] for k in ("from", "to") if k in kwargs]
    lo, hi = (0, bounds[0] if bounds else None) if len(bounds) < 2 else bounds
    shape, dt = _meta(out)
    if hi is None:
        hi = _random_upper(dt)
    if hi is None:  # int64 up to its max
        if lo != 0:
            raise NotImplementedError("torchacc: random_(from, None) on int64")
        return (jax.random.bits(rng, shape, jnp.uint64) >> 1).astype(dt)
    if hi > 2**62 or lo < -(2**62):
        raise NotImplementedError("torchacc: random_ bounds beyond +-2**62")
    return jax.random.randint(rng, shape, lo, hi, dtype=jnp.int64).astype(dt)


@register(aten.multinomial.default, rng=True)
def multinomial(self, num_samples, replacement=False, *, rng, **_kwargs):
    """Category indices drawn with probability proportional to each row of ``self``: with
    replacement a categorical draw per sample, without it the Gumbel top-k trick (distinct
    categories, in the order drawn)."""
    logits = jnp.log(self.astype(jnp.float32))
    if replacement:
        shape = self.shape[:-1] + (num_samples,)
        draws = jax.random.categorical(rng, logits[..., None, :], axis=-1, shape=shape)
        return draws.astype(jnp.int64)
    keys = logits + jax.random.gumbel(rng, logits.shape, jnp.float32)
    return jax.lax.top_k(keys, num_samples)[1].astype(jnp.int64)


@register(aten.rrelu_with_noise_functional.default, rng=True)
def rrelu_with_noise_functional(
    self, noise, lower=0.125, upper=1 / 3, training=False, generator=None, *, rng
):
    """Randomized leaky ReLU: in training each negative element is scaled by a slope drawn
    uniformly from [lower, upper] (returned as the new ``noise``; 1 elsewhere); in evaluation by
    the fixed slope (lower + upper) / 2, ``noise`` unchanged."""
    x = self.astype(opmath_dtype(self.dtype))
    lo, hi = jnp.asarray(lower, x.dtype), jnp.asarray(upper, x.dtype)
    if not training:
        return jnp.where(x >= 0, x, x * (lo + hi) / 2).astype(self.dtype), noise
    slope = jax.random.uniform(rng, x.shape, x.dtype, minval=lo, maxval=hi)
    r = jnp.where(x >= 0, jnp.ones_like(x), slope)
    return (x * r).astype(self.dtype), r.astype(noise.dtype)
