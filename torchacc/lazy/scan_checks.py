"""Input checks and the eager reference of ``scan`` (torchacc/lazy/scan.py): shared by the lazy
recorder's path and the trace-once frontend's (scan_capture.py)."""

from __future__ import annotations

import torch
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from torchacc.lazy.tensor import LazyTensor


def _flatten(tree):
    """The tensor leaves of ``tree`` (None leaves left out, as torch_xla does) and how to put
    them back."""
    leaves, spec = tree_flatten(tree)
    return [v for v in leaves if v is not None], (spec, tuple(v is None for v in leaves))


def _unflatten(tensors, spec):
    it = iter(tensors)
    return tree_unflatten([None if none else next(it) for none in spec[1]], spec[0])


def _check_inputs(init, xs):
    """The common length of ``xs``'s leaves (ValueError naming the leaves that disagree)."""
    leaves = tree_flatten_with_path(xs)[0]
    if not leaves:
        raise ValueError(f"scan: xs {xs!r} is an empty pytree (nothing to scan over)")
    for path, t in tree_flatten_with_path(init)[0] + leaves:
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"scan: leaf {keystr(path) or '<root>'} is a {type(t).__name__}, not a tensor"
            )
    first_path, first = leaves[0]
    for path, t in leaves:
        if t.dim() == 0:
            raise ValueError(
                f"scan: xs leaf {keystr(path) or '<root>'} is 0-d; every leaf of xs "
                "needs a leading dimension to scan over"
            )
        if t.shape[0] != first.shape[0]:
            raise ValueError(
                f"scan: the leaves of xs must have the same leading length: xs"
                f"{keystr(first_path)} has shape {tuple(first.shape)}, xs{keystr(path)} has "
                f"shape {tuple(t.shape)}"
            )
    return first.shape[0]


def _check_same_device(init, xs):
    for name, tree in (("init", init), ("xs", xs)):
        for path, t in tree_flatten_with_path(tree)[0]:
            if type(t) is not LazyTensor:
                raise ValueError(
                    f"scan: {name}{keystr(path)} is on {t.device}, the other leaves on torchacc; "
                    "move it with .to(device)"
                )


def _check_carry(new, spec, flat_init, init_spec):
    if spec != init_spec:
        raise ValueError(f"scan: fn returned a carry of structure {spec}, init has {init_spec}")
    paths = [keystr(p) for p, _ in tree_flatten_with_path(tree_unflatten(flat_init, spec))[0]]
    for path, a, b in zip(paths, flat_init, new):
        if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
            raise ValueError(
                f"scan: fn changed carry{path} from shape {tuple(a.shape)} {a.dtype} to "
                f"{tuple(b.shape)} {b.dtype}; the carry must keep its shape and dtype"
            )


def _loop(fn, init, xs, length):
    flat_xs, xs_spec = tree_flatten(xs)
    flat_init, init_spec = tree_flatten(init)
    carry, ys = init, []
    for i in range(length):
        carry, y = fn(carry, tree_unflatten([t[i] for t in flat_xs], xs_spec))
        flat_new, spec = tree_flatten(carry)
        _check_carry(flat_new, spec, flat_init, init_spec)
        ys.append(_flatten(y))
    if not ys:
        raise ValueError("scan: xs has length 0; the outputs' structure is unknown")
    flat_ys = [torch.stack([y[0][j] for y in ys]) for j in range(len(ys[0][0]))]
    return carry, _unflatten(flat_ys, ys[0][1])
