"""The graph IR both frontends record into: Values, Nodes, OpEntries and Storages.

Note [Values, storages and views]
A ``Value`` is one array of the step: either a device buffer (``array`` set, ``node`` None) or the
pending output ``index`` of a ``Node``. A ``Storage`` is what a tensor's memory is in eager PyTorch:
it holds the *current* Value of a base tensor and a version that increases on every write. A base
LazyTensor reads ``storage.value``; a view LazyTensor keeps a chain of view ops from its storage and
replays it (recording nodes) when the storage's version moved since it last looked. Writing into a
view records the inverse ops (slice_scatter, select_scatter, ...) back up the chain and installs
the new base Value, so every other view and the base see the write: eager aliasing, functional
graph.

Values point at their Node and Nodes at their input Values, never back: the graph is a DAG, freed
by reference counting. When a sync runs a graph, each computed Value gets its array and drops its
node, so graphs are freed as soon as no pending Value needs them.
"""

from __future__ import annotations

import itertools
import weakref


class Value:
    """One array of the step; ``desc`` is (shape, stride, dtype, storage_offset) from meta.

    ``buf`` is where its data lives once computed: a JAX array, a piece ``(Pack, offset)`` of a
    step's packed results (Note [Packed state] in program/pack.py), or None (pending, or given to
    a later step's outputs). ``array`` is always a JAX array of the Value's own shape.
    """

    # ``mark``/``slot``: scratch of the graph walk at a sync (Note [Walking a graph at a sync]);
    # ``sid``: its number among the step's data inputs (Note [Known steps] in program/known.py);
    # ``host``: a CPU copy of a small upload (Note [Reads of host-known values], lazy/host_eval.py)
    __slots__ = ("node", "index", "buf", "desc", "mark", "slot", "sid", "host")

    def __init__(self, desc, node=None, index=0, array=None):
        self.node = node
        self.index = index
        self.buf = array
        self.desc = desc
        self.mark = 0
        self.sid = 0
        self.host = None

    @property
    def array(self):
        """The data as a JAX array of this Value's shape (a piece of a pack is sliced out on the
        device); None while pending or after its buffer was donated."""
        b = self.buf
        if type(b) is tuple:
            return unpack[0](b[0], b[1], self.desc)
        if b is not None and b.shape != self.desc[0]:  # a padded shard layout (SPMD)
            return b[tuple([slice(0, n) for n in self.desc[0]])]
        return b

    @array.setter
    def array(self, array):
        self.buf = array

    @property
    def pending(self):
        return self.node is not None

    def __repr__(self):
        state = f"pending {self.node.op.rule.name}[{self.index}]" if self.node else "data"
        return f"Value({state}, shape={self.desc[0]}, dtype={self.desc[2]})"


class OpEntry:
    """What every node with the same structural signature shares (cached by the dispatcher).

    ``key`` is the signature (op, argument descriptions, static values, scalar kinds): two nodes
    with equal keys lower to the same JAX code. ``args``/``kwargs`` are templates in which
    ``TensorSlot(i)`` stands for the node's ``inputs[i]`` and ``ScalarSlot(i)`` for its
    ``scalars[i]``. ``descs`` are the output descs (None for an output the op leaves out; a random
    op has one more, its next RNG key) and ``kind`` how the op returns them. ``calls`` counts the
    nodes recorded with it (torch_xla's ``xla::<op>`` counters, torchacc/lazy/op_counters.py).
    """

    __slots__ = ("rule", "key", "args", "kwargs", "descs", "kind", "calls")

    def __init__(self, rule, key, args, kwargs, descs, kind):
        self.rule = rule
        self.key = key
        self.args = args
        self.kwargs = kwargs
        self.descs = descs
        self.kind = kind
        self.calls = 0


class Node:
    """One recorded op: its shared OpEntry, input Values and runtime scalars.

    A Node does not point at its outputs: Values point at their node (``value.index`` is the output
    position), so a step's graph is a DAG that reference counting frees as soon as no tensor needs
    it (no cycles for the garbage collector to find).
    """

    # ``seq``: creation order (a topological order); ``mark``/``slot``: scratch of the graph walk;
    # ``spos``: its position in the step's op stream (Note [Known steps] in program/known.py)
    __slots__ = ("op", "inputs", "scalars", "seq", "mark", "slot", "spos")

    def __init__(self, op, inputs, scalars):
        self.op = op
        self.inputs = inputs
        self.scalars = scalars
        self.seq = _next_seq()
        self.mark = 0
        self.spos = -1
        op.calls += 1
        if observe is not None:
            observe(self)


_next_seq = itertools.count(1).__next__
unpack = [None]  # fn(pack, offset, desc) -> JAX array (set by torchacc/program/pack.py)
observe = None  # fn(node) called for every new Node (set by torchacc/program/known.py)


class TensorSlot(int):
    __slots__ = ()

    def __repr__(self):
        return f"T{int(self)}"


class ScalarSlot(int):
    __slots__ = ()

    def __repr__(self):
        return f"S{int(self)}"


def fill(template, inputs, scalars):
    """An OpEntry's ``args``/``kwargs`` template with its slots filled: ``inputs[i]`` for
    ``TensorSlot(i)``, ``scalars[i]`` for ``ScalarSlot(i)`` (sequences come back as lists)."""
    tp = type(template)
    if tp is TensorSlot:
        return inputs[template]
    if tp is ScalarSlot:
        return scalars[template]
    if tp is list or tp is tuple:
        return [fill(x, inputs, scalars) for x in template]
    if tp is dict:
        return {k: fill(v, inputs, scalars) for k, v in template.items()}
    return template


class Storage:
    """The memory of a base tensor: its current Value, the base's desc and a write counter.

    ``start`` is the last computed Value (data, no pending node) the step overwrote: the
    parameter an optimizer updates in place, the uploaded tensor a first step writes into;
    None where the step overwrote none (a storage the step created and computes). Every sync
    clears it (``engine.execute``). Note [Packed state] in program/pack.py packs such *state*."""

    __slots__ = ("value", "desc", "version", "start", "__weakref__")

    def __init__(self, value, desc):
        self.value = value
        self.desc = desc
        self.version = 0
        self.start = None
        _refs.append(_ref(self))
        if len(_refs) > _prune_at[0]:
            _prune()

    def write(self, value):
        old = self.value
        if old.node is None:
            self.start = old
        self.value = value
        self.version += 1


_ref = weakref.ref
_refs: list = []  # weak references to every Storage, in creation order
_prune_at = [4096]


def _prune():
    _refs[:] = [r for r in _refs if r() is not None]
    _prune_at[0] = max(4096, 2 * len(_refs))


def live_storages():
    """Every Storage some tensor (or the RNG) still refers to, oldest first.

    Creation order (not memory addresses) makes a sync build the same graph -- node order, cache
    key -- in every run and on every rank of a multi-process job (Note [Multi-process programs] in
    torchacc/distributed).
    """
    alive, live = [], []  # one pass: prune the dead references and collect the live storages
    for r in _refs:
        st = r()
        if st is not None:
            alive.append(r)
            live.append(st)
    _refs[:] = alive
    _prune_at[0] = max(4096, 2 * len(alive))
    return live


# --------------------------------------------------------------------------------------------
# descs: (shape, stride, dtype, storage_offset)


def desc_of(t):
    """The desc of a torch tensor (a meta tensor, typically)."""
    return (tuple(t.shape), tuple(t.stride()), t.dtype, t.storage_offset())


def contiguous_desc(shape, dtype):
    """The desc of a fresh contiguous tensor of ``shape`` and ``dtype``."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return (tuple(shape), tuple(reversed(stride)), dtype, 0)
