"""Trace-once programs that hold a collective: one manual region over the process axis.

A graph with a collective node (``torchacc.distributed``'s ``xm.all_reduce``,
``xm.reduce_gradients``, ``xm.optimizer_step`` inside ``compile_step``) is compiled the way the
lazy path compiles one (Note [Multi-process programs] in ``torchacc/distributed/__init__.py``):
``jax.shard_map`` over the mesh with one device per process, every operand declared replicated,
so the collectives are ``jax.lax.psum`` and friends over the mesh axis and the local arrays go in
and come out unchanged. This module adapts ``sharding.manual.compile_manual`` (flat arrays in, a
list out) to the trace-once frontend's pytree-shaped programs.
"""

from __future__ import annotations

import jax
import torch

from torchacc.lowering import lookup
from torchacc.sharding import manual


def is_collective(target):
    """Whether an FX node target is a collective (its rule is marked ``torchacc_collective``)."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    rule = lookup(target)
    return rule is not None and getattr(rule.fn, "torchacc_collective", False)


def has_collective(nodes):
    return any(n.op == "call_function" and is_collective(n.target) for n in nodes)


def compile(fn, *args):
    """``fn(*args)`` (pytrees of arrays; None leaves allowed) as one SPMD executable over the
    process mesh; returns a callable with ``fn``'s signature and output structure."""
    leaves, tree = jax.tree.flatten(args)
    out_tree = []

    def flat(*xs):
        out = fn(*jax.tree.unflatten(tree, list(xs)))
        out_leaves, out_tree_ = jax.tree.flatten(out)
        out_tree[:] = [out_tree_]
        return out_leaves

    exe = manual.compile_manual(flat, leaves, donate=())
    _check_device(exe, leaves)
    unflatten, leaves_of = jax.tree.unflatten, jax.tree.leaves

    def call(*xs):
        return unflatten(out_tree[0], exe(*leaves_of(xs)))

    return call


def _check_device(exe, leaves):
    for a in leaves:
        if isinstance(a, jax.Array) and a.devices() != {exe.device}:
            (d,) = a.devices()
            raise RuntimeError(
                f"torchacc.dynamo: a step with a collective runs on this process's mesh device "
                f"{exe.device}, but its tensors live on {d}; keep the model on the device "
                "torchacc uses (TORCHACC_DEVICE)"
            )


_eager_programs: dict = {}


def run_eager(op, args):
    """Run collective ``op`` (a custom op with a lowering rule) on CPU/CUDA tensors outside any
    trace: one small SPMD program per (op, shapes, dtypes, non-tensor arguments), cached. This
    is the op's CPU/CUDA kernel, so a step that ``compile_step`` runs eagerly (its first call)
    reduces exactly like its compiled form."""
    from torchacc.dynamo import bridge
    from torchacc.lowering import fx_calling

    rule = lookup(op)
    tensors = [t for a in args for t in (a if isinstance(a, (list, tuple)) else [a])]
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]
    device = bridge.jax_device_for(tensors[0].device)
    arrays = [bridge.to_jax(t, device) for t in tensors]
    shape = [_arg_shape(a) for a in args]
    key = (op, tuple((tuple(t.shape), t.dtype) for t in tensors), tuple(shape))
    exe = _eager_programs.get(key)
    if exe is None:

        def program(*xs):
            it = iter(xs)
            call_args = [_refill(a, it) for a in args]
            call_args, kwargs = fx_calling._convention(op, rule, call_args, {})
            out = rule.fn(*call_args, **kwargs)
            return list(out) if isinstance(out, (list, tuple)) else [out]

        exe = _eager_programs[key] = compile(program, *arrays)
    outs = exe(*arrays)
    cuda = device.platform != "cpu"
    results = [(bridge.to_torch_cuda(o) if cuda else bridge.to_torch_cpu(o)) for o in outs]
    schema_returns_list = str(op._schema.returns[0].type) == "List[Tensor]"
    return results if schema_returns_list else results[0]


def _arg_shape(a):
    if isinstance(a, torch.Tensor):
        return "T"
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        return ("L", len(a))
    return ("v", a)


def _refill(a, it):
    if isinstance(a, torch.Tensor):
        return next(it)
    if isinstance(a, (list, tuple)) and any(isinstance(t, torch.Tensor) for t in a):
        return [next(it) for _ in a]
    return a
