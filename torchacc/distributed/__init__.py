"""Multi-process torchacc: one process per device, collectives compiled into the step.

Each process of a ``torchrun`` job drives one device and records its own training step, as in
``torch_xla``. The processes form one JAX multi-process runtime (``jax.distributed``; gloo
collectives on CPU, NCCL on GPU), so a collective recorded on a torchacc tensor becomes part of the
XLA program that the next ``torchacc.sync()`` runs -- there is no transport of our own.

- ``torchacc.runtime.processes``: joins the job from torchrun's environment, rank / world size /
  local rank; ``torchacc.program.spmd``: the process mesh and the SPMD compile described below.
- ``collectives``: ``all_reduce``, ``all_gather``, ``reduce_scatter``, ``broadcast``,
  ``all_to_all``, ``barrier``, ``rendezvous``, ``broadcast_parameters`` on torchacc tensors.
- ``xla_backend``: the ``"xla"`` ``torch.distributed`` backend built on ``collectives``.

Note [Multi-process programs]
A graph with no collective is compiled as before: a ``jax.jit`` program on this process's device,
fed and returning single-device arrays; nothing changes for single-process runs. A graph holding at
least one collective node (a rule marked ``torchacc_collective``) must run as *one* SPMD program on
every process, so ``program.compiled_for`` hands it to ``program.spmd.compile_spmd``:

- the step function is wrapped in ``jax.shard_map`` over a mesh with one device per process, axis
  ``runtime.AXIS`` ("p"), ordered by rank, so ``jax.lax.psum(x, "p")`` and friends are the
  collectives and ``jax.lax.axis_index("p")`` is the rank;
- every input and output is declared *replicated* over that mesh (``PartitionSpec()``) with
  ``check_vma=False``. The arrays are not equal across processes (each holds its own batch,
  gradients, ...), but nothing reads the global view: inside ``shard_map`` each device sees its own
  block, and XLA inserts no communication for replicated operands of a manual computation. The
  pay-off is that the global array's one local shard has the local shape, so wrapping a local
  array as a global one (``SpmdExecutable.__call__``) and taking the local result back
  (``addressable_data(0)``) are metadata operations -- no reshape kernels per tensor per step;
- the returned ``SpmdExecutable`` is called exactly like a compiled single-device program (local
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

from torchacc.runtime.processes import (  # noqa: F401
    AXIS,
    initialize,
    is_initialized,
    local_rank,
    local_world_size,
    maybe_initialize,
    rank,
    set_replication,
    world_size,
)

get_rank = rank
get_world_size = world_size
get_local_rank = local_rank
get_local_world_size = local_world_size


def __getattr__(name):
    # collectives register custom ops and rules: load them on first use, not with the runtime
    if name in ("collectives", "xla_backend"):
        import importlib

        return importlib.import_module(f"torchacc.distributed.{name}")
    if name in (
        "all_reduce",
        "all_gather",
        "reduce_scatter",
        "broadcast",
        "all_to_all",
        "barrier",
        "rendezvous",
        "broadcast_parameters",
        "broadcast_master_param",
        "collective_broadcast",
    ):
        from torchacc.distributed import collectives

        return getattr(collectives, name)
    raise AttributeError(f"module 'torchacc.distributed' has no attribute {name!r}")
