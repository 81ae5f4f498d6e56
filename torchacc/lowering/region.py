"""``torch.ops.torchacc.call_graph`` and ``torchacc.while_loop``: traced FX graphs as one node;
``torchacc.call_jax``: a JAX function as one node (torch_xla's ``xb.call_jax``;
``call_jax_rng`` for one taking the step's RNG key).

Note [Traced regions]
``assume_pure`` and ``while_loop`` (torchacc/lazy/region.py) trace a function once, on fake
torchacc tensors, into a functional FX graph of ATen and ``torchacc`` ops; the tensors the function
closes over (a module's weights) are lifted to extra graph inputs, so the graph holds no device
data. Each graph becomes a ``Graph`` registered under a ``key`` hashed from its code, its inputs'
shapes and dtypes and the bytes of its CPU constants: the key is a static argument of the recorded
node, so it is part of the step's structural key and equal traces reuse one executable.

- ``call_graph(args, graph)`` replays the graph's nodes with their lowering rules in the step's
  program (as the lazy recorder would have recorded them one by one, minus the per-op recording).
- ``while_loop(carried, extra, cond, body)`` is one ``jax.lax.while_loop``: ``cond`` and ``body``
  take ``(*carried, *additional inputs, *their closures)`` (``extra`` is the additional inputs,
  the body's closures, then the condition's); ``body`` returns the new carried values (same
  shapes and dtypes). ``while_loop_rng`` is the same for a body with random ops: it is a random
  op itself (it takes and advances the device RNG state) and splits a fresh key per iteration.

A graph must lower completely: an op with no rule is refused by name when the graph is made,
before anything is recorded (a region cannot fall back to the CPU). ``call_graph`` has no RNG
state of its own, so ``assume_pure`` refuses random ops.
"""

from __future__ import annotations

import jax
import torch

from torchacc.lowering.registry import lookup, register
from torchacc.lowering.scan import graph_digest, run_graph

_lib = torch.library.Library("torchacc", "FRAGMENT")
_lib.define("call_graph(Tensor[] args, str graph) -> Tensor[]")
_lib.define("while_loop(Tensor[] carried, Tensor[] extra, str cond, str body) -> Tensor[]")
_lib.define("while_loop_rng(Tensor[] carried, Tensor[] extra, str cond, str body) -> Tensor[]")

GRAPHS: dict = {}  # key -> Graph


class Graph:
    """One traced region: ``gm`` (placeholders = the region's tensor inputs, in order), its CPU
    constants, its outputs' (shape, dtype) and its key. ``what`` names it in errors."""

    def __init__(self, gm, what):
        self.gm = gm
        self.what = what
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.consts = _constants(gm, what)
        self.rng = _check_lowerable(gm, what)  # holds random ops
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.out_meta = tuple(_meta(a, what) for a in out.args[0])
        self.key = self._key()

    def _key(self):
        h = graph_digest(self.gm, self.placeholders, self.consts)
        return f"{self.what.split()[0]}-{h.hexdigest()[:32]}"

    def run(self, arrays, key=None):
        """The graph's outputs for ``arrays`` (one per placeholder), inside a JAX trace; ``key``
        feeds its random ops."""
        env = dict(zip(self.placeholders, arrays))
        return run_graph(self.gm, env, self.consts, key)


def _meta(node, what):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    if not isinstance(v, torch.Tensor):
        raise ValueError(f"torchacc: {what} returns {node!r}, not a tensor")
    return tuple(int(s) for s in v.shape), v.dtype


def _constants(gm, what):
    consts = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        t = gm
        for part in n.target.split("."):
            t = getattr(t, part)
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise ValueError(
                f"torchacc: {what} holds {n.target}, a {getattr(t, 'device', type(t))} constant "
                "with no value to lower"
            )
        consts[n.target] = t.detach().numpy()
    return consts


def _check_lowerable(gm, what):
    rng = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        if n.target is torch.ops.aten._local_scalar_dense.default:
            continue
        rule = lookup(n.target)
        if rule is None:
            raise NotImplementedError(
                f"torchacc: {what} uses {n.target}, which has no torchacc lowering; a traced "
                "region cannot fall back to the CPU"
            )
        rng = rng or rule.rng
    return rng


def add(graph):
    """Register ``graph`` and return its key (an equal graph already registered is reused)."""
    return GRAPHS.setdefault(graph.key, graph).key


def _get(key):
    g = GRAPHS.get(key)
    if g is None:
        raise RuntimeError(f"torchacc: unknown traced region {key!r}")
    return g


def _call_graph_meta(args, graph):
    return [torch.empty(s, dtype=d, device="meta") for s, d in _get(graph).out_meta]


def _while_loop_meta(carried, extra, cond, body):
    return [torch.empty_like(t, device="meta") for t in carried]


_lib.impl("call_graph", _call_graph_meta, "Meta")
_lib.impl("while_loop", _while_loop_meta, "Meta")
_lib.impl("while_loop_rng", _while_loop_meta, "Meta")
call_graph = torch.ops.torchacc.call_graph.default
while_loop = torch.ops.torchacc.while_loop.default
while_loop_rng = torch.ops.torchacc.while_loop_rng.default


@register(call_graph)
def _call_graph(args, graph):
    return list(_get(graph).run(list(args)))


@register(while_loop)
def _while_loop(carried, extra, cond, body):
    return _loop(carried, extra, cond, body, None)


@register(while_loop_rng, rng=True)
def _while_loop_rng(carried, extra, cond, body, rng):
    return _loop(carried, extra, cond, body, rng)


def _loop(carried, extra, cond, body, rng):
    c, b = _get(cond), _get(body)
    nc = len(carried)
    # extra = (*additional inputs, *body's closures, *cond's closures); both graphs read
    # (*carried, *additional, *their closures)
    nb, ncc = len(b.placeholders) - nc, len(c.placeholders) - nc
    na = nb + ncc - len(extra)
    extra = list(extra)
    b_extra, c_extra = extra[:nb], extra[:na] + extra[nb:]

    def keep_going(state):
        vals, key = state
        return c.run([*vals, *c_extra])[0].reshape(())

    def step(state):
        vals, key = state
        sub = None
        if key is not None:  # a fresh key per iteration for the body's random ops
            key, sub = jax.random.split(key)
        new = b.run([*vals, *b_extra], sub)
        return [r.astype(v.dtype) if r.dtype != v.dtype else r for r, v in zip(new, vals)], key

    return list(jax.lax.while_loop(keep_going, step, (list(carried), rng))[0])


# -------------------------------------------------------------------------------------------------
# call_jax: a JAX function as one node of the step

_lib.define("call_jax(Tensor[] args, str fn) -> Tensor[]")
JAX_CALLS: dict = {}  # key -> JaxCall


class JaxCall:
    """``fn`` called on a pytree ``treedef`` of leaves: the node's tensors at ``tensor_pos``, the
    rest the Python values ``statics`` (position -> value); under ``precision`` (JAX's
    default matmul precision when it was made). ``out_meta``: its results' (shape, dtype)."""

    def __init__(self, fn, treedef, tensor_pos, statics, precision, out_meta, out_tree):
        self.fn, self.treedef, self.tensor_pos = fn, treedef, tuple(tensor_pos)
        self.statics, self.precision = dict(statics), precision
        self.out_meta, self.out_tree = tuple(out_meta), out_tree
        self.key = f"call_jax-{getattr(fn, '__name__', 'fn')}-{len(JAX_CALLS)}"
        JAX_CALLS[self.key] = self

    def __call__(self, arrays, rng=None):
        leaves = [self.statics.get(i) for i in range(self.treedef.num_leaves)]
        for i, a in zip(self.tensor_pos, arrays):
            leaves[i] = a
        args, kwargs = jax.tree_util.tree_unflatten(self.treedef, leaves)
        if rng is not None:  # call_jax_rng: the function takes the step's key as ``rng=``
            kwargs = {**kwargs, "rng": rng}
        with jax.default_matmul_precision(self.precision):
            return jax.tree_util.tree_leaves(self.fn(*args, **kwargs))


def _call_jax_meta(args, fn):
    return [torch.empty(s, dtype=d, device="meta") for s, d in JAX_CALLS[fn].out_meta]


_lib.impl("call_jax", _call_jax_meta, "Meta")
call_jax = torch.ops.torchacc.call_jax.default


@register(call_jax)
def _call_jax(args, fn):
    return list(JAX_CALLS[fn](list(args)))


# the same for a function with random ops: a random op itself (it takes and advances the device
# RNG state), the function gets the key as ``rng=`` (pipeline stages with dropout)
_lib.define("call_jax_rng(Tensor[] args, str fn) -> Tensor[]")
_lib.impl("call_jax_rng", _call_jax_meta, "Meta")
call_jax_rng = torch.ops.torchacc.call_jax_rng.default


@register(call_jax_rng, rng=True)
def _call_jax_rng(args, fn, rng):
    return list(JAX_CALLS[fn](list(args), rng))
