"""Replaying one FX node with its lowering rule: the rules' calling convention (Note [FX calling
convention] in torchacc/dynamo/lower.py), result fix-ups, and the Python size/scalar nodes between
them. Used by the trace-once frontend's programs and by the bodies of ``torchacc.scan`` (scan.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import fx

from torchacc.lowering.dtypes import JAX_TO_TORCH, jdtype, wrapped_number_dtype
from torchacc.lowering.registry import scalar_arguments

_TRACED_ITEM = torch.ops.aten._local_scalar_dense.default
# higher-order operator -> its lowering, called with the node's arguments (subgraphs as
# GraphModules, tensors as arrays); filled by the families that lower one (scan.py)
HOP_RULES: dict = {}


def _val(node):
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _lift(value, dtype):
    if value is None or isinstance(value, jax.Array):
        return value
    if isinstance(value, (list, tuple)):
        return [_lift(v, dtype) for v in value]
    if isinstance(value, bool) or isinstance(value, int):
        return jnp.asarray(value, jnp.int64)
    if isinstance(value, float):
        return jnp.asarray(value, jnp.float64)
    return value


def _wrapped(value, partner):
    """A Python number in a Tensor slot as a 0-d array (Note [FX calling convention])."""
    kind = type(value)
    if kind not in (bool, int, float):
        return value
    ref = JAX_TO_TORCH.get(np.dtype(partner.dtype)) if partner is not None else None
    return jnp.asarray(value, wrapped_number_dtype(kind, ref))


def _convention(op, rule, args, kwargs):
    """Apply Note [FX calling convention] to one node's concrete arguments."""
    lifted = scalar_arguments(op, rule.static)
    schema = op._schema.arguments
    positional = [a for a in schema if not a.kwarg_only]
    partner = None
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, jax.Array) or hasattr(a, "aval"):
            partner = a
            break
        if isinstance(a, (list, tuple)) and a and hasattr(a[0], "aval"):
            partner = a[0]
            break
    args = list(args)
    for i, value in enumerate(args):
        if i >= len(positional):
            break
        args[i] = _convert_arg(positional[i], value, lifted, partner)
    by_name = {a.name: a for a in schema}
    kwargs = {
        k: (_convert_arg(by_name[k], v, lifted, partner) if k in by_name else v)
        for k, v in kwargs.items()
    }
    return args, kwargs


def _convert_arg(arg, value, lifted, partner):
    if arg.name in lifted:
        return _lift(value, None)
    if str(arg.type) in ("Tensor", "Optional[Tensor]"):
        return _wrapped(value, partner)
    return value


def _meta_list(val):
    if isinstance(val, (tuple, list)):
        return list(val)
    return [val]


def eval_rule(node, rule, args, kwargs, keys):
    """Run ``rule`` for ``node`` inside a JAX trace; returns its (cast, checked) result."""
    op = node.target
    args, kwargs = _convention(op, rule, args, kwargs)
    val = _val(node)
    metas = _meta_list(val)
    extra = {}
    if rule.rng:
        keys[0], sub = jax.random.split(keys[0])
        extra["rng"] = sub
    if rule.out_meta:
        extra["out"] = [
            None if m is None else (tuple(int(s) for s in m.shape), jdtype(m.dtype)) for m in metas
        ]
    result = rule.fn(*args, **kwargs, **extra)
    multi = isinstance(val, (tuple, list))
    results = list(result) if isinstance(result, (tuple, list)) else [result]
    if val is not None and len(results) != len(metas):
        raise RuntimeError(
            f"torchacc: lowering of {rule.name} returned {len(results)} outputs, "
            f"PyTorch's op has {len(metas)}"
        )
    fixed = [_fix(r, m, rule) for r, m in zip(results, metas)] if val is not None else results
    return fixed if multi else fixed[0]


def _fix(r, meta, rule):
    if meta is None or not isinstance(meta, torch.Tensor):
        return r
    if r is None:
        raise RuntimeError(
            f"torchacc: lowering of {rule.name} returned None for an output PyTorch's op produces"
        )
    r = jnp.asarray(r)
    want = jdtype(meta.dtype)
    if r.dtype != want:
        r = r.astype(want)
    shape = tuple(meta.shape)
    if all(type(s) is int for s in shape) and r.shape != shape:
        if 0 in shape:  # an empty placeholder output (e.g. eval-mode batch norm's saved stats)
            return jnp.zeros(shape, want)
        raise RuntimeError(
            f"torchacc: lowering of {rule.name} gave shape {r.shape}, PyTorch's op gives {shape}"
        )
    return r


_SIZE_OPS = {
    torch.ops.aten.sym_size.int: lambda x, d: x.shape[d],
    torch.ops.aten.sym_numel.default: lambda x: int(np.prod(x.shape)),
    _TRACED_ITEM: lambda x: x,
}


def _eval_python(node, env):
    """A getitem, size computation or higher-order op inside a JAX trace (arrays have static
    shapes there)."""
    size = _SIZE_OPS.get(node.target)
    if size is not None:
        return size(*fx.node.map_arg(node.args, env.__getitem__))
    hop = HOP_RULES.get(node.target)
    if hop is not None:
        args = fx.node.map_arg(node.args, env.__getitem__)
        return hop(*args, **fx.node.map_arg(node.kwargs, env.__getitem__))
    return _run_python(node, env)


def _run_python(node, env):
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
    return node.target(*args, **kwargs)


def is_hop(node):
    """A higher-order op node torchacc lowers (a ``torch.ops.higher_order.scan``)."""
    return node.op == "call_function" and node.target in HOP_RULES
