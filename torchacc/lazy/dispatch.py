"""__torch_dispatch__ for LazyTensor: classify each ATen op once, then run its handler.

Per op (cached in ``_handlers``): views keep eager aliasing (mutation.py); in-place, ``out=`` and
other mutating ops record their functional twin and write the result back (mutation.py); ops with
a lowering rule become graph nodes (record.py, Note [Recording an op]); ``_foreach_*`` ops record
one batched node per list (foreach.py); the rest decompose with PyTorch's own tables, and as a last
resort run eagerly on CPU as a counted, named fallback (fallback.py).
"""

from __future__ import annotations

import torch
from torch._decomp import decomposition_table

from torchacc.lazy import lenient, tensor
from torchacc.lazy.fallback import fallback_handler
from torchacc.lazy.foreach import foreach_handler
from torchacc.lazy.mutation import (
    assign,
    is_view_op,
    make_mutation_handler,
    view_handler,
    write_back,
)
from torchacc.lazy.record import (
    NeedsFallback,
    VRef,
    fresh,
    mutated_positions,
    record_values,
    value_of,
    wrap,
)
from torchacc.lazy.tensor import LazyTensor, adopt
from torchacc.lazy.transfer import deepcopy, to_cpu, upload
from torchacc.lowering import lookup

aten = torch.ops.aten


def _rule_handler(func, args, kwargs):
    try:
        vals, op = record_values(func, args, kwargs)
    except NeedsFallback:
        return fallback_handler(func, args, kwargs)
    return fresh(vals[0]) if op.kind == "one" else wrap(vals, op)


# --- special ops -----------------------------------------------------------------------------

_DROP_TO_COPY = ("device", "layout", "pin_memory", "non_blocking")


def _to_copy(func, args, kwargs):
    src = args[0]
    target = kwargs.get("device")
    if target is not None and torch.device(target).type != tensor.DEVICE_TYPE:
        out = to_cpu(src)
        kw = {k: v for k, v in kwargs.items() if k in ("dtype", "memory_format") and v is not None}
        return aten._to_copy.default(out, device=torch.device(target), **kw)
    kw = {k: v for k, v in kwargs.items() if k not in _DROP_TO_COPY and v is not None}
    return _rule_handler(func, (src,), kw)


def _copy_(func, args, kwargs):
    dst, src = args[0], args[1]
    if type(dst) is not LazyTensor:  # device -> host
        dst.copy_(to_cpu(src))
        return dst
    if type(src) is not LazyTensor:  # host -> device
        host = src.detach().to(dst.dtype).expand(dst.shape).contiguous()
        assign(dst, upload(host, defer=True))
        return dst
    val = value_of(src)
    if src._desc[0] != dst._desc[0]:
        val = record_values(aten.expand.default, (VRef(val, src._desc), list(dst.shape)), {})[0][0]
    assign(dst, val)
    return dst


def _local_scalar_dense(func, args, kwargs):
    return to_cpu(args[0]).item()


def _equal(func, args, kwargs):
    a, b = args
    return bool(torch.equal(to_cpu(a), to_cpu(b)))


def _identity(func, args, kwargs):
    return args[0]


def _noop(func, args, kwargs):
    return None


def _native_batch_norm(func, args, kwargs):
    """``native_batch_norm`` updates running stats in place although its schema does not say so:
    record the functional twin and write the new stats back."""
    names = (
        "input",
        "weight",
        "bias",
        "running_mean",
        "running_var",
        "training",
        "momentum",
        "eps",
    )
    a = dict(zip(names, args), **kwargs)
    if not a["training"] or a["running_mean"] is None:
        return _rule_handler(func, args, kwargs)
    fn = aten._native_batch_norm_legit_functional.default
    out, mean, rstd, new_mean, new_var = _handler(fn)(fn, tuple(a[n] for n in names), {})
    write_back(a["running_mean"], new_mean, func)
    write_back(a["running_var"], new_var, func)
    return out, mean, rstd


def _lu_of_transpose(func, args, kwargs):
    """``_linalg_det`` / ``_linalg_slogdet``: eager LU-factors A^T when A is contiguous and real
    (det(A^T) = det(A), no copy), else A, and their backward relies on which. Their rules factor
    the transpose of what they get (the contiguous case), so any other A goes in transposed."""
    a = args[0]
    if a.is_complex() or not a.is_contiguous():
        args = (a.mT, *args[1:])
    return _rule_handler(func, args, kwargs)


def _resize_(func, args, kwargs):
    """``resize_`` / ``resize_as_`` to the tensor's own shape (contiguous layout) changes nothing,
    as in eager; any other size or layout would change a device tensor in place: an error."""
    self, size = args[0], args[1]
    shape = tuple(size.shape) if func is aten.resize_as_.default else tuple(size)
    fmt = kwargs.get("memory_format", args[2] if len(args) > 2 else None)
    keeps_layout = fmt in (None, torch.contiguous_format) and self.is_contiguous()
    if shape == tuple(self.shape) and keeps_layout:
        return self
    raise RuntimeError(
        f"torchacc: {func} would resize a tensor from {tuple(self.shape)} to {shape} (memory "
        f"format {fmt}); resizing torchacc tensors in place is not supported"
    )


# in-place view ops: the tensor itself becomes the view (eager changes its sizes and strides)
_VIEW_INPLACE = {
    aten.transpose_.default: aten.transpose.int,
    aten.t_.default: aten.t.default,
    aten.unsqueeze_.default: aten.unsqueeze.default,
    aten.squeeze_.default: aten.squeeze.default,
    aten.squeeze_.dim: aten.squeeze.dim,
    aten.squeeze_.dims: aten.squeeze.dims,
    aten.as_strided_.default: aten.as_strided.default,
}
_NO_PYTHON = torch._C.DispatchKeySet(torch._C.DispatchKey.Python) | torch._C.DispatchKeySet(
    torch._C.DispatchKey.PythonTLSSnapshot
)


def _view_inplace(func, args, kwargs):
    """``t.transpose_(0, 1)`` & co.: record the view op, then make ``t`` that view -- its sizes and
    strides (set below the Python key, as eager's kernel sets them) and its storage chain."""
    target = args[0]
    view_op = _VIEW_INPLACE[func]
    view = _handler(view_op)(view_op, args, kwargs)
    with torch._C._ExcludeDispatchKeyGuard(_NO_PYTHON):
        aten.as_strided_.default(target, view.shape, view.stride(), view.storage_offset())
    adopt(target, view)
    return target


_SPECIAL = {
    **dict.fromkeys(_VIEW_INPLACE, _view_inplace),
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.equal.default: _equal,
    aten.lift_fresh.default: _identity,
    aten.resolve_conj.default: _identity,
    aten.resolve_neg.default: _identity,
    aten.record_stream.default: _noop,
    aten.native_batch_norm.default: _native_batch_norm,
    aten.resize_.default: _resize_,
    aten.resize_as_.default: _resize_,
    aten._linalg_det.default: _lu_of_transpose,
    aten._linalg_slogdet.default: _lu_of_transpose,
}


# --- classification ------------------------------------------------------------------------------

_handlers: dict = {}


def _handler(func):
    h = _handlers.get(func._op)  # keyed like record.py's _specs (no Python __hash__ per op)
    if h is None:
        h = _handlers[func._op] = _classify(func)
    return h


def _classify(func):
    return lenient.wrap(func, _classify_op(func))  # torch_xla's leniencies (lenient.py)


def _classify_op(func):
    if func in _SPECIAL:
        return _SPECIAL[func]
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return foreach_handler(func, _handler)
    if is_view_op(func) and lookup(func) is not None:
        return view_handler
    if mutated_positions(func):
        return make_mutation_handler(func, _handler, fallback_handler) or fallback_handler
    if lookup(func) is not None:
        return _rule_handler
    decomp = decomposition_table.get(func)
    if decomp is not None:
        return lambda _, args, kwargs: decomp(*args, **kwargs)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return lambda f, args, kwargs: f.decompose(*args, **kwargs)
    return fallback_handler


def _guarded(h, func):
    """Run handler ``h``; if the op cannot be recorded, run the fallback instead."""

    def guarded(f, args, kwargs):
        try:
            return h(f, args, kwargs)
        except NeedsFallback:
            return fallback_handler(f, args, kwargs)

    return guarded


def _torch_dispatch(cls, func, types, args=(), kwargs=None):
    h = _handlers.get(func._op)
    if h is None:
        h = _handler(func)
    return h(func, args, kwargs or {})


LazyTensor.__torch_dispatch__ = classmethod(_torch_dispatch)  # no forwarding frame per op


def dispatch(func, args, kwargs):
    """Record ``func`` as ``__torch_dispatch__`` would (for kernels registered outside it)."""
    return _torch_dispatch(LazyTensor, func, (), args, kwargs)


def _deepcopy(self, memo):
    return deepcopy(self, memo)


LazyTensor.__deepcopy__ = _deepcopy
