"""Horovod's PyTorch API on torchacc: ``import torchacc.horovod as hvd``.

A script written for Horovod (``hvd.init()``, ``hvd.DistributedOptimizer``,
``hvd.broadcast_parameters``, ...) runs unchanged under ``mpirun``, ``torchrun`` or
``torchaccrun`` (``python -m torchacc.horovod.run``), with no Horovod or MPI build.

- ``basics``: ``init``/``shutdown``, rank, size, local rank and size, nodes;
- ``ops``: reduce ops, ``allreduce`` and its forms, async handles, the ranks' agreement check;
- ``exchange``: the other collectives, object collectives, ``barrier``, ``join``;
- ``optimizer``: ``DistributedOptimizer``, ``Compression``, ``broadcast_parameters``,
  ``broadcast_optimizer_state``;
- ``sync_batch_norm``: ``SyncBatchNorm``;
- ``run``: the ``horovodrun``-style launcher.

Note [Horovod on two paths]
Every collective takes its path from its tensor:

- a CPU or CUDA tensor (the eager path) goes through the ``torch.distributed`` process group that
  ``hvd.init()`` created (gloo for CPU, NCCL for CUDA) and runs when called; async forms return
  a handle backed by the group's ``Work``;
- a tensor on the torchacc device is *recorded* with ``torchacc.distributed.collectives`` (as
  ``xm.all_reduce`` is): the collective becomes part of the step's XLA program and runs at the
  next ``torchacc.sync()``, so there is no device-to-host transfer in the training loop, and the
  async forms are complete at once (the program orders the work).

What a collective needs to know about the other ranks' tensors (their shapes and dtypes, the dim-0
sizes of ``allgather``, the splits of ``alltoall``) is metadata: it travels over the gloo group on
the host, for either path, and never touches the device's data. This exchange is also what turns
tensors of different shapes on different ranks into a clear error on every rank instead of a hang.
``DistributedOptimizer`` checks its parameters once, at the first ``synchronize()``; plain
``allreduce`` calls check every time (one small host collective).
"""

from torchacc.horovod.basics import (  # noqa: F401
    cross_rank,
    cross_size,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    shutdown,
    size,
)
from torchacc.horovod.exchange import (  # noqa: F401
    allgather,
    allgather_object,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    join,
    reducescatter,
)
from torchacc.horovod.ops import (  # noqa: F401
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    poll,
    synchronize,
)
from torchacc.horovod.optimizer import (  # noqa: F401
    Compression,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from torchacc.horovod.sync_batch_norm import SyncBatchNorm  # noqa: F401
