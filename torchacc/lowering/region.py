"""``torch.ops.torchacc.call_graph`` and ``torchacc.while_loop``: traced FX graphs as one node.

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
  take ``(*carried, *their closures)`` (``extra`` is the body's closures, then the
  condition's); ``body`` returns the new carried values (same shapes and dtypes).

A graph must lower completely (no CPU fallback inside a region) and hold no random op (the region
has no RNG state of its own): both are refused by name when the graph is made, before anything is
recorded.
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import torch

from torchacc.lowering.registry import lookup, register
from torchacc.lowering.scan import run_graph

_lib = torch.library.Library("torchacc", "FRAGMENT")
_lib.define("call_graph(Tensor[] args, str graph) -> Tensor[]")
_lib.define("while_loop(Tensor[] carried, Tensor[] extra, str cond, str body) -> Tensor[]")

GRAPHS: dict = {}  # key -> Graph


class Graph:
    """One traced region: ``gm`` (placeholders = the region's tensor inputs, in order), its CPU
    constants, its outputs' (shape, dtype) and its key. ``what`` names it in errors."""

    def __init__(self, gm, what):
        self.gm = gm
        self.what = what
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.consts = _constants(gm, what)
        _check_lowerable(gm, what)
        out = next(n for n in gm.graph.nodes if n.op == "output")
        self.out_meta = tuple(_meta(a, what) for a in out.args[0])
        self.key = self._key()

    def _key(self):
        h = hashlib.sha256(self.gm.code.encode())
        for n in self.placeholders:
            v = n.meta.get("val")
            h.update(repr((tuple(v.shape), v.dtype) if v is not None else None).encode())
        for name, arr in sorted(self.consts.items()):
            h.update(f"{name}{arr.shape}{arr.dtype}".encode())
            h.update(np.ascontiguousarray(arr).tobytes())
        return f"{self.what.split()[0]}-{h.hexdigest()[:32]}"

    def run(self, arrays):
        """The graph's outputs for ``arrays`` (one per placeholder), inside a JAX trace."""
        env = dict(zip(self.placeholders, arrays))
        return run_graph(self.gm, env, self.consts)


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
        if rule.rng:
            raise NotImplementedError(
                f"torchacc: {what} uses the random op {n.target}; random ops inside a traced "
                "region are not supported on torchacc"
            )


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
call_graph = torch.ops.torchacc.call_graph.default
while_loop = torch.ops.torchacc.while_loop.default


@register(call_graph)
def _call_graph(args, graph):
    return list(_get(graph).run(list(args)))


@register(while_loop)
def _while_loop(carried, extra, cond, body):
    c, b = _get(cond), _get(body)
    nb = len(b.placeholders) - len(carried)  # extra = (*body's closures, *cond's closures)
    b_extra, c_extra = list(extra[:nb]), list(extra[nb:])

    def keep_going(vals):
        return c.run([*vals, *c_extra])[0].reshape(())

    def step(vals):
        return [
            r.astype(v.dtype) if r.dtype != v.dtype else r
            for r, v in zip(b.run([*vals, *b_extra]), vals)
        ]

    return list(jax.lax.while_loop(keep_going, step, list(carried)))
