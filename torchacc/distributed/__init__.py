"""Multi-process torchacc: one process per device, collectives compiled into the step.

Each process of a ``torchrun`` job drives one device and records its own training step, as in
``torch_xla``. The processes form one JAX multi-process runtime (``jax.distributed``; gloo
collectives on CPU, NCCL on GPU), so a collective recorded on a torchacc tensor becomes part of the
XLA program that the next ``torchacc.sync()`` runs -- there is no transport of our own.

- ``torchacc.runtime.processes``: joins the job from torchrun's environment, rank / world size /
  local rank; ``torchacc.sharding``: the one engine (Note [One mesh]): the job-wide mesh, and
  ``sharding.manual``, the compile of a program holding a collective described below.
- ``sharding.collectives`` (also ``torchacc.distributed.collectives``): torch_xla-style
  ``all_reduce(reduce_type, inputs, scale)``, ``all_gather``, ``reduce_scatter``,
  ``broadcast(tensors, src)``, ``all_to_all``, ``collective_permute``, ``broadcast_parameters`` on
  torchacc tensors (what ``xm.*`` calls); ``host``: ``barrier(tag)``, ``rendezvous``.
- ``xla_backend``: the ``"xla"`` ``torch.distributed`` backend built on ``collectives``.
- this package is also a drop-in for ``torch.distributed`` (``import torchacc.distributed as
  dist``): ``torch_api`` has ``init_process_group``, ``get_rank``, ``all_reduce``, ``broadcast``,
  ``all_gather``, ``barrier`` with torch's signatures on CPU, CUDA and torchacc tensors (the
  launcher's world replaces a one-process script's); every other name is ``torch.distributed``'s.
  ``use_torchacc`` (a bool fixed at import: the launcher started more than one process),
  ``get_local_rank()`` and ``broadcast_optimizer_state`` (``state``) are the AIACC additions.

Note [Multi-process programs]
A graph with no collective is compiled as before: a ``jax.jit`` program on this process's device,
fed and returning single-device arrays; nothing changes for single-process runs. A graph holding at
least one collective node (a rule marked ``torchacc_collective``) must run as *one* SPMD program on
every process, so ``program.compiled_for`` hands it to ``sharding.manual.compile_manual``, a
manual region over the process axis of the job-wide mesh:

- the step function is wrapped in ``jax.shard_map`` over a mesh with one device per process, axis
  ``"process"``, ordered by rank, so ``jax.lax.psum(x, "process")`` and friends are the
  collectives and ``jax.lax.axis_index("process")`` is the rank;
- every input and output is declared *replicated* over that mesh (``PartitionSpec()``) with
  ``check_vma=False``. The arrays are not equal across processes (each holds its own batch,
  gradients, ...), but nothing reads the global view: inside ``shard_map`` each device sees its own
  block, and XLA inserts no communication for replicated operands of a manual computation. The
  pay-off is that the global array's one local shard has the local shape, so wrapping a local
  array as a global one (``ManualExecutable.__call__``) and taking the local result back
  (``addressable_data(0)``) are metadata operations -- no reshape kernels per tensor per step;
- the returned ``ManualExecutable`` is called exactly like a compiled single-device program (local
  arrays in, local arrays out), so ``execute.run`` binds results as usual.

Consequences: every process must run the same sequence of collective-bearing graphs (as in
torch_xla); a value that depends on a collective must not be read (``.item()``) on one rank only
before the step's ``sync()``. Collectives are recorded, not differentiable.

The JAX runtime must be joined before JAX starts its backends, which happens the first time
torchacc picks its device or seeds its RNG (``torch.manual_seed`` reaches it). So
``device.platform()`` calls ``runtime.maybe_initialize()``, which joins the job when the
environment says ``WORLD_SIZE > 1`` (opt out with ``TORCHACC_DISTRIBUTED=0``).
``dist.init_process_group("xla")`` joins it too, from the same environment, if nothing has yet.

Graphs must also be built the same way on every rank: ``graph.live_storages()`` lists storages in
creation order (not a set's address order), so the same recorded program gives the same node
order -- hence the same collective order -- in every process.
"""

from torchacc import mpi_env as _mpi_env
from torchacc.runtime.processes import (  # noqa: F401
    AXIS,
    initialize,
    local_world_size,
    maybe_initialize,
    set_replication,
)

use_torchacc = _mpi_env.job_world_size() > 1

_TORCH_API = (
    "init_process_group",
    "get_rank",
    "get_world_size",
    "get_local_rank",
    "get_local_world_size",
    "all_reduce",
    "broadcast",
    "all_gather",
    "barrier",
    "ReduceOp",
)


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Every rank's optimizer state and hyperparameters become rank ``root_rank``'s (a no-op in a
    one-process job)."""
    from torchacc.distributed import state, torch_api

    if torch_api.get_world_size() > 1:
        state.broadcast_optimizer_state(optimizer, root_rank)


def __getattr__(name):
    import importlib

    # collectives register custom ops and rules: load them on first use, not with the runtime.
    # Our own submodules (checkpoint, sharding, fsdp, ...) win over torch.distributed's names:
    # ``from torchacc.distributed import checkpoint`` asks this hook before importing it
    import importlib.util

    if not name.startswith("_") and importlib.util.find_spec(f"torchacc.distributed.{name}"):
        return importlib.import_module(f"torchacc.distributed.{name}")
    if name in _TORCH_API:
        return getattr(importlib.import_module("torchacc.distributed.torch_api"), name)
    import torch.distributed

    try:
        return getattr(torch.distributed, name)
    except AttributeError:
        raise AttributeError(f"module 'torchacc.distributed' has no attribute {name!r}") from None
