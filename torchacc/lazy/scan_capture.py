"""``scan`` while dynamo or ``make_fx`` traces a step (torch.compile, compile_step): torch's scan
operator, lowered by torchacc as one ``lax.scan``.

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
Two limits of the operator (torch 2.13) are handled here: it refuses backward inputs that share
memory ("aliasing"), which the gradients of two carry leaves often do (views of one tensor), so
``_DistinctGrads`` gives each its own; and it cannot differentiate a carry holding integer or bool
tensors, refused by name. Under ``make_fx`` a tensor ``fn`` closes over would be frozen into the
body as a constant: refused as on the lazy device; ``captured_scan`` passes tensors every step
reads (HF's attention mask) as the operator's loop-invariant inputs instead.
torch's backward scan as written copies whole stacks (it scans ``flip``ped copies of the forward's
saved stacks, and the operator's partitioner may save per-step transposed copies of the stacked
weights), which made the steady step slower than the unrolled loop: the graphs are rewritten
before lowering so the backward reads the stacks in place (Note [Copy-free backward scans] in
torchacc/lowering/scan_rewrites.py; same results, same scan nodes, same programs).
"""

from __future__ import annotations

import warnings

import torch
from torch.utils._pytree import (
    keystr,
    tree_flatten,
    tree_flatten_with_path,
    tree_map_only,
    tree_unflatten,
)

from torchacc import metrics
from torchacc.lazy.scan_checks import _check_carry, _check_inputs, _loop


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
