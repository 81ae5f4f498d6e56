"""The sharding engine's recipes: parallelism policies written as shardings of a model's
parameters, for the front doors to apply. ``tensor_parallel``: Megatron's column-parallel
Linear layers (each Linear's output features split over the tensor-parallel axis, its input
features optionally over the FSDP axis); XLA's partitioner inserts every collective."""

from __future__ import annotations

import torch

from torchacc.sharding import api as sharding

__all__ = ["tensor_parallel"]


def tensor_parallel(model, mesh, tp_axis="tp", fsdp_axis=None, call="dist.tp"):
    """Split every ``nn.Linear`` of ``model`` column-parallel over ``mesh``'s ``tp_axis``: the
    weight's dim 0 (output features) over ``tp_axis`` and its dim 1 over ``fsdp_axis`` (None:
    replicated), the bias over ``tp_axis``. The parameters must be on the torchacc device in
    SPMD mode. Returns the layers it split."""
    done = []
    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            w = m.weight
            spec = (tp_axis, fsdp_axis)
            sharding.mark(w, sharding.named_sharding(mesh, spec, tuple(w.shape), call))
            if m.bias is not None:
                b = m.bias
                sharding.mark(b, sharding.named_sharding(mesh, (tp_axis,), tuple(b.shape)))
            done.append(m)
    return done
