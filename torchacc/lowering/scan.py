"""``torch.ops.torchacc.scan`` (the lazy recorder's) and ``torch.ops.higher_order.scan`` (the
trace-once frontend's, ``_hop_scan``): one ``jax.lax.scan`` over a body traced once as an FX graph.

Note [Scan bodies]
``scan(fn, init, xs)`` (torchacc/lazy/scan.py) traces ``fn`` once with AOTAutograd, on fake
torchacc tensors, into a forward and a backward FX graph of ATen and ``torchacc`` ops (the ops the
lazy recorder would record, autocast's casts included). Each graph becomes a ``Body``: the graph,
the plumbing from the scan's carry and per-step slices to the graph's placeholders and back, and a
``key`` string hashed from all of it (the graph's code, its placeholders' shapes and dtypes, its
constants' bytes, the plumbing). The recorded node is ``torchacc.scan(carry, xs, body, reverse,
length)``: the key is a static argument, so it is part of the node's signature and of the step's
structural key (Note [What a compiled step is keyed on]); two traces of the same function give the
same key and the step reuses its executable. The rule looks the Body up by key and runs
``lax.scan`` whose step replays the graph's nodes with their lowering rules (Note [FX calling
convention] in torchacc/dynamo/lower.py): the repeated block is traced and compiled once, whatever
the length.

Each distinct body stays registered for the life of the process (one per traced function and input
signature). A body must lower completely: an op with no rule cannot fall back to the CPU inside a
loop, and random ops (dropout) would need a key per iteration; both are refused when the body is
made, before anything is recorded, naming the op.
"""

from __future__ import annotations

import hashlib
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch import fx

from torchacc.lowering.dtypes import jdtype
from torchacc.lowering.fx_calling import HOP_RULES, _eval_python, eval_rule
from torchacc.lowering.registry import lookup, register

_lib = torch.library.Library("torchacc", "FRAGMENT")
_lib.define("scan(Tensor[] carry, Tensor[] xs, str body, bool reverse, int length) -> Tensor[]")

BODIES: dict = {}  # key -> Body


class Body:
    """One traced step of a scan: ``step(carry, x) -> (carry, ys)`` over JAX arrays.

    ``gm``: the FX graph; ``inputs``: per placeholder, ("c", i) for carry ``i``, ("x", i) for
    slice ``i`` or ("zero", i) for a zero of that placeholder's shape (a tangent nobody gave);
    ``carry_out``/``y_out``: per carry and per-step output, the graph output position that
    gives it (None: zeros of the ``carry_meta``/``y_meta`` shape, a gradient the graph left
    out). ``carry_meta``/``y_meta``: (shape, dtype) per carry and per-step output."""

    def __init__(self, gm, inputs, carry_out, y_out, carry_meta, y_meta, name):
        self.gm = gm
        self.inputs = tuple(inputs)
        self.carry_out = tuple(carry_out)
        self.y_out = tuple(y_out)
        self.carry_meta = tuple(carry_meta)
        self.y_meta = tuple(y_meta)
        self.name = name
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.consts = _constants(gm, name)
        _check_lowerable(gm, name)
        self.key = self._key()

    def _key(self):
        h = graph_digest(self.gm, self.placeholders, self.consts)
        plumbing = (self.inputs, self.carry_out, self.y_out, self.carry_meta, self.y_meta)
        h.update(repr(plumbing).encode())
        return f"{self.name}-{h.hexdigest()[:32]}"

    def step(self, carry, x):
        env = {}
        for node, (kind, i) in zip(self.placeholders, self.inputs):
            if kind == "c":
                env[node] = carry[i]
            elif kind == "x":
                env[node] = x[i]
            else:
                v = node.meta["val"]
                env[node] = jnp.zeros(tuple(v.shape), jdtype(v.dtype))
        outs = run_graph(self.gm, env, self.consts)
        new_carry = [_pick(outs, p, m) for p, m in zip(self.carry_out, self.carry_meta)]
        ys = [_pick(outs, p, m) for p, m in zip(self.y_out, self.y_meta)]
        return new_carry, ys


def graph_digest(gm, placeholders, consts):
    """A sha256 of an FX graph's code, its placeholders' shapes and dtypes and its constants."""
    h = hashlib.sha256(gm.code.encode())
    for n in placeholders:
        v = n.meta.get("val")
        h.update(repr((tuple(v.shape), v.dtype) if v is not None else None).encode())
    for name, arr in sorted(consts.items()):
        h.update(f"{name}{arr.shape}{arr.dtype}".encode())
        h.update(np.ascontiguousarray(arr).tobytes())
    return h


def _pick(outs, pos, meta):
    shape, dtype = meta
    r = None if pos is None else outs[pos]
    if r is None:
        return jnp.zeros(shape, jdtype(dtype))
    return r.astype(jdtype(dtype)) if r.dtype != jdtype(dtype) else r


def _constants(gm, name):
    consts = {}
    for n in gm.graph.nodes:
        if n.op != "get_attr":
            continue
        t = gm
        for part in n.target.split("."):
            t = getattr(t, part)
        if isinstance(t, fx.GraphModule):  # a nested scan's body
            continue
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            raise ValueError(
                f"torchacc.scan: fn's {name} graph holds {n.target}, a tensor it closes over "
                "with no value to lower; pass such tensors to scan in init or xs"
            )
        consts[n.target] = t.detach().cpu().numpy()
    return consts


def _check_lowerable(gm, name):
    for n in gm.graph.nodes:
        if n.op == "get_attr" and isinstance(sub := _attr(gm, n.target), fx.GraphModule):
            _check_lowerable(sub, name)
        if n.op != "call_function" or not isinstance(n.target, torch._ops.OpOverload):
            continue
        rule = lookup(n.target)
        if n.target is torch.ops.aten._local_scalar_dense.default:
            continue
        if rule is None:
            raise NotImplementedError(
                f"torchacc.scan: fn's {name} graph uses {n.target}, which has no torchacc "
                "lowering; a scan body cannot fall back to the CPU (run the layers in a loop)"
            )
        if rule.rng:
            raise NotImplementedError(
                f"torchacc.scan: fn's {name} graph uses the random op {n.target} (dropout?); "
                "random ops inside scan are not supported on torchacc yet"
            )


def run_graph(gm, env, consts, key=None):
    """Replay ``gm``'s nodes with their rules inside a JAX trace; ``env`` maps placeholders to
    arrays. Returns the graph's outputs as a list (None where the graph returns None)."""
    keys = [key]  # the random ops' key (split per op); None where the graph has none
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            continue
        if node.op == "get_attr":
            env[node] = jnp.asarray(consts[node.target])
        elif node.op == "output":
            (result,) = node.args
            return [None if a is None else env[a] for a in result]
        else:
            rule = lookup(node.target) if isinstance(node.target, torch._ops.OpOverload) else None
            if rule is None:
                env[node] = _eval_python(node, env)
            else:
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                env[node] = eval_rule(node, rule, args, kwargs, keys)
    raise RuntimeError("torchacc.scan: body graph has no output")


def add(body):
    """Register ``body`` and return its key (an equal body already registered is reused)."""
    return BODIES.setdefault(body.key, body).key


def _scan_meta(carry, xs, body, reverse, length):
    b = BODIES.get(body)
    if b is None:
        raise RuntimeError(f"torchacc.scan: unknown body {body!r}")
    outs = [torch.empty(s, dtype=d, device="meta") for s, d in b.carry_meta]
    outs += [torch.empty((length, *s), dtype=d, device="meta") for s, d in b.y_meta]
    return outs


_lib.impl("scan", _scan_meta, "Meta")
scan = torch.ops.torchacc.scan.default


@register(scan)
def _scan(carry, xs, body, reverse, length):
    b = BODIES[body]

    def step(c, x):
        return b.step(c, x if x is not None else [])

    final, ys = jax.lax.scan(step, list(carry), list(xs) or None, length=length, reverse=reverse)
    return [*final, *ys]


def _attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# -------------------------------------------------------------------------------------------------
# torch.ops.higher_order.scan: the trace-once frontend's scans (Note [Scan on the trace-once
# frontend] in torchacc/lazy/scan.py)

_hop_consts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # combine graph -> consts


def _hop_scan(combine_fn, init, xs, additional_inputs, reverse=False):
    """``scan_op(combine_fn, init, xs, additional_inputs)`` as one ``lax.scan``: the combine
    graph takes ``(*carry, *x_slices, *additional_inputs)`` and returns ``(*carry, *y_slices)``;
    the op returns ``[*final_carry, *stacked_ys]``. ``reverse``: from the last slice to the first
    (Note [Copy-free backward scans] in scan_rewrites.py)."""
    gm = combine_fn
    consts = _hop_consts.get(gm)
    if consts is None:
        _check_lowerable(gm, "combine")
        consts = _hop_consts[gm] = _constants(gm, "combine")
    places = [n for n in gm.graph.nodes if n.op == "placeholder"]
    init, xs, extra = list(init), list(xs), list(additional_inputs)
    if len(places) != len(init) + len(xs) + len(extra):
        raise RuntimeError(
            f"torchacc: scan's combine graph has {len(places)} inputs, the op gives "
            f"{len(init)} carries, {len(xs)} xs and {len(extra)} additional inputs"
        )
    nc = len(init)

    def step(carry, x):
        outs = run_graph(gm, dict(zip(places, [*carry, *x, *extra])), consts)
        if any(o is None for o in outs):
            raise NotImplementedError("torchacc: scan's combine graph returns None")
        new = [o.astype(c.dtype) if o.dtype != c.dtype else o for o, c in zip(outs[:nc], carry)]
        return new, outs[nc:]

    final, ys = jax.lax.scan(step, init, xs, reverse=reverse)
    return [*final, *ys]


HOP_RULES[torch.ops.higher_order.scan] = _hop_scan
