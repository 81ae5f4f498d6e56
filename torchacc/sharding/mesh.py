"""The job-wide mesh (runtime stage of the one engine): SPMD mode's state, the engine mesh, the
process axis, and global uploads and gathers.

Note [One mesh] is in torchacc/sharding/__init__.py.

Note [SPMD mode]
``use_spmd()`` (torch_xla's ``xr.use_spmd()``) switches the process from "one device per
process" to torch_xla's SPMD model: the torchacc device stands for *all* devices of the job (the
local devices of every process, ``jax.devices()``), every array on it is a global ``jax.Array``
with a ``NamedSharding`` over a ``jax.sharding.Mesh``, and XLA's SPMD partitioner (through
``jax.jit``) splits each step's program over the devices. torchacc itself has no partitioner,
inserts no collective and moves no shard by hand:

- data uploaded to the device is replicated over the *engine mesh* (the mesh of the last
  sharding annotation, else every device along one axis ``"spmd"``);
- ``mark_sharding`` of a computed tensor reshards its array (``jax.device_put``), of a pending
  one records a ``with_sharding_constraint`` (``sharding/rules.py``);
- a step's program is jitted with its inputs' shardings, and every result that overwrites a
  tensor's previous data keeps that data's sharding (``sharding/layout.py``): parameters and
  optimizer state stay sharded across steps and the program compiles once;
- reading a sharded array gathers it (across processes with ``process_allgather``).

Packed state (Note [Packed state] in program/pack.py) is off in SPMD mode: a pack concatenates
tensors, which would erase their shardings.

Several processes (torchrun, the launcher) form one global mesh: each process joins the JAX
multi-process runtime with all its local devices (``local_device_ids=None``), so 1 process x 4
devices and 2 processes x 2 devices are the same program. On a CPU machine the local device
count comes from ``CPU_NUM_DEVICES`` (torch_xla's variable, with ``PJRT_DEVICE=CPU``) or XLA's
``--xla_force_host_platform_device_count`` (``torchacc/_jaxconfig.py``).
"""

from __future__ import annotations

import threading

import jax
import numpy as np

from torchacc.runtime import processes
from torchacc.runtime.device import jax_device, platform

DEFAULT_AXIS = "spmd"
PROCESS_AXIS = processes.AXIS  # "process": the axis of the job-wide mesh that runs along processes


class _State:
    __slots__ = ("on", "mesh", "replicated")

    def __init__(self):
        self.on = False
        self.mesh = None  # the engine mesh (jax.sharding.Mesh), None: the default one
        self.replicated = None  # NamedSharding(mesh, P()) of the engine mesh


_state = _State()
_state.on = processes.wants_all_local_devices()  # XLA_USE_SPMD=1 before the script starts
_lock = threading.Lock()


def enable():
    """Switch SPMD mode on (idempotent)."""
    _state.on = True
    processes.all_local_devices[0] = True


def is_spmd():
    """Whether SPMD mode is on (``use_spmd()``, or torch_xla's ``XLA_USE_SPMD=1``)."""
    return _state.on


def devices():
    """Every device of the job on torchacc's platform, ordered by id."""
    return sorted(jax.devices(platform()), key=lambda d: d.id)


def local_devices():
    return sorted(jax.local_devices(backend=platform()), key=lambda d: d.id)


def default_mesh():
    return jax.sharding.Mesh(np.array(devices(), dtype=object), (DEFAULT_AXIS,))


def engine_mesh():
    """The mesh replicated data lives on (see the Note)."""
    if _state.mesh is None:
        with _lock:
            if _state.mesh is None:
                _set_mesh(default_mesh())
    return _state.mesh


def _set_mesh(mesh):
    from jax.sharding import NamedSharding, PartitionSpec

    _state.mesh = mesh
    _state.replicated = NamedSharding(mesh, PartitionSpec())


def adopt_mesh(mesh):
    """Make ``mesh`` (a jax Mesh over every device) the engine mesh."""
    if engine_mesh() != mesh:
        _set_mesh(mesh)


def replicated():
    """``NamedSharding`` replicating an array over the engine mesh."""
    engine_mesh()
    return _state.replicated


def same_devices(a, b):
    """Whether two meshes hold the same devices in the same order (JAX can mix their arrays)."""
    return a is b or list(a.devices.flat) == list(b.devices.flat)


def put(host, sharding=None):
    """A global array of the NumPy array ``host`` laid out by ``sharding`` (default: replicated
    over the engine mesh); every process passes the same data."""
    sharding = sharding or replicated()
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def put_local(host, sharding):
    """The global array whose dimension 0 is every process's ``host`` (this process's share, the
    same shape on each) laid out by ``sharding`` (Note [Per-process batches] in
    torchacc/sharding/data.py)."""
    if host.ndim == 0 or sharding.is_fully_replicated:  # the same data on every process
        return put(host, sharding)
    procs = processes.world_size()
    global_shape = (host.shape[0] * procs, *host.shape[1:])
    _check_splits(host.shape, global_shape, sharding)
    return jax.make_array_from_process_local_data(sharding, host, global_shape)


def _check_splits(local, global_shape, sharding):
    """A ``ValueError`` where a process's share cannot be laid out as ``sharding``."""
    sizes = dict(sharding.mesh.shape)
    spec = tuple(sharding.spec) + (None,) * (len(local) - len(sharding.spec))
    for dim, (n, entry) in enumerate(zip(global_shape, spec)):
        k = 1
        for axis in () if entry is None else entry if isinstance(entry, tuple) else (entry,):
            k *= sizes[axis]
        if n % k:
            raise ValueError(
                f"torchacc: a per-process batch tensor of local shape {tuple(local)} (global "
                f"{tuple(global_shape)} over {processes.world_size()} processes) cannot be split "
                f"as {sharding.spec} over mesh {sizes}: dimension {dim} ({n}) is not a multiple "
                f"of {k}; make each process's batch size a multiple of its device count"
            )
    if spec[0] is None:
        raise ValueError(
            f"torchacc: a per-process batch tensor of local shape {tuple(local)} is laid out as "
            f"{sharding.spec}, which does not split dimension 0 (the batch) over the processes"
        )


def batch_sharding(ndim, jmesh=None, axes=None):
    """``NamedSharding`` splitting dimension 0 of a rank-``ndim`` batch tensor over ``axes`` of
    ``jmesh`` (default: every axis of the engine mesh), the rest replicated."""
    from jax.sharding import NamedSharding, PartitionSpec

    jmesh = jmesh or engine_mesh()
    axes = tuple(jmesh.axis_names if axes is None else axes)
    if ndim == 0:
        return NamedSharding(jmesh, PartitionSpec())
    return NamedSharding(jmesh, PartitionSpec(axes if len(axes) > 1 else axes[0]))


def upload_bytes(shape, itemsize, sharding):
    """Bytes an upload of a global array of ``shape`` laid out by ``sharding`` sends to this
    process's devices."""
    shard = sharding.shard_shape(tuple(shape))
    n = len(sharding.addressable_devices)
    return int(np.prod(shard, dtype=np.int64)) * itemsize * n


def gather(array):
    """The whole of a global array as NumPy (all processes call this together when the array
    spans processes)."""
    if array.is_fully_addressable:
        return np.array(array)
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(array, tiled=True))


# --------------------------------------------------------------------------------------------
# the job-wide mesh: processes x local devices (Note [One mesh])

_job = [None]  # (mesh, replicated sharding) of the one-device-per-process job mesh


def job_devices():
    """The devices the torchacc device stands for, as a (processes, local devices) grid: every
    local device of every process in SPMD mode, else this process's one device (and one device
    of each other process, the lowest id, as its peers have chosen the same way)."""
    world = processes.world_size()
    if _state.on:
        rows = {}
        for d in devices():
            rows.setdefault(d.process_index, []).append(d)
    else:
        mine = jax_device()
        rows = {}
        for d in jax.devices(platform()):
            p = d.process_index
            if p == jax.process_index():
                rows[p] = [mine]
            elif p not in rows or d.id < rows[p][0].id:
                rows[p] = [d]
    if sorted(rows) != list(range(world)):
        raise RuntimeError(
            f"torchacc: expected devices of {world} processes, JAX sees processes {sorted(rows)}"
        )
    widths = {len(r) for r in rows.values()}
    if len(widths) != 1:
        raise RuntimeError(
            "torchacc: every process must have the same number of devices for one job-wide mesh, "
            f"got { ({p: len(r) for p, r in sorted(rows.items())}) }"
        )
    return np.array([rows[p] for p in range(world)], dtype=object)


def job_mesh(axis_names=None):
    """The job-wide ``jax.sharding.Mesh``: processes x local devices. ``axis_names`` (two names)
    defaults to ``("process", "local")``."""
    names = tuple(axis_names or (PROCESS_AXIS, "local"))
    return jax.sharding.Mesh(job_devices(), names)


def process_mesh():
    """The mesh per-process code runs a manual region over: one device per process (this
    process's torchacc device), axis ``"process"``, ordered by rank."""
    if _job[0] is None:
        with processes._lock:
            if _job[0] is None:
                from jax.sharding import Mesh, NamedSharding, PartitionSpec

                m = Mesh(job_devices()[:, 0], (PROCESS_AXIS,))
                _job[0] = (m, NamedSharding(m, PartitionSpec()))
    return _job[0][0]


def process_replicated():
    process_mesh()
    return _job[0][1]


def process_axes(mesh):
    """The axes of ``mesh`` that run along processes: a manual region over them gives each
    process exactly its own devices. A ValueError when the mesh does not split by process."""
    import itertools

    names = mesh.axis_names
    grid = mesh.devices
    procs = {d.process_index for d in grid.flat}
    if len(procs) == 1:
        return ()
    for k in range(1, len(names) + 1):
        for axes in itertools.combinations(range(len(names)), k):
            rest = [i for i in range(len(names)) if i not in axes]
            moved = np.moveaxis(grid, list(axes), list(range(k))).reshape(
                int(np.prod([grid.shape[i] for i in axes])), -1
            )
            if rest and len(moved) != len(procs):
                continue
            if all(len({d.process_index for d in row}) == 1 for row in moved):
                return tuple(names[i] for i in axes)
    raise ValueError(
        f"torchacc: mesh {dict(mesh.shape)} has no axes that run along processes (each process's "
        "devices must be one block of the mesh for per-process code)"
    )
