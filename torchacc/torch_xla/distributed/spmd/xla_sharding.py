"""``torch_xla.distributed.spmd`` (``xs``) on torchacc: meshes and sharding annotations.

A thin translation into torchacc's sharding engine (``torchacc.distributed.sharding``; Note [SPMD
mode] in torchacc/sharding/mesh.py): a :class:`Mesh` names global device ordinals, a partition
spec becomes a JAX ``NamedSharding``, and XLA's SPMD partitioner splits each step. Call
``torch_xla.runtime.use_spmd()`` first. On a CPU machine ``PJRT_DEVICE=CPU CPU_NUM_DEVICES=4``
gives four devices.
"""

from __future__ import annotations

import dataclasses
import enum

import numpy as np
import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.sharding import api as engine
from torchacc.torch_xla._api import differs, not_implemented
from torchacc.torch_xla.distributed.spmd import _mesh as _mesh_module

# meshes (Mesh, HybridMesh, the global mesh) live in _mesh.py; xs.* names them from here
from torchacc.torch_xla.distributed.spmd._mesh import (  # noqa: F401
    HybridMesh,
    Mesh,
    MeshError,
    OpSharding,
    _device_count,
    _global_mesh,
    _one_per_process,
    get_1d_mesh,
    get_global_mesh,
    set_global_mesh,
    traced_sharding,
)

# torch's DTensor vocabulary (an xla DeviceMesh, placements) lives in _placements.py
from torchacc.torch_xla.distributed.spmd._placements import (  # noqa: F401
    _as_mesh,
    _entry,
    _placement_spec,
)

# a Mesh asks this module's _device_count at call time (Note in _mesh.py: _count_source)
_mesh_module._count_source[0] = lambda: _device_count()

_MANUAL = (
    "_mark_manual_sharding is not supported; use enable_manual_sharding / "
    "disable_manual_sharding or xs.shard_map(func, mesh, in_specs, out_specs)"
)


class ShardingType(enum.IntEnum):
    """XLA's OpSharding types (torch_xla's numbering)."""

    REPLICATED = 0
    MAXIMAL = 1
    TUPLE = 2
    TILED = 3
    MANUAL = 4
    PARTIAL = 5
    UNKNOWN = 6


class XLAShard:
    """One device's shard: ``data`` (a CPU copy), ``indices`` (a list of one ``slice`` per
    dimension into the global tensor, or ``Ellipsis`` for a replicated tensor), ``replica_id``
    and the device's ordinal."""

    def __init__(self, data, indices, replica_id, ordinal):
        self.data = data
        self.indices = indices
        self.replica_id = replica_id
        self.ordinal = ordinal

    @property
    def unpadded_data(self):
        return self.data

    def __repr__(self):
        return f"XLAShard(device={self.ordinal}, indices={self.indices}, replica={self.replica_id})"


class XLAShardedTensor(torch.Tensor):
    """What ``mark_sharding`` returns: the annotated tensor (``global_tensor``) and its shards.
    Used as a tensor it is its global tensor; a wrapper of a tensor that needs a gradient is
    differentiable (its gradient flows to ``global_tensor``); ``requires_grad=True`` makes a
    leaf."""

    @staticmethod
    def __new__(cls, global_tensor, *args, requires_grad=None, **kwargs):
        if requires_grad is None and global_tensor.requires_grad and torch.is_grad_enabled():
            r = _Wrap.apply(global_tensor)
            r.mesh_shape, r.partition_spec = kwargs.get("mesh_shape"), kwargs.get("partition_spec")
            return r
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            global_tensor.size(),
            strides=global_tensor.stride(),
            dtype=global_tensor.dtype,
            device=global_tensor.device,
            requires_grad=bool(requires_grad),
        )
        r.global_tensor = global_tensor
        r.mesh_shape, r.partition_spec = kwargs.get("mesh_shape"), kwargs.get("partition_spec")
        return r

    _cached_spec = None

    @property
    def _spec(self):
        """torch's ``DTensorSpec`` of this tensor (an ``xla`` DeviceMesh, its placements and
        tensor meta), from ``mesh_shape``/``partition_spec`` when given, else from its
        sharding; cached until ``invalidate_spec_cache()``."""
        if self._cached_spec is None:
            self._cached_spec = _dtensor_spec(self)
        return self._cached_spec

    def invalidate_spec_cache(self):
        self._cached_spec = None

    def redistribute(self, device_mesh=None, placements=None, **kwargs):
        """A new sharded tensor with this one's values laid out by DTensor ``placements`` over
        ``device_mesh`` (an ``xs.Mesh`` or an ``xla`` DeviceMesh; default: this one's)."""
        from torch.distributed.tensor.placement_types import Replicate

        mesh = _as_mesh(device_mesh) if device_mesh is not None else None
        mesh = _mesh_or_global(mesh, "XLAShardedTensor.redistribute")
        rank = len(mesh.mesh_shape)
        placements = list(placements) if placements is not None else [Replicate()] * rank
        if len(placements) != rank:
            raise ValueError(
                f"XLAShardedTensor.redistribute: {len(placements)} placements {placements} for a "
                f"{rank}-d mesh of shape {mesh.mesh_shape}"
            )
        spec = _placement_spec(placements, self.dim(), "XLAShardedTensor.redistribute")
        out = mark_sharding(self.global_tensor.clone(), mesh, spec)
        out.mesh_shape, out.partition_spec = mesh.mesh_shape, spec
        return out

    @property
    def placements(self):
        return self._spec.placements

    @property
    def device_mesh(self):
        return self._spec.mesh

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        import torch.utils._pytree as pytree

        unwrap = lambda x: x.global_tensor if isinstance(x, XLAShardedTensor) else x
        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(_wrap_result, out)

    @property
    def sharding_spec(self):
        return engine.hlo_text(engine.sharding_of(self.global_tensor), self.global_tensor.dim())

    @property
    def sharding_type(self):
        spec = self.sharding_spec
        if spec in ("", "{replicated}"):
            return ShardingType.REPLICATED
        return ShardingType.PARTIAL if "last_tile_dim_replicate" in spec else ShardingType.TILED

    @property
    def local_shards(self):
        replicated = self.sharding_type == ShardingType.REPLICATED
        local = engine.local_shards(self.global_tensor)
        if replicated:
            return [XLAShard(d, Ellipsis, r, o) for d, _, r, o in local]
        # (a shard past a dimension's end holds only its part, unpadded, unlike torch_xla's
        # zero-padded one: Note [Padded shards])
        shards = []
        for data, index, replica, ordinal in local:
            slices = [slice(i.start, i.stop, 1) for i in index]
            shards.append(XLAShard(data, slices, replica, ordinal))
        return shards

    def load_local_shards_(self, shards):
        """Replace this process's shards with ``shards`` (XLAShard objects as ``local_shards``
        gives, their ``data`` changed on the CPU), in place. The shards of every local device,
        each of its block's shape, of a tensor that is split (not replicated); a RuntimeError
        names what differs otherwise."""
        from torchacc.torch_xla import _XLAC

        call = "XLAShardedTensor.load_local_shards_"
        if self.sharding_type == ShardingType.REPLICATED:
            raise RuntimeError(f"{call}: the tensor is replicated; it has no shards to load")
        current = {s.ordinal: s for s in self.local_shards}
        given = {s.ordinal: s for s in shards}
        if sorted(given) != sorted(current):
            raise RuntimeError(
                f"{call}: shards of devices {sorted(given)} given, this process holds the shards "
                f"of devices {sorted(current)}"
            )
        for k, s in sorted(given.items()):
            if tuple(s.data.shape) != tuple(current[k].data.shape):
                raise RuntimeError(
                    f"{call}: the shard of device {k} has shape {tuple(s.data.shape)}, its block "
                    f"has shape {tuple(current[k].data.shape)}"
                )
        sharding = OpSharding(engine.sharding_of(self.global_tensor))
        data = [given[k].data.to(self.dtype) for k in sorted(given)]
        loaded = _XLAC._global_tensor_from_cpu_shards(data, sharding, tuple(self.shape))
        with torch.no_grad():
            self.global_tensor.copy_(loaded)
        return self

    def __repr__(self):
        return f"XLAShardedTensor({self.global_tensor!r}, sharding={self.sharding_spec})"


def _dtensor_spec(t):
    from torch.distributed.tensor import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor.placement_types import Replicate, Shard

    if t.mesh_shape is not None and t.partition_spec is not None:
        shape = tuple(t.mesh_shape)
        ids = list(range(int(np.prod(shape))))
        spec = [
            (e if isinstance(e, tuple) else (e,)) if e is not None else () for e in t.partition_spec
        ]
    else:
        named = engine.sharding_of(t.global_tensor)
        jmesh = getattr(named, "mesh", None)
        if jmesh is None:  # a CPU tensor, or a pending result no mark laid out
            # torch_xla's text, word for word: its users (and tests) match on it
            raise ValueError(
                "Placements not available: XLAShardedTensor requires mesh_shape and "
                "partition_spec to be set. Use mark_sharding() to properly initialize sharding "
                "information."
            )
        else:
            shape = tuple(jmesh.devices.shape)
            ids = [engine.ordinal(d) for d in jmesh.devices.flat]
            index = {name: i for i, name in enumerate(jmesh.axis_names)}
            spec = [
                tuple(index[a] for a in (e if isinstance(e, tuple) else (e,)))
                if e is not None
                else ()
                for e in named.spec
            ]
    placements = []
    for axis in range(len(shape)):
        dims = [d for d, axes in enumerate(spec) if axis in axes]
        placements.append(Shard(dims[0]) if dims else Replicate())
    mesh = DeviceMesh("xla", torch.tensor(ids).reshape(shape))
    meta = TensorMeta(t.shape, t.stride(), t.dtype)
    return DTensorSpec(mesh, tuple(placements), tensor_meta=meta)


def _wrap_result(x):
    """An op on a sharded tensor gives a sharded tensor, as torch_xla's does: on the device, or
    on the CPU (``.cpu()`` of a sharded tensor: its ``global_tensor`` is the host copy)."""
    if isinstance(x, torch.Tensor) and not isinstance(x, XLAShardedTensor):
        return XLAShardedTensor(x, requires_grad=False)
    return x


class _Wrap(torch.autograd.Function):
    """``XLAShardedTensor(t)`` for a ``t`` in an autograd graph: the wrapper keeps a grad_fn."""

    @staticmethod
    def forward(ctx, t):
        return XLAShardedTensor(t, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        return unwrap_sharded_tensor(grad)


def wrap_as_sharded_tensor(t, mesh_shape=None, partition_spec=None):
    """``t`` as an ``XLAShardedTensor``; ``mesh_shape``/``partition_spec`` (torch_xla's DTensor
    metadata) describe it for ``_spec`` (they do not move data)."""
    if not isinstance(t, XLAShardedTensor):
        return XLAShardedTensor(t, mesh_shape=mesh_shape, partition_spec=partition_spec)
    if mesh_shape is not None or partition_spec is not None:
        if mesh_shape is not None:
            t.mesh_shape = mesh_shape
        if partition_spec is not None:
            t.partition_spec = partition_spec
        t.invalidate_spec_cache()
    return t


def unwrap_sharded_tensor(t):
    return t.global_tensor if isinstance(t, XLAShardedTensor) else t


def _mesh_or_global(mesh, call):
    mesh = get_global_mesh() if mesh is None else _as_mesh(mesh)
    if not isinstance(mesh, Mesh):
        raise ValueError(f"{call}: expected an xs.Mesh (or a global mesh), got {mesh!r}")
    return mesh


def mark_sharding(t, mesh, partition_spec):
    """Shard ``t`` by ``partition_spec`` over ``mesh``: the layout of a parameter or input, or a
    sharding constraint on an activation (XLA propagates the rest). Returns an
    ``XLAShardedTensor``. Without SPMD mode only an annotation that splits nothing (every
    axis it names has size 1, e.g. HF Trainer's FSDPv2 mesh of one device) is accepted.
    Inside ``torch.compile``: a sharding constraint on ``t`` in the compiled graph (returns
    ``t``)."""
    if torch.compiler.is_dynamo_compiling():
        spec = tuple(partition_spec)
        return engine.constrain_traced(t, traced_sharding, mesh, spec, tuple(t.shape))
    t = unwrap_sharded_tensor(t)
    mesh = _mesh_or_global(mesh, "xs.mark_sharding")
    if not engine.is_spmd():
        mesh._check_unsplit("xs.mark_sharding", tuple(t.shape), partition_spec)
        return XLAShardedTensor(t)
    sharding = mesh.named_sharding(partition_spec, tuple(t.shape), "xs.mark_sharding")
    engine.mark(t, sharding, "xs.mark_sharding")
    return XLAShardedTensor(t)


class MarkShardingFunction(torch.autograd.Function):
    """``MarkShardingFunction.apply(t, mesh, partition_spec)``: ``t`` sharded by the spec, and
    its gradient sharded the same way in the backward pass (torch_xla's autograd-aware form of
    ``mark_sharding``). Returns a new tensor (the constrained value)."""

    @staticmethod
    def forward(ctx, t, mesh, partition_spec):
        ctx.mesh, ctx.partition_spec = mesh, partition_spec
        out = t.clone()
        mark_sharding(out, mesh, partition_spec)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        mark_sharding(grad, ctx.mesh, ctx.partition_spec)
        return grad, None, None


def mark_sharding_with_gradients(t, mesh, partition_spec):
    """``mark_sharding`` whose gradient is sharded the same way (returns the new tensor)."""
    mesh = _mesh_or_global(mesh, "xs.mark_sharding_with_gradients")
    if not engine.is_spmd():
        mesh._check_unsplit("xs.mark_sharding_with_gradients", tuple(t.shape), partition_spec)
        return t
    return MarkShardingFunction.apply(unwrap_sharded_tensor(t), mesh, partition_spec)


def annotate_custom_sharding(t, mesh, partition_spec):
    return mark_sharding(t, mesh, partition_spec)


def clear_sharding(t):
    """Drop ``t``'s sharding (its data is replicated again); returns the plain tensor."""
    t = unwrap_sharded_tensor(t)
    if engine.is_spmd():
        engine.clear(t)
    return t


def sharding_of(t):
    """The JAX ``NamedSharding`` of ``t``'s data, or None (torchacc helper)."""
    return engine.sharding_of(unwrap_sharded_tensor(t))


def wrap_if_sharded(x):
    if isinstance(x, torch.Tensor) and not isinstance(x, XLAShardedTensor):
        s = engine.sharding_of(x)
        if s is not None and engine.hlo_text(s, x.dim()) not in ("", "{replicated}"):
            return XLAShardedTensor(x)
    return x


def shard_as(a, b):
    raise NotImplementedError(
        "xs.shard_as: XLA's shard-as groups are not exposed through JAX; mark both with "
        "mark_sharding"
    )


@dataclasses.dataclass
class ShardingSpec:
    """A mesh and a partition spec to apply to tensors (e.g. a loader's inputs)."""

    mesh: Mesh
    partition_spec: tuple
    minibatch: bool = False

    def can_apply(self, t):
        return len(t.shape) == len(self.partition_spec)

    def apply(self, t):
        mark_sharding(t, self.mesh, self.partition_spec)

    def replicate(self, t):
        """Lay ``t`` out replicated over the mesh (a loader's tensor the spec does not fit)."""
        mark_sharding(t, self.mesh, (None,) * t.dim())

    def xla_spec(self, t):
        if not self.can_apply(t):
            return None
        return self.mesh.named_sharding(self.partition_spec, tuple(t.shape), "ShardingSpec")


def xla_patched_nn_linear_forward(m, input):
    """torch_xla's einsum-based ``nn.Linear`` forward (to help its partitioner): a linear here."""
    return torch.nn.functional.linear(input, m.weight, m.bias)


class XLAPatchedLinear:
    """``XLAPatchedLinear.apply(input, weight, bias=None)``: the linear layer."""

    @staticmethod
    def apply(input, weight, bias=None):
        return torch.nn.functional.linear(input, weight, bias)


@differs("returns the module unchanged: torchacc already lowers nn.Linear to one dot_general")
def apply_xla_patch_to_nn_linear(module):
    """torch_xla swaps each ``nn.Linear`` for an einsum-based one so that its partitioner sees
    one dot; torchacc's linear is one ``dot_general`` already, so ``module`` is returned as is."""
    return module


def xla_distribute_module(module, mesh=None, partition_fn=None, input_fn=None, output_fn=None):
    """Move ``module`` to the device; ``partition_fn(name, module, mesh)`` shards its
    parameters (as torch_xla); ``input_fn``/``output_fn`` become forward hooks. Those of torch's
    Colwise/Rowwise/SequenceParallel (``parallelize_module`` on an ``xla`` DeviceMesh) become
    layouts (``recipes.distribute_module``): no DTensor exists in SPMD mode."""
    import torchacc
    from torchacc.sharding import recipes

    given, call = mesh, "xs.xla_distribute_module"  # partition_fn gets the mesh it was given
    mesh = _mesh_or_global(_as_mesh(mesh), call)
    fns = (partition_fn, input_fn, output_fn, mesh if given is None else given, mesh)
    module = module.to(torchacc.device())
    return recipes.distribute_module(module, mesh.get_jax_mesh(), *fns, unwrap_sharded_tensor, call)


def xla_distribute_tensor(tensor, device_mesh, placements=None):
    """torch's ``distribute_tensor`` on an ``xla`` DeviceMesh: ``Shard(d)`` on mesh dim ``i``
    splits tensor dim ``d`` over mesh axis ``i``, ``Replicate()`` leaves it whole (a CPU tensor
    moves to the device first). Returns the ``XLAShardedTensor`` (a leaf when ``tensor`` needs
    a gradient, as torch_xla's)."""
    from torch.distributed.tensor.placement_types import Replicate

    mesh = _mesh_or_global(_as_mesh(device_mesh), "xs.xla_distribute_tensor")
    rank = len(mesh.mesh_shape)
    placements = list(placements) if placements is not None else [Replicate()] * rank
    if len(placements) != rank:
        raise ValueError(
            f"xs.xla_distribute_tensor: {len(placements)} placements {placements} for a "
            f"{rank}-d mesh of shape {mesh.mesh_shape}"
        )
    spec = _placement_spec(placements, tensor.dim(), "xs.xla_distribute_tensor")
    if tensor.device.type != DEVICE_TYPE:
        tensor = (
            tensor.detach().to(torch.device(DEVICE_TYPE, 0)).requires_grad_(tensor.requires_grad)
        )
    out = mark_sharding(unwrap_sharded_tensor(tensor), mesh, tuple(spec))
    if tensor.requires_grad:
        return XLAShardedTensor(out.global_tensor, requires_grad=True)
    return out


def _mark_manual_sharding(t):
    """torch_xla's low-level mark of a per-device block: here a block of an open manual region
    (``enable_manual_sharding`` / ``_XLAC._spmd_full_to_shard_shape``) is manual already, so it
    comes back as is; a tensor outside a region is a RuntimeError."""
    from torchacc.sharding import regions

    t = unwrap_sharded_tensor(t)
    if not regions.in_manual_region(t):
        raise RuntimeError(
            f"xs._mark_manual_sharding: the tensor of shape {tuple(t.shape)} is not a block of a "
            "manual region; begin one with xs.enable_manual_sharding (or "
            "_XLAC._spmd_full_to_shard_shape) and compute the tensor from its block"
        )
    return wrap_as_sharded_tensor(t)


def enable_manual_sharding(t, partition_spec, *, mesh=None):
    """``t``'s per-device block (an XLAShardedTensor of the block's shape): ops on it run per
    device up to ``disable_manual_sharding``, a manual region over ``mesh``'s axes."""
    from torchacc.sharding import regions

    mesh = _mesh_or_global(mesh, "xs.enable_manual_sharding")
    block = regions.enable_manual_sharding(unwrap_sharded_tensor(t), partition_spec, mesh)
    return wrap_as_sharded_tensor(block)


def disable_manual_sharding(t, partition_spec, full_shape, *, mesh=None):
    """The global tensor of ``full_shape`` made of the per-device blocks ``t`` (laid out by
    ``partition_spec``): the end of the manual region ``enable_manual_sharding`` began."""
    from torchacc.sharding import regions

    mesh = _mesh_or_global(mesh, "xs.disable_manual_sharding")
    full = regions.disable_manual_sharding(
        unwrap_sharded_tensor(t), partition_spec, full_shape, mesh
    )
    return wrap_as_sharded_tensor(full)


def shard_map(func, mesh, in_specs, out_specs):
    """``func`` as a manual region over every axis of ``mesh`` (torch_xla's ``xs.shard_map``,
    the same as ``custom_kernel._shard_map``); ``xm`` collectives inside run over its axes."""
    from torchacc.sharding import regions

    return regions.shard_map(func, _mesh_or_global(mesh, "xs.shard_map"), in_specs, out_specs)


apply_backward_optimization_barrier = not_implemented(
    "xs.apply_backward_optimization_barrier",
    "needs optimization barriers in the recorded backward, which torchacc does not record",
)
auto_policy = not_implemented(
    "xs.auto_policy", "XLA's auto-sharding pass is not exposed through JAX on CPU/GPU"
)
