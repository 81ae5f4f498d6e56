"""The pending graph: Values, Nodes and Storages.

Note [Values, storages and views]
A ``Value`` is one array of the step: either a device buffer (``array`` set, ``node`` None) or the
pending output ``index`` of a ``Node``. A ``Storage`` is what a tensor's memory is in eager PyTorch:
it holds the *current* Value of a base tensor and a version that increases on every write. A base
LazyTensor reads ``storage.value``; a view LazyTensor keeps a chain of view ops from its storage and
replays it (recording nodes) when the storage's version moved since it last looked. Writing into a
view records the inverse ops (slice_scatter, select_scatter, ...) back up the chain and installs
the
new base Value, so every other view and the base see the write: eager aliasing, functional graph.

When a sync runs a graph, each computed Value gets its array and drops its node, so graphs are freed
as soon as no pending Value needs them.
"""

from __future__ import annotations

import itertools
import operator
import weakref


class Value:
    """One array of the step; ``desc`` is (shape, stride, dtype, storage_offset) from meta."""

    __slots__ = ("node", "index", "array", "desc", "__weakref__")

    def __init__(self, desc, node=None, index=0, array=None):
        self.node = node
        self.index = index
        self.array = array
        self.desc = desc

    @property
    def pending(self):
        return self.node is not None

    def __repr__(self):
        state = f"pending {self.node.rule.name}[{self.index}]" if self.node else "data"
        return f"Value({state}, shape={self.desc[0]}, dtype={self.desc[2]})"


class Node:
    """One recorded op: a rule, its input Values and the static template of its arguments.

    ``key`` is the structural signature (op, argument descriptions, static values, scalar kinds):
    two nodes with equal keys lower to the same JAX code. ``args``/``kwargs`` are templates in which
    ``TensorSlot(i)`` stands for ``inputs[i]`` and ``ScalarSlot(i)`` for ``scalars[i]``.
    """

    __slots__ = ("rule", "key", "inputs", "args", "kwargs", "scalars", "outs")

    def __init__(self, rule, key, inputs, args, kwargs, scalars):
        self.rule = rule
        self.key = key
        self.inputs = inputs
        self.args = args
        self.kwargs = kwargs
        self.scalars = scalars
        self.outs = None


class TensorSlot(int):
    __slots__ = ()

    def __repr__(self):
        return f"T{int(self)}"


class ScalarSlot(int):
    __slots__ = ()

    def __repr__(self):
        return f"S{int(self)}"


class Storage:
    """The memory of a base tensor: its current Value, the base's desc and a write counter."""

    __slots__ = ("value", "desc", "version", "seq", "__weakref__")

    def __init__(self, value, desc):
        self.value = value
        self.desc = desc
        self.version = 0
        self.seq = _next_seq()
        _live.add(self)

    def write(self, value):
        self.value = value
        self.version += 1


_live = weakref.WeakSet()
_next_seq = itertools.count().__next__
_by_seq = operator.attrgetter("seq")


def live_storages():
    """Every Storage some tensor (or the RNG) still refers to, oldest first.

    Creation order (not the set's, which follows memory addresses) makes a sync build the same
    graph -- node order, cache key -- in every run and on every rank of a multi-process job
    (Note [Multi-process programs] in torchacc/distributed).
    """
    return sorted(_live, key=_by_seq)
