"""Sharding annotations inside a step: ``torchacc::shard`` -> ``jax.lax.with_sharding_constraint``.

Note [SPMD mode] (torchacc/runtime/mesh.py): ``mark_sharding`` of a tensor whose value is still
pending records this op; XLA's partitioner takes the constraint and propagates the rest. The
sharding travels as a static string (part of the op's structural key) naming a
``NamedSharding`` kept in ``SHARDINGS`` by whoever recorded it (``torchacc.distributed.sharding``).
"""

from __future__ import annotations

import jax
import torch

from torchacc.lowering.registry import register

_lib = torch.library.Library("torchacc", "FRAGMENT")
_lib.define("shard(Tensor x, str sharding) -> Tensor")
_lib.impl("shard", lambda x, sharding: torch.empty_like(x), "Meta")
shard_op = torch.ops.torchacc.shard.default

SHARDINGS: dict = {}  # name -> jax.sharding.NamedSharding


def name_sharding(sharding):
    """A stable static name for ``sharding`` (equal shardings get equal names)."""
    mesh = sharding.mesh
    devices = ",".join(str(d.id) for d in mesh.devices.flat)
    name = f"{mesh.devices.shape}{mesh.axis_names}[{devices}]{tuple(sharding.spec)}"
    SHARDINGS.setdefault(name, sharding)
    return name


@register(shard_op)
def shard(x, sharding):
    return jax.lax.with_sharding_constraint(x, SHARDINGS[sharding])
