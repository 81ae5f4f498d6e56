"""``torchacc.accelerate(model, dataloader, config)``: TorchAcc's one-call setup.

::

    model, loader = ta.accelerate(model, loader, ta.Config())   # backend 'lazy' by default
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for batch in loader:                                         # on model.device already
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()                                    # no mark_step: the loader syncs

Order of work (everything is checked before anything happens):

1. ``config.validate_for(model, world_size)`` (``ValueError`` naming the field) and the sizes
   this build cannot run (``NotImplementedError`` naming the field): nothing is started, moved
   or patched before that;
2. ``memory.gc``: the ``gc_cls`` submodules are checkpointed (torchacc/accel/gc.py);
3. the model moves to the device (``'lazy'``: the torchacc device; ``'eager'``: CUDA when there
   is one, else the CPU) and ``model.device`` says where;
4. ``compute.bf16``/``fp16``: the model's forward runs under autocast of that dtype, parameters
   stay float32 (a user's own autocast inside is harmless); fp16 wants a GradScaler
   (``ta.amp.GradScaler`` is sync-free with ``ta.amp.syncfree`` optimizers); nothing process-wide
   is replaced;
5. ``compute.acc_scaled_dot_attn``: inside the model's forward only,
   ``F.scaled_dot_product_attention`` is torchacc_ops' ``flash_attention``;
6. ``dist``: on ``'lazy'``, ``dp`` ranks start from rank 0's parameters and every gradient is
   averaged over them by an all-reduce recorded into the step; on ``'eager'``, ``dp`` is torch
   DDP and ``fsdp`` torch FSDP2 (``fully_shard`` on the ``wrap_layer_cls`` modules, then the
   root; ``sync_module_states`` first broadcasts rank 0's parameters, as FSDP2 does not); both
   > 1 is HSDP, FSDP2 over a 2-D (dp, fsdp) device mesh laid out in ``dist.topology``'s order
   (replicated over dp, sharded over fsdp: FSDP within a node, data parallel across nodes). On
   ``'lazy'`` with ``fsdp.size``/``tp.size``/``sp.size`` > 1 the sizes are a (dp, fsdp, sp, tp)
   mesh of every device of the job in SPMD mode (switched on first; the sizes multiply to the
   device count): FSDPv2, Megatron's column->row Linear pairs and context parallel (the
   sequence split, attention as the ring / Ulysses region) through XLA's partitioner
   (``_lazy_sharded``; a tp size that does not divide the heads or the hidden size is a
   ValueError before anything changes);
   With ``dist.pp.size > 1`` (backend ``'lazy'``) the model is cut into stages on the ``pp``
   axis of a (dp, fsdp, pp) mesh instead (torchacc/pipeline/), or with tp / sp of a (dp, pp,
   sp, tp) mesh (uniform stages, torchacc/pipeline/uniform.py): the returned model trains with
   ``model.forward_backward(...)``; gc and bf16/fp16 apply to its stages;
7. the dataloader becomes an ``AsyncLoader`` with the config's bucketing; on the sharded lazy
   path its batches are split over (dp, fsdp) as they are uploaded, and under torchrun each
   rank's batch (its ``DistributedSampler`` share) is its part of the global batch (Note
   [Per-process batches] in torchacc/sharding/data.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from torchacc.accel.config import Config
from torchacc.accel.gc import apply_gc
from torchacc.accel.loader import AsyncLoader
from torchacc.lazy.device import DEVICE_TYPE


def mark_dynamic(*args, **kwargs):
    """TorchAcc marks dynamic dimensions for bounded dynamic shapes; XLA through JAX has none."""
    raise NotImplementedError(
        "torchacc.mark_dynamic: XLA through JAX has no bounded dynamic shapes; pad variable "
        "lengths to a few sizes instead with bucketing (Config.dataloader.buckets or "
        "max_length/num_buckets, or torchacc.AsyncLoader(loader, device, buckets=[...]))"
    )


def _world_size():
    return int(os.environ.get("WORLD_SIZE", "1"))


def _refuse_unsupported(config, sizes):
    dp, fsdp, tp, pp, sp = sizes
    if pp > 1 and (not config.is_lazy_backend() or ((tp > 1 or sp > 1) and fsdp > 1)):
        raise NotImplementedError(
            f"Config.dist.pp.size = {pp}: pipeline parallelism runs on backend 'lazy' with dp "
            f"and fsdp, or with dp, tp and sp (got backend {config.backend!r}, fsdp.size {fsdp}, "
            f"tp.size {tp}, sp.size {sp})"
        )
    if config.is_lazy_backend():
        return  # fsdp / tp / sp: a (dp, fsdp, sp, tp) mesh of the SPMD engine (_lazy_sharded)
    if tp > 1:
        raise NotImplementedError(
            f"Config.dist.tp.size = {tp} on backend 'eager': tensor parallelism is not supported"
        )
    if sp > 1:
        raise NotImplementedError(
            f"Config.dist.sp.size = {sp}: sequence (context) parallelism is not supported on "
            "backend 'eager' (backend 'lazy' runs it)"
        )


def _wrap_forward(module, autocast_device, dtype, sdpa):
    """``module.forward`` under autocast of ``dtype`` and/or with SDPA as flash_attention."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args, **kwargs):
        original = F.scaled_dot_product_attention
        if sdpa:
            F.scaled_dot_product_attention = _sdpa_as_flash_attention(original)
        try:
            if dtype is None:
                return inner(*args, **kwargs)
            with torch.autocast(autocast_device, dtype=dtype):
                return inner(*args, **kwargs)
        finally:
            F.scaled_dot_product_attention = original

    module.forward = forward


def _sdpa_as_flash_attention(original):
    """SDPA's signature over torchacc_ops.flash_attention (whose eager path calls the original
    SDPA: it is put back during the call)."""
    import torchacc_ops

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        F.scaled_dot_product_attention = original
        try:
            return torchacc_ops.flash_attention(
                q, k, v, causal=is_causal, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale
            )
        finally:
            F.scaled_dot_product_attention = sdpa

    return sdpa


def _average_gradients_over(module, dp):
    """Every gradient, once accumulated, is all-reduced (mean over ``dp`` ranks) in the step."""
    from torchacc.sharding import collectives

    def reduce(param):
        collectives.average_gradients([param.grad], 1.0 / dp)

    for p in module.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(reduce)


def _spmd_device_count():
    """The job's devices for a (dp, fsdp, tp) mesh. One process counts its devices without
    switching SPMD mode on (``_lazy_sharded`` does, once the config is valid); several processes
    must switch it on first, since they join the job with every local device."""
    from torchacc.sharding import api as sharding

    if _world_size() > 1:
        sharding.use_spmd()
        return sharding.device_count()
    return len(sharding.devices())


def mesh_axes(topology, sizes):
    """The (dp, fsdp, sp, tp) mesh's axis names, outermost first, in ``dist.topology``'s order;
    names it leaves out follow in the order dp, fsdp, sp, tp, except that a missing ``sp`` goes
    just before ``tp`` (tensor parallel innermost, context parallel next to it)."""
    axes = ("dp", "fsdp", "sp", "tp")
    names = [n for n in topology if n in axes]
    for n in axes:
        if n in names:
            continue
        if n == "sp" and "tp" in names:
            names.insert(names.index("tp"), n)
        else:
            names.append(n)
    return names


def _lazy_sharded(model, sizes, topology=("dp", "fsdp", "tp"), tp_plan=None, sp_algorithm="auto"):
    """fsdp / tp / sp on the lazy backend: the SPMD engine over a (dp, fsdp, sp, tp) mesh of
    every device of the job (Note [SPMD mode]). ``tp`` splits the Megatron column->row pairs of
    ``tp_plan`` (Note [Megatron pairs] in torchacc/sharding/recipes.py), ``fsdp`` dim 0 of every
    other parameter (ZeRO-3), ``sp`` the sequence, with the model's attention as the context
    parallel region (Note [Context parallel for a model] in torchacc/context_parallel/model.py);
    a forward pre-hook splits the batch of the model's tensor inputs over dp x fsdp (and their
    dim 1 over sp); XLA inserts every other collective."""
    from torchacc.context_parallel import model as cp_model
    from torchacc.distributed import fsdp as zero
    from torchacc.lazy.device import device
    from torchacc.sharding import api as sharding
    from torchacc.sharding import recipes

    sharding.use_spmd()
    dp, fsdp, tp, _, sp = sizes
    # the mesh's axes in dist.topology's order, the first outermost (dp x fsdp by default: each
    # fsdp group is consecutive devices, one node; dp runs across nodes)
    names = mesh_axes(topology, sizes)
    size = {"dp": dp, "fsdp": fsdp, "tp": tp, "sp": sp}
    mesh = sharding.jax_mesh(range(dp * fsdp * tp * sp), [size[n] for n in names], names)
    batch_axes = tuple(n for n in names if n in ("dp", "fsdp"))
    dev = device()
    model.to(dev)
    if tp > 1:  # Megatron column->row pairs (the engine's recipe)
        recipes.tensor_parallel(model, mesh, "tp", "fsdp" if fsdp > 1 else None, plan=tp_plan)
    if fsdp > 1:
        zero.shard_parameters(model, mesh, "fsdp")
    if sp > 1:  # after the other wrappers of forward: attention is the region inside all
        cp_model.parallelize(
            model, mesh, "sp", batch_axes, "tp" if tp > 1 else None, sp_algorithm, "dist.sp"
        )

    def spec_of(shape):
        return cp_model.batch_spec(shape, batch_axes, "sp", sp)

    def split_batch(module, args, kwargs):
        for t in [*args, *kwargs.values()]:
            if isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE and t.dim() > 0:
                shape = tuple(t.shape)
                sharding.mark(t, sharding.named_sharding(mesh, spec_of(shape), shape, "dist batch"))
        return None

    model.register_forward_pre_hook(split_batch, with_kwargs=True)

    def input_sharding(host):  # the loader's layout: each process's batch is its share
        shape = tuple(host.shape)
        return sharding.named_sharding(mesh, spec_of(shape), shape, "dist batch")

    return model, dev, input_sharding


def _lazy(model, sizes, spmd=False, topology=("dp", "fsdp", "tp"), tp_plan=None, sp_algo="auto"):
    from torchacc.lazy.device import device
    from torchacc.sharding import collectives

    if spmd:
        return _lazy_sharded(model, sizes, topology, tp_plan, sp_algo)
    dev = device()
    model.to(dev)
    dp = sizes[0]
    if dp > 1:
        collectives.broadcast_parameters(model, 0)
        _average_gradients_over(model, dp)
    return model, dev, None


def _hsdp_mesh(device_type, dp, fsdp, topology):
    """The (dp, fsdp) DeviceMesh of HSDP, ranks laid out in ``topology``'s order (default dp
    outer: the fsdp groups are consecutive ranks, i.e. one node)."""
    from torch.distributed.device_mesh import DeviceMesh

    ranks = torch.arange(dp * fsdp)
    order = [n for n in topology if n in ("dp", "fsdp")]
    if order == ["fsdp", "dp"]:
        ranks = ranks.reshape(fsdp, dp).t()
    return DeviceMesh(device_type, ranks.reshape(dp, fsdp), mesh_dim_names=("dp", "fsdp"))


def _eager(model, config, sizes):
    import torch.distributed as dist

    dp, fsdp = sizes[0], sizes[1]
    if torch.cuda.is_available():
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    model.to(dev)
    if dp * fsdp > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    if fsdp > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        # an explicit mesh: FSDP2's default one would be on torch's current accelerator, which
        # is the torchacc device once torchacc is imported. dp x fsdp is HSDP: a 2-D mesh
        # (replicated over dp, sharded over fsdp), its axes in dist.topology's order
        if dp > 1:
            mesh = _hsdp_mesh(dev.type, dp, fsdp, config.dist.topology)
        else:
            mesh = init_device_mesh(dev.type, (fsdp,))
        if config.dist.fsdp.sync_module_states:  # rank 0's parameters and buffers everywhere
            for t in (*model.parameters(), *model.buffers()):
                dist.broadcast(t.data, 0)
        names = set(config.dist.fsdp.wrap_layer_cls)
        for m in list(model.modules())[1:]:
            if type(m).__name__ in names:
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif dp > 1:
        ids = [dev.index] if dev.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids)
    return model, dev


def _loader(dataloader, device, config, input_sharding):
    dl = config.dataloader
    return AsyncLoader(
        dataloader,
        device,
        buckets=dl.buckets,
        max_length=dl.max_length,
        num_buckets=dl.num_buckets or 8,
        pad_value_dict=dl.pad_value_dict,
        input_sharding=input_sharding,
    )


def _pipeline(model, dataloader, config, sizes, dtype):
    """``dist.pp.size > 1``: the model cut into stages on the pp axis of a (dp, fsdp, pp) mesh
    (torchacc/pipeline/); train with ``model.forward_backward(...)``. gc makes each stage a
    recomputed (``jax.checkpoint``) function; bf16/fp16 run the stages under autocast."""
    from torchacc.lazy.device import device
    from torchacc.pipeline import PipelineModule

    dp, fsdp, tp, pp, sp = sizes
    dist = config.dist
    kw = dict(
        num_micro_batches=dist.pp.num_micro_batches,
        schedule=dist.pp.schedule,
        fsdp=fsdp,
        topology=[t for t in dist.topology if t in ("dp", "fsdp", "pp")],
        dp=dp,
        autocast=dtype,
    )
    if tp > 1 or sp > 1:  # uniform stages running tp / sp inside (torchacc/pipeline/uniform.py)
        from torchacc.pipeline.uniform import UniformPipelineModule

        model = UniformPipelineModule(
            model, pp, dist.pp.split_points, tp=tp, sp=sp, sp_algorithm=dist.sp.algorithm, **kw
        )
    else:
        model = PipelineModule(model, pp, dist.pp.split_points, **kw)
    if config.memory.gc:
        apply_gc(model._underlay, config.memory.gc_cls, config.memory.gc_cnt, lazy=True)
    dev = device()
    model.to(dev)
    model.device = dev
    if dataloader is None:
        return model
    return model, _loader(dataloader, dev, config, None)


def accelerate(model, dataloader=None, config=None):
    """Set ``model`` (and ``dataloader``) up as ``config`` says; returns ``(model, loader)``, or
    just the model when no dataloader is given. See the module docstring for what happens."""
    if config is None:
        config = Config()
    if not isinstance(config, Config):
        raise TypeError(
            f"torchacc.accelerate: config must be a torchacc.Config, got {type(config)}"
        )
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"torchacc.accelerate: model must be a torch.nn.Module, got {type(model)}")
    lazy = config.is_lazy_backend()
    config.validate()
    d = config.dist
    spmd = lazy and (d.fsdp.size > 1 or d.tp.size > 1 or d.sp.size > 1 or d.pp.size > 1)
    sizes = config.validate_for(model, _spmd_device_count() if spmd else _world_size())
    _refuse_unsupported(config, sizes)
    tp_plan = None
    if lazy and sizes[2] > 1:  # the pairs and their sizes are checked before anything changes
        from torchacc.sharding import recipes

        tp_plan = recipes.megatron_plan(model, sizes[2])
    compute = config.compute
    dtype = torch.bfloat16 if compute.bf16 else torch.float16 if compute.fp16 else None
    if lazy and sizes[3] > 1:  # the split points are checked before anything changes
        return _pipeline(model, dataloader, config, sizes, dtype)
    if config.memory.gc:
        apply_gc(model, config.memory.gc_cls, config.memory.gc_cnt, lazy=lazy)
    if dtype is not None or compute.acc_scaled_dot_attn:
        # before DDP/FSDP wrap it: they call the module's own forward
        autocast_device = DEVICE_TYPE if lazy else ("cuda" if torch.cuda.is_available() else "cpu")
        _wrap_forward(model, autocast_device, dtype, compute.acc_scaled_dot_attn)
    if lazy:
        model, device, input_sharding = _lazy(
            model, sizes, spmd, config.dist.topology, tp_plan, config.dist.sp.algorithm
        )
    else:
        (model, device), input_sharding = _eager(model, config, sizes), None
    if not hasattr(model, "device"):  # a Hugging Face model has its own property
        model.device = device
    if dataloader is None:
        return model
    return model, _loader(dataloader, device, config, input_sharding)
