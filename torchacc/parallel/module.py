"""Module-level strategies (``shard(module, in_strategy, out_strategy, parameter_plan)``): the
plans, their hooks and the parameters' layouts, and the gradient factor of ``gradients_mean``.

See Note [Parallel modes on the sharding engine] in ``torchacc/parallel/__init__.py``.
"""

from __future__ import annotations

import math

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.parallel import context, layout
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


def place_params(module, plan, matrix):
    for name, strategy in plan.params.items():
        p = module.get_parameter(name)
        if p.device.type != DEVICE_TYPE:
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
        place_params(module, plan, matrix)
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


def gradient_scale():
    """The factor between XLA's exact gradient of the written loss and MindSpore's per-device
    gradient combined by ``gradients_mean`` (Note [Parallel modes on the sharding engine])."""
    d = context.data_parallel_degree()
    mean = context.option("gradients_mean")
    if context.option("loss_reduction") == "mean":
        return 1.0 if mean else float(d)
    return 1.0 / d if mean else 1.0
