"""The one engine for every kind of parallelism: a job-wide mesh, shardings, manual regions and the
collective rules. Its modules sit at the stages they serve (docs/architecture.md):

- ``mesh``        (runtime)  the job-wide mesh (processes x local devices), SPMD mode's state, the
                             engine mesh, the process axis, global uploads and gathers
- ``rules``       (lowering) ``torchacc::shard`` and the collectives' custom ops and rules, over the
                             axes of the manual region being lowered
- ``layout``      (program)  a program's argument/result shardings, padded shards
- ``manual``      (program)  a graph holding a collective compiled as a manual region (shard_map)
                             over the process axis
- ``api``         (library)  meshes, partition specs, ``mark``: what every front door translates to
- ``collectives`` (library)  ``xm``-style collectives on torchacc tensors and the recipes built on
                             them (gradient averaging, "start ranks equal")
- ``regions``     (library)  manual regions of the user's code (``xs.shard_map``,
                             ``custom_kernel._shard_map``)
- ``data``        (library)  every process loads its own data: how the loaders lay a batch out,
                             the processes' agreement on its shapes (Note [Per-process batches])
- ``recipes``     (library)  parallelism policies as parameter shardings (``tensor_parallel``:
                             Megatron pairs; ``parallelize_module``: torch's tp plans)

Front doors (``torch_xla``'s spmd, ``parallel/``, ``horovod/``, ``accel/``, ``nn/``) import these
modules; they never import each other, nor ``sharding.mesh`` directly (tests/test_architecture.py).
This package's ``__init__`` imports nothing, so lower stages can import ``sharding.mesh`` and
``sharding.rules`` without pulling in the library half.

Note [One mesh]
In JAX, per-process collectives and SPMD sharding are one thing, and torchacc runs them as one:

    job-wide mesh = processes x local devices, axes named by the user or "process"
      auto region   : NamedSharding / with_sharding_constraint -> XLA's partitioner
                      (mark_sharding, FSDPv2, torchacc.parallel, accelerate fsdp/tp)
      manual region : jax.shard_map over some axes; collectives (psum, all_gather, psum_scatter,
                      all_to_all, ppermute) over those axes. Per-process code (xm.*, the xla
                      process group, Horovod, DDP) is a manual region over the process axis;
                      xs.shard_map / custom_kernel._shard_map are regions over the mesh the
                      user names.

One program per step, whichever front door recorded it. The collective rules read the axes of the
region being lowered (``rules.region_axes()``): the process axis when a step holding a collective
is compiled by ``manual.compile_manual``, the region's own axes inside a user's region
(``regions``). Nothing of torchacc's own partitions, schedules or moves bytes below JAX.
"""
