"""Reductions, scans, sorting.

float16/bfloat16 inputs accumulate in float32 like torch (cast back at the end); integer and bool
sums/products accumulate in int64 (torch's result dtype). ``dim`` may be None, an int or a list;
for most reductions None and ``[]`` both mean "all dimensions" (``any``/``all.dims`` with ``[]``
reduce nothing, like torch).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering.dtypes import jdtype
from torchacc.lowering.pointwise import float_dtype, is_floating, opmath_dtype
from torchacc.lowering.registry import register

aten = torch.ops.aten


def dims(dim, ndim, empty_means_all=True):
    """Normalize ``dim`` (None, int or list) to a sorted tuple of non-negative axes."""
    if dim is None or (empty_means_all and isinstance(dim, (list, tuple)) and len(dim) == 0):
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    n = max(ndim, 1)
    return tuple(sorted({d % n for d in dim})) if ndim else ()


def _numel(shape, axes):
    return math.prod(shape[a] for a in axes)


def _accum_dtype(x, dtype):
    """Output dtype of sum/prod/cumsum: ``dtype`` if given, int64 for ints/bools, else x's."""
    if dtype is not None:
        return np.dtype(jdtype(dtype))
    return np.dtype(x.dtype) if is_floating(x.dtype) else np.dtype(jnp.int64)


def _reduce(fn, x, dim, keepdim, dtype):
    dt = _accum_dtype(x, dtype)
    axes = dims(dim, x.ndim)
    return fn(x.astype(dt).astype(opmath_dtype(dt)), axis=axes, keepdims=keepdim).astype(dt)


@register(aten.sum.default, aten.sum.dim_IntList)
def sum_(self, dim=None, keepdim=False, *, dtype=None):
    return _reduce(jnp.sum, self, dim, keepdim, dtype)


@register(aten.prod.default, aten.prod.dim_int)
def prod(self, dim=None, keepdim=False, *, dtype=None):
    return _reduce(jnp.prod, self, dim, keepdim, dtype)


@register(aten.mean.default, aten.mean.dim)
def mean(self, dim=None, keepdim=False, *, dtype=None):
    dt = np.dtype(jdtype(dtype)) if dtype is not None else float_dtype(self.dtype)
    axes = dims(dim, self.ndim)
    x = self.astype(dt).astype(opmath_dtype(dt))
    return (jnp.sum(x, axis=axes, keepdims=keepdim) / _numel(self.shape, axes)).astype(dt)


@register(aten.amax.default, aten.max.default)
def amax(self, dim=None, keepdim=False):
    return jnp.max(self, axis=dims(dim, self.ndim), keepdims=keepdim)


@register(aten.amin.default, aten.min.default)
def amin(self, dim=None, keepdim=False):
    return jnp.min(self, axis=dims(dim, self.ndim), keepdims=keepdim)


def _arg(fn, x, dim, keepdim):
    if dim is None:
        r = fn(x.reshape(-1), axis=0)
        return r.reshape((1,) * x.ndim) if keepdim else r
    if x.ndim == 0:
        return jnp.zeros((), jnp.int64)
    return fn(x, axis=dim, keepdims=keepdim)


@register(aten.argmax.default)
def argmax(self, dim=None, keepdim=False):
    return _arg(jnp.argmax, self, dim, keepdim).astype(jnp.int64)


@register(aten.argmin.default)
def argmin(self, dim=None, keepdim=False):
    return _arg(jnp.argmin, self, dim, keepdim).astype(jnp.int64)


def _value_index(arg_fn, x, dim, keepdim):
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = arg_fn(x, axis=dim, keepdims=True)
    values = jnp.take_along_axis(x, idx, axis=dim)
    if not keepdim:
        values, idx = jnp.squeeze(values, dim), jnp.squeeze(idx, dim)
    return values, idx.astype(jnp.int64)


@register(aten.max.dim)
def max_dim(self, dim, keepdim=False):
    return _value_index(jnp.argmax, self, dim, keepdim)


@register(aten.min.dim)
def min_dim(self, dim, keepdim=False):
    return _value_index(jnp.argmin, self, dim, keepdim)


@register(aten.aminmax.default)
def aminmax(self, *, dim=None, keepdim=False):
    return amin(self, dim, keepdim), amax(self, dim, keepdim)


def _var_mean(x, dim, correction, keepdim):
    """(var, mean) in x's float dtype; ``correction`` may be traced; divisor max(N - c, 0)."""
    dt = float_dtype(x.dtype)
    ct = opmath_dtype(dt)
    axes = dims(dim, x.ndim)
    xf = x.astype(ct)
    n = _numel(x.shape, axes)
    m = jnp.sum(xf, axis=axes, keepdims=True) / n
    d = xf - m
    ss = jnp.sum(d * d, axis=axes, keepdims=keepdim)
    c = 1 if correction is None else correction
    denom = jnp.maximum(jnp.asarray(n - c).astype(ct), 0)
    if not keepdim:
        m = jnp.squeeze(m, axes)
    return (ss / denom).astype(dt), m.astype(dt)


@register(aten.var.correction)
def var(self, dim=None, *, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)[0]


@register(aten.std.correction)
def std(self, dim=None, *, correction=None, keepdim=False):
    v = _var_mean(self, dim, correction, keepdim)[0]
    return jnp.sqrt(v.astype(opmath_dtype(v.dtype))).astype(v.dtype)


@register(aten.var_mean.correction)
def var_mean(self, dim=None, *, correction=None, keepdim=False):
    return _var_mean(self, dim, correction, keepdim)


@register(aten.std_mean.correction)
def std_mean(self, dim=None, *, correction=None, keepdim=False):
    v, m = _var_mean(self, dim, correction, keepdim)
    return jnp.sqrt(v.astype(opmath_dtype(v.dtype))).astype(v.dtype), m


def _vector_norm(x, ord, dim, keepdim, dtype):
    dt = np.dtype(jdtype(dtype)) if dtype is not None else float_dtype(x.dtype)
    ct = opmath_dtype(dt)
    axes = dims(dim, x.ndim)
    a = jnp.abs(x.astype(dt).astype(ct))
    ord = 2.0 if ord is None else float(ord)
    if ord == math.inf:
        r = jnp.max(a, axis=axes, keepdims=keepdim)
    elif ord == -math.inf:
        r = jnp.min(a, axis=axes, keepdims=keepdim)
    elif ord == 0:
        r = jnp.sum((a != 0).astype(ct), axis=axes, keepdims=keepdim)
    elif ord == 1:
        r = jnp.sum(a, axis=axes, keepdims=keepdim)
    elif ord == 2:
        r = jnp.sqrt(jnp.sum(a * a, axis=axes, keepdims=keepdim))
    else:
        p = np.asarray(ord, ct)
        r = jnp.sum(a**p, axis=axes, keepdims=keepdim) ** (1 / p)
    return r.astype(dt)


@register(aten.linalg_vector_norm.default, static=("ord",))
def linalg_vector_norm(self, ord=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(self, ord, dim, keepdim, dtype)


@register(
    aten.norm.Scalar,
    aten.norm.ScalarOpt_dim,
    aten.norm.ScalarOpt_dim_dtype,
    aten.norm.ScalarOpt_dtype,
    static=("p",),
)
def norm(self, p=2, dim=None, keepdim=False, *, dtype=None):
    return _vector_norm(self, p, dim, keepdim, dtype)


@register(aten.any.default, aten.any.dim, aten.any.dims)
def any_(self, dim=None, keepdim=False):
    return jnp.any(self != 0, axis=dims(dim, self.ndim, empty_means_all=False), keepdims=keepdim)


@register(aten.all.default, aten.all.dim, aten.all.dims)
def all_(self, dim=None, keepdim=False):
    return jnp.all(self != 0, axis=dims(dim, self.ndim, empty_means_all=False), keepdims=keepdim)


@register(aten.count_nonzero.default, aten.count_nonzero.dim_IntList)
def count_nonzero(self, dim=None):
    return jnp.sum(self != 0, axis=dims(dim, self.ndim), dtype=jnp.int64)


@register(aten.logsumexp.default)
def logsumexp(self, dim, keepdim=False):
    dt = float_dtype(self.dtype)
    x = self.astype(opmath_dtype(dt))
    axes = dims(dim, self.ndim)
    m = jnp.max(x, axis=axes, keepdims=True)
    m = jnp.where(jnp.isinf(m), 0, m)  # all -inf (or an inf): no shift, like torch
    r = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    return (r if keepdim else jnp.squeeze(r, axes)).astype(dt)


def _scan(fn, x, dim, dtype):
    dt = _accum_dtype(x, dtype)
    if x.ndim == 0:
        return x.astype(dt)
    return fn(x.astype(dt).astype(opmath_dtype(dt)), axis=dim).astype(dt)


@register(aten.cumsum.default)
def cumsum(self, dim, *, dtype=None):
    return _scan(jnp.cumsum, self, dim, dtype)


@register(aten.cumprod.default)
def cumprod(self, dim, *, dtype=None):
    return _scan(jnp.cumprod, self, dim, dtype)


def _cum_extreme(x, dim, better):
    """torch's cummax/cummin: ties and NaNs take the later index; NaN propagates."""
    if x.ndim == 0:
        return x, jnp.zeros((), jnp.int64)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, dim % x.ndim)

    def combine(a, b):
        (va, ia), (vb, ib) = a, b
        take_b = better(vb, va) | (vb == va)
        if is_floating(x.dtype):
            take_b = jnp.isnan(vb) | (~jnp.isnan(va) & take_b)
        return jnp.where(take_b, vb, va), jnp.where(take_b, ib, ia)

    return lax.associative_scan(combine, (x, idx), axis=dim % x.ndim)


@register(aten.cummax.default)
def cummax(self, dim):
    return _cum_extreme(self, dim, jnp.greater)


@register(aten.cummin.default)
def cummin(self, dim):
    return _cum_extreme(self, dim, jnp.less)


def _descending_key(x):
    """A key whose ascending order is x's descending order (bool/int: bitwise not)."""
    return -x if is_floating(x.dtype) else ~x


@register(aten.sort.default, aten.sort.stable)
def sort(self, dim=-1, descending=False, *, stable=None):
    """Always stable. NaNs sort as the largest values (last ascending, first descending)."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    x = jnp.moveaxis(self, dim, -1)
    idx = lax.broadcasted_iota(jnp.int64, x.shape, x.ndim - 1)
    if not descending:
        keys = (x,)  # lax.sort orders NaN last
    elif is_floating(x.dtype):
        keys = (~jnp.isnan(x), -x)
    else:
        keys = (_descending_key(x),)
    *_, values, indices = lax.sort(
        keys + (x, idx), dimension=x.ndim - 1, is_stable=True, num_keys=len(keys)
    )
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices, -1, dim)


@register(aten.topk.default)
def topk(self, k, dim=-1, largest=True, sorted=True):
    """lax.top_k (NaN counts as largest, like torch); ties keep the lower index."""
    if self.ndim == 0:
        return self, jnp.zeros((), jnp.int64)
    x = jnp.moveaxis(self, dim, -1)
    key = x.astype(jnp.int8) if x.dtype == jnp.bool_ else x
    if not largest:
        key = _descending_key(key)
        if is_floating(x.dtype):
            key = jnp.where(jnp.isnan(x), -jnp.inf, key)
    _, indices = lax.top_k(key, k)
    values = jnp.take_along_axis(x, indices, axis=-1)
    return jnp.moveaxis(values, -1, dim), jnp.moveaxis(indices.astype(jnp.int64), -1, dim)
