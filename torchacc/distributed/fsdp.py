"""Fully sharded data parallel (ZeRO-3) on the sharding engine: which dimension of each
parameter goes over the ``fsdp`` mesh axis, and the batch layout of a module's inputs/outputs.

XLA gathers each layer's parameters where the step uses them and reduce-scatters their gradients
(Note [SPMD mode] in torchacc/sharding/mesh.py); optimizer state follows its parameter's sharding.
Used by torch_xla's ``SpmdFullyShardedDataParallel`` and by ``accelerate``'s ``dist.fsdp``.
"""

from __future__ import annotations

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.sharding import api as engine


def parameter_spec(shape, axis="fsdp", maximal=False):
    """The partition spec of a parameter of ``shape``: dim 0 over ``axis`` (a dim the axis does
    not divide is padded: Note [Padded shards] in sharding/layout.py), or with ``maximal`` its
    largest dim (the first of equals), as torch_xla's FSDPv2 does."""
    if not shape:
        return ()
    spec = [None] * len(shape)
    spec[shape.index(max(shape)) if maximal else 0] = axis
    return tuple(spec)


def batch_spec(ndim, batch_axes):
    """Dim 0 (the batch) over ``batch_axes`` (one name or a tuple), the rest replicated."""
    if ndim == 0:
        return ()
    return (batch_axes, *([None] * (ndim - 1)))


def shard_parameters(module, jmesh, axis="fsdp", maximal=False):
    """Shard every parameter of ``module`` not sharded yet over ``axis`` of ``jmesh`` (its
    largest dim with ``maximal``, else dim 0)."""
    for p in module.parameters():
        s = engine.sharding_of(p)
        if s is not None and any(e is not None for e in s.spec):
            continue
        spec = parameter_spec(tuple(p.shape), axis, maximal)
        engine.mark(p, engine.named_sharding(jmesh, spec, tuple(p.shape), "fsdp"), "fsdp")


def shard_batch(t, jmesh, batch_axes):
    """Constrain tensor ``t`` to be split by batch (dim 0) over ``batch_axes``."""
    if isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE and t.dim() > 0:
        spec = batch_spec(t.dim(), batch_axes)
        engine.mark_spec(t, jmesh, spec, "fsdp output")
    return t
