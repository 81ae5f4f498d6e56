"""Horovod's reduce ops, ``allreduce`` in all its forms, async handles, and the host-side check
that the ranks' tensors agree (the other collectives are in ``exchange.py``).

Each picks its path from the tensor (Note [Horovod on two paths] in ``horovod/__init__.py``): a
CPU or CUDA tensor goes through the ``torch.distributed`` group ``hvd.init()`` made; a torchacc
tensor is recorded into the step with ``torchacc.distributed.collectives``.
"""

from __future__ import annotations

import hashlib
import itertools

import torch
import torch.distributed as dist

from torchacc.horovod import basics
from torchacc.lazy.tensor import LazyTensor
from torchacc.sharding import collectives as C


class ReduceOp:
    """Horovod's reduction ops (``hvd.Average``, ``hvd.Sum``, ...)."""

    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"hvd.{self.name}"


Average, Sum, Adasum, Min, Max, Product = (
    ReduceOp(n) for n in ("Average", "Sum", "Adasum", "Min", "Max", "Product")
)
_TORCH_OP = {"Sum": "SUM", "Average": "SUM", "Min": "MIN", "Max": "MAX", "Product": "PRODUCT"}
_DEVICE_OP = {"Sum": "sum", "Average": "sum", "Min": "min", "Max": "max", "Product": "product"}


def on_device(t):
    """True for a tensor on the torchacc device (recorded collectives)."""
    return isinstance(t, LazyTensor)


def _check_op(name, op, t=None):
    if not isinstance(op, ReduceOp) or op.name not in _TORCH_OP:
        raise NotImplementedError(
            f"torchacc.horovod.{name}: op={op!r} is not supported (hvd.Average, hvd.Sum, hvd.Min, "
            "hvd.Max or hvd.Product)"
        )
    if t is not None and op is Average and not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(
            f"torchacc.horovod.{name}: hvd.Average needs a floating point tensor, got {t.dtype} "
            "(use hvd.Sum)"
        )


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"torchacc.horovod.{name}: expected a tensor, got {type(t).__name__}")
    if on_device(t) and C.world_size() != basics.size():
        raise RuntimeError(
            f"torchacc.horovod.{name}: the torchacc device runs a job of {C.world_size()} "
            f"process(es) but hvd.init() joined one of {basics.size()}"
        )


# --------------------------------------------------------------------------------------------
# metadata across ranks (host side: shapes, splits; never the device's data)


def _signature(*parts):
    digest = hashlib.sha1(repr(parts).encode()).digest()
    return int.from_bytes(digest[:7], "big")


def _exchange(name, meta, sig):
    """All ranks' ``meta`` (a list of ints) after checking that ``sig`` agrees on every rank;
    a clear error on every rank when it does not."""
    row = torch.tensor([sig, *meta], dtype=torch.int64)
    rows = [torch.empty_like(row) for _ in range(basics.size())]
    try:
        dist.all_gather(rows, row)
    except RuntimeError as e:  # a rank sent a different number of values
        raise ValueError(
            f"torchacc.horovod.{name}: the ranks called it with different arguments ({e})"
        ) from None
    if any(int(r[0]) != sig for r in rows):
        described = [None] * basics.size()
        dist.all_gather_object(described, _describe.current)
        raise ValueError(
            f"torchacc.horovod.{name}: tensors differ across ranks: "
            + "; ".join(f"rank {i}: {d}" for i, d in enumerate(described))
        )
    return [[int(v) for v in r[1:]] for r in rows]


class _Describe:
    current = ""


_describe = _Describe()


def check_same(name, tensors, skip_dim0=False, root=None):
    """Raise on every rank when the tensors' shapes or dtypes (or the root rank) differ across
    ranks (one small host collective); returns every rank's dim-0 sizes of the first tensor."""
    shapes = [tuple(t.shape[1:] if skip_dim0 else t.shape) for t in tensors]
    _describe.current = ", ".join(f"{tuple(t.shape)} {t.dtype}" for t in tensors)
    if root is not None:
        _describe.current += f" from root rank {root}"
    sig = _signature(name, shapes, [str(t.dtype) for t in tensors], root)
    first = tensors[0]
    rows = _exchange(name, [first.shape[0] if first.dim() else 1], sig)
    return [r[0] for r in rows]


# --------------------------------------------------------------------------------------------
# handles (Horovod returns an int; synchronize(handle) waits and gives the result)


class _Handle:
    __slots__ = ("work", "finish")

    def __init__(self, work, finish):
        self.work, self.finish = work, finish


_handles: dict[int, _Handle] = {}
_next_handle = itertools.count()


def _new_handle(work, finish):
    h = next(_next_handle)
    _handles[h] = _Handle(work, finish)
    return h


def poll(handle):
    """True when the operation behind ``handle`` is done (``synchronize`` will not block)."""
    h = _handles.get(handle)
    if h is None:
        raise ValueError(f"torchacc.horovod.poll: unknown handle {handle!r}")
    return h.work is None or h.work.is_completed()


def synchronize(handle):
    """Wait for the operation behind ``handle``; returns its output."""
    h = _handles.pop(handle, None)
    if h is None:
        raise ValueError(f"torchacc.horovod.synchronize: unknown handle {handle!r}")
    if h.work is not None:
        h.work.wait()
    return h.finish()


# --------------------------------------------------------------------------------------------
# allreduce


def _scales(op, prescale_factor, postscale_factor):
    post = float(postscale_factor) / (basics.size() if op is Average else 1)
    return float(prescale_factor), post


def _allreduce_start(name, tensors, op, prescale_factor, postscale_factor, out):
    """Start reducing ``tensors`` into ``out`` (same length); returns (work, finish)."""
    basics.require(name)
    for t in tensors:
        _check_tensor(name, t)
        _check_op(name, op, t)
    pre, post = _scales(op, prescale_factor, postscale_factor)
    if basics.size() > 1:
        check_same(name, tensors)
    if tensors and on_device(tensors[0]):
        ins = [t * pre if pre != 1.0 else t for t in tensors]
        results = C.all_reduce_coalesced(_DEVICE_OP[op.name], ins, post)
        with torch.no_grad():
            for o, r in zip(out, results, strict=True):
                o.copy_(r)
        return None, lambda: out
    with torch.no_grad():
        for o, t in zip(out, tensors, strict=True):
            if o is not t:
                o.copy_(t)
            if pre != 1.0:
                o.mul_(pre)
    if basics.size() == 1 or not out:
        work = None
    else:
        flat = out[0] if len(out) == 1 else torch.cat([o.reshape(-1) for o in out])
        work = dist.all_reduce(flat, getattr(dist.ReduceOp, _TORCH_OP[op.name]), async_op=True)

    def finish():
        with torch.no_grad():
            if len(out) > 1 and work is not None:
                for o, piece in zip(out, flat.split([o.numel() for o in out]), strict=True):
                    o.copy_(piece.view_as(o))
            if post != 1.0:
                for o in out:
                    o.mul_(post)
        return out

    return work, finish


def _grouped_start(name, tensors, op, prescale_factor, postscale_factor, in_place):
    tensors = list(tensors)
    out = tensors if in_place else [torch.empty_like(t) for t in tensors]
    if any(on_device(t) for t in tensors) or len({t.dtype for t in tensors}) <= 1:
        return _allreduce_start(name, tensors, op, prescale_factor, postscale_factor, out)
    works = []  # mixed dtypes on the eager path: one collective per dtype
    for dtype in dict.fromkeys(t.dtype for t in tensors):
        idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
        works.append(
            _allreduce_start(
                name,
                [tensors[i] for i in idx],
                op,
                prescale_factor,
                postscale_factor,
                [out[i] for i in idx],
            )
        )

    class _All:
        def is_completed(self):
            return all(w is None or w.is_completed() for w, _ in works)

        def wait(self):
            for w, _ in works:
                if w is not None:
                    w.wait()

    def finish():
        for _, f in works:
            f()
        return out

    return _All(), finish


def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Start an allreduce of ``tensor`` into a new tensor; returns a handle."""
    op = _resolve_op(average, op)
    work, finish = _grouped_start(
        "allreduce", [tensor], op, prescale_factor, postscale_factor, False
    )
    return _new_handle(work, lambda: finish()[0])


def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Start an in-place allreduce of ``tensor``; returns a handle."""
    op = _resolve_op(average, op)
    work, finish = _grouped_start(
        "allreduce_", [tensor], op, prescale_factor, postscale_factor, True
    )
    return _new_handle(work, lambda: finish()[0])


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """The reduction of ``tensor`` over all ranks (default ``hvd.Average``), as a new tensor."""
    if compression is not None:
        compressed, ctx = compression.compress(tensor)
        out = synchronize(
            allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor)
        )
        return compression.decompress(out, ctx)
    return synchronize(
        allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor)
    )


def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """In-place ``allreduce``; returns ``tensor``."""
    return synchronize(
        allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor)
    )


def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    op = _resolve_op(average, op)
    work, finish = _grouped_start(
        "grouped_allreduce", tensors, op, prescale_factor, postscale_factor, False
    )
    return _new_handle(work, finish)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    """Reduce a list of tensors as one collective; returns a list of new tensors."""
    return synchronize(
        grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor)
    )


def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=None,
):
    op = _resolve_op(average, op)
    work, finish = _grouped_start(
        "grouped_allreduce_", tensors, op, prescale_factor, postscale_factor, True
    )
    return synchronize(_new_handle(work, finish))


def _resolve_op(average, op):
    if average is not None:
        if op is not None:
            raise ValueError("torchacc.horovod: pass op= or the deprecated average=, not both")
        return Average if average else Sum
    return Average if op is None else op
