"""__torch_dispatch__ for LazyTensor: classify each ATen op once, then record it.

Per op (cached in ``_handlers``): views keep eager aliasing (Note [Values, storages and views] in
graph.py); in-place, ``out=`` and other mutating ops record their functional twin and write the
result back; ops with a lowering rule become graph nodes; the rest decompose with PyTorch's own
tables, and as a last resort run eagerly on CPU as a counted, named fallback (``aten::<op>``).
``_foreach_*`` ops record one batched node per list. Output shapes/dtypes come from PyTorch's meta
kernels, cached by op signature (Note [Recording an op]).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import torch
from torch._decomp import decomposition_table

from torchacc import _lenient, metrics, tensor
from torchacc import random as device_random
from torchacc.graph import Node, OpEntry, ScalarSlot, Storage, TensorSlot, Value
from torchacc.lowering import lookup
from torchacc.lowering.registry import Rule, scalar_arguments
from torchacc.tensor import LazyTensor, make

aten = torch.ops.aten


class VRef:
    """A Value passed where a tensor argument goes, with the desc to use for meta."""

    __slots__ = ("value", "desc")

    def __init__(self, value, desc):
        self.value = value
        self.desc = desc


# --------------------------------------------------------------------------------------------
# descs and meta


def desc_of(t):
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())


def contiguous_desc(shape, dtype):
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return (tuple(shape), tuple(reversed(stride)), dtype, 0)


def _meta_tensor(desc):
    shape, stride, dtype, offset = desc
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    return torch.empty(extent, dtype=dtype, device="meta").as_strided(shape, stride, offset)


def _to_meta(a):
    tp = type(a)
    if tp is LazyTensor:
        return _meta_tensor(a._desc)
    if tp is VRef:
        return _meta_tensor(a.desc)
    if tp is list or tp is tuple:
        return tp(_to_meta(x) for x in a)
    if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0:
        return a.item()  # a CPU 0-dim tensor mixes with device tensors like a scalar
    return a


class Meta:
    __slots__ = ("descs", "kind")

    def __init__(self, descs, kind):
        self.descs = descs
        self.kind = kind  # "one", "tuple", "list", "none"


class NeedsFallback(Exception):
    """The op cannot be recorded (no meta kernel, data-dependent output shape)."""


def _compute_meta(func, args, kwargs):
    margs = _to_meta(args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "device" in mkwargs:
        mkwargs["device"] = "meta"
    try:
        out = func(*margs, **mkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        raise NeedsFallback(str(e)) from e
    except RuntimeError as e:
        msg = str(e)
        if "meta" in msg.lower() and ("not implemented" in msg.lower() or "backend" in msg):
            raise NeedsFallback(msg) from e
        raise RuntimeError(f"torchacc: {func}: {msg}") from e
    if out is None:
        return Meta((), "none")
    if isinstance(out, torch.Tensor):
        return Meta((desc_of(out),), "one")
    if isinstance(out, (tuple, list)) and all(
        o is None or isinstance(o, torch.Tensor) for o in out
    ):
        # backward ops with an output_mask return None in the masked positions
        descs = tuple(None if o is None else desc_of(o) for o in out)
        return Meta(descs, "tuple" if isinstance(out, tuple) else "list")
    raise NeedsFallback(f"{func} returns {type(out).__name__}")


# --------------------------------------------------------------------------------------------
# recording


def value_of(t):
    """The Value a LazyTensor reads now (replaying its view chain if its storage moved)."""
    view = t._view
    st = t._st
    if view is None:
        return st.value
    cache = t._vcache
    if cache is not None and cache[0] == st.version:
        return cache[1]
    val = _replay(st, view)
    t._vcache = (st.version, val)
    return val


def _replay(st, chain):
    cur = VRef(st.value, st.desc)
    val = cur.value
    for func, rest, kwargs, index, out_desc in chain:
        val = record_values(func, (cur, *rest), kwargs)[0][index]
        cur = VRef(val, out_desc)
    return val


_CPU_INDEX_OPS = {"index", "_unsafe_index", "index_put", "_unsafe_index_put", "index_put_"}


# Note [Recording an op]
# The hot path of tracing. ``record_values`` walks the arguments once, collecting the runtime
# parts (input Values, lifted scalars) and a flat structural signature; the signature finds the
# op's OpEntry (output descs from meta, argument templates), computed once per signature. A
# LazyTensor argument -- nearly every argument -- is handled inline; everything else goes through
# ``_scan``, whose decisions ``_template`` mirrors to build the entry's templates on a miss.


def _scan(a, lift, inputs, scalars, sig, func):
    """Append the runtime parts and the signature of argument ``a``."""
    tp = type(a)
    if tp is LazyTensor:
        inputs.append(value_of(a))
        sig.append(a._desc)
    elif tp is float or (tp is int and lift):
        if lift:
            scalars.append(a)
            sig.append(tp if lift == 1 else ("wrapped", tp))
        else:
            sig.append(a)
    elif tp is list or tp is tuple:
        if a and not isinstance(a[0], (int, float, bool)):
            for x in a:
                _scan(x, lift, inputs, scalars, sig, func)
            sig.append(len(a))
        elif lift:
            for x in a:
                _scan(x, True, inputs, scalars, sig, func)
            sig.append(len(a))
        else:
            sig.append(tuple(a))
    elif tp is VRef:
        inputs.append(a.value)
        sig.append(a.desc)
    elif isinstance(a, torch.Tensor):
        _scan_foreign_tensor(a, inputs, scalars, sig, func)
    else:
        sig.append(a)


def _template(a, lift, count):
    """Argument ``a`` with TensorSlot/ScalarSlot where ``_scan`` took a runtime part."""
    tp = type(a)
    if tp is LazyTensor or tp is VRef:
        count[0] += 1
        return TensorSlot(count[0] - 1)
    if tp is float or (tp is int and lift):
        if lift:
            count[1] += 1
            return ScalarSlot(count[1] - 1)
        return a
    if tp is list or tp is tuple:
        if a and not isinstance(a[0], (int, float, bool)):
            return [_template(x, lift, count) for x in a]
        if lift:
            return [_template(x, True, count) for x in a]
        return list(a) if tp is list else a  # a copy: the caller may reuse its list
    if isinstance(a, torch.Tensor):  # a foreign tensor _scan accepted
        if a.dim() == 0:
            count[1] += 1
            return ScalarSlot(count[1] - 1)
        count[0] += 1
        return TensorSlot(count[0] - 1)
    return a


def _scan_foreign_tensor(a, inputs, scalars, sig, func):
    if a.device.type == "meta":
        raise RuntimeError(f"torchacc: {func} got a meta tensor")
    if a.dim() == 0:
        # a CPU scalar tensor: its value becomes a runtime scalar of its dtype
        scalars.append(a.item())
        sig.append(("cpu0", a.dtype))
        return
    if func.overloadpacket.__name__ in _CPU_INDEX_OPS:
        t = to_device(a)
        inputs.append(value_of(t))
        sig.append(t._desc)
        return
    raise RuntimeError(
        f"torchacc: {func} got a {a.device} tensor of shape {tuple(a.shape)} next to torchacc "
        "tensors; expected all tensors to be on the same device (move it with .to(device))"
    )


class OpSpec:
    __slots__ = ("func", "rule", "lift_pos", "lift_kw")

    def __init__(self, func, rule):
        self.func = func
        self.rule = rule
        # 1: a Scalar/float argument -> runtime scalar; 2: a Python number where the schema says
        # Tensor (torch's "wrapped number") -> runtime scalar of the partner tensor's dtype
        lifted = scalar_arguments(func, rule.static if rule else frozenset())
        self.lift_pos = {p: 1 for p, _ in lifted.values() if p is not None}
        self.lift_kw = dict.fromkeys(lifted, 1)
        position = 0
        for arg in func._schema.arguments:
            if str(arg.type) in ("Tensor", "Optional[Tensor]"):
                if arg.kwarg_only:
                    self.lift_kw[arg.name] = 2
                else:
                    self.lift_pos[position] = 2
            position += not arg.kwarg_only


_specs: dict = {}
_entries: dict = {}  # structural signature -> OpEntry


def _spec(func):
    spec = _specs.get(func)
    if spec is None:
        spec = _specs[func] = OpSpec(func, lookup(func))
    return spec


def _new_entry(spec, key, args, kwargs):
    meta = _compute_meta(spec.func, args, kwargs)
    count = [0, 0]
    lift_pos, lift_kw = spec.lift_pos, spec.lift_kw
    targs = [_template(a, lift_pos.get(i, 0), count) for i, a in enumerate(args)]
    tkwargs = {k: _template(v, lift_kw.get(k, 0), count) for k, v in kwargs.items()}
    descs = meta.descs + ((device_random.KEY_DESC,) if spec.rule.rng else ())
    return OpEntry(spec.rule, key, targs, tkwargs, descs, meta.kind)


def record_values(func, args, kwargs):
    """Record ``func`` as a node; returns (list of output Values, its OpEntry).

    Note [Recording an op]."""
    spec = _specs.get(func) or _spec(func)
    rule = spec.rule
    if rule is None:
        raise NeedsFallback(f"no lowering rule for {func}")
    inputs, scalars = [], []
    sig = [func]
    lift_pos = spec.lift_pos
    i = 0
    for a in args:
        if type(a) is LazyTensor:
            inputs.append(a._st.value if a._view is None else value_of(a))
            sig.append(a._desc)
        else:
            _scan(a, lift_pos.get(i, 0), inputs, scalars, sig, func)
        i += 1
    if kwargs:
        lift_kw = spec.lift_kw
        for k, v in kwargs.items():
            sig.append(k)
            _scan(v, lift_kw.get(k, 0), inputs, scalars, sig, func)
    key = tuple(sig)
    op = _entries.get(key)
    if op is None:
        op = _entries[key] = _new_entry(spec, key, args, kwargs)
    if rule.rng:
        inputs.append(device_random.state_value())
        node = Node(op, inputs, scalars)
        descs = op.descs[:-1]
        device_random.advance(node, len(descs))
    else:
        node = Node(op, inputs, scalars)
        descs = op.descs
    if len(descs) == 1:
        return [Value(descs[0], node, 0)], op
    return [None if d is None else Value(d, node, i) for i, d in enumerate(descs)], op


# Note [Batched foreach nodes]
# torch.optim's foreach path issues a handful of ``_foreach_*`` ops per step, each over every
# parameter. Recording one node per element would cost a full dispatch per parameter and op; a
# batched node records the whole list at once: one signature (all elements' argument parts in
# order, ``_CALL_END`` between them), one OpEntry whose argument template is the list of per-
# element (args, kwargs) templates, and a rule that applies the element op's rule to each. Ops
# whose element op is random, needs ``out=`` descs, returns several outputs or takes a wrapped
# Python number are not batched (the per-element path records them).

_CALL_END = object()
_NOT_BATCHED = object()


def _batchable(func):
    """Whether functional op ``func``'s rule can run batched (Note [Batched foreach nodes])."""
    rule = lookup(func)
    return rule is not None and not rule.rng and not rule.out_meta


def record_batch(func, n, pos_cols, kw_cols):
    """Record functional op ``func`` (``_batchable``) for ``n`` elements as one node; returns the
    output Values (one per element), or None if the op cannot be batched for these arguments. The
    arguments come as columns (see ``_foreach_handler``): an argument shared by all elements is
    scanned once and its slot shared. Note [Batched foreach nodes]."""
    spec = _specs.get(func) or _spec(func)
    inputs, scalars = [], []
    sig = [_CALL_END, func, n]
    lift_pos, lift_kw = spec.lift_pos, spec.lift_kw
    for i, (each, col) in enumerate(pos_cols):
        _scan_column(each, col, lift_pos.get(i, 0), inputs, scalars, sig, func)
    for name, each, col in kw_cols:
        sig.append(name)
        _scan_column(each, col, lift_kw.get(name, 0), inputs, scalars, sig, func)
    key = tuple(sig)
    op = _entries.get(key)
    if op is None:
        op = _entries[key] = _new_batch_entry(spec, key, n, pos_cols, kw_cols)
    if op is _NOT_BATCHED:
        return None
    node = Node(op, inputs, scalars)
    return [Value(d, node, i) for i, d in enumerate(op.descs)]


def _scan_column(each, col, lift, inputs, scalars, sig, func):
    if not each:
        _scan(col, lift, inputs, scalars, sig, func)
        sig.append(_CALL_END)
        return
    for x in col:
        if type(x) is LazyTensor:
            inputs.append(x._st.value if x._view is None else value_of(x))
            sig.append(x._desc)
        else:
            _scan(x, lift, inputs, scalars, sig, func)
    sig.append(len(col))


def _column_template(each, col, lift, count):
    """``_template`` of a column: one per element, or one shared by all (mirrors _scan_column)."""
    return [_template(x, lift, count) for x in col] if each else _template(col, lift, count)


def _new_batch_entry(spec, key, n, pos_cols, kw_cols):
    if any(type(p) is tuple and len(p) == 2 and p[0] == "wrapped" for p in key):
        return _NOT_BATCHED
    if any(each and len(col) != n for each, col in pos_cols) or any(
        each and len(col) != n for _, each, col in kw_cols
    ):
        raise RuntimeError(f"torchacc: {spec.func} (foreach): argument lists differ in length")
    count = [0, 0]  # in _scan_column's order
    lift_pos, lift_kw = spec.lift_pos, spec.lift_kw
    pos_t = [
        _column_template(each, col, lift_pos.get(i, 0), count)
        for i, (each, col) in enumerate(pos_cols)
    ]
    kw_t = [_column_template(each, col, lift_kw.get(name, 0), count) for name, each, col in kw_cols]
    templates, descs = [], []
    for j, (args, kwargs) in enumerate(_element_calls(n, pos_cols, kw_cols)):
        try:
            meta = _compute_meta(spec.func, args, kwargs)
        except NeedsFallback:
            return _NOT_BATCHED
        if meta.kind != "one":
            return _NOT_BATCHED
        descs.append(meta.descs[0])
        targs = [t[j] if each else t for t, (each, _) in zip(pos_t, pos_cols)]
        tkwargs = {name: t[j] if each else t for t, (name, each, _) in zip(kw_t, kw_cols)}
        templates.append((targs, tkwargs))
    return OpEntry(_batched_rule(spec.rule), key, templates, {}, tuple(descs), "list")


_batched_rules: dict = {}


def _batched_rule(rule):
    batched = _batched_rules.get(rule.name)
    if batched is None:
        fn = rule.fn

        def apply_each(*calls):
            return [fn(*args, **kwargs) for args, kwargs in calls]

        batched = _batched_rules[rule.name] = Rule(
            apply_each, rule.static, False, False, f"batched {rule.name}"
        )
    return batched


def _pack(items, kind):
    """Outputs in the structure the op returns (Meta.kind)."""
    if kind == "one":
        return items[0]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    return None


def fresh(value):
    """A new base tensor (its own Storage) holding ``value``."""
    return make(Storage(value, value.desc), value.desc)


def wrap(values, op):
    """Fresh base tensors holding ``values``, in the structure ``op`` returns."""
    return _pack([None if v is None else fresh(v) for v in values], op.kind)


# --------------------------------------------------------------------------------------------
# writes (in-place semantics)


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
        "_conj",
        "_neg_view",
    )
)


# --------------------------------------------------------------------------------------------
# handlers


def _is_view_op(func):
    rets = func._schema.returns
    args = func._schema.arguments
    if not rets or not args or args[0].alias_info is None:
        return False
    info = rets[0].alias_info
    return info is not None and not info.is_write and not args[0].alias_info.is_write


_FULL_ALIASES = frozenset((aten.detach.default, aten.alias.default))


def _view_handler(func, args, kwargs):
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
    return _pack(outs, meta.kind)


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


def _rule_handler(func, args, kwargs):
    try:
        vals, op = record_values(func, args, kwargs)
    except NeedsFallback:
        return _fallback_handler(func, args, kwargs)
    return fresh(vals[0]) if op.kind == "one" else wrap(vals, op)


def _functional_variant(func):
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


def _mutated_positions(func):
    return [
        i
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


def _make_mutation_handler(func):
    functional, mode = _functional_variant(func)
    if functional is None:
        return None
    fhandler = _handler(functional)
    schema_args = func._schema.arguments
    mutated = _mutated_positions(func)
    names = [schema_args[i].name for i in mutated]

    def get_arg(args, kwargs, i):
        return args[i] if i < len(args) else kwargs.get(schema_args[i].name)

    if mode == "inplace" and lookup(functional) is not None:

        def inplace(_, args, kwargs):  # hot path: no throwaway result tensor
            try:
                vals, _meta = record_values(functional, args, kwargs)
            except NeedsFallback:
                return _fallback_handler(func, args, kwargs)
            target = args[0]
            if vals[0].desc[0] != target._desc[0]:
                _write_back(target, wrap(vals, _meta), func)  # raises the resize error
            assign(target, vals[0])
            return target

        return inplace

    if mode == "inplace":

        def handler(_, args, kwargs):
            result = fhandler(functional, args, kwargs)
            _write_back(args[0], result, func)
            return args[0]

    elif mode == "out":

        def handler(_, args, kwargs):
            kwargs = dict(kwargs)
            outs = [kwargs.pop(n) for n in names]
            result = fhandler(functional, args, kwargs)
            results = result if isinstance(result, (tuple, list)) else (result,)
            for o, r in zip(outs, results):
                _write_back(o, r, func)
            return outs[0] if len(outs) == 1 else tuple(outs)

    else:  # mutating op with a *_functional twin returning (outs..., new mutated args...)
        n_mut = len(mutated)

        def handler(_, args, kwargs):
            result = fhandler(functional, args, kwargs)
            for i, r in zip(mutated, result[len(result) - n_mut :]):
                target = get_arg(args, kwargs, i)
                if target is not None:
                    _write_back(target, r, func)
            outs = result[: len(result) - n_mut]
            return outs[0] if len(outs) == 1 else tuple(outs)

    return _guarded(handler, func)


def _write_back(target, result, func):
    if isinstance(target, (list, tuple)):
        for t, r in zip(target, result):
            _write_back(t, r, func)
        return
    if type(target) is not LazyTensor:
        raise RuntimeError(f"torchacc: {func} writes into a {target.device} tensor")
    if tuple(result.shape) != tuple(target.shape):
        raise RuntimeError(
            f"torchacc: {func} would resize its output from {tuple(target.shape)} to "
            f"{tuple(result.shape)}; resizing torchacc tensors in place is not supported"
        )
    assign(target, value_of(result))


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
        assign(dst, upload(host))
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
    _write_back(a["running_mean"], new_mean, func)
    _write_back(a["running_var"], new_var, func)
    return out, mean, rstd


def _foreach_handler(func):
    """``_foreach_<op>[_]`` -> one batched node computing ``<op>`` for every list element (see
    ``record_batch``), or, when the op cannot be batched, one ``<op>[_]`` call per element."""
    name = func.overloadpacket.__name__[len("_foreach_") :]
    inplace = name.endswith("_")
    base_name = name[:-1] if inplace else name
    overload = func._overloadname
    schema_args = func._schema.arguments
    if base_name == "norm":
        target = aten.linalg_vector_norm.default
    else:
        packet = getattr(aten, base_name + ("_" if inplace else ""), None)
        if packet is None:  # no in-place twin (maximum_): run the functional op and write back
            packet = getattr(aten, base_name)
        target = _foreach_target(packet, overload, schema_args)
    target_handler = _handler(target)
    if target.overloadpacket.__name__.endswith("_"):
        functional, mode = _functional_variant(target)
        write_back = False
    else:  # a functional target: in-place foreach ops write its results back
        functional, mode = target, "inplace"
        write_back = inplace
    if mode != "inplace" or not _batchable(functional):
        functional = None  # record each element on its own
    per_element = [
        str(a.type).startswith("List[Tensor") or str(a.type) == "List[number]" for a in schema_args
    ]
    names = [a.name for a in schema_args]
    target_pos = [a.name for a in target._schema.arguments if not a.kwarg_only]
    target_kw = [a.name for a in target._schema.arguments if a.kwarg_only]

    def columns(args, kwargs):
        """The target's arguments as columns: (positional [(each, value)], keyword [(name, each,
        value)]), where ``each`` says ``value`` holds one entry per element. Positional arguments
        come first, then keywords (by name where names agree, ``alpha``; else in order,
        ``scalars`` -> ``value``)."""
        given = list(enumerate(args)) + [
            (i, kwargs[nm]) for i, nm in enumerate(names) if i >= len(args) and nm in kwargs
        ]
        n = len(next(a for i, a in given if per_element[i]))  # the first list (not always args[0])
        pos_cols, kw_cols = [], []
        for i, a in given:
            each = per_element[i]
            if not each and isinstance(a, torch.Tensor) and a.dim() == 1 and a.device.type == "cpu":
                a, each = [a[j] for j in range(n)], True  # a tensor of per-element scalars
            if names[i] in target_kw:
                kw_cols.append((names[i], each, a))
            elif len(pos_cols) < len(target_pos):
                pos_cols.append((each, a))
            else:
                taken = [c[0] for c in kw_cols]
                kw_cols.append((next(nm for nm in target_kw if nm not in taken), each, a))
        return n, pos_cols, kw_cols

    def handler(_, args, kwargs):
        n, pos_cols, kw_cols = columns(args, kwargs)
        if n == 0:
            return None if inplace else []
        batch = functional is not None and not (inplace and _writes_alias(args, kwargs))
        vals = record_batch(functional, n, pos_cols, kw_cols) if batch else None
        if vals is not None:
            if not inplace:
                return [fresh(v) for v in vals]
            for t, v in zip(args[0], vals):
                if type(t) is not LazyTensor or v.desc[0] != t._desc[0]:
                    _write_back(t, fresh(v), func)  # raises the device or resize error
                assign(t, v)
            return None
        results = []
        for j, (call, kw) in enumerate(_element_calls(n, pos_cols, kw_cols)):
            result = target_handler(target, call, kw)
            if write_back:
                _write_back(args[0][j], result, func)
            results.append(result)
        return None if inplace else results

    return handler


def _element_calls(n, pos_cols, kw_cols):
    """Per element (args, kwargs) from foreach argument columns."""
    calls = []
    for j in range(n):
        call = tuple(v[j] if each else v for each, v in pos_cols)
        kw = {name: v[j] if each else v for name, each, v in kw_cols}
        calls.append((call, kw))
    return calls


def _writes_alias(args, kwargs):
    """Whether an in-place foreach op writes a tensor another element reads or writes (then the
    elements must run in order, as eager does)."""
    targets = [t._st for t in args[0] if type(t) is LazyTensor]
    target_ids = set(map(id, targets))
    if len(target_ids) != len(args[0]):
        return True
    for a in (*args[1:], *kwargs.values()):
        if type(a) is LazyTensor:
            if id(a._st) in target_ids:
                return True
        elif isinstance(a, (list, tuple)):
            read = [x._st for x in a if type(x) is LazyTensor]
            if target_ids.isdisjoint(map(id, read)):
                continue
            if len(read) != len(a) or any(
                r is not t and id(r) in target_ids for r, t in zip(read, targets)
            ):
                return True
    return False


_ELEMENT_TYPE = {
    "List[Tensor]": "Tensor",
    "List[number]": "number",
    "List[Optional[Tensor]]": "Tensor",
}


def _foreach_target(packet, overload, schema_args):
    """The per-element overload: the one whose positional argument types are the foreach op's with
    lists replaced by their elements (``_foreach_pow.Scalar(Tensor[], Scalar)`` ->
    ``pow.Tensor_Scalar``), else by overload name."""
    want = [_ELEMENT_TYPE.get(str(a.type), str(a.type)) for a in schema_args if not a.kwarg_only]
    ovs = packet.overloads()
    for ov in ovs:
        cand = getattr(packet, ov)
        got = [str(a.type) for a in cand._schema.arguments if not a.kwarg_only]
        if got == want:
            return cand
    prefer = {
        "List": ["Tensor", "default"],
        "Scalar": ["Scalar", "default"],
        "ScalarList": ["Scalar", "default"],
        "Tensor": ["Tensor", "Scalar", "default"],
        "default": ["default"],
        "ScalarAndTensor": ["Scalar"],
    }.get(overload, [overload])
    for ov in prefer + list(ovs):
        if ov in ovs:
            return getattr(packet, ov)
    raise NotImplementedError(f"torchacc: no per-tensor op for _foreach overload {overload}")


_SPECIAL = {
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten._local_scalar_dense.default: _local_scalar_dense,
    aten.equal.default: _equal,
    aten.lift_fresh.default: _identity,
    aten.resolve_conj.default: _identity,
    aten.resolve_neg.default: _identity,
    aten.record_stream.default: _noop,
    aten.native_batch_norm.default: _native_batch_norm,
}


# --- fallback ----------------------------------------------------------------------------------

_warned: set = set()


def _fallback_handler(func, args, kwargs):
    name = f"aten::{func.overloadpacket.__name__}"
    if os.environ.get("TORCHACC_STRICT", "0") not in ("", "0"):
        raise RuntimeError(
            f"torchacc: {func} has no lowering and no decomposition "
            "(TORCHACC_STRICT=1 forbids running it eagerly on CPU)"
        )
    metrics.counter_inc(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(
            f"torchacc: {func} has no lowering; it runs eagerly on CPU (counter {name!r}). "
            "Each call syncs its inputs to the host.",
            stacklevel=3,
        )
    cpu_args = _map_tensors(args, to_cpu)
    cpu_kwargs = _map_tensors(kwargs, to_cpu)
    if "device" in cpu_kwargs:
        cpu_kwargs["device"] = "cpu"
    out = func(*cpu_args, **cpu_kwargs)
    for i in _mutated_positions(func):
        target = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
        source = cpu_args[i] if i < len(args) else cpu_kwargs.get(func._schema.arguments[i].name)
        if type(target) is LazyTensor:
            assign(target, upload(source))
        elif isinstance(target, list):
            for t, s in zip(target, source):
                assign(t, upload(s))
    if _mutated_positions(func) and out is not None and isinstance(out, torch.Tensor):
        return args[0]
    return _map_tensors(out, to_device)


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x


# --- classification ------------------------------------------------------------------------------

_handlers: dict = {}


def _handler(func):
    h = _handlers.get(func)
    if h is None:
        h = _handlers[func] = _classify(func)
    return h


def _classify(func):
    return _lenient.wrap(func, _classify_op(func))  # torch_xla's leniencies (torchacc/_lenient.py)


def _classify_op(func):
    if func in _SPECIAL:
        return _SPECIAL[func]
    name = func.overloadpacket.__name__
    if name.startswith("_foreach_"):
        return _foreach_handler(func)
    if _is_view_op(func) and lookup(func) is not None:
        return _view_handler
    if _mutated_positions(func):
        return _make_mutation_handler(func) or _fallback_handler
    if lookup(func) is not None:
        return _rule_handler
    decomp = decomposition_table.get(func)
    if decomp is not None:
        return lambda _, args, kwargs: decomp(*args, **kwargs)
    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        return lambda f, args, kwargs: f.decompose(*args, **kwargs)
    return _fallback_handler


def _guarded(h, func):
    """Run handler ``h``; if the op cannot be recorded, run the fallback instead."""

    def guarded(f, args, kwargs):
        try:
            return h(f, args, kwargs)
        except NeedsFallback:
            return _fallback_handler(f, args, kwargs)

    return guarded


def _torch_dispatch(cls, func, types, args=(), kwargs=None):
    h = _handlers.get(func)
    if h is None:
        h = _handler(func)
    return h(func, args, kwargs or {})


LazyTensor.__torch_dispatch__ = classmethod(_torch_dispatch)  # no forwarding frame per op


def dispatch(func, args, kwargs):
    """Record ``func`` as ``__torch_dispatch__`` would (for kernels registered outside it)."""
    return _torch_dispatch(LazyTensor, func, (), args, kwargs)


# --------------------------------------------------------------------------------------------
# host <-> device


def upload(host):
    """A device Value holding the CPU tensor ``host``'s data (counted as a transfer)."""
    from torchacc import execute

    return execute.upload(host)


def to_device(host):
    if type(host) is LazyTensor:
        return host
    return fresh(upload(host.detach().contiguous()))


def to_cpu(t):
    """CPU copy of a LazyTensor (runs what it needs; counted as a transfer)."""
    from torchacc import execute

    if type(t) is not LazyTensor:
        return t
    return execute.fetch(value_of(t), t.dtype)


def deepcopy(t, memo):
    new = to_device(to_cpu(t))
    if t.requires_grad:
        new.requires_grad_(True)
    if getattr(t, "_is_param", False):
        new = torch.nn.Parameter(new, t.requires_grad)
    memo[id(t)] = new
    return new
