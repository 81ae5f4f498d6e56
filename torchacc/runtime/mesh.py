"""SPMD mode: the torchacc device as one virtual device over every device of the job.

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
  one records a ``with_sharding_constraint`` (``lowering/sharding.py``);
- a step's program is jitted with its inputs' shardings, and every result that overwrites a
  tensor's previous data keeps that data's sharding (``program/sharding.py``): parameters and
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
from torchacc.runtime.device import platform

DEFAULT_AXIS = "spmd"


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


def gather(array):
    """The whole of a global array as NumPy (all processes call this together when the array
    spans processes)."""
    if array.is_fully_addressable:
        return np.array(array)
    from jax.experimental import multihost_utils

    return np.array(multihost_utils.process_allgather(array, tiled=True))
