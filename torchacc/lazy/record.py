"""Recording an op: argument scan, structural signature, meta (output descs), the Node.

Note [Recording an op] is the hot path's description. Also the small helpers every handler uses:
reading a tensor's current Value (``value_of``), fresh result tensors (``fresh``/``wrap``).
"""

from __future__ import annotations

import torch

from torchacc.engine.transfer import DEFERRED as _deferred
from torchacc.engine.transfer import materialize as _materialize
from torchacc.engine.transfer import upload
from torchacc.ir import Node, OpEntry, ScalarSlot, Storage, TensorSlot, Value, desc_of
from torchacc.lazy import random as device_random
from torchacc.lazy.tensor import LazyTensor, make
from torchacc.lowering import lookup
from torchacc.lowering.dtypes import TORCH_TO_JAX
from torchacc.lowering.registry import scalar_arguments

aten = torch.ops.aten


class VRef:
    """A Value passed where a tensor argument goes, with the desc to use for meta."""

    __slots__ = ("value", "desc")

    def __init__(self, value, desc):
        self.value = value
        self.desc = desc


# --------------------------------------------------------------------------------------------
# meta


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
        # "one", "tuple", "list", "none", or a tuple of list lengths: a tuple of tensor lists
        # (fused optimizers), whose descs are flattened in order
        self.kind = kind


class NeedsFallback(Exception):
    """The op cannot be recorded (no meta kernel, data-dependent output shape)."""


def _cpu_scalar_as_meta(a):
    """A CPU 0-dim tensor as a 0-dim meta tensor (where the schema wants a Tensor)."""
    if isinstance(a, torch.Tensor) and a.device.type == "cpu" and a.dim() == 0:
        return torch.empty((), dtype=a.dtype, device="meta")
    return a


def _compute_meta(func, args, kwargs):
    try:
        return _compute_meta_once(func, args, kwargs)
    except RuntimeError:
        # a CPU 0-dim tensor went to meta as a number (right for Scalar arguments); a schema
        # that wants a Tensor there (``_fused_adam.tensor_lr``) gets a 0-dim meta tensor instead
        scalars = [a for a in (*args, *kwargs.values()) if _cpu_scalar_as_meta(a) is not a]
        if not scalars:
            raise
        args = tuple(_cpu_scalar_as_meta(a) for a in args)
        kwargs = {k: _cpu_scalar_as_meta(v) for k, v in kwargs.items()}
        return _compute_meta_once(func, args, kwargs)


def _compute_meta_once(func, args, kwargs):
    margs = _to_meta(args)
    mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
    if "device" in mkwargs:
        mkwargs["device"] = "meta"
    try:
        out = func(*margs, **mkwargs)
    except (NotImplementedError, torch._subclasses.fake_tensor.DynamicOutputShapeException) as e:
        mirrored = _mirrored_lists_meta(func, margs)
        if mirrored is not None:
            return mirrored
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
    if isinstance(out, tuple) and all(isinstance(o, list) for o in out):
        if all(isinstance(t, torch.Tensor) for o in out for t in o):
            return Meta(tuple(desc_of(t) for o in out for t in o), tuple(len(o) for o in out))
    raise NeedsFallback(f"{func} returns {type(out).__name__}")


def returns_tensor_lists(op):
    """Whether ``op`` returns several tensor lists (functional list updates: ``_fused_adamw``)."""
    rets = op._schema.returns
    return len(rets) > 1 and all(str(r.type) == "List[Tensor]" for r in rets)


def _mirrored_lists_meta(func, margs):
    """Meta of a functional list-update op whose k output lists are the new values of its first
    k list arguments (``_fused_sgd``: torch has no meta kernel for it)."""
    rets = func._schema.returns
    if not returns_tensor_lists(func) or len(margs) < len(rets):
        return None
    lists = margs[: len(rets)]
    if not all(isinstance(x, list) for x in lists):
        return None
    return Meta(tuple(desc_of(t) for x in lists for t in x), tuple(len(x) for x in lists))


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
            for x in a:  # tensor lists (foreach, fused optimizers): base tensors inline
                if type(x) is LazyTensor and x._view is None:
                    inputs.append(x._st.value)
                    sig.append(x._desc)
                else:
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
        value = upload(a.detach().contiguous())
        inputs.append(value)
        sig.append(value.desc)
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


# Both tables are read once per recorded op, so neither hashes an OpOverload (its ``__hash__`` is
# a Python method): ``_specs`` is keyed by the overload's C++ callable ``func._op``, and a
# signature starts with the op's OpSpec (identity hash). An OpEntry's own ``key`` starts with the
# OpOverload, for the messages that name it (program/miss.py).
_specs: dict = {}  # func._op -> OpSpec
_entries: dict = {}  # structural signature -> OpEntry


def _spec(func):
    spec = _specs.get(func._op)
    if spec is None:
        spec = _specs[func._op] = OpSpec(func, lookup(func))
    return spec


def _new_entry(spec, key, args, kwargs):
    meta = _compute_meta(spec.func, args, kwargs)
    for d in meta.descs:  # fail at the op, not at the next sync's compile
        if d is not None and d[2] not in TORCH_TO_JAX:
            hint = "; use torch.complex64" if d[2] == torch.complex32 else ""
            raise TypeError(
                f"torchacc: {spec.func} would make a {d[2]} tensor, a dtype the device does not "
                f"have{hint}"
            )
    count = [0, 0]
    lift_pos, lift_kw = spec.lift_pos, spec.lift_kw
    targs = [_template(a, lift_pos.get(i, 0), count) for i, a in enumerate(args)]
    tkwargs = {k: _template(v, lift_kw.get(k, 0), count) for k, v in kwargs.items()}
    descs = meta.descs + ((device_random.KEY_DESC,) if spec.rule.rng else ())
    return OpEntry(spec.rule, key, targs, tkwargs, descs, meta.kind)


def record_values(func, args, kwargs):
    """Record ``func`` as a node; returns (list of output Values, its OpEntry).

    Note [Recording an op]."""
    spec = _specs.get(func._op) or _spec(func)
    rule = spec.rule
    if rule is None:
        raise NeedsFallback(f"no lowering rule for {func}")
    inputs, scalars = [], []
    sig = [spec]
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
        op = _entries[key] = _new_entry(spec, (func, *key[1:]), args, kwargs)
    if _deferred[0]:  # an input still on the host goes up now (Note [Deferred uploads])
        _materialize(inputs)
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


def pack(items, kind):
    """Outputs in the structure the op returns (Meta.kind)."""
    if kind == "one":
        return items[0]
    if kind == "tuple":
        return tuple(items)
    if kind == "list":
        return items
    if type(kind) is tuple:  # a tuple of lists
        out, start = [], 0
        for n in kind:
            out.append(items[start : start + n])
            start += n
        return tuple(out)
    return None


def fresh(value):
    """A new base tensor (its own Storage) holding ``value``."""
    return make(Storage(value, value.desc), value.desc)


def wrap(values, op):
    """Fresh base tensors holding ``values``, in the structure ``op`` returns."""
    return pack([None if v is None else fresh(v) for v in values], op.kind)


def mutated_positions(func):
    return [
        i
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]


_functorch_active = torch._C._are_functorch_transforms_active


def direct_apply(function):
    """``function.apply`` for torchacc's own autograd Functions, minus torch's Python preamble.

    ``Function.apply`` first checks for a ``setup_context`` and unwraps dead functorch wrappers
    from every argument, about 15 us per call, then calls the C++ apply. Our Functions define no
    ``setup_context``, and their tensors are torchacc's, so the C++ apply is called directly;
    under a functorch transform the full ``apply`` runs as before."""
    raw = super(torch.autograd.Function, function).apply

    def apply(*args):
        if _functorch_active():
            return function.apply(*args)
        return raw(*args)

    return apply
