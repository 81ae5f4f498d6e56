"""``torch.distributed``'s functions with its signatures, for ``import torchacc.distributed as
dist`` (the DDP drop-in of the AIACC workflow): CPU and CUDA tensors go to ``torch.distributed``,
torchacc tensors are recorded into the step (``collectives``).

``init_process_group`` lets the launcher decide: under ``mpirun``/``torchrun``/``torchaccrun`` the
job's world size and rank replace the script's (a script written for one process,
``init_process_group(..., world_size=1, rank=0)``, runs as N ranks), the rendezvous is the
launcher's (``env://``), and the backend is gloo for CPU tensors plus NCCL for CUDA tensors when
CUDA is there (a script's ``"nccl"`` on a machine without CUDA still runs).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as _td
from torch.distributed import distributed_c10d as _c10d  # not rebound by recipes (xm.get_ordinal)

from torchacc import mpi_env
from torchacc.lazy.tensor import LazyTensor
from torchacc.runtime import processes as runtime
from torchacc.sharding import collectives as C

ReduceOp = _td.ReduceOp


class _Done:
    """What ``async_op=True`` returns for a recorded collective: it runs with the step."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _backend(requested):
    if requested not in (None, "nccl", "gloo", "cpu:gloo,cuda:nccl"):
        return requested  # "xla", "mpi", custom backends: as asked
    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(
    backend=None,
    init_method=None,
    timeout=None,
    world_size=-1,
    rank=-1,
    store=None,
    group_name="",
    pg_options=None,
    device_id=None,
):
    """``torch.distributed.init_process_group``; a launcher's job replaces the script's
    ``world_size``/``rank``/``init_method`` (see the module docstring)."""
    mpi_env.adopt()
    launched = mpi_env.job_world_size() > 1 and store is None
    kwargs = {"backend": _backend(backend)}
    if timeout is not None:
        kwargs["timeout"] = timeout
    if launched:
        kwargs.update(
            init_method="env://",
            world_size=int(os.environ["WORLD_SIZE"]),
            rank=int(os.environ["RANK"]),
        )
    else:
        kwargs.update(init_method=init_method, world_size=world_size, rank=rank, store=store)
        if init_method is None and store is None and world_size in (-1, 1) and rank in (-1, 0):
            kwargs.update(store=_td.HashStore(), world_size=1, rank=0)  # a world of one
    if device_id is not None:
        kwargs["device_id"] = device_id
    _td.init_process_group(group_name=group_name, pg_options=pg_options, **kwargs)


def get_rank(group=None):
    """This process's rank (in ``group``); before ``init_process_group``, the launcher's."""
    if group is not None or _td.is_initialized():
        return _c10d.get_rank(group)
    mpi_env.adopt()
    return runtime.rank()


def get_world_size(group=None):
    if group is not None or _td.is_initialized():
        return _c10d.get_world_size(group)
    mpi_env.adopt()
    return runtime.world_size()


def get_local_rank():
    """This process's rank on its node (its device there)."""
    mpi_env.adopt()
    return int(os.environ.get("LOCAL_RANK", 0))


def get_local_world_size():
    mpi_env.adopt()
    return int(os.environ.get("LOCAL_WORLD_SIZE", get_world_size()))


def _whole_world(name, group):
    if group is not None and group is not _td.GroupMember.WORLD:
        raise NotImplementedError(
            f"torchacc.distributed.{name}: on torchacc tensors only the whole job is supported "
            "(group=None)"
        )


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False):
    """In place, as ``torch.distributed.all_reduce``."""
    if isinstance(tensor, LazyTensor):
        _whole_world("all_reduce", group)
        C.all_reduce(op, [tensor])
        return _Done() if async_op else None
    return _td.all_reduce(tensor, op, group, async_op)


def broadcast(tensor, src=None, group=None, async_op=False, group_src=None):
    if isinstance(tensor, LazyTensor):
        _whole_world("broadcast", group)
        C.broadcast([tensor], src if src is not None else group_src or 0)
        return _Done() if async_op else None
    return _td.broadcast(tensor, src, group, async_op, group_src=group_src)


def all_gather(tensor_list, tensor, group=None, async_op=False):
    if isinstance(tensor, LazyTensor):
        _whole_world("all_gather", group)
        gathered = C.all_gather(tensor.unsqueeze(0), 0)
        with torch.no_grad():
            for out, piece in zip(tensor_list, gathered.unbind(0), strict=True):
                out.copy_(piece)
        return _Done() if async_op else None
    return _td.all_gather(tensor_list, tensor, group, async_op)


def barrier(group=None, async_op=False, device_ids=None):
    if _td.is_initialized():
        return _td.barrier(group, async_op, device_ids)
    C.barrier()
    return _Done() if async_op else None
