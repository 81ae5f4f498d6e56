"""Ops that only constrain how XLA schedules and reuses memory: ``torchacc::optimization_barrier``
and ``torchacc::checkpoint_fence``.

``jax.lax.optimization_barrier`` returns its operands unchanged, but XLA may not move a
computation across it nor merge a computation on its outputs with the same computation on its
inputs -- on XLA:GPU/TPU. XLA:CPU expands barriers away early in its pipeline, before common-
subexpression elimination, so there a barrier alone constrains nothing.

``checkpoint_fence(tensors, after)`` gives gradient checkpointing's recompute its inputs (Note
[Checkpointing that saves memory] in torchacc/accel/checkpoint.py): ``tensors``' values, new to
XLA and computed only once ``after`` (the gradients reaching the block) exist. It is a barrier over
both lists, then a ``select`` of each tensor on a predicate XLA cannot fold, ``s != s & s == s``
for one element ``s`` of ``after`` (false for every value, NaN included): the outputs equal the
inputs bit for bit, on every platform, and the recompute can neither be merged back into the
forward nor run before backward reaches the block.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchacc.lowering import custom_ops
from torchacc.lowering.registry import register


@register(custom_ops.optimization_barrier)
def optimization_barrier(tensors):
    return list(jax.lax.optimization_barrier(tuple(tensors)))


@register(custom_ops.checkpoint_fence)
def checkpoint_fence(tensors, after):
    fenced = jax.lax.optimization_barrier((tuple(tensors), tuple(after)))
    tensors, after = fenced
    anchor = [a for a in (*after, *tensors) if a.size]
    if not anchor:
        return list(tensors)
    s = jnp.reshape(anchor[0], (-1,))[0]
    never = (s != s) & (s == s)
    return [jnp.where(never, _other(t), t) for t in tensors]


def _other(t):
    """Any value of ``t``'s shape and dtype other than ``t`` itself (the select's dead branch)."""
    return jnp.zeros_like(t) if t.dtype == jnp.bool_ else t + jnp.ones((), t.dtype)
