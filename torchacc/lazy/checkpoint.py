"""Gradient checkpointing that saves device memory on the lazy device: ``optimization_barrier_``
and ``checkpoint`` (``Config.memory.gc`` applies it: ``apply_gc`` in torchacc/accel/gc.py).

Note [Checkpointing that saves memory]
Checkpointing runs a block's forward without keeping its activations and recomputes them in
backward. On the lazy device both runs are recorded into the *same* XLA program, from the same
input values: XLA's common-subexpression elimination sees the recompute as a copy of the forward,
merges them, and the activations stay alive from forward to backward -- numerically right, no
memory saved. ``checkpoint`` here therefore feeds the recompute through a fence,
``torchacc::checkpoint_fence`` over the block's saved inputs *and* the gradients arriving at its
outputs (an optimization barrier plus a select XLA cannot fold; torchacc/lowering/memory.py says
why a barrier alone is not enough on XLA:CPU):

- the fence's outputs are new values to XLA, so the recompute is no longer the forward's twin;
- they depend on the incoming gradients, so XLA cannot schedule the recompute before backward
  reaches the block (which would again keep its activations alive).

The forward itself runs under ``no_grad`` (the reentrant scheme), so it saves nothing for autograd;
the recompute runs under the forward's autocast state and device RNG state (dropout masks match).
On other devices the barrier is a no-op (and ``apply_gc`` uses ``torch.utils.checkpoint``).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchacc.lazy import random as _device_random
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.mutation import assign
from torchacc.lazy.record import fresh, record_values
from torchacc.lazy.tensor import LazyTensor
from torchacc.lowering import custom_ops

_AUTOCAST_DEVICES = (DEVICE_TYPE, "cpu")
_NEEDS_GRAD = torch.zeros((), requires_grad=True)


def _on_device(t):
    return isinstance(t, LazyTensor)


def _barrier_values(tensors):
    return record_values(custom_ops.optimization_barrier, (list(tensors),), {})[0]


def _fenced_values(tensors, after):
    return record_values(custom_ops.checkpoint_fence, (list(tensors), list(after)), {})[0]


def optimization_barrier_(tensors):
    """torch_xla's ``xm.optimization_barrier_``: ``tensors`` (torchacc tensors; others are left
    alone) keep their values, now as the outputs of one XLA optimization barrier."""
    lazy = [t for t in tensors if _on_device(t)]
    if lazy:
        for t, v in zip(lazy, _barrier_values(lazy)):
            assign(t, v)


def _autocast_state():
    return [
        (d, torch.get_autocast_dtype(d), torch.is_autocast_cache_enabled())
        for d in _AUTOCAST_DEVICES
        if torch.is_autocast_enabled(d)
    ]


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, preserve_rng_state, _needs_grad, *args):
        ctx.run = run
        ctx.rng = None
        if preserve_rng_state:
            ctx.rng = (_device_random.get_state(), torch.get_rng_state())
        ctx.autocast = _autocast_state()
        ctx.positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        ctx.args = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.positions))
        with torch.no_grad():
            return run(*args)

    @staticmethod
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        lazy = [t for t in saved if _on_device(t)]
        lazy_grads = [g for g in grads if _on_device(g)]
        fenced = {}
        if lazy:  # Note [Checkpointing that saves memory]
            fenced = {id(t): fresh(v) for t, v in zip(lazy, _fenced_values(lazy, lazy_grads))}
        args = list(ctx.args)
        inputs = []
        for i, t in zip(ctx.positions, saved):
            x = fenced.get(id(t), t).detach()
            x.requires_grad_(t.requires_grad)
            args[i] = x
            inputs.append(x)
        current = None
        if ctx.rng is not None:
            current = (_device_random.get_state(), torch.get_rng_state())
            _device_random.set_state(ctx.rng[0])
            torch.set_rng_state(ctx.rng[1])
        try:
            with torch.enable_grad():
                contexts = [
                    torch.autocast(d, dtype=dt, cache_enabled=c) for d, dt, c in ctx.autocast
                ]
                for c in contexts:
                    c.__enter__()
                try:
                    outputs = ctx.run(*args)
                finally:
                    for c in reversed(contexts):
                        c.__exit__(None, None, None)
        finally:
            if current is not None:
                _device_random.set_state(current[0])
                torch.set_rng_state(current[1])
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [
            (o, g)
            for o, g in zip(outputs, grads)
            if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = [None] * len(ctx.args)
        for i, x in zip(ctx.positions, inputs):
            input_grads[i] = x.grad if x.requires_grad else None
        return (None, None, None, *input_grads)


def checkpoint(function, *args, preserve_rng_state=True, **kwargs):
    """Run ``function(*args, **kwargs)`` keeping none of its activations; they are recomputed in
    backward behind a fence (Note [Checkpointing that saves memory]). Gradients flow to every
    tensor in ``args`` and ``kwargs``, nested ones included (tuples, lists, dicts: HF layers take
    ``position_embeddings=(cos, sin)``), and to the parameters ``function`` uses."""
    leaves, spec = tree_flatten((args, kwargs))
    where = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
    if len(where) == len(leaves) and not kwargs:
        run = function
    else:  # tensors travel as arguments (saved, fenced, given gradients), the rest as they are

        def run(*tensors):
            filled = list(leaves)
            for i, t in zip(where, tensors, strict=True):
                filled[i] = t
            a, kw = tree_unflatten(filled, spec)
            return function(*a, **kw)

        args = tuple(leaves[i] for i in where)
    # the output needs a grad_fn even when no tensor in ``args`` requires grad (the parameters
    # ``function`` uses are not arguments): a CPU scalar that requires grad, given no gradient
    return _Checkpoint.apply(run, preserve_rng_state, _NEEDS_GRAD, *args)
