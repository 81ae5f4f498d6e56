"""``hvd.init()`` and the job's shape: rank, size, local rank, nodes; the process group behind it.

``init()`` reads the launcher's environment: torchrun's (``RANK``, ``WORLD_SIZE``, ...), or
mpirun's (Open MPI, MPICH, Intel MPI; ``torchacc/mpi_env.py``), which it copies into torchrun's
variables so that the torchacc device's multi-process runtime joins the same job. With no launcher
the job is one process. A job of more than one process gets a ``torch.distributed`` process group
(gloo for CPU tensors, plus NCCL for CUDA tensors when CUDA is there) unless the script already
made one; the group also carries the host-side metadata of device collectives (Note [Horovod on
two paths] in ``torchacc/horovod/__init__.py``).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from torchacc import mpi_env
from torchacc.runtime import processes


class _State:
    __slots__ = ("initialized", "rank", "size", "local_rank", "local_size", "owns_group")

    def __init__(self):
        self.initialized = False
        self.rank, self.size, self.local_rank, self.local_size = 0, 1, 0, 1
        self.owns_group = False


_state = _State()


def _env_int(name, default):
    return processes.env_int(name, default, who="torchacc.horovod.init")


def _backend():
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init(comm=None, process_sets=None):
    """Join the job the launcher started (idempotent); a world of 1 without a launcher.

    ``comm`` and ``process_sets`` (Horovod's MPI communicator and process sets) are not
    supported: every collective runs over the whole job.
    """
    if comm is not None or process_sets is not None:
        raise NotImplementedError(
            "torchacc.horovod.init: comm= and process_sets= are not supported (collectives run "
            "over all processes of the job)"
        )
    if _state.initialized:
        return
    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
        _state.owns_group = False
    else:
        mpi_env.adopt()
        size = _env_int("WORLD_SIZE", 1)
        rank = _env_int("RANK", 0)
        if size > 1:
            if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
                raise RuntimeError(
                    f"torchacc.horovod.init: WORLD_SIZE={size} but MASTER_ADDR/MASTER_PORT are "
                    "not set; start the job with torchaccrun, mpirun or torchrun"
                )
            timeout = datetime.timedelta(seconds=_env_int("TORCHACC_HVD_TIMEOUT", 1800))
            dist.init_process_group(_backend(), rank=rank, world_size=size, timeout=timeout)
            _state.owns_group = True
    _state.rank, _state.size = rank, size
    _state.local_rank = _env_int("LOCAL_RANK", 0 if size == 1 else rank)
    _state.local_size = _env_int("LOCAL_WORLD_SIZE", 1 if size == 1 else size)
    _state.initialized = True


def shutdown():
    """Leave the job: destroys the process group ``init()`` made; ``is_initialized()`` is then
    False and ``init()`` may be called again."""
    if _state.owns_group and dist.is_initialized():
        dist.destroy_process_group()
    _state.owns_group = False
    _state.initialized = False


def is_initialized():
    return _state.initialized


def require(name):
    if not _state.initialized:
        raise ValueError(
            f"torchacc.horovod.{name}: Horovod has not been initialized; call hvd.init()"
        )


def size():
    """Number of processes in the job."""
    require("size")
    return _state.size


def rank():
    """This process's rank in the job."""
    require("rank")
    return _state.rank


def local_rank():
    """This process's rank on its node (its device index there)."""
    require("local_rank")
    return _state.local_rank


def local_size():
    """Processes on this node."""
    require("local_size")
    return _state.local_size


def cross_size():
    """Number of nodes (processes with the same local rank)."""
    require("cross_size")
    return max(_state.size // max(_state.local_size, 1), 1)


def cross_rank():
    """This process's node index."""
    require("cross_rank")
    return _state.rank // max(_state.local_size, 1)


def is_homogeneous():
    require("is_homogeneous")
    return _state.size % max(_state.local_size, 1) == 0


def mpi_threads_supported():
    return False


def mpi_enabled():
    return False


def mpi_built():
    return False


def gloo_enabled():
    return True


def gloo_built():
    return True


def nccl_built():
    return int(torch.cuda.is_available())
