"""``xs.Mesh`` and its kin for ``torch_xla.distributed.spmd`` on torchacc: a mesh of global device
ordinals with axis names (``Mesh``, ``HybridMesh`` for ICI x DCN shapes), its partition specs as
``OpSharding``, and the global mesh (``set_global_mesh``/``get_global_mesh``/``get_1d_mesh``).
The public names are ``xla_sharding``'s (``xs.Mesh``); this private module keeps that one short.
"""

from __future__ import annotations

import collections

import numpy as np

from torchacc import metrics
from torchacc.sharding import api as engine


def _device_count():
    return engine.device_count() if engine.is_spmd() else _one_per_process()


# how many devices a Mesh may hold: xla_sharding, the module that has always held _device_count,
# puts a lookup of its own name here (a callback: this module does not import it), so code that
# patches xla_sharding._device_count, as the compat tests do, still decides
_count_source = [_device_count]


def _job_device_count():
    return _count_source[0]()


def _one_per_process():
    from torchacc.torch_xla import runtime as xr

    return xr.world_size()


class OpSharding:
    """A partition spec over a mesh, as ``Mesh.get_op_sharding`` returns it."""

    def __init__(self, named_sharding):
        self.named_sharding = named_sharding

    def __repr__(self):
        return f"OpSharding({self.named_sharding})"


class MeshError(ValueError, AssertionError):
    """A bad mesh: a ``ValueError`` naming the problem (torch_xla raises ``AssertionError``)."""


class Mesh:
    """A logical mesh of the job's devices: global ordinals ``device_ids`` reshaped to
    ``mesh_shape`` (C order), with optional ``axis_names``. It must hold every device once."""

    def __init__(self, device_ids, mesh_shape, axis_names=None):
        device_ids = np.asarray(device_ids).reshape(-1)
        mesh_shape = tuple(int(d) for d in mesh_shape)
        count = _job_device_count()
        size = int(np.prod(mesh_shape))
        if axis_names is not None:
            axis_names = tuple(axis_names)
            if len(axis_names) != len(mesh_shape):
                raise MeshError(
                    f"Mesh: Number of axis names {axis_names} ({len(axis_names)}) must match "
                    f"mesh dimensions: mesh_shape {mesh_shape} has {len(mesh_shape)}"
                )
            if len(set(axis_names)) != len(axis_names):
                raise MeshError(f"Mesh: Axis names must be unique, got {axis_names}")
        if size != len(device_ids):
            raise MeshError(
                f"Mesh: Number of device IDs ({len(device_ids)}) must match mesh size: "
                f"mesh_shape {mesh_shape} holds {size} devices"
            )
        if len(device_ids) != count:
            raise MeshError(
                f"Mesh: {len(device_ids)} device ids {device_ids.tolist()} for mesh_shape "
                f"{mesh_shape}: Number of device IDs ({len(device_ids)}) must match the global "
                f"number of devices, and the job has {count} device(s)"
                + ("" if engine.is_spmd() else " (one per process: SPMD mode is off)")
            )
        if len(np.unique(device_ids)) != len(device_ids):
            raise MeshError(
                f"Mesh: Device IDs must be unique: repeated device ids in {device_ids.tolist()}"
            )
        if any(not 0 <= int(d) < count for d in device_ids):
            raise MeshError(
                f"Mesh: Device IDs must be less than mesh size ({count}) and not negative, got "
                f"{device_ids.tolist()}"
            )
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

    def _names(self):
        return self.axis_names or tuple(f"axis{i}" for i in range(len(self.mesh_shape)))

    def get_jax_mesh(self):
        """The same mesh as a ``jax.sharding.Mesh`` over the job's JAX devices."""
        return engine.jax_mesh(self.device_ids, self.mesh_shape, self._names())

    def named_sharding(self, partition_spec, shape, call="mark_sharding"):
        """The JAX ``NamedSharding`` of a tensor of ``shape`` split by ``partition_spec``."""
        spec = tuple(partition_spec)
        names = self._names()

        def name_of(axis):
            if isinstance(axis, int) and not isinstance(axis, bool) and 0 <= axis < len(names):
                return names[axis]
            return axis

        spec = tuple(
            None
            if e is None
            else tuple(name_of(a) for a in e)
            if isinstance(e, tuple)
            else name_of(e)
            for e in spec
        )
        try:
            key = (spec, len(shape))
            made = self.__dict__.setdefault("_made", {}).get(key)
        except TypeError:  # an unhashable entry: validated below, not kept
            key = made = None
        if made is not None:
            return made
        try:
            made = engine.named_sharding(self.get_jax_mesh(), spec, shape, call)
        except ValueError as e:
            raise ValueError(f"{e} (xs.Mesh {self})") from None
        if key is not None:  # one sharding per spec and rank, as torch_xla keeps per mesh
            self._made[key] = made
        metrics.counter_inc("CreateOpSharding")  # torch_xla's counter of shardings made
        return made

    def get_op_sharding(self, partition_spec):
        """torch_xla's OpSharding of ``partition_spec`` over this mesh: here an object holding
        the JAX ``NamedSharding`` (what ``_XLAC._global_tensor_from_cpu_shards`` takes)."""
        spec = tuple(partition_spec)
        return OpSharding(self.named_sharding(spec, (1,) * len(spec), "get_op_sharding"))

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


class HybridMesh(Mesh):
    """A mesh of ``ici_mesh_shape`` (the devices of one process, fast links) times
    ``dcn_mesh_shape`` (the processes, slower links): mesh axis ``i`` has
    ``ici_mesh_shape[i] * dcn_mesh_shape[i]`` devices, a block per process as in torch_xla's
    multislice meshes. On GPU and CPU a "slice" is a process."""

    def __init__(self, *, ici_mesh_shape, dcn_mesh_shape=None, axis_names=None):
        from torchacc.sharding import api as runtime_mesh

        ici = tuple(int(x) for x in ici_mesh_shape)
        dcn = tuple(int(x) for x in (dcn_mesh_shape or (1,) * len(ici)))
        if len(ici) != len(dcn):
            raise ValueError(f"HybridMesh: ici_mesh_shape {ici} and dcn_mesh_shape {dcn} differ")
        devices = runtime_mesh.devices()
        by_process = collections.defaultdict(list)
        for i, d in enumerate(devices):
            by_process[d.process_index].append(i)
        granules = [by_process[p] for p in sorted(by_process)]
        if int(np.prod(dcn)) != len(granules):
            raise ValueError(
                f"HybridMesh: dcn_mesh_shape {dcn} holds {int(np.prod(dcn))} processes, the "
                f"job has {len(granules)}"
            )
        if any(int(np.prod(ici)) != len(g) for g in granules):
            raise ValueError(
                f"HybridMesh: ici_mesh_shape {ici} holds {int(np.prod(ici))} devices, a process "
                f"has {[len(g) for g in granules]}"
            )
        self.ici_mesh_shape, self.dcn_mesh_shape = ici, dcn
        shape = tuple(a * b for a, b in zip(ici, dcn))
        grid = np.empty(shape, dtype=np.int64)
        per = [np.asarray(g).reshape(ici) for g in granules]
        which = np.arange(len(granules)).reshape(dcn)
        for index in np.ndindex(*shape):
            outer = tuple(i // n for i, n in zip(index, ici))
            inner = tuple(i % n for i, n in zip(index, ici))
            grid[index] = per[which[outer]][inner]
        super().__init__(grid.reshape(-1), shape, axis_names)


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
    count = _job_device_count()
    names = None if axis_name is None else (axis_name,)
    return Mesh(np.arange(count), (count,), names)
