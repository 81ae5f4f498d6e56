"""Module-level strategies (``shard(module, in_strategy, out_strategy, parameter_plan)``) and
``parallelize(model)``, which applies the context's mode to a model: the device matrix, the
parameters' layouts, the batch split of its inputs and MindSpore's ``gradients_mean``.

See Note [Parallel modes on the sharding engine] in ``torchacc/parallel/__init__.py``.
"""

from __future__ import annotations

import math

import torch

from torchacc.parallel import context, layout
from torchacc.parallel.context import ParallelMode
from torchacc.parallel.ops import Primitive


class ShardPlan:
    """A module's strategies: per positional input, per output, per parameter name."""

    def __init__(self, owner, in_strategy, out_strategy, parameter_plan, by_search=False):
        self.owner = owner
        self.inputs = in_strategy
        self.outputs = out_strategy
        self.params = parameter_plan
        self.by_search = by_search
        self.placed = False

    def devices_used(self):
        used = [math.prod(s) for s in (*self.inputs, *self.outputs) if s is not None]
        used += [math.prod(s) for s in self.params.values()]
        return max(used, default=1)


def _strategies(owner, what, value):
    if value is None:
        return ()
    if isinstance(value, tuple) and value and all(isinstance(v, int) for v in value):
        value = (value,)  # one strategy for the single input
    if not isinstance(value, (tuple, list)):
        raise ValueError(f"{owner}: {what} must be a tuple of strategies, got {value!r}")
    return tuple(None if s is None else layout.check_strategy(owner, s) for s in value)


def shard(module, in_strategy, out_strategy=None, parameter_plan=None, *, _by_search=False):
    """Give ``module`` strategies: ``in_strategy`` one per positional input (``None``: data
    parallel), ``out_strategy`` one per output, ``parameter_plan`` ``{"weight": (2, 1)}`` with
    parameter names relative to ``module``. Applied in the semi-auto and auto modes."""
    if not isinstance(module, torch.nn.Module):
        raise ValueError(f"shard: expects an nn.Module, got {type(module).__name__}")
    owner = getattr(module, "_torchacc_name", None) or type(module).__name__
    if not _by_search:
        context.freeze("shard()")
    plan_params = {}
    for name, strategy in (parameter_plan or {}).items():
        try:
            p = module.get_parameter(name)
        except AttributeError:
            raise ValueError(
                f"shard({owner}): parameter_plan names {name!r}, which is not a parameter of "
                f"the module (it has {[n for n, _ in module.named_parameters()]})"
            ) from None
        where = f"{owner}.{name}"
        strategy = layout.check_strategy(where, strategy)
        layout.check_against(where, strategy, p.shape, "parameter")
        plan_params[name] = strategy
    plan = ShardPlan(
        owner,
        _strategies(owner, "in_strategy", in_strategy),
        _strategies(owner, "out_strategy", out_strategy),
        plan_params,
        _by_search,
    )
    first = getattr(module, "_torchacc_shard", None) is None
    module._torchacc_shard = plan
    if first:
        module.register_forward_pre_hook(_shard_inputs)
        module.register_forward_hook(_shard_outputs)
    return module


def _place_params(module, plan, matrix):
    for name, strategy in plan.params.items():
        p = module.get_parameter(name)
        if p.device.type != "torchacc":
            raise ValueError(
                f"{plan.owner}.{name}: the parameter is on {p.device}; move the model to the "
                "torchacc device before its first step"
            )
        spec = layout.tensor_layout(f"{plan.owner}.{name}", strategy, p.shape, matrix, False)
        layout.place_parameter(p, f"{plan.owner}.{name}", strategy, spec, matrix)
    plan.placed = True


def _lay_out(values, strategies, owner, matrix):
    for i, (t, s) in enumerate(zip(values, strategies)):
        if s is None or not isinstance(t, torch.Tensor):
            continue
        where = f"{owner} input {i}"
        layout.constrain(t, layout.tensor_layout(where, s, t.shape, matrix, True), where, matrix)


def _shard_inputs(module, args):
    plan = module._torchacc_shard
    if not context.uses_strategies():
        return None
    matrix = context.device_matrix()
    if not plan.placed:
        _place_params(module, plan, matrix)
    _lay_out(args, plan.inputs, plan.owner, matrix)
    return None


def _shard_outputs(module, args, out):
    plan = module._torchacc_shard
    if context.uses_strategies() and plan.outputs:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        _lay_out(outs, plan.outputs, f"{plan.owner} output", context.device_matrix())
    return None


def model_parallel_size(model):
    """The least common multiple of the devices every strategy in ``model`` uses."""
    mp = 1
    for m in model.modules():
        plan = getattr(m, "_torchacc_shard", None)
        if plan is not None:
            mp = math.lcm(mp, plan.devices_used())
        for v in vars(m).values():
            if isinstance(v, Primitive):
                mp = math.lcm(mp, v.devices_used())
    return mp


def _name(model):
    for mod_name, m in model.named_modules():
        m._torchacc_name = mod_name or type(model).__name__
        plan = getattr(m, "_torchacc_shard", None)
        if plan is not None:
            plan.owner = m._torchacc_name
        for attr, v in vars(m).items():
            if isinstance(v, Primitive) and "-op" in v.name:
                v.name = f"{mod_name + '.' if mod_name else ''}{attr} ({type(v).__name__})"


def gradient_scale():
    """The factor between XLA's exact gradient of the written loss and MindSpore's per-device
    gradient combined by ``gradients_mean`` (Note [Parallel modes on the sharding engine])."""
    d = context.data_parallel_degree()
    mean = context.option("gradients_mean")
    if context.option("loss_reduction") == "mean":
        return 1.0 if mean else float(d)
    return 1.0 / d if mean else 1.0


def parallelize(model):
    """Apply the context's parallel mode to ``model`` (on the torchacc device): the device
    matrix from its strategies, its parameters' layouts, its inputs split by batch, and
    ``gradients_mean``. In STAND_ALONE it returns the model unchanged."""
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
                from torchacc.parallel import auto

                auto.search(model, args)
        matrix = context.device_matrix()
        for t in args:
            layout.split_batch(t, f"{type(model).__name__} input", matrix)
        return None

    model.register_forward_pre_hook(split_inputs)
    if mode == ParallelMode.SEMI_AUTO_PARALLEL:
        matrix = context.device_matrix()
        for m in model.modules():
            plan = getattr(m, "_torchacc_shard", None)
            if plan is not None and not plan.placed and _on_device(m):
                _place_params(m, plan, matrix)
    for p in model.parameters():
        if p.requires_grad:
            p.register_hook(_scale_gradient)
    return model


def _scale_gradient(grad):
    scale = gradient_scale()
    return grad if scale == 1.0 else grad * scale


def _on_device(module):
    return all(p.device.type == "torchacc" for p in module.parameters())


def _broadcast_parameters(model):
    """``parameter_broadcast``: process 0's initial weights everywhere. One process drives all
    its devices with one copy, so this matters only across processes (JAX's broadcast)."""
    import jax

    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils

    with torch.no_grad():
        for p in model.parameters():
            host = p.detach().cpu().numpy()
            p.copy_(torch.from_numpy(multihost_utils.broadcast_one_to_all(host)))
