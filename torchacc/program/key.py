"""A pending graph's nodes in order, its inputs and its structural key.

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

import operator

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

    __slots__ = ("order", "inputs", "outputs", "key", "floats", "ints", "donate", "out_slots")

    def __init__(self, outputs, donatable=None):
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
        self.donate = _donations(inputs, outputs, donatable) if donatable else ()
        in_avals = tuple([(v.desc[0], v.desc[2]) for v in inputs])
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
