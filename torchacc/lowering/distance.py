"""Lowering rules for pairwise distances and products: ``cdist`` and ``pdist`` (p-norms of
differences), and ``_trilinear`` (bilinear's product). Half floats compute in float32 and round
once.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from torchacc.lowering.dtypes import opmath
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
