"""Ops that only constrain how XLA schedules and reuses memory: ``torchacc::optimization_barrier``
and ``torchacc::checkpoint_fence``.

``jax.lax.optimization_barrier`` returns its operands unchanged, but XLA may not move a
computation across it nor merge a computation on its outputs with the same computation on its
inputs -- on XLA:GPU/TPU. XLA:CPU expands barriers away early in its pipeline, before common-
subexpression elimination, so there a barrier alone constrains nothing.

``checkpoint_fence(tensors, after)`` gives gradient checkpointing's recompute its inputs (Note
[Checkpointing that saves memory] in torchacc/lazy/checkpoint.py): ``tensors``' values, new to
XLA and computed only once ``after`` (the gradients reaching the block) exist. It is a barrier over
both lists, then a ``select`` of each tensor on a predicate XLA cannot fold, ``s != s & s == s``
for one element ``s`` of ``after`` (false for every value, NaN included): the outputs equal the
inputs bit for bit, on every platform, and the recompute can neither be merged back into the
forward nor run before backward reaches the block.

Note [Backward rules read fenced forward values]
A backward rule recomputes from what the forward saved: layer norm's normalized input from the
input, mean and rstd, GELU's tanh from its input, attention's probabilities from q, k and the
logsumexp, a linear layer's float32 copy of its input (XLA:CPU runs a weight gradient's dot in
float32). Left alone, XLA merges each recompute with the forward's identical computation (CSE)
or schedules it right after its forward inputs exist, so the forward's float32 intermediates --
larger than the values eager autograd saves -- stay alive from the forward to the backward: in
GPT-2 124M's bf16 step (batch 4, seq 256) the attention probabilities (float32 and bf16, 216
MB), GELU's float32 input and tanh (288 MB), layer norm's normalized inputs (75 MB) and the
float32 upcasts of the linear layers' inputs (258 MB). So those rules read their forward values
through ``fenced(saved, grads)``, a ``checkpoint_fence`` of the values on the incoming gradient:
the recompute happens in the backward, from the values eager saves too, and the forward's
intermediates die in the forward. The results are the same values bit for bit (the fence is an
identity XLA cannot see through); the cost is the recompute (elementwise math, and attention's
scores matmul, as flash attention does). Activation backwards fence a half input only: on a
float32 one the fence changed how XLA:CPU fuses the math (GELU's tanh), and so its last bits.
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
    # its first element by index: flattening a sharded tensor first would gather it whole
    s = anchor[0][(0,) * anchor[0].ndim]
    never = (s != s) & (s == s)
    return [jnp.where(never, _other(t), t) for t in tensors]


def fenced(saved, grads):
    """``saved`` (forward values a backward rule reads; None entries stay None) as new values
    computed once ``grads`` exist (Note [Backward rules read fenced forward values])."""
    keep = [i for i, t in enumerate(saved) if t is not None]
    anchor = [g for g in grads if g is not None]
    if not keep or not anchor:
        return list(saved)
    out = list(saved)
    for i, t in zip(keep, checkpoint_fence([saved[i] for i in keep], anchor)):
        out[i] = t
    return out


def _other(t):
    """Any value of ``t``'s shape and dtype other than ``t`` itself (the select's dead branch)."""
    return jnp.zeros_like(t) if t.dtype == jnp.bool_ else t + jnp.ones((), t.dtype)
