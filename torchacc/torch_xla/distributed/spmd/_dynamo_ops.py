"""torch_xla's custom op for dynamo: ``torch.ops.xla.dynamo_mark_sharding`` (registered when
``torch_xla.distributed.spmd`` is imported).

``dynamo_mark_sharding(input, device_ids, mesh_shape, axis_names, partition_spec)`` is
``xs.mark_sharding(input, Mesh(device_ids, mesh_shape, eval(axis_names)), eval(partition_spec))``
with every argument a constant dynamo can keep in a graph (lists of ints and strings; the two
strings are Python literals, ``"('data', 'model')"``, ``"(1, 0)"``). Called eagerly it marks
``input`` like ``xs.mark_sharding``; inside ``torch.compile`` it is a sharding constraint in the
compiled graph (its kernel is CompositeImplicitAutograd, so AOTAutograd traces ``mark_sharding``
itself: Note [torch.compile over torchacc tensors] in torchacc/dynamo/device_tensors.py). It
returns ``input``. Off the torchacc device it does nothing, as in torch_xla.
"""

from __future__ import annotations

import ast

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla.distributed.spmd.xla_sharding import Mesh, mark_sharding

_lib = torch.library.Library("xla", "FRAGMENT")
_lib.define(
    "dynamo_mark_sharding(Tensor input, int[] device_ids, int[] mesh_shape, str axis_names, "
    "str partition_spec) -> Tensor"
)


def _dynamo_mark_sharding(input, device_ids, mesh_shape, axis_names, partition_spec):
    if input.device.type != DEVICE_TYPE:
        return input
    mesh = Mesh(list(device_ids), tuple(mesh_shape), ast.literal_eval(axis_names))
    mark_sharding(input, mesh, ast.literal_eval(partition_spec))
    return input


_lib.impl("dynamo_mark_sharding", _dynamo_mark_sharding, "CompositeImplicitAutograd")
