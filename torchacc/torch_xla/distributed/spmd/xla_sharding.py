"""``torch_xla.distributed.spmd`` on torchacc: meshes and sharding annotations, honestly.

torchacc runs one device per process (scale out with torchrun); it has no SPMD partitioner. So:

- a :class:`Mesh` over the job's devices (``xr.global_runtime_device_count()``: one per process)
  works, as do ``set_global_mesh``/``get_global_mesh``/``get_1d_mesh``;
- an annotation that replicates -- every tensor dimension ``None`` or mapped only to mesh axes of
  size 1 -- is accepted and remembered (``clear_sharding`` forgets it): it is what torchacc does
  anyway;
- an annotation that would split a tensor over several devices raises ``NotImplementedError``
  naming the call, the tensor's shape, the spec and the axis. Nothing pretends to shard.

``mark_sharding`` returns the tensor itself (torch_xla wraps it in an ``XLAShardedTensor``).
"""

from __future__ import annotations

import collections
import dataclasses
import enum

import numpy as np
import torch

from torchacc.torch_xla._api import differs, not_implemented, not_implemented_class

_NO_SPMD = (
    "torchacc has no SPMD partitioner (one device per process); run one process per device "
    "with torchrun and data parallelism (xm.all_reduce / the 'xla' process group) instead"
)


def _device_count():
    from torchacc.torch_xla import runtime as xr

    return xr.global_runtime_device_count()


class Mesh:
    """A logical mesh of the job's devices: ``device_ids`` reshaped to ``mesh_shape``.

    As in torch_xla the mesh must hold every device of the job exactly once; in torchacc that is
    one device per process, so in a single process the only mesh is of one device (any shape of
    ones, e.g. ``(1, 1)`` with axis names ``("fsdp", "tensor")``).
    """

    def __init__(self, device_ids, mesh_shape, axis_names=None):
        device_ids = np.asarray(device_ids).reshape(-1)
        mesh_shape = tuple(int(d) for d in mesh_shape)
        count = _device_count()
        if len(device_ids) != count:
            raise ValueError(
                f"Mesh: {len(device_ids)} device ids given, but the job has {count} device(s) "
                "(torchacc: one per process)"
            )
        if int(np.prod(mesh_shape)) != len(device_ids):
            raise ValueError(
                f"Mesh: mesh_shape {mesh_shape} holds {int(np.prod(mesh_shape))} devices, "
                f"not the {len(device_ids)} device ids given"
            )
        if len(np.unique(device_ids)) != len(device_ids) or any(
            not 0 <= int(d) < len(device_ids) for d in device_ids
        ):
            raise ValueError(f"Mesh: device ids must be 0..{len(device_ids) - 1}, got {device_ids}")
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(mesh_shape):
                raise ValueError(
                    f"Mesh: {len(axis_names)} axis names {axis_names} for a "
                    f"{len(mesh_shape)}-d mesh_shape {mesh_shape}"
                )
            if len(set(axis_names)) != len(axis_names):
                raise ValueError(f"Mesh: axis names must be unique, got {axis_names}")
        self.device_ids = device_ids
        self.mesh_shape = mesh_shape
        self.axis_names = axis_names

    def size(self):
        return int(np.prod(self.mesh_shape))

    def shape(self):
        names = self.axis_names if self.axis_names is not None else range(len(self.mesh_shape))
        return collections.OrderedDict(zip(names, self.mesh_shape))

    def get_logical_mesh(self):
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name):
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def get_jax_mesh(self):
        """The same mesh as a ``jax.sharding.Mesh`` over the job's JAX devices."""
        import jax

        import torchacc

        devices = jax.devices(torchacc.platform())
        names = self.axis_names or tuple(str(i) for i in range(len(self.mesh_shape)))
        grid = np.array([devices[int(i)] for i in self.device_ids], dtype=object)
        return jax.sharding.Mesh(grid.reshape(self.mesh_shape), names)

    def get_op_sharding(self, partition_spec):
        raise NotImplementedError(f"Mesh.get_op_sharding: XLA OpSharding objects: {_NO_SPMD}")

    def __str__(self):
        return (
            f"{{'device_ids': {self.device_ids.tolist()}, 'mesh_shape': {self.mesh_shape}, "
            f"'axis_names': {self.axis_names}}}"
        )

    __repr__ = __str__

    @classmethod
    def from_str(cls, mesh_str):
        """Parse :meth:`__str__`'s form back into a Mesh (None if it is not one)."""
        import ast

        try:
            d = ast.literal_eval(mesh_str.replace("Mesh", ""))
            return cls(d["device_ids"], d["mesh_shape"], d["axis_names"])
        except (ValueError, SyntaxError, KeyError, TypeError):
            return None


_global_mesh = [None]


def set_global_mesh(mesh):
    """Make ``mesh`` the process's global mesh (what ``get_global_mesh`` returns)."""
    if mesh is not None and not isinstance(mesh, Mesh):
        raise TypeError(f"set_global_mesh: expected a Mesh, got {type(mesh).__name__}")
    _global_mesh[0] = mesh


def get_global_mesh():
    return _global_mesh[0]


def get_1d_mesh(axis_name=None):
    """All the job's devices along one axis."""
    count = _device_count()
    names = None if axis_name is None else (axis_name,)
    return Mesh(np.arange(count), (count,), names)


class ShardingType(enum.IntEnum):
    """XLA's OpSharding types (torch_xla's numbering)."""

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


def _axis_index(mesh, axis, call, partition_spec):
    if isinstance(axis, bool) or not isinstance(axis, (int, str)):
        raise ValueError(
            f"{call}: partition spec entry {axis!r} in {partition_spec}: expected None, a mesh "
            "axis index or name, or a tuple of them"
        )
    if isinstance(axis, str):
        index = mesh.get_axis_name_idx(axis)
        if index is None:
            raise ValueError(f"{call}: axis name {axis!r} is not defined in the mesh {mesh}")
        return index
    if not 0 <= axis < len(mesh.mesh_shape):
        raise ValueError(f"{call}: mesh axis {axis} out of range for mesh {mesh}")
    return axis


def _check_replicated(call, t, mesh, partition_spec):
    """Validate ``partition_spec`` for ``t`` on ``mesh``; raise NotImplementedError if it would
    split ``t`` over more than one device."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"{call}: expected a Mesh, got {type(mesh).__name__}")
    partition_spec = tuple(partition_spec)
    if len(partition_spec) != len(t.shape):
        raise ValueError(
            f"{call}: partition spec {partition_spec} has {len(partition_spec)} entries for a "
            f"tensor of rank {len(t.shape)} (shape {tuple(t.shape)})"
        )
    for dim, entry in enumerate(partition_spec):
        if entry is None:
            continue
        for axis in entry if isinstance(entry, tuple) else (entry,):
            index = _axis_index(mesh, axis, call, partition_spec)
            if mesh.mesh_shape[index] > 1:
                raise NotImplementedError(
                    f"{call}: tensor of shape {tuple(t.shape)} with partition spec "
                    f"{partition_spec} would be split along dim {dim} over mesh axis {axis!r} "
                    f"of size {mesh.mesh_shape[index]}: {_NO_SPMD}. Replicated annotations "
                    "(None, or mesh axes of size 1) are accepted"
                )
    return partition_spec


_ANNOTATION = "_torchacc_sharding"  # (mesh, partition_spec) kept on the annotated tensor


def _annotate(call, t, mesh, partition_spec):
    spec = _check_replicated(call, t, mesh, partition_spec)
    setattr(t, _ANNOTATION, (mesh, spec))
    return t


@differs("replicated annotations only (sharding raises NotImplementedError); returns the tensor")
def mark_sharding(t, mesh, partition_spec):
    """Annotate ``t`` with ``partition_spec`` over ``mesh`` (replicated only; see module doc)."""
    return _annotate("xs.mark_sharding", t, mesh, partition_spec)


@differs("replicated annotations only (sharding raises NotImplementedError); returns the tensor")
def mark_sharding_with_gradients(t, mesh, partition_spec):
    return _annotate("xs.mark_sharding_with_gradients", t, mesh, partition_spec)


@differs("replicated annotations only (sharding raises NotImplementedError); returns the tensor")
def annotate_custom_sharding(t, mesh, partition_spec):
    return _annotate("xs.annotate_custom_sharding", t, mesh, partition_spec)


def clear_sharding(t):
    """Forget ``t``'s annotation; returns ``t``."""
    if hasattr(t, _ANNOTATION):
        delattr(t, _ANNOTATION)
    return t


def sharding_of(t):
    """``(mesh, partition_spec)`` that ``t`` was annotated with, or None (torchacc helper)."""
    return getattr(t, _ANNOTATION, None)


def wrap_if_sharded(x):
    """torch_xla wraps sharded tensors in ``XLAShardedTensor``; none is sharded here."""
    return x


def shard_as(a, b):
    """Both trees are replicated (torchacc shards nothing), so they are sharded alike as is."""
    return a, b


@dataclasses.dataclass
class ShardingSpec:
    """A mesh and a partition spec to apply to tensors (e.g. loader inputs); replicated only."""

    mesh: Mesh
    partition_spec: tuple
    minibatch: bool = False

    def can_apply(self, t):
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t):
        mark_sharding(t, self.mesh, self.partition_spec)

    def xla_spec(self, t):
        if not self.can_apply(t):
            return None
        _check_replicated("ShardingSpec.xla_spec", t, self.mesh, self.partition_spec)
        return None  # replicated: no sharding to send with the data


def xla_patched_nn_linear_forward(m, input):
    """torch_xla's einsum-based ``nn.Linear`` forward (to help its partitioner): a linear here."""
    return torch.nn.functional.linear(input, m.weight, m.bias)


class XLAPatchedLinear:
    """``XLAPatchedLinear.apply(input, weight, bias=None)``: the linear layer."""

    @staticmethod
    def apply(input, weight, bias=None):
        return torch.nn.functional.linear(input, weight, bias)


HybridMesh = not_implemented_class(
    "xs.HybridMesh", f"TPU ICI/DCN meshes over several hosts' devices: {_NO_SPMD}", bases=(Mesh,)
)
XLAShardedTensor = not_implemented_class(
    "xs.XLAShardedTensor", f"tensors split over devices: {_NO_SPMD}"
)
XLAShard = not_implemented_class("xs.XLAShard", f"shards of split tensors: {_NO_SPMD}")
enable_manual_sharding = not_implemented("xs.enable_manual_sharding", _NO_SPMD)
disable_manual_sharding = not_implemented("xs.disable_manual_sharding", _NO_SPMD)
_mark_manual_sharding = not_implemented("xs._mark_manual_sharding", _NO_SPMD)
apply_backward_optimization_barrier = not_implemented(
    "xs.apply_backward_optimization_barrier",
    "needs optimization barriers in the recorded backward, which torchacc does not record",
)
xla_distribute_tensor = not_implemented("xs.xla_distribute_tensor", _NO_SPMD)
xla_distribute_module = not_implemented("xs.xla_distribute_module", _NO_SPMD)
auto_policy = not_implemented("xs.auto_policy", _NO_SPMD)
