"""``scan(fn, init, xs)`` on torchacc tensors: one recorded ``torchacc.scan`` node each way.

``fn`` is traced once per call (or once per input signature when ``is_fn_pure``) with AOTAutograd
into a forward and a backward FX graph (Note [Scan bodies] in torchacc/lowering/scan.py), on fake
tensors of the torchacc device: torchacc's autocast policy and its kernels above autograd (linear,
attention, RMSNorm: torch.ops.torchacc ops) apply inside ``fn`` exactly as in the unrolled loop,
and a tensor ``fn`` closes over is refused by name. The autograd Function ``_Scan`` records the
forward scan, which also returns the per-step activations the backward graph needs (stacked), and
its backward records the reverse scan of the backward graph. Activations that are a step's own
slice of ``xs`` are not returned: the backward reads ``xs`` itself. While ``torch.compile`` or
``compile_step`` traces the step, ``scan`` becomes torch's own scan operator (Note [Scan on the
trace-once frontend]). On other tensors (CPU, eager) ``scan`` is the plain Python loop it stands
for, the reference it is tested against.

Note [Scan on the trace-once frontend]
``torch.compile(backend="torchacc")`` and ``compile_step`` see the step through dynamo/AOTAutograd
or ``make_fx``, never as torchacc tensors, so the recorder's ``torchacc.scan`` node is out of
reach there; a Python loop would be unrolled into the graph (trace and compile time linear in
depth). Candidates were (a) an opaque custom op whose body torchacc traces and differentiates
itself: dynamo cannot see through it, so its autograd, closures and fake-mode meta would all be
hand-written and the body traced outside dynamo's guards; (b) a dynamo ``disable`` region: a graph
break per scan, run eagerly; (c) torch's higher-order operator ``torch.ops.higher_order.scan``.
(c) is what torch itself uses: dynamo speculates ``fn`` once into a subgraph (tensors it closes
over become extra inputs, no graph break), AOTAutograd differentiates it into a forward scan
(which also returns the per-step activations) and a backward scan with their own partitioned
subgraphs, ``make_fx`` (compile_step) traces it the same way, and functionalization keeps it
whole. torchacc lowers the node with one ``jax.lax.scan`` replaying the subgraph's nodes with their
rules (``_hop_scan`` in torchacc/lowering/scan.py), so the body is traced and compiled once at any
length. So while dynamo compiles (``torch.compiler.is_dynamo_compiling()``) ``scan`` calls torch's
public ``scan`` (dynamo only accepts the operator through it), and under ``make_fx``'s proxy mode
it calls the operator itself with flattened leaves (the public function would start a nested
dynamo compile there). ``partition_fn`` and ``is_fn_pure`` have no effect on this path (dynamo's
guards and AOTAutograd's partitioner decide). The operator has no ``None`` outputs, so ``None``
leaves of ``fn``'s ``y`` travel as empty tuples and come back as ``None``. Checked on torch 2.13
(this box); on a torch without the operator's autograd (older than 2.9) the path is not taken:
``scan`` runs as the loop, counted as ``ScanUnrolled`` in torchacc.metrics with a warning.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map_only,
    tree_unflatten,
)

from torchacc import metrics
from torchacc.lazy.tensor import LazyTensor
from torchacc.lowering import lookup
from torchacc.lowering import scan as ops

_traced_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # fn -> {sig: Traced}


def scan(fn, init, xs, partition_fn=None, is_fn_pure=False):
    """``carry, ys``: ``fn(carry, x_i) -> (carry, y_i)`` over the leading dimension of ``xs``'s
    leaves, the ``y_i`` stacked (torch_xla.experimental.scan.scan's contract)."""
    if not callable(fn):
        raise ValueError(f"scan: fn {fn!r} must be callable")
    flat_init, init_spec = tree_flatten(init)
    flat_xs, xs_spec = tree_flatten(xs)
    length = _check_inputs(init, xs)
    if not any(type(t) is LazyTensor for t in (*flat_init, *flat_xs)):
        if captured():
            return _captured_scan(fn, init, xs, length)
        return _loop(fn, init, xs, length)
    _check_same_device(init, xs)
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (*flat_init, *flat_xs))
    traced = _traced(fn, flat_init, init_spec, flat_xs, xs_spec, partition_fn, grad, is_fn_pure)
    outs = _Scan.apply(traced, *flat_init, *flat_xs)
    carry = tree_unflatten(list(outs[: traced.nc]), traced.carry_spec)
    return carry, _unflatten(list(outs[traced.nc :]), traced.y_spec)


def _flatten(tree):
    """The tensor leaves of ``tree`` (None leaves left out, as torch_xla does) and how to put
    them back."""
    leaves, spec = tree_flatten(tree)
    return [v for v in leaves if v is not None], (spec, tuple(v is None for v in leaves))


def _unflatten(tensors, spec):
    it = iter(tensors)
    return tree_unflatten([None if none else next(it) for none in spec[1]], spec[0])


# -------------------------------------------------------------------------------------------------
# checks


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


# -------------------------------------------------------------------------------------------------
# the eager reference


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


# -------------------------------------------------------------------------------------------------
# the trace-once frontend: torch's scan operator (Note [Scan on the trace-once frontend])


def captured():
    """Whether dynamo or ``make_fx`` is tracing the caller (torch.compile, compile_step)."""
    if torch.compiler.is_dynamo_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


def _load_hop():
    """torch's scan operator module, or None where it cannot differentiate (torch < 2.9)."""
    if tuple(int(v) for v in torch.__version__.split(".")[:2]) < (2, 9):
        return None
    import importlib

    try:
        hop = importlib.import_module("torch._higher_order_ops.scan")
    except ImportError:
        return None
    return hop if hasattr(hop, "scan_op") and hasattr(hop, "ScanAutogradOp") else None


_HOP = _load_hop()  # at import: dynamo would break the graph on an import inside a trace


def captured_scan(fn, init, xs, fixed):
    """``scan`` on the trace-once frontend with ``fn(carry, x, fixed)``: ``fixed``, a tuple of
    tensors every step reads (HF's attention mask, rotary embeddings), enters torch's scan
    operator as its loop-invariant inputs (make_fx turns tensors ``fn`` closes over into
    constants of the body; dynamo lifts them itself)."""
    return _captured_scan(fn, init, xs, _check_inputs(init, xs), tuple(fixed))


def _captured_scan(fn, init, xs, length, fixed=None):
    hop = _HOP
    if hop is None:
        metrics.counter_inc("ScanUnrolled")
        warnings.warn(
            f"torchacc: scan under torch.compile/compile_step needs torch >= 2.9's scan "
            f"operator (torch {torch.__version__} here); it runs as a loop of {length} steps "
            "unrolled into the graph (counted as 'ScanUnrolled')",
            stacklevel=3,
        )
        if fixed is not None:
            return _loop(lambda c, x: fn(c, x, fixed), init, xs, length)
        return _loop(fn, init, xs, length)

    _check_float_carry(init, xs)

    def body(carry, x, extra):
        out = fn(carry, x) if fixed is None else fn(carry, x, extra)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"scan: fn must return (carry, y), got {type(out).__name__}")
        flat_new, new_spec = tree_flatten(out[0])
        _check_carry(flat_new, new_spec, tree_flatten(carry)[0], tree_flatten(carry)[1])
        # fresh outputs: the operator refuses outputs that alias its inputs (XLA drops copies)
        new, y = tree_map_only(torch.Tensor, torch.clone, tuple(out))
        return new, _nones_out(y)

    if torch.compiler.is_dynamo_compiling():
        carry, ys = hop.scan(lambda c, x: body(c, x, fixed), init, xs)
        return _distinct_grads(carry), _nones_in(_distinct_grads(ys))
    flat_init, init_spec = tree_flatten(init)
    flat_xs, xs_spec = tree_flatten(xs)
    nc, nx, specs = len(flat_init), len(flat_xs), {}

    def flat_body(*args):
        carry = tree_unflatten(list(args[:nc]), init_spec)
        new, y = body(carry, tree_unflatten(list(args[nc : nc + nx]), xs_spec), args[nc + nx :])
        flat_y, specs["y"] = tree_flatten(y)
        return [*tree_flatten(new)[0], *flat_y]

    # the operator traces fn on these very tensors: fresh copies keep a tensor fn closes over
    # (the init itself, say) from passing for the carry (XLA drops the copies)
    flat_init = [t.clone() for t in flat_init]
    outs = hop.scan_op(flat_body, flat_init, flat_xs, additional_inputs=fixed or ())
    _check_no_closures()
    outs = _distinct_grads(outs)
    return tree_unflatten(outs[:nc], init_spec), _nones_in(tree_unflatten(outs[nc:], specs["y"]))


def _check_no_closures():
    """Under make_fx a tensor of the outer trace that ``fn`` closes over becomes a (fake)
    constant of the scan's body, its value lost: refused, as on the lazy device."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    root = get_proxy_mode().tracer.root
    for name, sub in root.named_children():
        if not name.startswith("scan_combine_graph") or not isinstance(sub, torch.fx.GraphModule):
            continue
        for node in sub.graph.nodes:
            if node.op == "get_attr" and isinstance(getattr(sub, node.target, None), FakeTensor):
                raise ValueError(
                    "scan: fn uses a tensor it closes over (not one of its arguments); scan "
                    "traces fn once, so pass every tensor fn reads through init or xs"
                )


def _check_float_carry(init, xs):
    """torch's scan operator (2.13) fails deep in AOTAutograd ("outs_to_grad length != tangents
    length") on a differentiated scan whose carry holds an integer or bool tensor: refused here."""
    if not torch.is_grad_enabled():
        return
    if not any(t.requires_grad for t in (*tree_flatten(init)[0], *tree_flatten(xs)[0])):
        return
    for path, t in tree_flatten_with_path(init)[0]:
        if not (t.is_floating_point() or t.is_complex()):
            raise NotImplementedError(
                f"scan under torch.compile/compile_step: carry{keystr(path)} is a {t.dtype} "
                "tensor; torch's scan operator cannot differentiate a scan whose carry holds "
                "integer or bool tensors. Carry it as a float tensor, or pass tensors that do not "
                "change through xs or as tensors fn closes over (torch.compile lifts those)"
            )


class _DistinctGrads(torch.autograd.Function):
    """Identity whose backward gives every gradient its own memory: the scan operator's backward
    refuses gradients that share storage (e.g. two carries' ``sum()`` gradients, views of one
    tensor) as "aliasing"."""

    @staticmethod
    def forward(ctx, *tensors):
        return tuple(t.clone() for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(None if g is None else g.clone() for g in grads)


def _distinct_grads(tree):
    leaves, spec = tree_flatten(tree)
    if len(leaves) < 2 or not any(t.requires_grad for t in leaves):
        return tree
    return tree_unflatten(list(_DistinctGrads.apply(*leaves)), spec)


def _nones_out(tree):
    if tree is None:
        return ()
    if type(tree) in (tuple, list):
        return type(tree)(_nones_out(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _nones_out(v) for k, v in tree.items()}
    return tree


def _nones_in(tree):
    if isinstance(tree, tuple) and not tree:
        return None
    if type(tree) in (tuple, list):
        return type(tree)(_nones_in(v) for v in tree)
    if isinstance(tree, dict):
        return {k: _nones_in(v) for k, v in tree.items()}
    return tree


# -------------------------------------------------------------------------------------------------
# tracing


class Traced:
    """A traced ``fn`` for one input signature: its bodies' keys and the plumbing around them."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


@functools.lru_cache(maxsize=None)
def _decompositions():
    """Core ATen decompositions minus the ops torchacc lowers whole (as the dynamo backend)."""
    from torch._decomp import core_aten_decompositions

    return {op: fn for op, fn in core_aten_decompositions().items() if lookup(op) is None}


def _fake(mode, shape, dtype, requires_grad):
    with mode:
        t = torch.empty(tuple(shape), dtype=dtype, device="torchacc")
    return t.requires_grad_(requires_grad and (t.is_floating_point() or t.is_complex()))


def _traced(fn, flat_init, init_spec, flat_xs, xs_spec, partition_fn, grad, pure):
    sig = (
        tuple((tuple(t.shape), t.dtype, t.requires_grad) for t in (*flat_init, *flat_xs)),
        init_spec,
        xs_spec,
        partition_fn,
        grad,
    )
    if pure:
        try:
            hit = _traced_cache.setdefault(fn, {}).get(sig)
        except TypeError:  # fn cannot be weakly referenced
            hit, pure = None, False
        if hit is not None:
            return hit
    traced = _trace(fn, flat_init, init_spec, flat_xs, xs_spec, partition_fn, grad)
    if pure:
        _traced_cache[fn][sig] = traced
    return traced


def _trace(fn, flat_init, init_spec, flat_xs, xs_spec, partition_fn, grad):
    from functorch.compile import aot_function, default_partition, make_boxed_func

    nc, nx = len(flat_init), len(flat_xs)
    length = flat_xs[0].shape[0]
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_fallback_kernels=False)
    fake_c = [_fake(mode, t.shape, t.dtype, grad) for t in flat_init]
    fake_x = [_fake(mode, t.shape[1:], t.dtype, grad and t.requires_grad) for t in flat_xs]
    specs = {}

    def flat_fn(*args):
        out = fn(
            tree_unflatten(list(args[:nc]), init_spec), tree_unflatten(list(args[nc:]), xs_spec)
        )
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(f"scan: fn must return (carry, y), got {type(out).__name__}")
        flat_c, c_spec = tree_flatten(out[0])
        _check_carry(flat_c, c_spec, fake_c, init_spec)
        flat_y, specs["y"] = _flatten(out[1])
        for y in flat_y:
            if not isinstance(y, torch.Tensor):
                raise ValueError(f"scan: fn's y holds a {type(y).__name__}, not a tensor")
        # fresh outputs: AOTAutograd keeps outputs that alias inputs or each other out of its
        # graphs (an epilogue we could not scan); XLA removes the copies
        return tuple(v.clone() for v in (*flat_c, *flat_y))

    graphs = {}

    def capture(kind):
        def compiler(gm, example_inputs):
            graphs[kind] = gm
            return make_boxed_func(gm)

        return compiler

    compiled = aot_function(
        flat_fn,
        fw_compiler=capture("fw"),
        bw_compiler=capture("bw"),
        partition_fn=partition_fn or default_partition,
        decompositions=_decompositions(),
    )
    # the whole trace on placeholders, the captured graphs' own run included (a tensor fn
    # creates, such as a causal mask, is one too)
    with mode, torch.enable_grad() if grad else torch.no_grad():
        try:
            outs = compiled(*fake_c, *fake_x)
        except (AssertionError, RuntimeError) as e:  # a real tensor met the placeholders
            if "FakeTensor" not in str(e) and "next to torchacc tensors" not in str(e):
                raise
            raise ValueError(
                "scan: fn uses a tensor it closes over (not one of its arguments); scan traces "
                "fn once on placeholder tensors, so pass every tensor fn reads through init or "
                f"xs (PyTorch said: {str(e).splitlines()[0][:300]})"
            ) from None
        diff = [i for i, o in enumerate(outs) if o.requires_grad]
        if diff:
            torch.autograd.backward(
                [outs[i] for i in diff], [torch.ones_like(outs[i]) for i in diff]
            )
    ny = len(outs) - nc
    y_meta = [(tuple(o.shape), o.dtype) for o in outs[nc:]]
    c_meta = [(tuple(t.shape), t.dtype) for t in flat_init]
    fw_gm = graphs["fw"]
    fw_outs = list(next(n for n in fw_gm.graph.nodes if n.op == "output").args[0])
    places = [n for n in fw_gm.graph.nodes if n.op == "placeholder"]
    if len(places) != nc + nx:
        raise RuntimeError(
            f"scan: the forward graph of fn has {len(places)} inputs, expected {nc + nx}"
        )
    acts = fw_outs[nc + ny :]
    # activations that are a step's own slice of xs are read from xs, not stacked again
    alias = {k: places.index(a) - nc for k, a in enumerate(acts) if a in places[nc:]}
    computed = [k for k in range(len(acts)) if k not in alias]
    for k in computed:
        v = acts[k].meta.get("val")
        if not isinstance(v, torch.Tensor):
            raise NotImplementedError(f"scan: fn saves a non-tensor for backward ({v!r})")
    act_meta = [(tuple(acts[k].meta["val"].shape), acts[k].meta["val"].dtype) for k in computed]
    fw = ops.Body(
        fw_gm,
        [("c", i) for i in range(nc)] + [("x", i) for i in range(nx)],
        range(nc),
        [nc + j for j in range(ny)] + [nc + ny + k for k in computed],
        c_meta,
        y_meta + act_meta,
        "forward",
    )
    bw_key, d, g, ty = None, (), (), ()
    if "bw" in graphs:
        d = tuple(i for i in range(nc) if flat_init[i].is_floating_point())
        ty = tuple(j for j in range(ny) if outs[nc + j].requires_grad)
        g = tuple(i for i in range(nx) if fake_x[i].requires_grad)
        bw_gm = graphs["bw"]
        inputs = [("x", k) for k in range(len(acts))]
        for o in diff:
            inputs.append(("c", d.index(o)) if o < nc else ("x", len(acts) + ty.index(o - nc)))
        bw_places = [n for n in bw_gm.graph.nodes if n.op == "placeholder"]
        if len(bw_places) != len(inputs):
            raise RuntimeError(
                f"scan: the backward graph of fn has {len(bw_places)} inputs, "
                f"expected {len(inputs)}"
            )
        bw = ops.Body(
            bw_gm,
            inputs,
            d,
            [nc + i for i in g],
            [c_meta[i] for i in d],
            [(tuple(fake_x[i].shape), fake_x[i].dtype) for i in g],
            "backward",
        )
        bw_key = ops.add(bw)
    return Traced(
        nc=nc,
        ny=ny,
        length=length,
        fw=ops.add(fw),
        bw=bw_key,
        alias=alias,
        n_acts=len(acts),
        carry_spec=init_spec,
        y_spec=specs["y"],
        d=d,
        g=g,
        ty=ty,
        y_meta=y_meta,
        c_meta=c_meta,
    )


# -------------------------------------------------------------------------------------------------
# recording


class _Scan(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t, *flat):
        carry, xs = list(flat[: t.nc]), list(flat[t.nc :])
        outs = ops.scan(carry, xs, t.fw, False, t.length)
        n = t.nc + t.ny
        if t.bw is not None:
            computed = iter(outs[n:])
            acts = [xs[t.alias[k]] if k in t.alias else next(computed) for k in range(t.n_acts)]
            ctx.save_for_backward(*acts)
            ctx.t = t
            ctx.device = flat[0].device
        else:  # nothing fn returns depends differentiably on its inputs
            ctx.mark_non_differentiable(*outs[:n])
        return tuple(outs[:n])

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        t = ctx.t
        acts = list(ctx.saved_tensors)

        def grad_or_zeros(i, shape, dtype):
            g = grads[i]
            return torch.zeros(shape, dtype=dtype, device=ctx.device) if g is None else g

        carry = [grad_or_zeros(i, *t.c_meta[i]) for i in t.d]
        gy = [grad_or_zeros(t.nc + j, (t.length, *t.y_meta[j][0]), t.y_meta[j][1]) for j in t.ty]
        outs = ops.scan(carry, acts + gy, t.bw, True, t.length)
        result = [None] * (len(ctx.needs_input_grad) - 1)
        for j, i in enumerate(t.d):
            result[i] = outs[j]
        for j, i in enumerate(t.g):
            result[t.nc + i] = outs[len(t.d) + j]
        return (None, *result)
