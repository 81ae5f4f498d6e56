"""Pending graph -> structural key -> one jitted JAX program, cached in memory and on disk.

Note [What a compiled step is keyed on]
The key is the graph's structure: for every node its op and static signature (input shapes,
strides, dtypes, static arguments, the *kinds* of its runtime scalars; stood for by the node's
OpEntry, unique per signature so it compares and hashes by identity), how nodes connect, the
inputs' shapes and dtypes, which outputs are returned and which inputs are donated. It never holds
data or Python scalar values: scalars (learning rate, loss scale, bias corrections) are gathered
into two runtime vectors, one float64 and one int64, so a schedule that changes them every step
reuses the same executable.
"""

from __future__ import annotations

import os
import sys
import time

import jax
import jax.numpy as jnp

from torchacc import metrics
from torchacc.distributed import runtime as _spmd  # Note [Multi-process programs]
from torchacc.graph import ScalarSlot, TensorSlot
from torchacc.lowering import precision
from torchacc.lowering.dtypes import jdtype

_cache: dict = {}
_persistent_hits = [0]
memory_hits = [0]  # executables reused from the in-memory cache (never reset by metrics)


def _on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":
        _persistent_hits[0] += 1


def enable_persistent_cache(path=None):
    """Keep compiled programs under ``path`` (TORCHACC_CACHE_DIR, default ~/.cache/torchacc)."""
    path = (
        path
        or os.environ.get("TORCHACC_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "torchacc")
    )
    if path.lower() in ("0", "off", "none"):
        return None
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


jax.monitoring.register_event_listener(_on_event)


class Graph:
    """The nodes needed to compute ``outputs``, in topological order, and their inputs.

    Slots number the program's arrays: inputs first, then each node's outputs in order (one slot
    per output desc of its OpEntry). ``key[1]`` alternates each node's OpEntry and the slots of its
    inputs."""

    __slots__ = ("order", "inputs", "outputs", "key", "floats", "ints", "donate", "out_slots")

    def __init__(self, outputs, donatable=None):
        order, inputs = _collect(outputs)
        slot = {id(v): i for i, v in enumerate(inputs)}  # input Value or node -> (first) slot
        nslots = len(inputs)
        parts = []
        floats, ints = [], []
        for node in order:
            op = node.op
            ins = tuple(
                [slot[id(v)] if v.node is None else slot[id(v.node)] + v.index for v in node.inputs]
            )
            parts.append(op)  # OpEntries are unique per signature: equality is identity, hash is id
            parts.append(ins)
            slot[id(node)] = nslots
            nslots += len(op.descs)
            for s in node.scalars:
                (ints if type(s) is int or type(s) is bool else floats).append(s)
        self.order = order
        self.inputs = inputs
        self.outputs = outputs
        self.floats = floats
        self.ints = ints
        self.out_slots = out_slots = tuple(slot[id(v.node)] + v.index for v in outputs)
        self.donate = _donations(inputs, outputs, donatable) if donatable else ()
        in_avals = tuple((v.desc[0], v.desc[2]) for v in inputs)
        self.key = (in_avals, tuple(parts), out_slots, self.donate)


def _donations(inputs, outputs, donatable):
    """Positions of inputs whose buffers an output of the same shape and dtype can take over.

    Only as many inputs of a given shape/dtype are donated as there are outputs of it: XLA could
    not use the others (and JAX would warn on every compile)."""
    free = {}
    for v in outputs:
        aval = (v.desc[0], v.desc[2])
        free[aval] = free.get(aval, 0) + 1
    donate = []
    for i, v in enumerate(inputs):
        aval = (v.desc[0], v.desc[2])
        if free.get(aval, 0) > 0 and donatable(v):
            free[aval] -= 1
            donate.append(i)
    return tuple(donate)


def _collect(outputs):
    """Topological order of pending nodes reachable from ``outputs``, and the input Values."""
    order, inputs = [], []
    seen = set()
    seen_inputs = set()
    for root in outputs:
        if root.node is None or id(root.node) in seen:
            continue
        stack = [(root.node, 0)]
        seen.add(id(root.node))
        while stack:
            node, i = stack[-1]
            ins = node.inputs
            while i < len(ins):
                v = ins[i]
                i += 1
                n = v.node
                if n is None:
                    if id(v) not in seen_inputs:
                        seen_inputs.add(id(v))
                        inputs.append(v)
                elif id(n) not in seen:
                    seen.add(id(n))
                    stack[-1] = (node, i)
                    stack.append((n, 0))
                    break
            else:
                stack.pop()
                order.append(node)
    return order, inputs


def _fill(t, env, scalars):
    tp = type(t)
    if tp is TensorSlot:
        return env[t]
    if tp is ScalarSlot:
        return scalars[t]
    if tp is list or tp is tuple:
        return [_fill(x, env, scalars) for x in t]
    if tp is dict:
        return {k: _fill(v, env, scalars) for k, v in t.items()}
    return t


def _program(graph):
    """A pure function (floats, ints, *inputs) -> outputs replaying the graph's rules."""

    steps = []
    fpos = ipos = 0
    base = len(graph.inputs)  # first slot of the node's outputs (Graph's numbering)
    for node, in_ids in zip(graph.order, graph.key[1][1::2]):
        op = node.op
        slots = []
        for s in node.scalars:
            if type(s) is int or type(s) is bool:
                slots.append(("i", ipos))
                ipos += 1
            else:
                slots.append(("f", fpos))
                fpos += 1
        out_ids = [None if d is None else base + j for j, d in enumerate(op.descs)]
        base += len(op.descs)
        kinds = _scalar_kinds(node)
        steps.append((op.rule, op.args, op.kwargs, in_ids, slots, kinds, out_ids, op.descs))
    out_ids = list(graph.out_slots)
    nslots = base

    def program(floats, ints, *arrays):
        env = list(arrays)
        env.extend([None] * (nslots - len(env)))
        for rule, args, kwargs, in_ids, slots, kinds, outs, descs in steps:
            ins = [env[i] for i in in_ids]
            sc = []
            for (vec, pos), kind in zip(slots, kinds):
                x = (floats if vec == "f" else ints)[pos]
                sc.append(x.astype(kind) if kind is not None else x)
            extra = {}
            n = len(descs)
            if rule.rng:
                key = jax.random.wrap_key_data(ins[-1])
                key, sub = jax.random.split(key)
                extra["rng"] = sub
                n -= 1
            if rule.out_meta:
                extra["out"] = [None if d is None else (d[0], jdtype(d[2])) for d in descs[:n]]
            result = rule.fn(*_fill(args, ins, sc), **_fill(kwargs, ins, sc), **extra)
            results = list(result) if isinstance(result, (tuple, list)) else [result]
            if len(results) != n:
                raise RuntimeError(
                    f"torchacc: lowering of {rule.name} returned {len(results)} "
                    f"outputs, PyTorch's op has {n}"
                )
            for slot, r, d in zip(outs, results, descs):
                if slot is None:
                    continue
                if r is None:
                    raise RuntimeError(
                        f"torchacc: lowering of {rule.name} returned None for an "
                        "output PyTorch's meta kernel produces"
                    )
                r = jnp.asarray(r)
                if r.shape != d[0]:
                    raise RuntimeError(
                        f"torchacc: lowering of {rule.name} gave shape {r.shape}, "
                        f"PyTorch's meta kernel says {d[0]}"
                    )
                env[slot] = r.astype(jdtype(d[2])) if r.dtype != jdtype(d[2]) else r
            if rule.rng:
                env[outs[-1]] = jax.random.key_data(key)
        return [env[i] for i in out_ids]

    return program


def _scalar_kinds(node):
    """Per runtime scalar: the dtype a CPU 0-dim tensor had, else None (keep float64/int64)."""
    kinds = []
    for part in node.op.key:
        if type(part) is tuple and len(part) == 2 and part[0] == "cpu0":
            kinds.append(jdtype(part[1]))
        elif type(part) is tuple and len(part) == 2 and part[0] == "wrapped":
            kinds.append(_wrapped_dtype(part[1], node))
        elif part is float or part is int:
            kinds.append(None)
    return kinds


def _wrapped_dtype(kind, node):
    """dtype of a Python number standing for a tensor: the partner tensor's dtype when they are of
    the same category (torch's wrapped-number promotion), else torch's default for the number."""
    import torch

    ref = node.inputs[0].desc[2] if node.inputs else None
    if kind is float:
        same = ref is not None and ref.is_floating_point
        return jdtype(ref if same else torch.get_default_dtype())
    same = ref is not None and not ref.is_floating_point and ref != torch.bool
    return jdtype(ref if same else torch.int64)


def compiled_for(graph, args):
    """The executable for ``graph`` (compiling it on a cache miss)."""
    key = graph.key + (precision.key(),)  # Note [float32 precision follows torch]
    exe = _cache.get(key)
    if exe is not None:
        metrics.counter_inc("CachedCompile")
        memory_hits[0] += 1
        return exe
    if os.environ.get("TORCHACC_DEBUG", "0") not in ("", "0"):
        print(
            f"torchacc: compiling graph #{len(_cache) + 1} ({len(graph.order)} ops): "
            f"{explain_miss(key)}",
            file=sys.stderr,
        )
    start = time.perf_counter()
    hits = _persistent_hits[0]
    donate = tuple(2 + i for i in graph.donate)
    with precision.scope():
        if _spmd.is_spmd_graph(graph):  # collectives: one SPMD program, Note [Multi-process ...]
            exe = _spmd.compile_spmd(_program(graph), args, donate)
        else:
            fn = jax.jit(_program(graph), donate_argnums=donate)
            exe = fn.lower(*args).compile()
    metrics.record_time("CompileTime", time.perf_counter() - start)
    metrics.counter_inc("PersistentCacheHit" if _persistent_hits[0] > hits else "UncachedCompile")
    _cache[key] = exe
    return exe


def explain_miss(key):
    """Why ``key`` is not in the cache: the nearest cached graph and what differs."""
    if not _cache:
        return "first graph"
    in_avals, parts, out_ids = key[:3]
    best, best_score = None, -1
    for other in _cache:
        score = sum(1 for a, b in zip(parts[::2], other[1][::2]) if a == b)
        if other[0] == in_avals:
            score += 1
        if score > best_score:
            best, best_score = other, score
    o_avals, o_parts = best[0], best[1]
    if len(o_avals) != len(in_avals):
        return f"{len(in_avals)} inputs vs {len(o_avals)} in the nearest cached graph"
    for i, (a, b) in enumerate(zip(in_avals, o_avals)):
        if a != b:
            return (
                f"input {i} has shape {tuple(a[0])} dtype {a[1]}; nearest cached graph had "
                f"shape {tuple(b[0])} dtype {b[1]}"
            )
    for i, (a, b) in enumerate(zip(parts[::2], o_parts[::2])):
        a, b = a.key, b.key
        if a != b:
            if a[0] != b[0]:
                return f"op {i} is {a[0]}; nearest cached graph has {b[0]} there"
            return f"op {i} ({a[0]}) has different arguments: {a[1:]} vs {b[1:]}"
    if len(parts) != len(o_parts):
        return f"{len(parts) // 2} ops vs {len(o_parts) // 2} in the nearest cached graph"
    if out_ids != best[2]:
        return "the same ops, but different tensors are live at the sync"
    if key[4:] != best[4:]:
        return f"float32 precision settings {key[4]} differ from the cached graph's {best[4]}"
    return "the same graph with different donated buffers"


def cache_size():
    """Number of executables in the in-memory cache."""
    return len(_cache)
