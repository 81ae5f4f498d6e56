"""``parallelize(model)``: applies the context's mode to a model: the device matrix, the
parameters' layouts, the batch split of its inputs, the AUTO_PARALLEL search and MindSpore's
``gradients_mean``.

See Note [Parallel modes on the sharding engine] in ``torchacc/parallel/__init__.py``.
"""

from __future__ import annotations

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.parallel import auto, context, layout
from torchacc.parallel.context import ParallelMode
from torchacc.parallel.module import gradient_scale, model_parallel_size, place_params
from torchacc.parallel.ops import Primitive


def _name(model):
    for mod_name, m in model.named_modules():
        m._torchacc_name = mod_name or type(model).__name__
        plan = getattr(m, "_torchacc_shard", None)
        if plan is not None:
            plan.owner = m._torchacc_name
        for attr, v in vars(m).items():
            if isinstance(v, Primitive) and "-op" in v.name:
                v.name = f"{mod_name + '.' if mod_name else ''}{attr} ({type(v).__name__})"


def parallelize(model):
    """Apply the context's parallel mode to ``model`` (on the torchacc device): the device
    matrix from its strategies, its parameters' layouts, its inputs split by batch, and
    ``gradients_mean``. In STAND_ALONE it returns the model unchanged."""
    if getattr(model, "_torchacc_parallelized", False):
        return model  # its hooks are in place already
    context.freeze("parallelize()")
    _name(model)
    mode = context.mode()
    if mode == ParallelMode.STAND_ALONE:
        return model
    if mode == ParallelMode.SEMI_AUTO_PARALLEL:
        context.device_matrix(model_parallel_size(model))
    elif mode == ParallelMode.DATA_PARALLEL:
        context.device_matrix(1)
    if context.option("parameter_broadcast"):
        _broadcast_parameters(model)
    state = {"first": True}

    def split_inputs(module, args):
        if state["first"]:
            state["first"] = False
            context.freeze("the first training step")
            if mode == ParallelMode.AUTO_PARALLEL:
                auto.search(model, args)
                _onto_matrix(model, context.device_matrix())
        matrix = context.device_matrix()
        for t in args:
            layout.split_batch(t, f"{type(model).__name__} input", matrix)
        return None

    model.register_forward_pre_hook(split_inputs)
    model._torchacc_parallelized = True
    if mode != ParallelMode.AUTO_PARALLEL:
        matrix = context.device_matrix()
        for m in model.modules():
            plan = getattr(m, "_torchacc_shard", None)
            if plan is not None and not plan.placed and _on_device(m) and context.uses_strategies():
                place_params(m, plan, matrix)
        _onto_matrix(model, matrix)
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_scale_gradient)
    return model


def _onto_matrix(model, matrix):
    """Replicated parameters and buffers onto the device matrix's mesh: one mesh for every
    array of the step (JAX names the layouts of the step's new results on its inputs' mesh)."""
    from torchacc.sharding import api as engine

    for t in (*model.parameters(), *model.buffers()):
        if t.device.type != DEVICE_TYPE:
            continue
        s = engine.sharding_of(t)
        if s is None or (s.mesh != matrix.mesh and all(e is None for e in s.spec)):
            spec = (None,) * t.dim()
            engine.mark(t, engine.named_sharding(matrix.mesh, spec, tuple(t.shape)), "parallelize")


def _scale_gradient(grad):
    scale = gradient_scale()
    return grad if scale == 1.0 else grad * scale


def _on_device(module):
    return all(p.device.type == DEVICE_TYPE for p in module.parameters())


def _broadcast_parameters(model):
    """``parameter_broadcast``: process 0's initial weights everywhere. One process holds one
    copy for all its devices, so this matters across processes only: each process's copy goes
    through JAX's ``broadcast_one_to_all`` and back, in the parameter's layout."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    from torchacc.sharding import api as engine

    with torch.no_grad():
        for p in (*model.parameters(), *model.buffers()):
            if p.device.type != DEVICE_TYPE:
                continue
            local = engine.local_shards(p)[0][0]
            if tuple(local.shape) != tuple(p.shape):
                raise ValueError(
                    f"parameter_broadcast: a parameter of shape {tuple(p.shape)} is already "
                    "split; broadcast happens before strategies lay parameters out"
                )
            before = engine.sharding_of(p)
            host = multihost_utils.broadcast_one_to_all(local.numpy())
            p.copy_(torch.from_numpy(host))
            if before is not None and engine.sharding_of(p) != before:
                engine.mark(p, before, "parameter_broadcast")
