"""Same-shaped calls of one rule as one batched (``jax.vmap``) call, and elementwise calls on
pieces of a pack as one flat call (``apply_flat``): the optimizer updates.

Note [Batched optimizer updates]
An optimizer step applies the same elementwise update to every parameter. Member by member, each
parameter of its own shape is its own set of XLA kernels, and XLA compiles each (the cold first
step of GPT-2 with AdamW was ~4x its forward+backward, issue 32). ``apply_batched`` groups the calls
whose arguments have the same structure, the same array shapes and dtypes and the same Python
values, stacks the arrays that differ between the calls of a group along a new leading axis (an
array every call shares, such as the learning rate, is passed once) and runs the rule once under
``jax.vmap``; each call gets its slice of the results. The intent was kernels that grow with the
number of distinct parameter shapes, not with the number of parameters. Every element goes
through the same operations as member by member, so the results are the same bit for bit
(tests/test_optim_batched.py checks it).

It is OFF by default (``TORCHACC_BATCHED_UPDATES=1`` turns it on): measured on XLA:CPU it makes
compiles slower, not faster (48 AdamW parameters of one shape: 4.4 s instead of 1.1 s of CPU
for the fused step's compile, benchmarks/RESULTS.md). XLA already compiles identical kernels
once, so same-shaped members cost little each; the stacking and slicing the batch adds are
kernels of their own per member. On a GPU it would launch one kernel per group instead of one
per parameter (not measured: no GPU lent). What keeps the update's compile flat in depth is
parameters stored stacked (``ScannedLayers``, torchacc/lazy/scan_layers.py): the optimizer then
sees one parameter per layer weight name, whatever the depth. When on, the fused optimizers use
it for members that packed state does not already update as one flat array (Note [Flat optimizer
updates] in optim.py), and the ``_foreach_*`` batched nodes (Note [Batched foreach nodes] in
torchacc/lazy/foreach.py) for each op's elements. Each batched group counts
``BatchedOptimizerUpdate`` in torchacc.metrics when a program is lowered.
"""

from __future__ import annotations

import math
import os

import jax

from torchacc import metrics

enabled = [os.environ.get("TORCHACC_BATCHED_UPDATES", "0") == "1"]


def _signature(args):
    leaves, tree = jax.tree_util.tree_flatten(args)
    parts = []
    for leaf in leaves:
        if isinstance(leaf, jax.Array):
            parts.append((leaf.shape, leaf.dtype))
        else:
            parts.append(("value", type(leaf), leaf))
    return tree, tuple(parts), leaves


def apply_batched(fn, calls):
    """``[fn(*args, **kwargs) for args, kwargs in calls]``, each group of same-shaped calls as
    one ``jax.vmap`` call (Note [Batched optimizer updates])."""
    if not enabled[0] or len(calls) < 2:
        return [fn(*a, **k) for a, k in calls]
    groups, flat = {}, []
    for i, call in enumerate(calls):
        tree, parts, leaves = _signature(call)
        flat.append(leaves)
        try:
            groups.setdefault((tree, parts), []).append(i)
        except TypeError:  # an unhashable Python value: this call on its own
            groups[("alone", i)] = [i]
    out = [None] * len(calls)
    for key, idx in groups.items():
        if len(idx) == 1 or key[0] == "alone":
            for i in idx:
                out[i] = fn(*calls[i][0], **calls[i][1])
            continue
        metrics.counter_inc("BatchedOptimizerUpdate")
        for i, result in zip(idx, _vmapped(fn, key[0], [flat[i] for i in idx])):
            out[i] = result
    return out


def _vmapped(fn, tree, leaves_per_call):
    """One vmapped call for calls whose flattened arguments are ``leaves_per_call``."""
    first = leaves_per_call[0]
    stacked = [
        isinstance(leaf, jax.Array) and any(c[j] is not leaf for c in leaves_per_call)
        for j, leaf in enumerate(first)
    ]
    if not any(stacked):  # the same call every time
        args, kwargs = jax.tree_util.tree_unflatten(tree, first)
        return [fn(*args, **kwargs)] * len(leaves_per_call)
    batched = [
        jax.numpy.stack([c[j] for c in leaves_per_call]) for j in range(len(first)) if stacked[j]
    ]

    def one(*arrays):
        it = iter(arrays)
        leaves = [next(it) if s else leaf for s, leaf in zip(stacked, first)]
        args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
        return fn(*args, **kwargs)

    results = jax.vmap(one)(*batched)
    out_leaves, out_tree = jax.tree_util.tree_flatten(results)
    return [
        jax.tree_util.tree_unflatten(out_tree, [leaf[k] for leaf in out_leaves])
        for k in range(len(leaves_per_call))
    ]


def apply_flat(fn, calls, limit):
    """``[fn(*args, **kwargs) for args, kwargs in calls]`` for an elementwise ``fn`` (each call's
    array arguments all have its result's shape), with the calls whose arrays are pieces of a
    pack (at most ``limit`` elements) run as one call on flat arrays per dtype signature (Note
    [Flat optimizer updates] in optim.py); the others through ``apply_batched``."""
    if not limit or len(calls) < 2:
        return apply_batched(fn, calls)
    flat = [jax.tree_util.tree_flatten(call)[::-1] for call in calls]
    tree0, first = flat[0]
    if any(tree != tree0 or len(leaves) != len(first) for tree, leaves in flat):
        return apply_batched(fn, calls)
    shared = [all(_same(f[1][j], leaf) for f in flat) for j, leaf in enumerate(first)]
    if any(s and isinstance(leaf, jax.Array) and leaf.ndim for s, leaf in zip(shared, first)):
        return apply_batched(fn, calls)  # a shared array would not broadcast over a flat one
    groups, alone = {}, []
    for i, (_tree, leaves) in enumerate(flat):
        own = [leaf for s, leaf in zip(shared, leaves) if not s]
        shape = own[0].shape if own and isinstance(own[0], jax.Array) else None
        if shape is not None and all(
            isinstance(a, jax.Array) and a.shape == shape and a.size <= limit for a in own
        ):
            groups.setdefault(tuple(a.dtype for a in own), []).append(i)
        else:
            alone.append(i)
    out = [None] * len(calls)
    for i, r in zip(alone, apply_batched(fn, [calls[i] for i in alone])):
        out[i] = r
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = fn(*calls[idx[0]][0], **calls[idx[0]][1])
            continue
        for i, r in zip(idx, _flat_call(fn, tree0, shared, [flat[i][1] for i in idx])):
            out[i] = r
    return out


def _same(a, b):
    if a is b:
        return True
    return not isinstance(a, jax.Array) and type(a) is type(b) and a == b


def _flat_call(fn, tree, shared, leaves_per_call):
    """One call of ``fn`` on the calls' own arrays raveled and concatenated; per call its slice
    of the result (member by member instead if ``fn`` does not return one flat array)."""
    sizes = [next(x for s, x in zip(shared, c) if not s).size for c in leaves_per_call]
    shapes = [next(x for s, x in zip(shared, c) if not s).shape for c in leaves_per_call]
    first = leaves_per_call[0]
    leaves = [
        leaf if s else jax.numpy.concatenate([c[j].ravel() for c in leaves_per_call])
        for j, (s, leaf) in enumerate(zip(shared, first))
    ]
    args, kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    result = fn(*args, **kwargs)
    total = sum(sizes)
    if not (isinstance(result, jax.Array) and result.shape == (total,)):
        calls = [jax.tree_util.tree_unflatten(tree, c) for c in leaves_per_call]
        return [fn(*a, **k) for a, k in calls]
    metrics.counter_inc("FlatForeachUpdate")
    return [piece(result, start, shape) for start, shape in zip(offsets_of(sizes), shapes)]


def offsets_of(sizes):
    """Where each of ``sizes`` starts when they lie one after another."""
    starts, start = [], 0
    for size in sizes:
        starts.append(start)
        start += size
    return starts


def piece(flat, start, shape):
    """``flat[start:start + prod(shape)].reshape(shape)`` through ``lax`` directly: the same HLO
    as jnp's indexing at ~1/5 of its trace time (a flat update slices hundreds of members)."""
    size = math.prod(shape)
    return jax.lax.reshape(jax.lax.slice(flat, (start,), (start + size,)), tuple(shape))
