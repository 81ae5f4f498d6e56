"""A Graph -> a pure JAX function replaying its nodes' lowering rules (what jax.jit compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchacc.ir import ScalarSlot, TensorSlot
from torchacc.lowering import optim
from torchacc.lowering.dtypes import jdtype, wrapped_number_dtype
from torchacc.program import pack


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


def program_of(graph):
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
        nested = type(op.kind) is tuple  # a tuple of lists (fused optimizers): flattened in order
        steps.append((op.rule, op.args, op.kwargs, in_ids, slots, kinds, out_ids, op.descs, nested))
    out_ids = list(graph.out_slots)
    nslots = base
    # Note [Packed state] (pack.py): the array arguments are the packs, then the loose inputs
    n_packs = len(graph.packs)
    in_places = [
        (i, code >> pack.SHIFT, code & pack.MASK, v.desc[0])
        for i, (code, v) in enumerate(zip(graph.in_codes, graph.inputs))
        if code != pack.LOOSE
    ]
    loose_slots = [i for i, code in enumerate(graph.in_codes) if code == pack.LOOSE]
    out_groups = [[] for _ in graph.out_packs]
    for j, code in sorted(enumerate(graph.out_codes), key=lambda jc: jc[1]):
        if code != pack.LOOSE:  # by pack, then offset
            out_groups[code >> pack.SHIFT].append(j)
    loose_outs = graph.out_order  # Note [Donation pairs] (key.py)
    # Note [Flat optimizer updates] (lowering/optim.py): small state members are pieces of packs
    packed_limit = pack.max_numel() if n_packs else 0

    def program(floats, ints, *arrays):
        with optim.packed_members(packed_limit):
            return replay(floats, ints, arrays)

    def replay(floats, ints, arrays):
        env = [None] * nslots
        for slot, a in zip(loose_slots, arrays[n_packs:]):
            env[slot] = a
        for slot, k, offset, shape in in_places:
            env[slot] = pack.piece(arrays[k], offset, shape)
        for rule, args, kwargs, in_ids, slots, kinds, outs, descs, nested in steps:
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
            if nested:
                results = [r for part in result for r in part]
            elif isinstance(result, (tuple, list)):
                results = list(result)
            else:
                results = [result]
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
        results = [env[i] for i in out_ids]
        packed = [pack.concat([results[j] for j in group]) for group in out_groups]
        return packed + [results[j] for j in loose_outs]

    return program


def _scalar_kinds(node):
    """Per runtime scalar: the dtype a CPU 0-dim tensor had, else None (keep float64/int64)."""
    kinds = []
    for part in node.op.key:
        if type(part) is tuple and len(part) == 2 and part[0] == "cpu0":
            kinds.append(jdtype(part[1]))
        elif type(part) is tuple and len(part) == 2 and part[0] == "wrapped":
            partner = node.inputs[0].desc[2] if node.inputs else None
            kinds.append(wrapped_number_dtype(part[1], partner))
        elif part is float or part is int:
            kinds.append(None)
    return kinds
