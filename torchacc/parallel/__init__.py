"""MindSpore-style parallel modes for PyTorch models on torchacc's sharding engine.

Pick a mode with one call, give strategies (slices per tensor dimension) to the few ops or
modules that matter, let everything else run data parallel, and save one checkpoint slice per
device that merges and re-slices for another device count.

Note [Parallel modes on the sharding engine]
``torchacc.parallel`` only translates: it has no partitioner and no communication code. Every
layout it asks for goes through ``torchacc.distributed.sharding`` (Note [SPMD mode] in
torchacc/sharding/mesh.py) and XLA's SPMD partitioner inserts the collectives.

- Devices. ``init()`` switches torchacc to SPMD mode: one process drives all its devices and the
  job's devices (processes x local devices, ``get_group_size()``) form one mesh.
- Device matrix. A model's strategies fix one mesh: ``dp`` data-parallel devices (major axes
  ``dp0, dp1, ...``) times ``mp`` model-parallel devices (minor axes ``mp0, ...``), where ``mp``
  is the least common multiple of the devices each strategy uses (DATA_PARALLEL: ``mp = 1``),
  one axis per prime factor so that every strategy's slice counts find axes.
- Strategies. A strategy tuple gives the slices per dimension. An op's inputs name their
  dimensions (``MatMul``: ``mk``, ``kn``); each dimension with ``c > 1`` slices goes on free axes
  whose sizes multiply to ``c``, the most minor first, so a dimension two inputs share gets the
  same axes. The axes a strategy leaves over split dimension 0 (the batch) of its activation
  inputs; a parameter is replicated over them. A parameter is laid out once (resharded by the
  engine) and keeps its layout through the steps; an activation gets a sharding constraint.
  Ops and modules without a strategy run data parallel: the model's inputs are split by batch
  over the ``dp`` axes and XLA propagates that layout.
- Gradients. Under SPMD XLA computes the exact gradient of the loss as written, over the whole
  batch. MindSpore's data parallel computes the loss per device on its batch slice and combines
  the device gradients: ``gradients_mean=True`` averages, ``False`` sums them. For a loss that
  averages over its samples (``loss_reduction="mean"``, every torch loss by default) the mean of
  the ``dp`` slice gradients is the whole-batch gradient, and the sum is ``dp`` times it; for a
  summed loss (``loss_reduction="sum"``) the sum is the whole-batch gradient and the mean is
  ``1/dp`` of it. ``parallelize`` registers a gradient hook on each parameter with that factor.
- One mesh. ``parallelize`` also re-lays the model's replicated tensors on the device matrix's
  mesh: JAX names the layouts of a step's new results (optimizer state) on its inputs' mesh,
  and a step mixing two meshes over the same devices fails there.
- Processes. ``parameter_broadcast=True`` gives every process rank 0's initial weights (JAX's
  ``broadcast_one_to_all``); within a process there is one copy for all its devices anyway.
  Every process feeds the same global batch (``DistributedSampler.global_batches``).
- Order. The context is set before ``shard()`` and before the first step of a parallelized
  model (it fixes the device matrix); a later ``set_auto_parallel_context`` is an error until
  ``reset_auto_parallel_context()``. STAND_ALONE changes nothing (strategies are ignored there,
  and in DATA_PARALLEL).
"""

from torchacc.parallel import ops
from torchacc.parallel.auto import strategy_table
from torchacc.parallel.checkpoint import (
    load_checkpoint,
    load_distributed_checkpoint,
    save_checkpoint,
)
from torchacc.parallel.context import (
    ParallelMode,
    get_auto_parallel_context,
    get_group_size,
    get_rank,
    init,
    reset_auto_parallel_context,
    set_auto_parallel_context,
)
from torchacc.parallel.module import gradient_scale, shard
from torchacc.parallel.parallelize import parallelize
from torchacc.parallel.sampler import DistributedSampler
from torchacc.parallel.strategy_file import apply_strategies, load_strategy_file

__all__ = [
    "DistributedSampler",
    "apply_strategies",
    "load_strategy_file",
    "ParallelMode",
    "get_auto_parallel_context",
    "get_group_size",
    "get_rank",
    "gradient_scale",
    "init",
    "load_checkpoint",
    "load_distributed_checkpoint",
    "ops",
    "parallelize",
    "reset_auto_parallel_context",
    "save_checkpoint",
    "set_auto_parallel_context",
    "shard",
    "strategy_table",
]
