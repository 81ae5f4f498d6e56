"""Strategies to partition specs: validating a strategy against a tensor, putting its slice
counts on device-matrix axes, laying out parameters (one layout per parameter) and activations.

See Note [Parallel modes on the sharding engine] in ``torchacc/parallel/__init__.py``.
"""

from __future__ import annotations

import itertools
import math

import torch

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.parallel import context
from torchacc.sharding import api as engine


def check_strategy(owner, strategy, n=None):
    """``strategy`` as a tuple of positive ints, its product dividing the device count."""
    if not isinstance(strategy, (tuple, list)) or not all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 1 for s in strategy
    ):
        raise ValueError(f"{owner}: strategy {strategy!r} must be a tuple of positive ints")
    strategy = tuple(strategy)
    n = n or context.get_group_size()
    total = math.prod(strategy)
    if total > n or n % total:
        raise ValueError(
            f"{owner}: strategy {strategy} uses {total} devices; the job has {n} devices, and a "
            "strategy's slice counts must multiply to a divisor of it"
        )
    return strategy


def check_against(owner, strategy, shape, what="input"):
    """The strategy fits a tensor of ``shape``: one entry per dimension, each dividing it."""
    shape = tuple(shape)
    if len(strategy) != len(shape):
        raise ValueError(
            f"{owner}: strategy {strategy} has {len(strategy)} entries for {what} of shape "
            f"{shape} (rank {len(shape)})"
        )
    for d, (s, n) in enumerate(zip(strategy, shape)):
        if n % s:
            raise ValueError(
                f"{owner}: strategy {strategy} splits dimension {d} of {what} of shape {shape} "
                f"into {s} slices, which do not divide {n}"
            )


def assign_axes(owner, counts, matrix, reserved=()):
    """Device-matrix axes for each label's slice count ``{label: count}`` (labels in the order
    they are placed): a subset of free axes whose sizes multiply to the count, the most minor
    (model-parallel) axes first. Returns ``({label: axes}, leftover axes)``."""
    free = [a for a in matrix.names if a not in reserved]
    out = {}
    for label, count in counts.items():
        if count == 1:
            out[label] = ()
            continue
        best = None
        for k in range(1, len(free) + 1):
            for combo in itertools.combinations(range(len(free)), k):
                if math.prod(matrix.size([free[i]]) for i in combo) != count:
                    continue
                score = sorted(combo, reverse=True)
                if best is None or score > best:
                    best = score
        if best is None:
            raise ValueError(
                f"{owner}: cannot lay {count} slices on the free axes {free} of {matrix} "
                f"(strategies {dict(counts)}); the slice counts of one op must multiply to a "
                "divisor of the model-parallel size"
            )
        out[label] = tuple(free[i] for i in sorted(best))
        free = [a for i, a in enumerate(free) if i not in best]
    return out, tuple(free)


def spec_for(labels, axes_of, batch_axes=()):
    """A partition spec: each dimension's axes; ``batch_axes`` joins dimension 0 (major)."""
    spec = []
    for d, label in enumerate(labels):
        axes = tuple(batch_axes) + axes_of.get(label, ()) if d == 0 else axes_of.get(label, ())
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return tuple(spec)


def is_parameter(t):
    return isinstance(t, torch.nn.Parameter)


def place_parameter(p, owner, strategy, spec, matrix):
    """Lay parameter ``p`` out as ``spec``; a parameter keeps one layout: a second owner with
    another strategy is an error naming both."""
    held = getattr(p, "_torchacc_parallel_layout", None)
    if held is not None:
        if held[1] != strategy:
            raise ValueError(
                f"parameter of shape {tuple(p.shape)} is used by {held[0]} with strategy "
                f"{held[1]} and by {owner} with strategy {strategy}; a parameter shared by two "
                "ops must have one strategy"
            )
        return
    sharding = engine.named_sharding(matrix.mesh, spec, tuple(p.shape), owner)
    engine.mark(p, sharding, owner)
    p._torchacc_parallel_layout = (owner, strategy, spec)


def split_batch(t, owner, matrix, axes=None):
    """Constrain activation ``t`` to be split by dimension 0 over ``axes`` (default: the data
    parallel axes)."""
    axes = matrix.dp_axes if axes is None else axes
    if not axes or not isinstance(t, torch.Tensor) or t.device.type != DEVICE_TYPE or t.dim() == 0:
        return t
    size = matrix.size(axes)
    if t.shape[0] % size:
        raise ValueError(
            f"{owner}: the batch dimension of an input of shape {tuple(t.shape)} does not split "
            f"into {size} data-parallel slices ({matrix})"
        )
    spec = (axes[0] if len(axes) == 1 else tuple(axes),) + (None,) * (t.dim() - 1)
    engine.mark_spec(t, matrix.mesh, spec, owner)
    return t


def constrain(t, spec, owner, matrix):
    """A sharding constraint (or a reshard of a computed tensor) on activation ``t``."""
    if isinstance(t, torch.Tensor) and t.device.type == DEVICE_TYPE:
        engine.mark_spec(t, matrix.mesh, spec, owner)
    return t


def tensor_layout(owner, strategy, shape, matrix, activation):
    """The partition spec of one tensor under ``strategy`` (its dims laid on free axes, the axes
    left over split dimension 0 when it is an activation)."""
    check_against(owner, strategy, shape, "an input" if activation else "parameter")
    labels = list(range(len(strategy)))
    counts = {d: strategy[d] for d in reversed(labels)}
    axes_of, left = assign_axes(owner, counts, matrix)
    batch = left if activation and shape else ()
    if batch and shape[0] % (strategy[0] * matrix.size(batch)):
        raise ValueError(
            f"{owner}: strategy {strategy} leaves {matrix.size(batch)} devices to split the "
            f"batch dimension of an input of shape {tuple(shape)}, and {strategy[0]} x "
            f"{matrix.size(batch)} slices do not divide {shape[0]}"
        )
    return spec_for(labels, axes_of, batch)
