"""GradScaler's two device kernels as single nodes: unscale + inf/NaN check, and the scale update.

``torch._amp_foreach_non_finite_check_and_unscale_`` is recorded as one ``torchacc::amp_unscale``
node (ATen's functional twin returns a list and a tensor, which one node's outputs cannot describe;
ours returns one flat list), ``torch._amp_update_scale_`` as its ATen functional twin. The lazy
frontend writes the new values back into the op's arguments (``_multi_write_handler`` in
torchacc/lazy/mutation.py), so ``torch.amp.GradScaler`` on the device never reads a value on the
host for these kernels. Semantics follow PyTorch's CPU/CUDA kernels (AmpKernels):

- each gradient is multiplied by ``inv_scale`` in its compute type (float32 for half types) and
  cast back; ``found_inf`` becomes 1.0 if any element of any gradient is inf or NaN, and keeps its
  value otherwise (it is never reset to 0, so several calls accumulate);
- the scale update backs off on ``found_inf`` (tracker reset), else counts a successful step and
  grows the scale every ``growth_interval`` steps, keeping the old scale if the grown one is not
  finite; factors are applied in float64 and rounded once to float32, as the kernels do.

torchacc's GradScaler (torchacc/amp), ``torch.amp.GradScaler("torchacc")`` and any code calling the
kernels on the lazy device reach these rules; ``torchacc.compile_step`` traces the kernels as their
ATen twins instead (torchacc/lowering/amp_twins.py).
"""

from __future__ import annotations

import jax.numpy as jnp
import torch

from torchacc.lowering import custom_ops
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _compute_type(dtype):
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


@register(custom_ops.amp_unscale)
def amp_unscale(grads, found_inf, inv_scale):
    inv = jnp.reshape(inv_scale, ())
    out, finite = [], jnp.asarray(True)
    for g in grads:
        compute = _compute_type(g.dtype)
        finite = finite & jnp.all(jnp.isfinite(g))
        out.append((g.astype(compute) * inv.astype(compute)).astype(g.dtype))
    found = jnp.where(finite, found_inf, jnp.ones_like(found_inf))
    return [*out, found]


@register(aten._amp_update_scale.default)
def amp_update_scale(
    scale, growth_tracker, found_inf, scale_growth_factor, scale_backoff_factor, growth_interval
):
    found = jnp.reshape(found_inf, ()) != 0  # the kernels' ``if (*found_inf)``; all 1-element
    wide = scale.astype(jnp.float64)
    backed_off = (wide * scale_backoff_factor).astype(scale.dtype)
    grown = (wide * scale_growth_factor).astype(scale.dtype)
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = jnp.where(jnp.isfinite(grown), grown, scale)
    new_scale = jnp.where(found, backed_off, jnp.where(grow, grown, scale))
    zero = jnp.zeros_like(growth_tracker)
    new_tracker = jnp.where(found | grow, zero, successful.astype(growth_tracker.dtype))
    return new_scale, new_tracker
