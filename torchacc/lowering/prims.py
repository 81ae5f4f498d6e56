"""``torch.ops.prims`` ops that PyTorch's reference decompositions (torch._refs) emit.

When an ATen op has no rule here, the recorder decomposes it with torch's own table, and several of
those decompositions bottom out in prims (``prims.where``, ``prims.abs``, ...). Prims do no type
promotion and no broadcasting of their own: the refs have already done both, so each rule is the
plain JAX function (math for half floats in float32, like the ATen rules).
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.special as jsp
import torch

from torchacc.lowering.dtypes import jdtype, opmath
from torchacc.lowering.registry import register

prims = torch.ops.prims


@register(prims.where.default)
def where(pred, a, b):
    return jnp.where(pred, a, b)


@register(prims.abs.default)
def abs_(self):
    return jnp.abs(self)


@register(prims.neg.default)
def neg(self):
    return jnp.negative(self)


@register(prims.signbit.default)
def signbit(self):
    return jnp.signbit(self)


@register(prims.convert_element_type.default)
def convert_element_type(a, dtype):
    return a.astype(jdtype(dtype))


@register(prims.nextafter.default)
def nextafter(self, other):
    return jnp.nextafter(self, other)


@register(prims.frexp.default)
def frexp(self):
    mantissa, exponent = jnp.frexp(self)
    return mantissa, exponent.astype(jnp.int32)


@register(prims.igamma.default)
def igamma(self, other):
    return jsp.gammainc(opmath(self), opmath(other)).astype(self.dtype)


@register(prims.igammac.default)
def igammac(self, other):
    return jsp.gammaincc(opmath(self), opmath(other)).astype(self.dtype)


@register(prims.bessel_i0.default)
def bessel_i0(self):
    return jsp.i0(opmath(self)).astype(self.dtype)
