"""``torch_xla.compile(f, max_different_graphs=N)``: at most N different traced graphs of ``f``.

Every call of the compiled function records the ops it dispatches on torchacc tensors (op name
and output shape, as torch_xla's IR nodes are told apart) and walks them through a prefix tree
of the traces seen for ``f`` so far: a node holds a run of ops shared by its traces, its children
the ops where they part, and whether a trace ends there. A call that leaves every known trace
(an op no trace has at that point, or an end where none ended) makes a new graph; the
(N+1)-th raises ``RuntimeError`` naming the op it got and the ops the known traces expected.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lowering.dtypes import HLO_NAMES


def _shape(t):
    dims = ",".join(str(s) for s in t.shape)
    layout = ",".join(str(i) for i in reversed(range(t.dim())))
    return f"{HLO_NAMES.get(t.dtype, str(t.dtype))}[{dims}]" + (f"{{{layout}}}" if t.dim() else "")


def _describe(func, out):
    tensors = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
    shapes = [_shape(t) for t in tensors]
    shape = shapes[0] if len(shapes) == 1 else f"({', '.join(shapes)})"
    return f"[] {func._schema.name}, xla_shape={shape}, dynamic_dims: ()"


class _Node:
    __slots__ = ("ops", "children", "end")

    def __init__(self, ops=None, children=None, end=False):
        self.ops = ops if ops is not None else []
        self.children = children if children is not None else {}
        self.end = end

    def split(self, at):
        rest = _Node(self.ops[at:], self.children, self.end)
        self.ops, self.children, self.end = self.ops[:at], {rest.ops[0]: rest}, False


class _Trie:
    """The traces of one function."""

    def __init__(self, limit):
        self.limit = limit
        self.root = _Node()
        self.graphs = 0

    def start(self):
        self.node, self.pos, self.new, self.last = self.root, 0, False, None

    def _new_graph(self, lines):
        if self.graphs >= self.limit:
            text = "\n".join(lines)
            raise RuntimeError(
                "Maximum number of different graphs allowed per function exceeded: "
                f"{self.limit}\n{text}\n"
            )
        self.graphs += 1
        self.new = True

    @staticmethod
    def _expected(node):
        if len(node.children) == 1:
            return [f"Expected: {next(iter(node.children))}"]
        return ["Expected either of:", *(f"  - {op}" for op in node.children)]

    def op(self, op):
        node, pos = self.node, self.pos
        if self.new:  # on a path this call made: grow it
            node.ops.append(op)
            pos += 1
        elif pos < len(node.ops) and node.ops[pos] == op:
            pos += 1
        elif pos < len(node.ops):
            self._new_graph([f"Got: {op}", f"Expected: {node.ops[pos]}"])
            node.split(pos)
            node.children[op] = child = _Node([op])
            node = child
            pos = 1
        elif op in node.children:
            node, pos = node.children[op], 1
        elif node is self.root and not node.ops and not node.children and not node.end:
            self._new_graph([f"Got: {op}"])  # the first trace
            node.ops.append(op)
            pos = 1
        else:
            self._new_graph([f"Got: {op}", *self._expected(node)] if node.children else [])
            node.children[op] = child = _Node([op])
            node = child
            pos = 1
        self.node, self.pos, self.last = node, pos, op

    def finish(self):
        node, pos = self.node, self.pos
        if self.new:
            node.end = True
            return
        at = f"Reached the end of the function at: {self.last}"
        if pos < len(node.ops):
            self._new_graph([at, f"Expected: {node.ops[pos]}"])
            node.split(pos)
            node.end = True
        elif not node.end:
            self._new_graph([at, *self._expected(node)] if node.children else [at])
            node.end = True


class _Watch(TorchDispatchMode):
    def __init__(self, trie):
        super().__init__()
        self.trie = trie

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if any(
            t.device.type == DEVICE_TYPE
            for t in tree_flatten(out)[0]
            if isinstance(t, torch.Tensor)
        ):
            self.trie.op(_describe(func, out))
        return out


_tries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # f -> _Trie
_by_id: dict = {}  # f's id -> _Trie, for functions that cannot be weakly referenced


def watched(f, limit, call):
    """Run ``call()`` (which calls ``f``) checking ``f``'s traces against ``limit``."""
    if not isinstance(limit, int) or limit < 1:
        raise ValueError(f"torch_xla.compile: max_different_graphs={limit!r} must be an int >= 1")
    try:
        trie = _tries.get(f)
        if trie is None:
            trie = _tries[f] = _Trie(limit)
    except TypeError:
        trie = _by_id.setdefault(id(f), _Trie(limit))
    trie.start()
    with _Watch(trie):
        out = call()
    trie.finish()
    return out
