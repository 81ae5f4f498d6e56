"""Traced regions on torchacc tensors: ``assume_pure(fn)`` and ``while_loop(cond, body, ...)``.

Both trace a function once on fake torchacc tensors (make_fx of its functionalized form, no
autograd) and record one node whose lowering replays the graph (Note [Traced regions] in
torchacc/lowering/region.py). Tensors the function closes over (module weights, a captured
tensor) are swapped for fakes as the trace meets them and become extra graph inputs, so the node
reads their current values every step. On tensors of other devices ``while_loop`` is torch's own.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.tensor import LazyTensor
from torchacc.lowering import region as ops

_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> {signature: Traced}


class Traced:
    """A traced function: its graph's key, the lifted closure tensors and its output plumbing."""

    def __init__(self, key, closures, out_spec, out_consts, out_pos):
        self.key = key
        self.closures = closures  # LazyTensors read by the graph after the inputs
        self.out_spec = out_spec
        self.out_consts = out_consts  # non-tensor output leaves, as returned at trace time
        self.out_pos = out_pos  # per tensor output, its position among the output leaves


_WRITES = (
    "torchacc: {op} in {what} writes into a tensor the function closes over; a traced region "
    "must not modify tensors it does not create"
)


def _fake(mode, t, requires_grad=False):
    with mode:
        f = torch.empty(tuple(t.shape), dtype=t.dtype, device=DEVICE_TYPE)
    return f.requires_grad_(requires_grad)


class _Lift(torch.utils._python_dispatch.TorchDispatchMode):
    """Swaps every LazyTensor an op meets for a fake of its own (made once per tensor, untracked
    by the trace, so the graph holds it as a constant that ``_lift_constants`` turns into an
    input) and notes the tensor."""

    def __init__(self, mode, found):
        super().__init__()
        self.mode, self.found = mode, found

    def _swap(self, t):
        if type(t) is not LazyTensor:
            return t
        entry = self.found.get(id(t))
        if entry is None:
            from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

            with disable_proxy_modes_tracing():
                entry = self.found[id(t)] = (len(self.found), t, _fake(self.mode, t))
        return entry[2]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.is_mutable:
            _check_not_written(func, args, kwargs or {})
        flat, spec = tree_flatten((args, kwargs or {}))
        args, kwargs = tree_unflatten([self._swap(a) for a in flat], spec)
        return func(*args, **kwargs)


def _check_not_written(func, args, kwargs):
    """A closure tensor in an argument the op writes: refused (the write would be lost)."""
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if type(v) is LazyTensor:
                raise ValueError(_WRITES.format(what="the traced function", op=func))


def _graph(fn, fakes, mode, what, grad):
    """The functional FX graph of ``fn`` on ``fakes`` (``fn`` runs once; under autograd with
    ``grad``, so that ``fn`` can take gradients itself)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchacc.lazy.scan import _decompositions

    decomps = _decompositions()
    with mode, torch.set_grad_enabled(grad):
        try:
            if grad:  # autograd first (it cannot run inside functionalize), then functionalize
                fn = make_fx(fn, decomposition_table=decomps)(*fakes)
                fakes = [f.detach() for f in fakes]
                torch.set_grad_enabled(False)
            functional = torch.func.functionalize(fn, remove="mutations_and_views")
            return make_fx(functional, decomposition_table=decomps)(*fakes)
        except torch._subclasses.fake_tensor.DataDependentOutputException as e:
            raise ValueError(
                f"torchacc: {what} reads a tensor's value on the host ({e}); a traced region "
                "cannot branch on device data"
            ) from None
        except RuntimeError as e:  # functionalization met the write before the Lift mode did
            if "mutating a non-functional tensor" not in str(e):
                raise
            raise ValueError(_WRITES.format(what=what, op="an in-place op")) from None


def trace(fn, flat_args, what, grad_args=()):
    """Trace ``fn(*flat_args) -> pytree`` into a registered graph; returns a ``Traced``.
    ``grad_args``: positions whose placeholders require grad (``fn`` differentiates itself)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_fallback_kernels=False)
    fakes = [_fake(mode, t, i in grad_args) for i, t in enumerate(flat_args)]
    found: dict = {}
    out = {}

    def first(*args):
        with _Lift(mode, found):
            return _tensors(fn(*args))

    def _tensors(result):
        leaves, spec = tree_flatten(result)
        pos = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        out["spec"], out["leaves"], out["pos"] = spec, leaves, pos
        return tuple(leaves[i] for i in pos)

    gm = _graph(first, fakes, mode, what, bool(grad_args))
    _check_no_input_writes(gm, what)
    entries = sorted(found.values(), key=lambda e: e[0])
    if entries:
        _lift_constants(gm, entries)
    closures = [t for _, t, _ in entries]
    key = ops.add(ops.Graph(gm, what))
    consts = [None if i in out["pos"] else v for i, v in enumerate(out["leaves"])]
    return Traced(key, closures, out["spec"], consts, out["pos"])


def _check_no_input_writes(gm, what):
    """Functionalization turns a write into an input into a copy back at the end: refused (a
    region is a function of its inputs; the write would be lost or repeated)."""
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is torch.ops.aten.copy_.default:
            if n.args[0] in places:
                raise ValueError(
                    f"torchacc: {what} writes in place into its input {places.index(n.args[0])} "
                    f"(shape {tuple(n.args[0].meta['val'].shape)}); return a new tensor instead"
                )


def _lift_constants(gm, entries):
    """Turn the graph's constants that stand for closure tensors into inputs after the others.
    The Lift mode runs below functionalization, so each constant is the very fake it made."""
    graph = gm.graph
    last = [n for n in graph.nodes if n.op == "placeholder"][-1]
    inputs = {}
    for k, _, fake in entries:
        with graph.inserting_after(last):
            last = graph.placeholder(f"closure_{k}")
        last.meta["val"] = fake
        inputs[id(fake)] = last
    lifted = set()
    for node in list(graph.nodes):
        if node.op == "get_attr":
            ph = inputs.get(id(getattr(gm, node.target)))
            if ph is not None:
                node.replace_all_uses_with(ph)
                graph.erase_node(node)
                lifted.add(node.target)
    for target in lifted:  # several get_attr nodes may read one attribute
        delattr(gm, target)
    gm.recompile()


def _signature(flat):
    return tuple(
        (tuple(v.shape), v.dtype, v.device) if isinstance(v, torch.Tensor) else ("py", repr(v))
        for v in flat
    )


def _check_torchacc(flat, what):
    for v in flat:
        if isinstance(v, torch.Tensor) and type(v) is not LazyTensor:
            raise ValueError(
                f"torchacc: {what} got a {v.device} tensor of shape {tuple(v.shape)} next to "
                "torchacc tensors; move it with .to(device)"
            )


# -------------------------------------------------------------------------------------------------
# assume_pure


def assume_pure(fn, use_cache=True, cache=None):
    """``fn`` (pure: its result depends only on its arguments and the tensors it reads) traced
    once per input signature and recorded as one ``torchacc.call_graph`` node per call.
    Non-tensor arguments are part of the signature. Under autograd, with inputs that require
    grad, the backward is one more node: the forward graph and its backward (traced from the
    forward graph, so ``fn`` runs once per signature), which recomputes the forward it needs.
    ``cache``: a dict to keep the traces in (keyed by the wrapper and the signature), instead of
    the module's own."""
    what = f"assume_pure({getattr(fn, '__name__', 'fn')})"

    @functools.wraps(fn)
    def pure(*args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        tensors = [v for v in flat if isinstance(v, torch.Tensor)]
        if not any(type(v) is LazyTensor for v in tensors):
            return fn(*args, **kwargs)
        _check_torchacc(flat, what)
        grad = torch.is_grad_enabled() and any(v.requires_grad for v in tensors)
        sig = (spec, _signature(flat), grad and tuple(v.requires_grad for v in tensors))
        store = _cache.setdefault(pure, {}) if cache is None else cache
        if cache is not None:
            sig = (pure, sig)
        traced = store.get(sig) if use_cache else None
        if traced is None:
            traced = _trace_pure(fn, flat, spec, tensors, grad, what)
            if use_cache:
                store[sig] = traced
        if grad:
            outs = _PureCall.apply(traced, *tensors)
        else:
            outs = ops.call_graph([*tensors, *traced.closures], traced.key)
        leaves = list(traced.out_consts)
        for i, t in zip(traced.out_pos, outs):
            leaves[i] = t
        return tree_unflatten(leaves, traced.out_spec)

    return pure


def _trace_pure(fn, flat, spec, tensors, grad, what):
    where = [i for i, v in enumerate(flat) if isinstance(v, torch.Tensor)]
    n = len(tensors)

    def flat_fn(*ts):
        full = list(flat)
        for i, t in zip(where, ts):
            full[i] = t
        a, k = tree_unflatten(full, spec)
        return fn(*a, **k)

    traced = trace(flat_fn, tensors, what)
    graph = ops.GRAPHS[traced.key]
    if graph.rng:
        raise NotImplementedError(
            f"torchacc: {what} uses random ops; a pure function has no RNG state of its own on "
            "torchacc (pass random tensors in as arguments)"
        )
    traced.joint = None
    if not grad:
        return traced
    for t in traced.closures:
        if t.requires_grad:
            raise ValueError(
                f"torchacc: {what} reads a tensor of shape {tuple(t.shape)} that requires grad "
                "without taking it as an argument; pass it in, or its gradient would be lost"
            )
    wrt = [i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point()]
    # the backward is traced from the forward graph, not from fn (which runs once)
    forward, nc = graph.gm, len(traced.closures)

    def joint(*ts):  # (*inputs, *closures, *output grads) -> input grads
        out = forward(*ts[: n + nc])
        pairs = [(o, g) for o, g in zip(out, ts[n + nc :]) if o.requires_grad]
        if not pairs:
            return tuple(torch.zeros_like(ts[i]) for i in wrt)
        grads = torch.autograd.grad(
            [o for o, _ in pairs], [ts[i] for i in wrt], [g for _, g in pairs], allow_unused=True
        )
        return tuple(torch.zeros_like(ts[i]) if g is None else g for i, g in zip(wrt, grads))

    templates = [torch.empty(s, dtype=d, device="meta") for s, d in graph.out_meta]
    args = [*tensors, *traced.closures, *templates]
    traced.joint = trace(joint, args, f"{what} backward", grad_args=wrt)
    traced.wrt = wrt
    return traced


class _PureCall(torch.autograd.Function):
    """An ``assume_pure`` call under autograd: the forward graph, then the joint graph's input
    gradients for the backward."""

    @staticmethod
    def forward(ctx, traced, *tensors):
        ctx.traced = traced
        ctx.save_for_backward(*tensors)
        return tuple(ops.call_graph([*tensors, *traced.closures], traced.key))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        traced, tensors = ctx.traced, ctx.saved_tensors
        metas = ops.GRAPHS[traced.key].out_meta
        device = tensors[0].device
        grads = [
            torch.zeros(s, dtype=d, device=device) if g is None else g
            for g, (s, d) in zip(grads, metas)
        ]
        joint = traced.joint
        outs = ops.call_graph([*tensors, *traced.closures, *grads, *joint.closures], joint.key)
        result = [None] * len(tensors)
        for i, g in zip(traced.wrt, outs):
            result[i] = g
        return (None, *result)


# -------------------------------------------------------------------------------------------------
# while_loop


def while_loop(cond_fn, body_fn, carried_inputs, additional_inputs=(), grad_inputs=()):
    """torch's ``while_loop(cond_fn, body_fn, carried_inputs)`` on torchacc tensors: one
    ``lax.while_loop``; ``cond_fn(*carried, *additional_inputs)`` is a bool scalar tensor,
    ``body_fn`` (same arguments) returns the new carried values (same structure, shapes and
    dtypes). No autograd through the loop; ``grad_inputs`` (positions in ``additional_inputs``)
    are traced as requiring grad, for a body that takes gradients itself."""
    flat, spec = tree_flatten(tuple(carried_inputs))
    additional = list(additional_inputs)
    for i, v in enumerate(flat):
        if not isinstance(v, torch.Tensor):
            raise ValueError(
                f"torchacc: while_loop carried input {i} is a {type(v).__name__}; on torchacc "
                "every carried input must be a tensor"
            )
    _check_torchacc([*flat, *additional], "while_loop")
    n = len(flat)

    def call(f):
        return lambda *ts: f(*tree_unflatten(list(ts[:n]), spec), *ts[n:])

    def flat_body(*ts):
        new, new_spec = tree_flatten(tuple(call(body_fn)(*ts)))
        if new_spec != spec:
            raise ValueError(
                f"torchacc: while_loop body_fn returned structure {new_spec}, the carried "
                f"inputs have {spec}"
            )
        return tuple(new)

    args = [*flat, *additional]
    grads = tuple(n + i for i in grad_inputs)
    body = trace(flat_body, args, "while_loop body_fn", grads)
    cond = trace(call(cond_fn), args, "while_loop cond_fn")
    b, c = ops.GRAPHS[body.key], ops.GRAPHS[cond.key]
    for i, ((shape, dtype), v) in enumerate(zip(b.out_meta, flat)):
        if shape != tuple(v.shape) or dtype != v.dtype:
            raise ValueError(
                f"torchacc: while_loop body_fn changed carried input {i} from shape "
                f"{tuple(v.shape)} {v.dtype} to {shape} {dtype}; it must keep both"
            )
    if len(c.out_meta) != 1 or c.out_meta[0] != ((), torch.bool):
        raise ValueError(
            f"torchacc: while_loop cond_fn must return one bool scalar tensor, got {c.out_meta}"
        )
    extra = [*additional, *body.closures, *cond.closures]  # Note [Traced regions]
    if torch.is_grad_enabled() and any(v.requires_grad for v in (*flat, *extra)):
        raise NotImplementedError(
            "torchacc: while_loop has no backward on torchacc; run it under torch.no_grad() "
            "(a carried input or a tensor the functions read requires grad)"
        )
    if c.rng:
        raise NotImplementedError("torchacc: while_loop cond_fn uses random ops")
    op = ops.while_loop_rng if b.rng else ops.while_loop
    outs = op(flat, extra, cond.key, body.key)
    return tuple(tree_unflatten(list(outs), spec))
