"""A pending graph's nodes in order, its inputs and its structural key.

Note [What a compiled step is keyed on]
The key is the graph's structure: for every node its op and static signature (input shapes,
strides, dtypes, static arguments, the *kinds* of its runtime scalars; stood for by the node's
OpEntry, unique per signature so it compares and hashes by identity), how nodes connect, the
inputs' shapes and dtypes, which outputs are returned, which inputs are donated and how inputs
and outputs are packed (Note [Packed state] in pack.py). It never holds
data or Python scalar values: scalars (learning rate, loss scale, bias corrections) are gathered
into two runtime vectors, one float64 and one int64, so a schedule that changes them every step
reuses the same executable.
"""

from __future__ import annotations

import operator

from torchacc.program import pack

# Note [Walking a graph at a sync]
# A sync walks the pending graph once per step, so the walk is the part of ``mark_step`` that
# grows with the number of recorded ops. It marks what it has seen with a per-walk number on the
# Nodes and Values themselves (no sets of ids), collects the reachable nodes with a plain work
# list and puts them in creation order (``Node.seq``, a topological order: a node only reads
# Values that existed when it was recorded), and numbers slots on the objects too. Inputs are
# numbered in the order the work list meets them, which depends only on the graph's structure, so
# the same step gives the same key every time.

_walks = [0]


class Graph:
    """The nodes needed to compute ``outputs``, in topological order, and their inputs.

    Slots number the program's arrays: inputs first, then each node's outputs in order (one slot
    per output desc of its OpEntry). ``key[1]`` alternates each node's OpEntry and the slots of its
    inputs. Note [Walking a graph at a sync]."""

    __slots__ = (
        "order",
        "inputs",
        "outputs",
        "key",
        "floats",
        "ints",
        "donate",
        "out_slots",
        "in_codes",
        "packs",
        "loose",
        "out_codes",
        "out_packs",
        "out_order",
    )

    def __init__(self, outputs, held=None, plan=None, starts=None):
        """``held``: ids of the Values and buffers live storages hold (``_live_outputs``), for
        donation (None: donate nothing); ``plan``: which outputs come back packed
        (``pack.output_plan``; None: none, Note [Packed state] in pack.py); ``starts``: per
        output the Value its storage held when the step began (``Storage.start``), which
        decides which donated buffer each output takes (Note [Donation pairs])."""
        order, inputs = _collect(outputs)
        for i, v in enumerate(inputs):
            v.slot = i
        nslots = len(inputs)
        parts = []
        floats, ints = [], []
        for node in order:
            op = node.op
            ins = tuple([v.slot if v.node is None else v.node.slot + v.index for v in node.inputs])
            parts.append(op)  # OpEntries are unique per signature: equality is identity, hash is id
            parts.append(ins)
            node.slot = nslots
            nslots += len(op.descs)
            scalars = node.scalars
            if scalars:
                for s in scalars:
                    (ints if type(s) is int or type(s) is bool else floats).append(s)
        self.order = order
        self.inputs = inputs
        self.outputs = outputs
        self.floats = floats
        self.ints = ints
        self.out_slots = out_slots = tuple([v.node.slot + v.index for v in outputs])
        self.in_codes, self.packs, self.loose = pack.input_layout(inputs)
        if plan is None:
            plan = (pack.LOOSE,) * len(outputs), ()
        self.out_codes, self.out_packs = plan
        arg_avals = [((p.size,), p.dtype) for p in self.packs]
        arg_avals += [(v.desc[0], v.desc[2]) for v in self.loose]
        loose_outs = [j for j, c in enumerate(self.out_codes) if c < 0]
        if held is None:
            self.donate, self.out_order = (), tuple(loose_outs)
        else:
            pack_avals = [((n,), d) for n, d, _ in self.out_packs]
            outs = [(j, (outputs[j].desc[0], outputs[j].desc[2])) for j in loose_outs]
            flags = donatable_flags(self.packs, self.loose, held)
            partners = _partners(self.loose, len(self.packs), outputs, loose_outs, starts)
            self.donate, self.out_order = donations(arg_avals, pack_avals, outs, flags, partners)
        in_avals = tuple([(v.desc[0], v.desc[2]) for v in inputs])
        layout = (self.in_codes, tuple(arg_avals[: len(self.packs)]), self.out_packs)
        self.key = (in_avals, tuple(parts), out_slots, self.donate, self.out_order, layout)

    def args(self):
        """The program's array arguments: the packs' arrays, then the loose inputs' arrays."""
        return args_of(self.packs, self.loose)


def args_of(packs, loose):
    """The packs' arrays, then the loose inputs' arrays (a loose piece, of a pack of results
    that are not state, sliced out of it)."""
    return [p.array for p in packs] + [v.array if type(v.buf) is tuple else v.buf for v in loose]


def donatable_flags(packs, loose, held):
    """Per program argument, whether no live storage holds it (``held``: ids of the Values and
    buffers live storages hold): a pack when no live Value is a piece of it, a loose input when
    neither it nor its array is held (never a piece sliced out: its Value stays a piece)."""
    flags = [id(p) not in held for p in packs]
    flags += [
        type(v.buf) is not tuple and id(v) not in held and id(v.buf) not in held for v in loose
    ]
    return tuple(flags)


# Note [Donation pairs]
# JAX gives a donated argument's buffer to the first result of the same shape and dtype, walking
# the results in order and taking donated arguments in order (per shape and dtype). Which result
# gets which buffer is invisible to the program's meaning (XLA copies where a buffer is still
# read after its new owner is written), but not to its memory: a result given the buffer of the
# very value it updates (a parameter, an optimizer moment) is computed in place, while a result
# given another same-shaped value's buffer (exp_avg_sq of one parameter into exp_avg's buffer,
# or layer 2's weight into layer 1's) makes XLA copy that value at the start and keep the copy
# alive until the end. GPT-2 124M's AdamW step held 149 such copies (1.3 GB of its 2.2 GB of
# temp memory) before the pairing below. So the donated arguments are chosen and the program's
# loose results are ordered such that JAX's rule pairs every result whose storage held a
# donated argument when the step began (``Storage.start``) with that argument: the order is part
# of the key and of a known step's launch, and ``pack.bind`` follows it.


def _partners(loose, first, outputs, loose_outs, starts):
    """Per loose output (``loose_outs``), the argument position of the loose input its storage
    held when the step began, or None."""
    if starts is None:
        return [None] * len(loose_outs)
    where = {id(v): first + i for i, v in enumerate(loose)}
    return [None if starts[j] is None else where.get(id(starts[j])) for j in loose_outs]


def donations(arg_avals, pack_avals, outs, flags, partners):
    """The positions of the arguments whose buffers results take over, and the order of the
    loose results in the program (Note [Donation pairs]).

    ``arg_avals``: per argument (packs, then loose inputs) its (shape, dtype); ``pack_avals``:
    the packed results' (they come first); ``outs``: per loose result (output index, aval);
    ``flags``: per argument whether no live storage holds it; ``partners``: per loose result the
    argument its storage held, or None. Only as many arguments of a given shape/dtype are
    donated as there are results of it: XLA could not use the others (and JAX would warn on
    every compile); partners are chosen first."""
    free = {}
    for aval in pack_avals:
        free[aval] = free.get(aval, 0) + 1
    for _, aval in outs:
        free[aval] = free.get(aval, 0) + 1
    chosen = set()
    for (_, aval), a in zip(outs, partners):
        if a is not None and flags[a] and arg_avals[a] == aval and a not in chosen:
            if free[aval] > 0:
                free[aval] -= 1
                chosen.add(a)
    for i, (aval, ok) in enumerate(zip(arg_avals, flags)):
        if ok and i not in chosen and free.get(aval, 0) > 0:
            free[aval] -= 1
            chosen.add(i)
    donate = tuple(sorted(chosen))
    queues = {}  # per aval, the donated arguments in the order JAX hands them out
    for i in donate:
        queues.setdefault(arg_avals[i], []).append(i)
    taken = {}  # per aval, how many the packed results (first in the program) take
    for aval in pack_avals:
        taken[aval] = taken.get(aval, 0) + 1
    by_aval, wants = {}, {}
    for k, (_, aval) in enumerate(outs):
        by_aval.setdefault(aval, []).append(k)
        if partners[k] is not None:
            wants.setdefault(partners[k], k)
    rank = [None] * len(outs)  # the argument each loose result is to receive
    for aval, queue in queues.items():
        left = queue[taken.get(aval, 0) :]
        coming = set(left)
        results = by_aval.get(aval, [])
        # results whose own argument is not coming first, then the others, for the leftovers
        spare = [k for k in results if partners[k] not in coming]
        spare += [k for k in results if partners[k] in coming]
        s = 0
        for a in left:
            k = wants.get(a)
            if k is None or rank[k] is not None or outs[k][1] != aval:
                while rank[spare[s]] is not None:
                    s += 1
                k = spare[s]
            rank[k] = a
    order = sorted(range(len(outs)), key=lambda k: (0, rank[k]) if rank[k] is not None else (1, k))
    return donate, tuple([outs[k][0] for k in order])


def _collect(outputs):
    """Pending nodes reachable from ``outputs`` in creation order, and the input Values."""
    _walks[0] += 1
    walk = _walks[0]
    order, inputs = [], []
    todo = []
    for root in outputs:
        n = root.node
        if n is not None and n.mark != walk:
            n.mark = walk
            todo.append(n)
    order.extend(todo)
    pop, push, keep, take = todo.pop, todo.append, order.append, inputs.append
    while todo:
        for v in pop().inputs:
            n = v.node
            if n is None:
                if v.mark != walk:
                    v.mark = walk
                    take(v)
            elif n.mark != walk:
                n.mark = walk
                push(n)
                keep(n)
    order.sort(key=_seq)
    return order, inputs


_seq = operator.attrgetter("seq")
