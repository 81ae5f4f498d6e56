"""torch's DTensor vocabulary for ``xs``: an ``xla`` ``DeviceMesh`` read as an ``xs.Mesh`` and
DTensor placements (``Shard(d)``, ``Replicate()``) read as a partition spec. ``xla_sharding``'s
``xla_distribute_tensor`` / ``xla_distribute_module`` and ``spmd.api`` use them."""

from __future__ import annotations

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla.distributed.spmd._mesh import Mesh


def _as_mesh(mesh):
    """An ``xs.Mesh`` for ``mesh`` (an ``xs.Mesh``, or torch's ``DeviceMesh("xla", ...)``)."""
    grid = getattr(mesh, "mesh", None)
    if isinstance(grid, torch.Tensor) and getattr(mesh, "device_type", None) in (
        "xla",
        DEVICE_TYPE,
    ):
        return Mesh(grid.flatten().tolist(), tuple(grid.shape), mesh.mesh_dim_names)
    return mesh


def _entry(e):
    return e if isinstance(e, tuple) else (e,)


def _placement_spec(placements, ndim, call):
    """The partition spec of DTensor ``placements`` (one per mesh axis) for a rank-``ndim``
    tensor: ``Shard(d)`` on axis ``i`` splits dim ``d`` over axis ``i``."""
    from torch.distributed.tensor.placement_types import Replicate, Shard

    spec = [None] * ndim
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            if not -ndim <= p.dim < ndim:
                raise IndexError(f"{call}: {p} of a tensor of rank {ndim}")
            d = p.dim % ndim
            spec[d] = axis if spec[d] is None else (*_entry(spec[d]), axis)
        elif not isinstance(p, Replicate):
            raise NotImplementedError(f"{call}: placement {p} (only Shard and Replicate)")
    return tuple(spec)
