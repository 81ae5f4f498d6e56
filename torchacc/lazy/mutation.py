"""Writes with eager semantics: views (chains from a storage), in-place, ``out=`` and mutating
ops recorded as their functional twins and written back (Note [Values, storages and views])."""

from __future__ import annotations

import numpy as np
import torch

from torchacc.ir import contiguous_desc
from torchacc.lazy.record import (
    NeedsFallback,
    VRef,
    fresh,
    mutated_positions,
    pack,
    record_values,
    returns_tensor_lists,
    value_of,
    wrap,
)
from torchacc.lazy.tensor import LazyTensor, make
from torchacc.lowering import custom_ops, lookup

aten = torch.ops.aten


def assign(t, val):
    """Make tensor ``t`` hold Value ``val`` (same shape), writing through its view chain."""
    if val.desc[2] != t._desc[2]:
        val = record_values(aten._to_copy.default, (VRef(val, val.desc),), {"dtype": t.dtype})[0][0]
    st = t._st
    view = t._view
    if view is None:
        st.write(val)
        return
    bases = [VRef(st.value, st.desc)]
    for func, rest, kwargs, index, out_desc in view[:-1]:
        v = record_values(func, (bases[-1], *rest), kwargs)[0][index]
        bases.append(VRef(v, out_desc))
    new = val
    for entry, base in zip(reversed(view), reversed(bases)):
        new = _inverse(entry, base, new)
    st.write(new)
    # no view cache here: ``val`` was computed from the old base, whose buffer a sync may donate
    t._vcache = None


def _inverse(entry, base, new):
    """The new base Value after writing ``new`` into view ``entry`` of ``base``."""
    func, rest, kwargs, index, out_desc = entry
    name = func.overloadpacket.__name__
    newref = VRef(new, out_desc)
    if name == "slice":
        scatter, args = aten.slice_scatter.default, (base, newref, *rest)
    elif name == "select":
        scatter, args = aten.select_scatter.default, (base, newref, *rest)
    elif name == "diagonal":
        scatter, args = aten.diagonal_scatter.default, (base, newref, *rest)
    elif name == "as_strided":
        scatter, args = aten.as_strided_scatter.default, (base, newref, *rest)
    elif name in ("transpose", "t"):
        dims = rest if name == "transpose" else (0, 1) if len(out_desc[0]) == 2 else (0, 0)
        scatter, args = aten.transpose.int, (newref, *dims)
    elif name == "permute":
        dims = [d % len(out_desc[0]) for d in rest[0]]
        scatter, args = aten.permute.default, (newref, list(np.argsort(dims).tolist()))
    elif name in _RESHAPE_VIEWS:
        flat = VRef(new, contiguous_desc(out_desc[0], out_desc[2]))
        scatter, args = aten.view.default, (flat, list(base.desc[0]))
    elif name in ("view_as_real", "view_as_complex"):  # each is the other's inverse
        other = aten.view_as_complex if name == "view_as_real" else aten.view_as_real
        scatter, args = other.default, (newref,)
    elif name == "_conj":  # a conjugated view holds conj(base): the base is conj(new)
        scatter, args = aten._conj_physical.default, (newref,)
    elif name == "expand":
        raise RuntimeError(
            "torchacc: unsupported operation: more than one element of the written-to tensor "
            "refers to a single memory location (in-place write into an expanded view)"
        )
    else:
        raise RuntimeError(
            f"torchacc: in-place write through a view made by {func} is not supported"
        )
    return record_values(scatter, args, {})[0][0]


_RESHAPE_VIEWS = frozenset(
    (
        "view",
        "_unsafe_view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "alias",
        "detach",
        "lift_fresh",
        "view_as",
        "flatten",
        "unflatten",
        "_reshape_alias",
        "_neg_view",
    )
)


def is_view_op(func):
    rets = func._schema.returns
    args = func._schema.arguments
    if not rets or not args or args[0].alias_info is None:
        return False
    info = rets[0].alias_info
    return info is not None and not info.is_write and not args[0].alias_info.is_write


_FULL_ALIASES = frozenset((aten.detach.default, aten.alias.default))


def view_handler(func, args, kwargs):
    base = args[0]
    if func in _FULL_ALIASES:
        # same storage, same view, same metadata: share the base's chain, record nothing. This
        # keeps parameters (Parameter(t) is t.detach()) plain bases, so optimizer writes to them
        # need no view bookkeeping.
        return make(base._st, base._desc, base._view, base._vcache)
    vals, meta = record_values(func, args, kwargs)
    st = base._st
    chain = base._view or ()
    rest, version = tuple(args[1:]), st.version
    outs = []
    for i, v in enumerate(vals):
        if meta.kind == "one":
            entry = (func, rest, kwargs, 0, v.desc)
        else:
            entry = _split_entry(func, args, kwargs, i, vals, v.desc)
        outs.append(make(st, v.desc, chain + (entry,), (version, v)))
    return pack(outs, meta.kind)


def _split_entry(func, args, kwargs, i, vals, out_desc):
    """The i-th output of a multi-output view op as a single slice/select view entry."""
    unbind = func.overloadpacket.__name__ == "unbind"
    dim_pos = 1 if unbind else 2  # unbind(self, dim) / split*(self, sizes, dim)
    dim = kwargs.get("dim", args[dim_pos] if len(args) > dim_pos else 0)
    if unbind:
        return (aten.select.int, (dim, i), {}, 0, out_desc)
    dim = dim % len(args[0].shape)
    start = sum(v.desc[0][dim] for v in vals[:i])
    end = start + vals[i].desc[0][dim]
    return (aten.slice.Tensor, (dim, start, end, 1), {}, 0, out_desc)


def functional_variant(func):
    """For an in-place/out=/mutating op: (functional op, how outputs map to mutated args)."""
    name = func.overloadpacket.__name__
    overload = func._overloadname
    special = _INPLACE_SPECIAL.get(str(func))
    if special is not None:
        return special, "inplace"
    schema = func._schema
    out_args = [
        a
        for a in schema.arguments
        if a.kwarg_only and a.alias_info is not None and a.alias_info.is_write
    ]
    if out_args:
        fn = _find_out_functional(func, {a.name for a in out_args})
        return fn, "out"
    if name.endswith("_") and not name.startswith("_foreach"):
        packet = getattr(aten, name[:-1], None)
        functional = _same_arguments(packet, func) if packet is not None else None
        if functional is not None:
            return functional, "inplace"
    packet = getattr(aten, name + "_functional", None)
    if packet is not None and overload in packet.overloads():
        return getattr(packet, overload), "mutating"
    return None, None


_INPLACE_SPECIAL = {
    # ATen's twin returns (list, tensor); ours one flat list (torchacc/lowering/amp.py)
    "aten._amp_foreach_non_finite_check_and_unscale_.default": custom_ops.amp_unscale,
    "aten.normal_.default": aten.normal_functional.default,
    "aten.bernoulli_.float": aten.bernoulli.p,
    "aten.bernoulli_.Tensor": aten.bernoulli.Tensor,
    "aten.uniform_.default": aten.uniform.default,
}


def _argument_types(op):
    return [(a.name, str(a.type), a.kwarg_only) for a in op._schema.arguments]


def _same_arguments(packet, func):
    """The overload of ``packet`` taking exactly ``func``'s arguments: the functional twin of an
    in-place op (names differ at times: ``pow_.Scalar`` is ``pow.Tensor_Scalar``)."""
    want = _argument_types(func)
    overloads = packet.overloads()
    if func._overloadname in overloads:  # usually the same overload name
        overloads = [func._overloadname] + [o for o in overloads if o != func._overloadname]
    for ov in overloads:
        cand = getattr(packet, ov)
        if _argument_types(cand) == want:
            return cand
    return None


def _find_out_functional(func, out_names):
    want = [(a.name, str(a.type)) for a in func._schema.arguments if a.name not in out_names]
    for ov in func.overloadpacket.overloads():
        cand = getattr(func.overloadpacket, ov)
        if cand is func:
            continue
        got = [
            (a.name, str(a.type))
            for a in cand._schema.arguments
            if not (a.kwarg_only and a.has_default_value() and a.name not in dict(want))
        ]
        if got == want:
            return cand
    return None


def make_mutation_handler(func, handler_of, fallback):
    """The handler of in-place/out=/mutating ``func`` (None if it has no functional twin).
    ``handler_of(op)`` is the dispatcher's handler lookup, ``fallback`` its eager CPU fallback."""
    functional, mode = functional_variant(func)
    if functional is None:
        return None
    fhandler = handler_of(functional)
    schema_args = func._schema.arguments
    mutated = mutated_positions(func)
    names = [schema_args[i].name for i in mutated]

    def get_arg(args, kwargs, i):
        return args[i] if i < len(args) else kwargs.get(schema_args[i].name)

    if mode == "inplace" and lookup(functional) is not None and returns_tensor_lists(functional):
        return _list_update_handler(func, functional, names, fallback)

    if mode == "inplace" and lookup(functional) is not None and len(mutated) > 1:
        return _multi_write_handler(func, functional, mutated, get_arg, fallback)

    if mode == "inplace" and lookup(functional) is not None:

        def inplace(_, args, kwargs):  # hot path: no throwaway result tensor
            try:
                vals, _meta = record_values(functional, args, kwargs)
            except NeedsFallback:
                return fallback(func, args, kwargs)
            target = args[0]
            if vals[0].desc[0] != target._desc[0]:
                write_back(target, wrap(vals, _meta), func)  # raises the resize error
            assign(target, vals[0])
            return target

        return inplace

    if mode == "inplace":

        def handler(_, args, kwargs):
            result = fhandler(functional, args, kwargs)
            write_back(args[0], result, func)
            return args[0]

    elif mode == "out":

        def handler(_, args, kwargs):
            kwargs = dict(kwargs)
            outs = [kwargs.pop(n) for n in names]
            result = fhandler(functional, args, kwargs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            for o, r in zip(outs, results):
                write_back(o, r, func)
            return outs[0] if len(outs) == 1 else tuple(outs)

    else:  # mutating op with a *_functional twin returning (outs..., new mutated args...)
        n_mut = len(mutated)

        def handler(_, args, kwargs):
            result = fhandler(functional, args, kwargs)
            for i, r in zip(mutated, result[len(result) - n_mut :]):
                target = get_arg(args, kwargs, i)
                if target is not None:
                    write_back(target, r, func)
            outs = result[: len(result) - n_mut]
            return outs[0] if len(outs) == 1 else tuple(outs)

    def guarded(f, args, kwargs):
        try:
            return handler(f, args, kwargs)
        except NeedsFallback:
            return fallback(f, args, kwargs)

    return guarded


def write_back(target, result, func):
    if isinstance(target, (list, tuple)):
        for t, r in zip(target, result):
            write_back(t, r, func)
        return
    if type(target) is not LazyTensor:
        raise RuntimeError(f"torchacc: {func} writes into a {target.device} tensor")
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"torchacc: {func} would resize its output from {tuple(target.shape)} to "
            f"{tuple(result.shape)}; resizing torchacc tensors in place is not supported"
        )
    assign(target, value_of(result))


# An argument list the op writes only when another argument is given: fused optimizers write the
# unscaled gradients back only with a ``grad_scale`` (else ``grads`` is unchanged, and writing it
# back would make every gradient an output of the step's program).
_WRITTEN_ONLY_WITH = {"grads": "grad_scale"}


def _list_update_handler(func, functional, names, fallback):
    """In-place ops that update several tensor lists (``_fused_adamw_`` & co.): one node of the
    functional twin, whose output lists are the new values of the mutated lists, in order."""

    def handler(_, args, kwargs):
        try:
            vals, op = record_values(functional, args, kwargs)
        except NeedsFallback:
            return fallback(func, args, kwargs)
        start = 0
        for i, (name, n) in enumerate(zip(names, op.kind)):
            outs = vals[start : start + n]
            start += n
            needs = _WRITTEN_ONLY_WITH.get(name)
            if needs is not None and kwargs.get(needs) is None:
                continue
            targets = args[i] if i < len(args) else kwargs[name]
            for t, v in zip(targets, outs):
                _write_value(t, v, func)
        return None

    return handler


def _write_value(t, v, func):
    """Make ``t`` hold Value ``v`` (a new value of an argument that ``func`` writes)."""
    if type(t) is not LazyTensor or v.desc[0] != t._desc[0]:
        write_back(t, fresh(v), func)  # raises the device or resize error
    assign(t, v)


def _multi_write_handler(func, functional, positions, get_arg, fallback):
    """In-place ops that write several arguments, tensors or tensor lists
    (``_amp_update_scale_``, ``_amp_foreach_non_finite_check_and_unscale_``): one node of the twin,
    whose outputs are the new values of the written arguments in order, a list giving one output
    per element."""
    returns_self = len(func._schema.returns) == 1

    def handler(_, args, kwargs):
        try:
            vals, _op = record_values(functional, args, kwargs)
        except NeedsFallback:
            return fallback(func, args, kwargs)
        targets = []
        for i in positions:
            a = get_arg(args, kwargs, i)
            if isinstance(a, (list, tuple)):
                targets.extend(a)
            else:
                targets.append(a)
        if len(targets) != len(vals):
            raise RuntimeError(
                f"torchacc: {functional} gave {len(vals)} new values for the {len(targets)} "
                f"tensors {func} writes"
            )
        for t, v in zip(targets, vals):
            _write_value(t, v, func)
        return args[0] if returns_self else None

    return handler
