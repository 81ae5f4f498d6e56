"""``torch_xla.distributed.spmd.api`` on torchacc: torch's DTensor names mapped onto ``xs``
(a DeviceMesh to an ``xs.Mesh``, placements to a partition spec, ``distribute_tensor`` /
``distribute_module``). The sharding itself is ``xla_sharding``'s."""

from __future__ import annotations

from torchacc.torch_xla.distributed.spmd.xla_sharding import (
    Mesh,
    _placement_spec,
    auto_policy,
    xla_distribute_module,
    xla_distribute_tensor,
)

__all__ = [
    "auto_policy",
    "convert_to_xla_mesh",
    "convert_to_xla_partition_spec",
    "xla_distribute_module",
    "xla_distribute_tensor",
]


def convert_to_xla_mesh(dt_mesh):
    """The ``xs.Mesh`` of torch's ``DeviceMesh`` ``dt_mesh``: its device ids in order, its shape
    and dimension names. It must hold every device of the job (an ``AssertionError`` naming the
    counts otherwise, as torch_xla asserts)."""
    from torchacc.torch_xla import runtime as xr

    count = xr.global_runtime_device_count()
    if dt_mesh.size() != count:
        raise AssertionError(
            f"convert_to_xla_mesh: the DeviceMesh holds {dt_mesh.size()} devices, the job has "
            f"{count}"
        )
    grid = dt_mesh.mesh
    return Mesh(grid.flatten().tolist(), tuple(grid.shape), dt_mesh.mesh_dim_names)


def convert_to_xla_partition_spec(tensor, placements):
    """The partition spec (one entry per tensor dimension) of DTensor ``placements`` (one per
    mesh dimension): ``Shard(d)`` on mesh dimension ``i`` puts ``i`` at dimension ``d``."""
    return _placement_spec(placements, tensor.dim(), "convert_to_xla_partition_spec")
