"""Pointwise ATen ops: arithmetic, comparisons, logic, unary math, activations and their backwards.

Type promotion follows PyTorch (see ``result_type``): tensors with dimensions outrank 0-d tensors,
which outrank wrapped numbers (Python numbers in a Tensor argument and every ``Scalar`` argument);
a lower tier only matters when it is of a higher category (bool < int < float < complex). Math runs
in the result dtype, or in float32 for float16/bfloat16 where torch's CPU kernels use float opmath
(arithmetic and transcendental functions); comparisons and selections stay in the result dtype.

The helpers here (``result_type``, ``scalar``, ``cast``) are shared by the other lowering files.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax

from torchacc.lowering import memory
from torchacc.lowering.dtypes import jdtype, opmath
from torchacc.lowering.registry import register

aten = torch.ops.aten

# ----------------------------------------------------------------------------------------------
# Promotion helpers


class Wrapped:
    """A ``Scalar`` argument (traced 0-d array or Python number): promotes like a wrapped number."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def scalar(value):
    """Mark a Scalar argument for ``result_type``; None stays None."""
    return None if value is None else Wrapped(value)


_PY_NUMBER = (bool, int, float, complex, np.number, np.bool_)


def _category(dtype):
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return 0
    if jnp.issubdtype(dtype, jnp.integer):
        return 1
    if jnp.issubdtype(dtype, jnp.floating):
        return 2
    return 3


def default_float():
    return np.dtype(jdtype(None))


def _complex_of(dtype):
    return np.dtype(jnp.complex128 if np.dtype(dtype) == np.float64 else jnp.complex64)


def _wrapped_dtype(v):
    """The dtype a wrapped number takes part in promotion with (torch's wrapped-number rule)."""
    if isinstance(v, Wrapped):
        v = v.value
    if isinstance(v, _PY_NUMBER):
        kind = np.asarray(v).dtype
    else:
        kind = np.dtype(v.dtype)
    cat = _category(kind)
    if cat == 0:
        return np.dtype(np.bool_)
    if cat == 1:
        return np.dtype(np.int64)
    if cat == 2:
        return default_float()
    return _complex_of(default_float())


def promote_types(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return np.dtype(jnp.promote_types(a, b))


def _combine(higher, lower):
    """c10's combine_categories: a lower tier wins only with a higher category."""
    if higher is None:
        return lower
    if lower is None:
        return higher
    ch, cl = _category(higher), _category(lower)
    if ch == 3:
        return higher
    if cl == 3:
        return _complex_of(higher) if ch == 2 else lower
    if ch == 2:
        return higher
    if ch == 0 or cl == 2:
        return promote_types(higher, lower)
    return higher


def result_type(*operands):
    """torch.result_type over jax arrays, Python numbers and ``Wrapped`` scalars (None skipped)."""
    tiers = [None, None, None]  # wrapped numbers, 0-d tensors, tensors with dimensions
    for v in operands:
        if v is None:
            continue
        if isinstance(v, (Wrapped,) + _PY_NUMBER):
            tier, dt = 0, _wrapped_dtype(v)
        else:
            tier, dt = (2 if jnp.ndim(v) else 1), np.dtype(v.dtype)
        tiers[tier] = promote_types(tiers[tier], dt)
    return _combine(tiers[2], _combine(tiers[1], tiers[0]))


def opmath_dtype(dtype):
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype in (jnp.float16, jnp.bfloat16) else dtype


def is_floating(dtype):
    return _category(dtype) >= 2


def cast(v, dtype):
    """Array, Python number or ``Wrapped`` -> jax array of ``dtype`` (None stays None)."""
    if v is None:
        return None
    if isinstance(v, Wrapped):
        v = v.value
    return jnp.asarray(v).astype(dtype)


def float_dtype(dtype):
    """The dtype torch computes a float-only op in: ints and bools go to the default float."""
    return np.dtype(dtype) if is_floating(dtype) else default_float()


def _is_scalar(v):
    return isinstance(v, (Wrapped,) + _PY_NUMBER) or jnp.ndim(v) == 0


def operand(v, dtype, keep_scalar=False):
    """``v`` as torch's CPU kernels see it in a ``dtype`` op: in ``dtype``, then upcast to opmath.

    Scalars (and 0-d tensors) are first rounded to ``dtype`` (torch wraps them as tensors of the
    common dtype), except where the kernel reads them at opmath precision (``keep_scalar``: mul,
    div, addcmul's value, lerp's weight, activation parameters).
    """
    ct = opmath_dtype(dtype)
    if keep_scalar and _is_scalar(v):
        return cast(v, ct)
    return cast(cast(v, dtype), ct)


def _binary(fn, *, math=True, out=None, keep_scalar=False):
    """Rule body: promote both operands, apply ``fn`` (in opmath when ``math``), cast back."""

    def rule(a, b):
        dt = result_type(a, b)
        if not math:
            return fn(cast(a, dt), cast(b, dt)).astype(out or dt)
        return fn(operand(a, dt, keep_scalar), operand(b, dt, keep_scalar)).astype(out or dt)

    return rule


def _unary_float(fn):
    """Float-only unary op: ints/bools compute in the default float, halves in float32."""

    def rule(self):
        dt = float_dtype(self.dtype)
        return fn(self.astype(opmath_dtype(dt))).astype(dt)

    return rule


# ----------------------------------------------------------------------------------------------
# Arithmetic


def _add(a, b, alpha, dt):
    b = operand(b, dt)
    if not (isinstance(alpha, _PY_NUMBER) and alpha == 1):
        b = b * operand(alpha, dt)
    return (operand(a, dt) + b).astype(dt)


@register(aten.add.Tensor, aten.add.Scalar)
def add(self, other, alpha=1):
    return _add(self, other, alpha, result_type(self, other))


def _negate(v):
    return Wrapped(-v.value) if isinstance(v, Wrapped) else -v


@register(aten.sub.Tensor, aten.sub.Scalar)
def sub(self, other, alpha=1):
    return _add(self, other, _negate(alpha), result_type(self, other))


@register(aten.rsub.Tensor, aten.rsub.Scalar)
def rsub(self, other, alpha=1):
    return _add(other, self, _negate(alpha), result_type(self, other))


register(aten.mul.Tensor, aten.mul.Scalar)(_binary(jnp.multiply, keep_scalar=True))


def _div_floor_float(a, b):
    # torch's div_floor_floating (matches Python's // on floats)
    mod = jnp.fmod(a, b)
    div = (a - mod) / b
    div = jnp.where((mod != 0) & ((b < 0) != (mod < 0)), div - 1, div)
    floordiv = jnp.floor(div)
    floordiv = jnp.where(div - floordiv > 0.5, floordiv + 1, floordiv)
    floordiv = jnp.where(div == 0, jnp.copysign(jnp.zeros_like(div), a / b), floordiv)
    return jnp.where(b == 0, a / b, floordiv)


def _divide(a, b, rounding_mode=None):
    dt = result_type(a, b)
    if rounding_mode is None:
        dt = float_dtype(dt)
    a, b = operand(a, dt, keep_scalar=True), operand(b, dt, keep_scalar=True)
    if rounding_mode is None:
        return (a / b).astype(dt)
    if rounding_mode == "trunc":
        r = jnp.trunc(a / b) if is_floating(dt) else lax.div(a, b)
    elif rounding_mode == "floor":
        r = _div_floor_float(a, b) if is_floating(dt) else jnp.floor_divide(a, b)
    else:
        raise ValueError(f"div: unknown rounding_mode {rounding_mode!r}")
    return r.astype(dt)


@register(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode)
def div(self, other, *, rounding_mode=None):
    return _divide(self, other, rounding_mode)


@register(aten.floor_divide.default, aten.floor_divide.Scalar)
def floor_divide(self, other):
    return _divide(self, other, "floor")


def _remainder(a, b):
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.remainder(a, b)
    mod = jnp.fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


register(aten.remainder.Tensor, aten.remainder.Scalar, aten.remainder.Scalar_Tensor)(
    _binary(_remainder)
)
register(aten.fmod.Tensor, aten.fmod.Scalar)(_binary(jnp.fmod))


@register(aten.pow.Tensor_Scalar, static=("exponent",))
def pow_tensor_scalar(self, exponent):
    dt = result_type(self, exponent)
    x = cast(self, opmath_dtype(dt))
    e = exponent
    if isinstance(e, _PY_NUMBER) and not isinstance(e, complex) and float(e).is_integer():
        n = int(e)
        if n == 0:
            return jnp.ones(self.shape, dt)
        if n < 0 and not is_floating(dt):
            raise ValueError("pow: integers to negative integer powers are not allowed")
        return lax.integer_pow(x, n).astype(dt)
    if isinstance(e, _PY_NUMBER) and e == 0.5:
        return jnp.sqrt(x).astype(dt)
    if isinstance(e, _PY_NUMBER) and e == -0.5:
        return lax.rsqrt(x).astype(dt)
    return jnp.power(x, operand(e, dt)).astype(dt)


register(aten.pow.Tensor_Tensor)(_binary(jnp.power))


@register(aten.pow.Scalar)
def pow_scalar(self, exponent):
    return _binary(jnp.power)(scalar(self), exponent)


@register(aten.addcmul.default)
def addcmul(self, tensor1, tensor2, *, value=1):
    dt = result_type(self, tensor1, tensor2)
    a, b, c, v = (operand(t, dt, keep_scalar=True) for t in (self, tensor1, tensor2, value))
    return (a + v * b * c).astype(dt)


@register(aten.addcdiv.default)
def addcdiv(self, tensor1, tensor2, *, value=1):
    dt = result_type(self, tensor1, tensor2)
    a, b, c, v = (operand(t, dt, keep_scalar=True) for t in (self, tensor1, tensor2, value))
    return (a + v * b / c).astype(dt)


@register(aten.lerp.Scalar, aten.lerp.Tensor)
def lerp(self, end, weight):
    dt = result_type(self, end)
    a, b = operand(self, dt), operand(end, dt)
    w = operand(weight, dt, keep_scalar=True)
    return jnp.where(jnp.abs(w) < 0.5, a + w * (b - a), b - (b - a) * (1 - w)).astype(dt)


# ----------------------------------------------------------------------------------------------
# Binary math, comparisons and logic (tables)


def _xlogy(x, y):
    return jnp.where(jnp.isnan(y), jnp.nan, jnp.where(x == 0, 0, x * jnp.log(y)))


def _float_binary(fn):
    def rule(a, b):
        dt = float_dtype(result_type(a, b))
        return fn(operand(a, dt), operand(b, dt)).astype(dt)

    return rule


_BINARY_FLOAT_OPS = {
    (aten.atan2.default,): jnp.arctan2,
    (aten.hypot.default,): jnp.hypot,
    (aten.logaddexp.default,): jnp.logaddexp,
    (aten.xlogy.Tensor, aten.xlogy.Scalar_Other, aten.xlogy.Scalar_Self): _xlogy,
}
for _ops, _fn in _BINARY_FLOAT_OPS.items():
    register(*_ops)(_float_binary(_fn))

_BINARY_SELECT_OPS = {  # exact in the result dtype
    (aten.maximum.default, aten.max.other): jnp.maximum,
    (aten.minimum.default, aten.min.other): jnp.minimum,
    (aten.fmax.default,): jnp.fmax,
    (aten.fmin.default,): jnp.fmin,
    (aten.bitwise_and.Tensor, aten.bitwise_and.Scalar, aten.bitwise_and.Scalar_Tensor): (
        jnp.bitwise_and
    ),
    (aten.bitwise_or.Tensor, aten.bitwise_or.Scalar, aten.bitwise_or.Scalar_Tensor): jnp.bitwise_or,
    (aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar, aten.bitwise_xor.Scalar_Tensor): (
        jnp.bitwise_xor
    ),
    (aten.__lshift__.Tensor, aten.__lshift__.Scalar, aten.bitwise_left_shift.Tensor): (
        jnp.left_shift
    ),
    (aten.__rshift__.Tensor, aten.__rshift__.Scalar, aten.bitwise_right_shift.Tensor): (
        jnp.right_shift
    ),
}
for _ops, _fn in _BINARY_SELECT_OPS.items():
    register(*_ops)(_binary(_fn, math=False))

_COMPARISONS = {
    "eq": jnp.equal,
    "ne": jnp.not_equal,
    "lt": jnp.less,
    "le": jnp.less_equal,
    "gt": jnp.greater,
    "ge": jnp.greater_equal,
}
for _name, _fn in _COMPARISONS.items():
    _packet = getattr(aten, _name)
    register(_packet.Tensor, _packet.Scalar)(_binary(_fn, math=False, out=jnp.bool_))

_LOGICAL = {
    "logical_and": jnp.logical_and,
    "logical_or": jnp.logical_or,
    "logical_xor": jnp.logical_xor,
}
for _name, _fn in _LOGICAL.items():
    register(getattr(aten, _name).default)(
        lambda a, b, _fn=_fn: _fn(jnp.asarray(a) != 0, jnp.asarray(b) != 0)
    )


@register(aten.logical_not.default)
def logical_not(self):
    return self == 0


@register(aten.bitwise_not.default)
def bitwise_not(self):
    return jnp.logical_not(self) if self.dtype == jnp.bool_ else jnp.bitwise_not(self)


# ----------------------------------------------------------------------------------------------
# Unary ops (tables)


def _erfinv(x):
    return lax.erf_inv(x)


_UNARY_FLOAT_OPS = {
    "exp": jnp.exp,
    "exp2": jnp.exp2,
    "log": jnp.log,
    "log2": jnp.log2,
    "log10": jnp.log10,
    "log1p": jnp.log1p,
    "expm1": jnp.expm1,
    "sqrt": jnp.sqrt,
    "rsqrt": lax.rsqrt,
    "reciprocal": jnp.reciprocal,
    "sin": jnp.sin,
    "cos": jnp.cos,
    "tan": jnp.tan,
    "asin": jnp.arcsin,
    "acos": jnp.arccos,
    "atan": jnp.arctan,
    "sinh": jnp.sinh,
    "cosh": jnp.cosh,
    "tanh": jnp.tanh,
    "asinh": jnp.arcsinh,
    "acosh": jnp.arccosh,
    "atanh": jnp.arctanh,
    "sigmoid": jax.nn.sigmoid,
    "erf": lax.erf,
    "erfc": lax.erfc,
    "erfinv": _erfinv,
    "lgamma": lax.lgamma,
    "digamma": lambda x: _digamma(x),
}
for _name, _fn in _UNARY_FLOAT_OPS.items():
    register(getattr(aten, _name).default)(_unary_float(_fn))


def _sign(x):
    """torch's sign: (0 < x) - (x < 0). NaN gives 0 (jnp.sign gives NaN) and -0.0 gives +0.0.
    Complex (``sgn``): z / |z|."""
    if x.dtype == jnp.bool_:
        return x
    if jnp.iscomplexobj(x):  # sgn: z / |z| (0 at 0), the gradient of abs
        mag = jnp.abs(x)
        return jnp.where(mag == 0, 0, x / jnp.where(mag == 0, 1, mag).astype(x.dtype))
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)


def _digamma(x):
    # torch (since 1.8): digamma(+0) = -inf and digamma(-0) = +inf, where lax.digamma gives NaN
    pole = jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x)
    return jnp.where(x == 0, pole, lax.digamma(x))


def _keep_ints(fn):
    """Rounding-like ops: identity on ints/bools, float math otherwise."""

    def rule(self):
        if not is_floating(self.dtype):
            return self
        return fn(opmath(self)).astype(self.dtype)

    return rule


_UNARY_SAME_DTYPE = {
    "floor": _keep_ints(jnp.floor),
    "ceil": _keep_ints(jnp.ceil),
    "round": _keep_ints(jnp.round),  # half to even, like torch/nearbyint
    "trunc": _keep_ints(jnp.trunc),
    "frac": _keep_ints(lambda x: x - jnp.trunc(x)),
    "neg": jnp.negative,
    "abs": lambda x: x if x.dtype == jnp.bool_ else jnp.abs(x),
    "sign": lambda x: _sign(x),
    "sgn": lambda x: _sign(x),
    "relu": lambda x: jnp.where(x < 0, jnp.zeros((), x.dtype), x),  # keeps -0.0 and NaN
}
for _name, _fn in _UNARY_SAME_DTYPE.items():
    register(getattr(aten, _name).default)(_fn)

_UNARY_PREDICATES = {
    "isnan": jnp.isnan,
    "isinf": jnp.isinf,
    "isposinf": jnp.isposinf,
    "isneginf": jnp.isneginf,
    "signbit": jnp.signbit,
}
for _name, _fn in _UNARY_PREDICATES.items():
    register(getattr(aten, _name).default)(
        lambda x, _fn=_fn: _fn(x) if is_floating(x.dtype) else _fn(x.astype(jnp.float32))
    )


@register(aten.round.decimals)
def round_decimals(self, *, decimals):
    if not is_floating(self.dtype):
        return self
    x = opmath(self)
    scale = np.asarray(10.0 ** abs(decimals), x.dtype)
    r = jnp.round(x / scale) * scale if decimals < 0 else jnp.round(x * scale) / scale
    return r.astype(self.dtype)


@register(aten.nan_to_num.default)
def nan_to_num(self, nan=None, posinf=None, neginf=None):
    if not is_floating(self.dtype):
        return self
    info = jnp.finfo(self.dtype)
    nan = jnp.zeros((), self.dtype) if nan is None else cast(nan, self.dtype)
    posinf = jnp.asarray(info.max, self.dtype) if posinf is None else cast(posinf, self.dtype)
    neginf = jnp.asarray(info.min, self.dtype) if neginf is None else cast(neginf, self.dtype)
    x = jnp.where(jnp.isnan(self), nan, self)
    return jnp.where(self == jnp.inf, posinf, jnp.where(self == -jnp.inf, neginf, x))


# ----------------------------------------------------------------------------------------------
# Selection, clamping, conversion, identities


@register(aten.where.self)
def where(condition, self, other):
    dt = result_type(self, other)
    return jnp.where(condition != 0, cast(self, dt), cast(other, dt))


def _clamp(x, lo, hi):
    dt = result_type(x, lo, hi)
    r = cast(x, dt)
    if lo is not None:
        r = jnp.maximum(r, cast(lo, dt))
    if hi is not None:
        r = jnp.minimum(r, cast(hi, dt))
    return r


@register(aten.clamp.default)
def clamp(self, min=None, max=None):
    return _clamp(self, scalar(min), scalar(max))


@register(aten.clamp.Tensor)
def clamp_tensor(self, min=None, max=None):
    return _clamp(self, min, max)


@register(aten.clamp_min.default)
def clamp_min(self, min):
    return _clamp(self, scalar(min), None)


@register(aten.clamp_min.Tensor)
def clamp_min_tensor(self, min):
    return _clamp(self, min, None)


@register(aten.clamp_max.default)
def clamp_max(self, max):
    return _clamp(self, None, scalar(max))


@register(aten.clamp_max.Tensor)
def clamp_max_tensor(self, max):
    return _clamp(self, None, max)


@register(aten.masked_fill.Scalar, aten.masked_fill.Tensor)
def masked_fill(self, mask, value):
    return jnp.where(mask != 0, cast(value, self.dtype), self)


@register(aten._to_copy.default)
def to_copy(self, *, dtype=None, **_placement):
    """dtype conversion only: device/layout/pin_memory/memory_format are the core's business."""
    if dtype is None:
        return self
    target = jdtype(dtype)
    if target == jnp.bool_:
        return self != 0
    return self.astype(target)


@register(aten.copy.default)
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(cast(src, self.dtype), self.shape)


@register(
    aten.clone.default,
    aten.alias.default,
    aten.alias_copy.default,
    aten.detach.default,
    aten.detach_copy.default,
    aten.lift_fresh.default,
    aten.lift_fresh_copy.default,
    aten.positive.default,
)
def identity(self, **_memory_format):
    return self


# ----------------------------------------------------------------------------------------------
# Activations (float math in opmath; Scalar parameters cast to the compute dtype)


def _activation(fn):
    """Rule body for ``fn(x, *params)`` on one float tensor and Scalar parameters."""

    def rule(self, *params, **kw):
        ct = opmath_dtype(self.dtype)
        ps = [cast(p, ct) for p in params]
        kws = {k: (v if isinstance(v, str) or v is None else cast(v, ct)) for k, v in kw.items()}
        return fn(self.astype(ct), *ps, **kws).astype(self.dtype)

    return rule


def _backward(fn):
    """Rule body for ``fn(grad, x, *params)``: grad and input in opmath, result in grad's dtype;
    a half ``x`` is read through a fence (Note [Backward rules read fenced forward values] in
    memory.py: its float32 upcast and what the forward computed from it would otherwise stay
    alive); a float32 one is not, which keeps XLA:CPU's fusion of the float32 math as it was."""

    def rule(grad_output, self, *params, **kw):
        dt = result_type(grad_output, self)
        ct = opmath_dtype(dt)
        if self.dtype != ct:
            (self,) = memory.fenced([self], [grad_output])
        ps = [p if isinstance(p, (bool, str)) or p is None else cast(p, ct) for p in params]
        return fn(cast(grad_output, ct), cast(self, ct), *ps, **kw).astype(dt)

    return rule


_SQRT1_2 = 0.7071067811865476
_SQRT_2_PI = 0.7978845608028654  # sqrt(2/pi)
_INV_SQRT_2PI = 0.3989422804014327  # 1/sqrt(2*pi)
_KAPPA = 0.044715


def _gelu(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + jnp.tanh(_SQRT_2_PI * (x + _KAPPA * x * x * x)))
    return 0.5 * x * (1 + lax.erf(x * _SQRT1_2))


def _gelu_backward(g, x, approximate="none"):
    if approximate == "tanh":
        inner = _SQRT_2_PI * (x + _KAPPA * x * x * x)
        t = jnp.tanh(inner)
        left_derivative = 0.5 * (1 + t)
        right_derivative = 0.5 * x * (1 - t * t) * _SQRT_2_PI * (1 + 3 * _KAPPA * x * x)
        return g * (left_derivative + right_derivative)
    cdf = 0.5 * (1 + lax.erf(x * _SQRT1_2))
    pdf = jnp.exp(-0.5 * x * x) * _INV_SQRT_2PI
    return g * (cdf + x * pdf)


def _elu(x, alpha=1.0, scale=1.0, input_scale=1.0):
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * (alpha * scale))


def _softplus(x, beta=1.0, threshold=20.0):
    return jnp.where(x * beta > threshold, x, jnp.log1p(jnp.exp(x * beta)) / beta)


def _hardsigmoid(x):
    return jnp.clip(x + 3, 0, 6) / 6


_ACTIVATIONS = {
    aten.gelu.default: _gelu,
    aten.silu.default: lambda x: x * jax.nn.sigmoid(x),
    aten.mish.default: lambda x: x * jnp.tanh(jax.nn.softplus(x)),
    aten.hardsigmoid.default: _hardsigmoid,
    aten.hardswish.default: lambda x: x * _hardsigmoid(x),
    aten.softplus.default: _softplus,
    aten.elu.default: _elu,
    aten.celu.default: lambda x, alpha=1.0: _elu(x, alpha, 1.0, 1.0 / alpha),
    aten.leaky_relu.default: lambda x, slope=0.01: jnp.where(x > 0, x, x * slope),
    aten.hardshrink.default: lambda x, lambd=0.5: jnp.where(jnp.abs(x) <= lambd, 0, x),
    aten.softshrink.default: lambda x, lambd=0.5: jnp.where(
        x > lambd, x - lambd, jnp.where(x < -lambd, x + lambd, 0)
    ),
}
for _op, _fn in _ACTIVATIONS.items():
    register(_op)(_activation(_fn))


@register(aten.logit.default)
def logit(self, eps=None):
    # torch's CPU kernel does this in the input dtype (no opmath), rounding after each step
    x = self if is_floating(self.dtype) else self.astype(default_float())
    if eps is not None:
        lo = cast(eps, x.dtype)
        x = jnp.clip(x, lo, 1 - lo)
    return jnp.log(x / (1 - x))


@register(aten.hardtanh.default)
def hardtanh(self, min_val=-1, max_val=1):
    return jnp.clip(self, cast(min_val, self.dtype), cast(max_val, self.dtype))


@register(aten.threshold.default)
def threshold(self, threshold, value):
    return jnp.where(self <= cast(threshold, self.dtype), cast(value, self.dtype), self)


@register(aten.glu.default)
def glu(self, dim=-1):
    a, b = jnp.split(opmath(self), 2, axis=dim)
    return (a * jax.nn.sigmoid(b)).astype(self.dtype)


@register(aten.log_sigmoid_forward.default)
def log_sigmoid_forward(self):
    x = opmath(self)
    z = jnp.exp(-jnp.abs(x))
    out = jnp.minimum(x, 0) - jnp.log1p(z)
    return out.astype(self.dtype), z.astype(self.dtype)


@register(aten.log_sigmoid_backward.default)
def log_sigmoid_backward(grad_output, self, buffer):
    # recomputes exp(-|x|) rather than trusting ``buffer`` (empty on CUDA)
    def fn(g, x):
        z = jnp.exp(-jnp.abs(x))
        neg = x < 0
        return g * (jnp.where(neg, 1.0, 0.0) - jnp.where(neg, 1.0, -1.0) * (z / (1 + z)))

    return _backward(fn)(grad_output, self)


def _silu_backward(g, x):
    s = jax.nn.sigmoid(x)
    return g * s * (1 + x * (1 - s))


def _mish_backward(g, x):
    s = jax.nn.sigmoid(x)
    t = jnp.tanh(jax.nn.softplus(x))
    return g * (t + x * s * (1 - t * t))


def _elu_backward(g, alpha, scale, input_scale, is_result, x):
    negcoef = alpha * scale
    if is_result:
        neg = g * input_scale * (x + negcoef)
    else:
        neg = g * input_scale * negcoef * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, neg, g * scale)


def _logit_backward(g, x, eps=None):
    d = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.nan, d)
    return jnp.where((x < eps) | (x > 1 - eps), 0, d)


def _softplus_backward(g, x, beta, threshold):
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


_BACKWARDS = {
    aten.threshold_backward.default: lambda g, x, t: jnp.where(x <= t, 0, g),
    aten.sigmoid_backward.default: lambda g, y: g * (1 - y) * y,
    aten.tanh_backward.default: lambda g, y: g * (1 - y * y),
    aten.gelu_backward.default: _gelu_backward,
    aten.silu_backward.default: _silu_backward,
    aten.mish_backward.default: _mish_backward,
    aten.leaky_relu_backward.default: lambda g, x, slope, is_result: jnp.where(x > 0, g, g * slope),
    aten.hardtanh_backward.default: lambda g, x, lo, hi: jnp.where((x <= lo) | (x >= hi), 0, g),
    aten.softplus_backward.default: _softplus_backward,
    # torch's kernel: 0 for x <= -3, the slope inside (-3, 3), the gradient for x >= 3
    aten.hardswish_backward.default: lambda g, x: jnp.where(
        x <= -3, 0, jnp.where(x < 3, g * (x / 3 + 0.5), g)
    ),
    aten.hardsigmoid_backward.default: lambda g, x: jnp.where((x > -3) & (x < 3), g / 6, 0),
    aten.logit_backward.default: _logit_backward,
}
for _op, _fn in _BACKWARDS.items():
    register(_op)(_backward(_fn))


@register(aten.elu_backward.default)
def elu_backward(grad_output, alpha, scale, input_scale, is_result, self_or_result):
    dt = result_type(grad_output, self_or_result)
    ct = opmath_dtype(dt)
    g, x = cast(grad_output, ct), cast(self_or_result, ct)
    a, s, i = (cast(v, ct) for v in (alpha, scale, input_scale))
    return _elu_backward(g, a, s, i, is_result, x).astype(dt)
