"""Fused optimizer updates: ``_fused_adam``, ``_fused_adamw``, ``_fused_sgd`` (functional forms).

torch.optim's ``fused=True`` path calls the in-place ``_fused_<opt>_`` once per (device, dtype)
group; the recorder records it as one node of the functional twin (whose outputs are the new values
of every list the op mutates) and writes them back. So a whole group's update is one node, however
many parameters it has, instead of ~15 recorded ops per parameter. The syncfree optimizers use the
same ops (torchacc/amp/syncfree).

Semantics follow PyTorch's fused CPU/CUDA kernels:
- ``grad_scale`` (GradScaler): gradients are divided by it first, and the unscaled gradients are
  written back into ``grads`` (the only case in which ``grads`` changes);
- ``found_inf`` > 0: nothing changes at all (parameters, state, gradients), on the device;
- bias corrections and the step size are computed from ``state_steps`` in float64, as the kernels
  do in double, then applied in the parameters' compute type (float32 for half types).

``weight_decay`` (and SGD's ``momentum``) decide the shape of the computation, as in torch's
kernels (``if weight_decay != 0``), so they are static: changing them recompiles. The learning rate
and betas are runtime scalars (schedules never recompile); ``tensor_lr`` overloads take a tensor.
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
import torch

from torchacc import metrics
from torchacc.lowering.batching import apply_batched, offsets_of, piece
from torchacc.lowering.registry import register

aten = torch.ops.aten


def _compute_type(dtype):
    """The type the update is computed in (torch's opmath: float32 for half types)."""
    return jnp.float32 if dtype in (jnp.float16, jnp.bfloat16) else dtype


def _scalar(x):
    """A runtime scalar or a 1-element tensor argument as a 0-d float64 array."""
    return jnp.asarray(x).reshape(()).astype(jnp.float64)


def _skip(found_inf):
    return None if found_inf is None else jnp.asarray(found_inf).reshape(()) > 0


def _keep(skip, old, new):
    """``new`` unless the step is skipped; in ``old``'s dtype."""
    new = new.astype(old.dtype)
    return new if skip is None else jnp.where(skip, old, new)


def _unscaled(grad, grad_scale, compute):
    g = grad.astype(compute)
    if grad_scale is not None:
        g = g / jnp.asarray(grad_scale).reshape(()).astype(compute)
    return g


# Note [Flat optimizer updates]
# A fused update is elementwise, so the members of a group that packed state keeps in packs
# (Note [Packed state] in program/pack.py: at most TORCHACC_PACK_MAX_NUMEL elements, i.e. biases,
# norm scales, small weights) are updated as ONE flat array when their dtypes match: each list's
# members are raveled and concatenated, the update runs once, and the results are sliced back.
# Member by member it would be a few XLA kernels each, and distinct ones: each member is read at its
# own offset of a pack, so no two members' kernels are the same program and XLA compiles every one
# (~8 ms each on XLA:CPU); on a GPU each kernel is also a launch per step. The members are
# consecutive pieces of a pack (an optimizer's outputs of the step before, laid out in order), so
# their concatenation folds back into one slice of it, and the results into the output pack.
# Larger members keep their own update (concatenating them would copy them; same-shaped ones are
# batched instead, Note [Batched optimizer updates] in batching.py), and so does every
# member when packing is off: separate arrays concatenated and sliced apart again gave XLA:CPU
# more kernels and copies, not fewer (measured on the narrow ResNet-50 step); the program stage
# says which programs read packs (``packed_members``). Each flat group counts
# ``FlatOptimizerUpdate`` in torchacc.metrics when a program is lowered. Per-member scalars
# (each member's bias corrections) stay one scalar where the members share their step count
# (Note [One step count per group] in amp/syncfree/_base.py); where each has a count of its own
# (torch's fused Adam) they are broadcast over each member's span, a few small kernels per member
# still (computing them as one vector and repeating it over the spans, ``jnp.repeat``, compiled
# slower on XLA:CPU: GPT-2's fused step 6.7 s instead of 3.9 s). The foreach path's list ops
# (``_foreach_*`` batched nodes, Note [Batched foreach nodes]) do the same for their elementwise
# ops on pieces (``batching.apply_flat``), 0-d step counts included.
# Each element sees the same operations as member by member; only the last bit may differ where
# XLA:CPU vectorizes a long array differently (tests/test_cold_step.py finds the same bits).


_packed_limit = [0]  # set while the program stage traces a program whose state comes packed


@contextlib.contextmanager
def packed_members(limit):
    """While tracing a program whose inputs come packed: members of at most ``limit`` elements
    are pieces of a pack, and update as flat arrays (Note [Flat optimizer updates]). The program
    stage sets it (program/build.py); elsewhere (torchacc.dynamo, unpacked steps) it is 0."""
    old = _packed_limit[0]
    _packed_limit[0] = limit
    try:
        yield
    finally:
        _packed_limit[0] = old


def packed_limit():
    """The element count up to which members are pieces of a pack now (0: none are)."""
    return _packed_limit[0]


_update_fns: set = set()  # rule functions of optimizer updates (see is_update)


def update_rule(fn):
    """Mark rule function ``fn`` as an optimizer update: a fused optimizer or a batched
    ``_foreach_*`` node (Note [The update runs after every read of what it overwrites] in
    program/build.py). Returns ``fn``."""
    _update_fns.add(fn)
    return fn


def is_update(op):
    """Whether recorded op ``op`` (an OpEntry) is an optimizer update (``update_rule``)."""
    return op.rule.fn in _update_fns


def _lists_update(update, lists, n, scalars_of=None, keys=None):
    """``update(arrays, scalars)`` -> new arrays, for each of the ``n`` members of ``lists`` (an
    empty list gives None members); the members a pack would hold, once per flat group of equal
    dtypes (Note [Flat optimizer updates]). ``scalars_of(key)`` gives a member's scalars from its
    ``keys[i]``, once per distinct key. Returns one output list per array ``update`` returns."""
    cache, limit = {}, _packed_limit[0]

    def scalars(i):
        if scalars_of is None:
            return ()
        key = keys[i]
        got = cache.get(id(key))
        if got is None:
            got = cache[id(key)] = (key, scalars_of(key))
        return got[1]

    def members(i):
        return [lst[i] if lst else None for lst in lists]

    groups, out, alone = {}, [None] * n, []
    for i in range(n):
        arrays = members(i)
        if limit and arrays[0].size <= limit:
            dtypes = tuple(None if a is None else a.dtype for a in arrays)
            groups.setdefault(dtypes, []).append(i)
        else:
            alone.append(i)
    # the others: same-shaped members as one batched update (Note [Batched optimizer updates])
    results = apply_batched(update, [((members(i), scalars(i)), {}) for i in alone])
    for i, r in zip(alone, results):
        out[i] = r
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = update(members(idx[0]), scalars(idx[0]))
            continue
        metrics.counter_inc("FlatOptimizerUpdate")
        for i, results in zip(idx, _flat_update(update, lists, idx, scalars)):
            out[i] = results
    return [list(column) for column in zip(*out)] if n else []


def _flat_update(update, lists, idx, scalars):
    """The members ``idx`` updated as one flat array; per member its results."""
    shapes = [lists[0][i].shape for i in idx]
    sizes = [lists[0][i].size for i in idx]
    flat = [jnp.concatenate([lst[i].ravel() for i in idx]) if lst else None for lst in lists]
    per = [scalars(i) for i in idx]
    shared = []
    for k in range(len(per[0])):
        values = [s[k] for s in per]
        if all(v is values[0] for v in values):
            shared.append(values[0])
        else:
            shared.append(
                jnp.concatenate([jnp.broadcast_to(v, (z,)) for v, z in zip(values, sizes)])
            )
    results = update(flat, tuple(shared))
    return [
        [piece(r, start, shape) for r in results] for shape, start in zip(shapes, offsets_of(sizes))
    ]


def _adam(
    params,
    grads,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    *,
    lr,
    beta1,
    beta2,
    weight_decay,
    eps,
    amsgrad,
    maximize,
    grad_scale=None,
    found_inf=None,
    decoupled,
):
    skip = _skip(found_inf)
    lr, beta1, beta2, eps = _scalar(lr), _scalar(beta1), _scalar(beta2), _scalar(eps)

    def bias_corrections(step):  # float64, as torch's kernels compute them in double
        step = _scalar(step)
        return lr / (1.0 - beta1**step), jnp.sqrt(1.0 - beta2**step)

    def update(arrays, scalars):
        p, g, m, v, vmax = arrays
        step_size, bias2_sqrt = scalars
        compute = _compute_type(p.dtype)
        grad = _unscaled(g, grad_scale, compute)
        param = p.astype(compute)
        d = -grad if maximize else grad
        if weight_decay != 0:
            if decoupled:
                param = param - (lr * weight_decay).astype(compute) * param
            else:
                d = d + weight_decay * param
        b1, b2 = beta1.astype(compute), beta2.astype(compute)
        m_new = m.astype(compute) + (1 - b1) * (d - m.astype(compute))
        v_new = b2 * v.astype(compute) + (1 - b2) * d * d
        second = v_new
        results = []
        if amsgrad:
            second = jnp.maximum(vmax.astype(compute), v_new)
            results.append(_keep(skip, vmax, second))
        denom = jnp.sqrt(second) / bias2_sqrt.astype(compute) + eps.astype(compute)
        param = param - step_size.astype(compute) * m_new / denom
        results += [_keep(skip, p, param), _keep(skip, m, m_new), _keep(skip, v, v_new)]
        if grad_scale is not None:
            results.append(_keep(skip, g, grad))
        return results

    lists = (params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs if amsgrad else [])
    columns = _lists_update(update, lists, len(params), bias_corrections, state_steps)
    if not columns:
        return [], list(grads), [], [], list(max_exp_avg_sqs)
    if amsgrad:
        out_vmax, columns = columns[0], columns[1:]
    else:
        out_vmax = list(max_exp_avg_sqs)
    out_p, out_m, out_v = columns[:3]
    out_g = columns[3] if grad_scale is not None else list(grads)
    return out_p, out_g, out_m, out_v, out_vmax


@register(aten._fused_adam, static=("weight_decay",))
@update_rule
def fused_adam(*args, **kwargs):
    return _adam(*args, **kwargs, decoupled=False)


@register(aten._fused_adamw, static=("weight_decay",))
@update_rule
def fused_adamw(*args, **kwargs):
    return _adam(*args, **kwargs, decoupled=True)


@register(aten._fused_sgd, static=("weight_decay", "momentum"))
@update_rule
def fused_sgd(
    params,
    grads,
    momentum_buffer_list,
    *,
    weight_decay,
    momentum,
    lr,
    dampening,
    nesterov,
    maximize,
    is_first_step,
    grad_scale=None,
    found_inf=None,
):
    skip = _skip(found_inf)
    lr, dampening = _scalar(lr), _scalar(dampening)

    def update(arrays, _scalars):
        p, g, old = arrays
        compute = _compute_type(p.dtype)
        grad = _unscaled(g, grad_scale, compute)
        param = p.astype(compute)
        d = -grad if maximize else grad
        if weight_decay != 0:
            d = d + weight_decay * param
        results = []
        if momentum != 0:
            if is_first_step:
                buf = d
            else:
                buf = momentum * old.astype(compute) + (1 - dampening.astype(compute)) * d
            results.append(_keep(skip, old, buf))
            d = d + momentum * buf if nesterov else buf
        param = param - lr.astype(compute) * d
        results.append(_keep(skip, p, param))
        if grad_scale is not None:
            results.append(_keep(skip, g, grad))
        return results

    buffers = momentum_buffer_list if momentum != 0 else []
    columns = _lists_update(update, (params, grads, buffers), len(params))
    if not columns:
        return [], list(grads), list(momentum_buffer_list)
    if momentum != 0:
        out_b, columns = columns[0], columns[1:]
    else:
        out_b = list(momentum_buffer_list)
    out_g = columns[1] if grad_scale is not None else list(grads)
    return columns[0], out_g, out_b
