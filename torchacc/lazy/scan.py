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
trace-once frontend] in scan_capture.py). On other tensors (CPU, eager) ``scan`` is the plain
Python loop it stands for (scan_checks.py), the reference it is tested against.
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.autograd.function import once_differentiable
from torch.utils._pytree import tree_flatten, tree_unflatten

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lazy.scan_capture import _captured_scan, captured
from torchacc.lazy.scan_checks import (
    _check_carry,
    _check_inputs,
    _check_same_device,
    _flatten,
    _loop,
    _unflatten,
)
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
        t = torch.empty(tuple(shape), dtype=dtype, device=DEVICE_TYPE)
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
