"""``_foreach_*`` ops: one batched node per list (Note [Batched foreach nodes])."""

from __future__ import annotations

import math

import torch

from torchacc.ir import Node, OpEntry, Value
from torchacc.lazy.mutation import assign, functional_variant
from torchacc.lazy.record import (
    NeedsFallback,
    _compute_meta,
    _entries,
    _scan,
    _spec,
    _specs,
    _template,
    fresh,
    value_of,
)
from torchacc.lazy.tensor import LazyTensor
from torchacc.lowering import lookup, optim
from torchacc.lowering.batching import apply_flat
from torchacc.lowering.registry import Rule

aten = torch.ops.aten

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
    spec = _specs.get(func._op) or _spec(func)
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

        @optim.update_rule  # Note [The update runs after every read of what it overwrites]
        def apply_each(*calls):  # Note [Batched optimizer updates], [Flat optimizer updates]
            return apply_flat(fn, calls, optim.packed_limit())

        batched = _batched_rules[rule.name] = Rule(
            apply_each, rule.static, False, False, f"batched {rule.name}"
        )
    return batched


def foreach_handler(func, handler_of):
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
    target_handler = handler_of(target)
    if target.overloadpacket.__name__.endswith("_"):
        functional, mode = functional_variant(target)
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
            elif each and _same_numbers(a):  # Note [Shared foreach scalars]
                a, each = a[0], False
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
                    write_back(t, fresh(v), func)  # raises the device or resize error
                assign(t, v)
            return None
        results = []
        for j, (call, kw) in enumerate(_element_calls(n, pos_cols, kw_cols)):
            result = target_handler(target, call, kw)
            if write_back:
                write_back(args[0][j], result, func)
            results.append(result)
        return None if inplace else results

    return handler


# Note [Shared foreach scalars]
# torch.optim's foreach Adam/AdamW pass each parameter's bias corrections as a list of Python
# numbers (``_foreach_div_(sqs, bias_correction2_sqrt)``, ``_foreach_addcdiv_(..., step_size)``),
# one per parameter, equal whenever the parameters share their step count (always, in a plain
# loop). Recorded one runtime scalar per element, each element's kernel read its own slot of the
# program's scalar vector, so no two parameters' update kernels were the same program and XLA
# compiled every one (~10-20 ms each on XLA:CPU; most of GPT-2's cold AdamW step, issue 32). A
# list whose numbers are all the same (same type, same value, same sign of zero) is recorded as
# one shared scalar instead: every element reads the same slot, same-shaped parameters get
# identical kernels, and XLA compiles each once. The values the element ops see are the same, so
# results are bit for bit the same. A list whose numbers differ keeps one scalar per element (a
# different node signature, so a different program, never a wrong one).


def _same_numbers(col):
    """Whether ``col`` is a list of 2+ equal Python numbers (Note [Shared foreach scalars])."""
    if type(col) is not list or len(col) < 2:
        return False
    first = col[0]
    tp = type(first)
    if tp is float:
        sign = math.copysign(1.0, first)
        return all(type(v) is float and v == first and math.copysign(1.0, v) == sign for v in col)
    if tp is int:
        return all(type(v) is int and v == first for v in col)
    return False


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
