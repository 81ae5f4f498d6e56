"""A Graph -> a pure JAX function replaying its nodes' lowering rules (what jax.jit compiles)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchacc.ir import fill as _fill
from torchacc.lowering import optim
from torchacc.lowering.dtypes import jdtype, wrapped_number_dtype
from torchacc.program import pack
from torchacc.runtime.processes import env_flag


def program_of(graph, offsets=False):
    """A pure function (floats, ints, *inputs) -> outputs replaying the graph's rules. With
    ``offsets``, ``(floats, ints, *inputs, *offsets)``: the pieces of packs that per-tensor ops
    read are read at the ``piece_offsets(graph)`` arguments (Note [Pieces read at offset
    arguments])."""

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
        lists = nested or op.kind == "list"  # a list op: it reads pieces where they lie
        steps.append(
            (op.rule, op.args, op.kwargs, in_ids, slots, kinds, out_ids, op.descs, nested, lists)
        )
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

    n_arrays = len(graph.inputs) - len(in_places) + n_packs
    dynamic = _dynamic_pieces(steps, in_places) if offsets else {}
    first, sources, fenced = _update_order(graph, steps)

    def program(floats, ints, *arrays):
        with optim.packed_members(packed_limit):
            return replay(floats, ints, arrays[:n_arrays], arrays[n_arrays:])

    def replay(floats, ints, arrays, offset_args):
        env = [None] * nslots
        for slot, a in zip(loose_slots, arrays[n_packs:]):
            env[slot] = a
        pieces = {}  # slot -> the piece read at its offset argument, for per-tensor ops
        for slot, k, offset, shape in in_places:
            env[slot] = pack.piece(arrays[k], offset, shape)
            j = dynamic.get(slot)
            if j is not None:
                pieces[slot] = pack.piece_at(arrays[k], offset_args[j], shape)
        for at, step in enumerate(steps):
            rule, args, kwargs, in_ids, slots, kinds, outs, descs, nested, lists = step
            if at == first:  # Note [The update runs after every read of what it overwrites]
                ready = _all_ready([env[i] for i in sources])
                for i in fenced:
                    env[i] = jnp.where(ready, env[i], jnp.zeros((), env[i].dtype))
            if lists or not pieces:
                ins = [env[i] for i in in_ids]
            else:
                ins = [pieces.get(i, env[i]) for i in in_ids]
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


# Note [Pieces read at offset arguments]
# A piece of a pack (Note [Packed state] in pack.py) read by a static slice makes every kernel
# that reads it a program of its own: the slice's offset is part of the kernel, so the twelve
# layers' layer norms, bias adds and GELUs of a GPT, identical otherwise, were a few hundred
# distinct kernels, which XLA compiles one by one (~10-20 ms each on XLA:CPU; issue 32: most
# of GPT-2's cold AdamW step beyond its forward+backward). XLA compiles identical kernels once,
# so where ``compiled_for`` allows it the program takes each such piece's offset as an int32
# argument of its own and reads the piece with a dynamic slice there: a kernel then differs from
# its twin only in the buffers it is given. List ops (fused optimizers, batched foreach nodes)
# keep reading pieces by static slices, which XLA folds back into one slice of the pack when
# they update the pieces as one flat array (Note [Flat optimizer updates] in
# lowering/optim.py). The values read are the same either way, so results are too.


# Note [The update runs after every read of what it overwrites]
# A step's program overwrites its parameters in place: the parameters are donated and each new
# value is written into its old buffer (Note [Donation pairs] in key.py). XLA may do that only
# where every other read of the old value comes first, and it decides this from data dependencies
# alone (copy insertion, before scheduling; an optimization barrier is dropped before it runs).
# A linear layer's backward reads its weight for the input's gradient, and nothing the weight's
# own update computes depends on that gradient, so XLA could not prove the order and copied
# every such weight first: GPT-2 124M's AdamW step copied its 48 layer weights (85M floats, a
# read and a write each, into fresh temp pages every step: 0.68 of the step's 8.29 GB of memory
# traffic, 306 of its 522 MB of temp memory). So where a step's optimizer updates (fused
# optimizer nodes, batched ``_foreach_*`` nodes) read inputs that its other ops read too, the
# updates read those inputs through ``where(ready, param, 0)``, where ``ready`` is a boolean
# made from one element of a few arrays the updates take from the rest of the step (gradients)
# and always true (a 32-bit value's bit pattern has at most 32 ones; XLA does not fold that).
# The few are chosen
# so that every op reading such an input before the updates is an ancestor of one of them
# (``_fewest_sources``: for a backward, the last gradients, which depend on every layer's input
# gradient); one element of every gradient worked too but added ~150 small kernels to compile
# (fused AdamW's first step: +0.7 CPU s). Each overwrite then comes after every read, and XLA
# writes in place. Only the moments' updates (which read no parameter) may still run as soon
# as their own gradient is there, so gradients need not all be live at once (fencing the
# gradients instead removed the copies too but kept all of them alive: 500 MB of temp memory).
# Parameters that are pieces of a pack (Note [Packed state]) are left alone: read through
# ``where`` they would no longer fold into one slice of their pack in a flat update (Note [Flat
# optimizer updates]), whose kernels would grow with depth again; their pack's copy is small.
# The values are the same, so the results are (tests/test_update_order.py).
# TORCHACC_UPDATE_ORDER=0 leaves the program as it was.
_UPDATE_ORDER = env_flag("TORCHACC_UPDATE_ORDER")


def _update_order(graph, steps):
    """(index of the first update node, the slots the updates read from the step's other ops,
    the loose inputs they read through ``ready``), or (-1, (), ()) where the updates read no
    loose input that other ops read (Note [The update runs after every read of what it
    overwrites])."""
    update = [optim.is_update(node.op) for node in graph.order]
    if not _UPDATE_ORDER or True not in update:
        return -1, (), ()
    first = update.index(True)
    n_inputs = len(graph.inputs)
    made_later, read_before = set(), set()
    for at, step in enumerate(steps):
        if at >= first:
            made_later.update(s for s in step[6] if s is not None)
        else:
            read_before.update(i for i in step[3] if i < n_inputs)
    sources, fenced = {}, {}
    for at in range(first, len(steps)):
        if update[at]:
            for i in steps[at][3]:
                if i >= n_inputs:
                    if i not in made_later:
                        sources[i] = None
                elif i in read_before and graph.in_codes[i] == pack.LOOSE:
                    fenced[i] = None
    if not sources or not fenced:
        return -1, (), ()
    chosen = _fewest_sources(steps[:first], list(sources), fenced)
    if not chosen:
        return -1, (), ()
    return first, chosen, tuple(fenced)


def _fewest_sources(steps, sources, fenced):
    """A few of ``sources`` that together depend on every step reading a ``fenced`` input (the
    last gradients of a backward depend on every layer's reads): ``ready`` reads one element of
    each, so it stays a couple of small kernels however many parameters there are."""
    bit = {s: 1 << k for k, s in enumerate(sources)}
    producer = {}
    for at, step in enumerate(steps):
        for s in step[6]:
            if s is not None:
                producer[s] = at
    reach = [0] * len(steps)  # per step: the sources that depend on it, as bits
    for at in range(len(steps) - 1, -1, -1):
        r = reach[at]
        for s in steps[at][6]:
            r |= bit.get(s, 0)
        reach[at] = r
        if r:
            for i in steps[at][3]:
                p = producer.get(i)
                if p is not None:
                    reach[p] |= r
    need = {reach[at] for at, step in enumerate(steps) if reach[at] and fenced.keys() & step[3]}
    chosen = []
    while need:  # greedy: the source most of the remaining readers reach
        k = max(range(len(sources)), key=lambda k: sum(m >> k & 1 for m in need))
        chosen.append(sources[k])
        need = {m for m in need if not m >> k & 1}
    return tuple(chosen)


def _all_ready(arrays):
    """A boolean that is always true and depends on each of ``arrays`` (one element of each)."""
    bits = []
    for a in arrays:
        if a.size == 0:
            continue
        x = a.reshape(-1)[:1]
        if jnp.issubdtype(x.dtype, jnp.complexfloating):
            x = jnp.real(x)
        bits.append(jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32))
    if not bits:
        return jnp.bool_(True)
    count = jax.lax.population_count(jnp.concatenate(bits) if len(bits) > 1 else bits[0])
    return jnp.all(count <= 32)


def _dynamic_pieces(steps, in_places):
    """Input slot -> position of its offset argument, for the packed inputs a per-tensor op
    reads (Note [Pieces read at offset arguments])."""
    packed = {slot for slot, _k, _o, _s in in_places}
    read = set()
    for step in steps:
        if not step[9]:
            read.update(i for i in step[3] if i in packed)
    return {slot: j for j, slot in enumerate(s for s, _k, _o, _s in in_places if s in read)}


def piece_offsets(graph):
    """The offsets ``program_of(graph, offsets=True)`` takes, in order."""
    steps_read = set()
    for node, in_ids in zip(graph.order, graph.key[1][1::2]):
        op = node.op
        if not (type(op.kind) is tuple or op.kind == "list"):
            steps_read.update(in_ids)
    return [
        code & pack.MASK
        for i, code in enumerate(graph.in_codes)
        if code != pack.LOOSE and i in steps_read
    ]


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
