"""An FX graph of ATen ops -> jitted JAX programs (one per lowerable piece), with eager fallback.

The trace-once frontend's back half: AOTAutograd's forward/backward graphs and compile_step's
whole-step graph come here. Each ``call_function`` node whose ATen overload has a rule in
``torchacc.lowering`` is replayed by that rule inside one ``jax.jit``; see Note [FX calling
convention] for how FX arguments map onto the rules' calling convention.

Note [Fallback policy]
An op with no lowering rule (after AOTAutograd's decompositions) is a *graph break inside the
graph*: the graph is cut into maximal runs of lowerable nodes, each one jitted program, and the
ops between them run eagerly in PyTorch on the user's tensors. Every eager run increments the
``aten::<op>`` counter in ``torchacc.metrics`` (like torch_xla's fallback counters) and the first
one per op warns. A graph with no such op is exactly one program.

Note [FX calling convention]
Rules expect the lazy recorder's conventions (lowering/registry.py): a ``Scalar``/``float``
argument arrives as a 0-d array (float64 for floats, int64 for ints and bools) unless the rule
names it ``static``; a Python number in a ``Tensor`` slot (a wrapped number) arrives as a 0-d
array of its partner tensor's dtype when they are of the same kind (else torch's default dtype
for the number); ``out_meta`` rules get ``out=[(shape, jnp dtype)]`` from the node's fake value;
``rng`` rules get ``rng=`` a key split off the program's key input. Python numbers in an FX graph
are constants of that graph, so they become constants of the program (a different value is a
different graph, which dynamo guards on). Ints that are graph *inputs* (symbolic sizes under
dynamic shapes) are static arguments of the jitted function: each new value compiles once.
"""

from __future__ import annotations

import operator
import os
import sys
import time
import warnings

import jax
import numpy as np
import torch
from torch import fx

from torchacc import metrics
from torchacc.dynamo import bridge, collective
from torchacc.dynamo.fixups import output_fixups
from torchacc.engine import handoff
from torchacc.lowering import lookup, scan_rewrites
from torchacc.lowering.fx_calling import (
    _TRACED_ITEM,
    _eval_python,
    _meta_list,
    _run_python,
    _val,
    eval_rule,
    is_hop,
)

_SCALAR_TYPES = (int, float, bool, torch.SymInt, torch.SymFloat, torch.SymBool)
_warned_ops: set = set()
# Called as hook(executable, key, arrays) before every program launch when set (benchmarks).
launch_hook = None


def debug_enabled():
    return os.environ.get("TORCHACC_DEBUG", "0") not in ("", "0")


def _is_scalar_node(node):
    """A node computing a Python number (sizes under dynamic shapes): recomputed where used."""
    if node.op != "call_function" or node.target is _TRACED_ITEM:
        return False
    val = _val(node)
    if val is not None:
        return isinstance(val, _SCALAR_TYPES)
    target = node.target
    return target is not operator.getitem and getattr(target, "__module__", None) in (
        "_operator",
        "math",
        "torch.fx.experimental.sym_node",
    )


# ``.item()`` on a traced value (tensor lr, capturable optimizers): the 0-d array stays traced


def _lowerable(node):
    return node.target is _TRACED_ITEM or _rule_of(node) is not None or is_hop(node)


def _rule_of(node):
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return lookup(target)
    return None


def op_name(target):
    if isinstance(target, torch._ops.OpOverload):
        return f"aten::{target.overloadpacket.__name__}"
    return f"aten::{getattr(target, '__name__', str(target))}"


class _Segment:
    """A run of nodes executed together: ``jax`` (one jitted program) or ``eager`` (PyTorch)."""

    def __init__(self, kind):
        self.kind = kind
        self.nodes = []
        self.inputs = []
        self.outputs = []


def _segment(graph):
    """Cut ``graph`` into maximal runs of lowerable / other nodes (Note [Fallback policy])."""
    segments = []
    home = {}  # node -> its segment
    for node in graph.nodes:
        if node.op != "call_function" or _is_scalar_node(node):
            continue
        if node.target is operator.getitem and node.args[0] in home:
            seg = home[node.args[0]]  # stays with its producer
        else:
            kind = "jax" if _lowerable(node) else "eager"
            if not segments or segments[-1].kind != kind:
                segments.append(_Segment(kind))
            seg = segments[-1]
        seg.nodes.append(node)
        home[node] = seg
    for seg in segments:
        _wire(seg, home)
    return segments, home


def _wire(seg, home):
    """Fill ``seg.inputs``/``seg.outputs``; scalar nodes it needs are recomputed inside it."""
    inside = set(seg.nodes)
    scalars, inputs, seen = [], [], set()

    def need(n):
        if n in inside or n in seen or (n.op == "get_attr" and seg.kind == "jax"):
            return  # (a jitted piece closes over the graph's constants)
        seen.add(n)
        if _is_scalar_node(n):
            for m in n.all_input_nodes:
                need(m)
            scalars.append(n)
        else:
            inputs.append(n)

    for node in seg.nodes:
        for n in node.all_input_nodes:
            need(n)
    order = {n: i for i, n in enumerate(seg.nodes[0].graph.nodes)} if seg.nodes else {}
    seg.nodes = sorted(scalars + seg.nodes, key=order.__getitem__)
    seg.inputs = inputs
    outs = []
    for node in seg.nodes:
        if node in inside and any(home.get(u) is not seg for u in node.users):
            outs.append(node)
    seg.outputs = outs


class JaxPiece:
    """One lowerable segment: a jitted JAX function of its array inputs (and static ints)."""

    def __init__(self, seg, consts, device, name):
        self.seg = seg
        self.name = name
        self.device = device
        self.consts = consts
        self.rng = any(
            (r := _rule_of(n)) is not None and r.rng for n in seg.nodes if n.op == "call_function"
        )
        self.static = tuple(
            i
            for i, n in enumerate(seg.inputs)
            if n.op == "placeholder" and isinstance(_val(n), (int, torch.SymInt))
        )
        self.n_ops = sum(1 for n in seg.nodes if n.op == "call_function")
        self.collective = collective.has_collective(
            seg.nodes
        )  # one manual region over the process axis
        # symbolic sizes (dynamic shapes): one executable per set of input shapes
        self.dynamic = any(
            isinstance(v, torch.Tensor) and not all(type(d) is int for d in v.shape)
            for v in map(_val, seg.inputs)
        )
        self._exes = {}
        self.out_like = None  # SPMD: per program output, the argument whose sharding it keeps

    def function(self, statics):
        seg, consts = self.seg, self.consts
        positions = dict(zip(self.static, statics))  # (input shapes follow when dynamic)

        def program(key, *arrays):
            env = dict(consts)
            it = iter(arrays)
            for i, n in enumerate(seg.inputs):
                env[n] = positions[i] if i in positions else next(it)
            keys = [None if key is None else jax.random.wrap_key_data(key)]
            for node in seg.nodes:
                rule = _rule_of(node)
                if rule is None:
                    env[node] = _eval_python(node, env)
                else:
                    args = fx.node.map_arg(node.args, env.__getitem__)
                    kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                    env[node] = eval_rule(node, rule, args, kwargs, keys)
            return [env[n] for n in seg.outputs]

        return program

    def executable(self, statics, key, arrays, out_shardings=None):
        exe = self._exes.get(statics)
        if exe is not None:
            return exe
        if debug_enabled():
            shapes = ", ".join(str(tuple(a.shape)) for a in arrays[:8])
            print(
                f"torchacc.dynamo: compiling {self.name} ({self.n_ops} ops, inputs {shapes}"
                f"{', ...' if len(arrays) > 8 else ''}; static {statics})",
                file=sys.stderr,
            )
        start = time.perf_counter()
        if self.collective:
            exe = collective.compile(self.function(statics), key, *arrays)
        elif self.out_like is not None or out_shardings is not None:
            # Note [Device tensors in a trace-once program]; None: XLA's propagation decides
            outs = list(out_shardings or [None] * len(self.seg.outputs))
            for i, j in enumerate(self.out_like or ()):
                if j is not None and outs[i] is None:
                    outs[i] = arrays[j].sharding
            jitted = jax.jit(self.function(statics), out_shardings=outs)
            exe = jitted.lower(key, *arrays).compile()
        else:
            exe = jax.jit(self.function(statics)).lower(key, *arrays).compile()
        metrics.record_time("DynamoCompileTime", time.perf_counter() - start)
        metrics.counter_inc("DynamoCompile")
        metrics.program_compiled(exe)  # its FLOPs (Note [Step FLOPs] in metrics.py)
        self._exes[statics] = exe
        return exe

    def new_key(self):
        if not self.rng:
            return None
        # Note [Random ops]: a fresh key per call from torch's generator (manual_seed reproduces)
        seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
        data = np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)
        return jax.device_put(data, self.device)


def _to_jax(value, device):
    if isinstance(value, torch.Tensor):
        if handoff.is_device_tensor(value):
            return handoff.array_of(value)
        return bridge.to_jax(value, device)
    if isinstance(value, float):
        return jax.device_put(np.float64(value), device)
    if isinstance(value, (torch.SymFloat,)):
        return jax.device_put(np.float64(float(value)), device)
    return value


def to_torch(value, cuda, dtype=None):
    """``value`` (JAX arrays) as torch tensors; ``cuda == "device"``: torchacc's, of ``dtype``."""
    if isinstance(value, jax.Array):
        if cuda == "device":
            return handoff.tensor_of(value, dtype)
        return bridge.to_torch_cuda(value) if cuda else bridge.to_torch_cpu(value)
    if isinstance(value, (list, tuple)):
        return type(value)(to_torch(v, cuda) for v in value)
    return value


class Lowered:
    """A callable running an FX graph: jitted pieces for lowerable runs, PyTorch for the rest.

    Called with the graph's inputs as a list (AOTAutograd's boxed convention: the list is
    cleared so inputs can be freed early); returns the graph's outputs as torch tensors on the
    inputs' device."""

    def __init__(self, gm, name="graph"):
        # in the instance dict: dynamo's disable() wrapper copies it (functools.wraps)
        self._boxed_call = True
        self.gm = gm
        self.name = name
        gm = scan_rewrites.rewritten(gm)  # Note [Copy-free backward scans]
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        out_node = next(n for n in reversed(graph.nodes) if n.op == "output")
        outs = out_node.args[0]
        self.out_tuple = isinstance(outs, (tuple, list))
        self.outs = list(outs) if self.out_tuple else [outs]
        self.torch_device = _graph_device(self.placeholders, graph)
        self.cuda = self.torch_device.type == "cuda"
        # torchacc-device tensors (SPMD): Note [Device tensors in a trace-once program]
        self.on_device = self.torch_device.type == handoff.device_type[0]
        if self.on_device:
            self.device = bridge.replicated()
            self.cuda = "device"
        else:
            self.device = bridge.jax_device_for(self.torch_device)
        consts = {}
        # compilers run under AOTAutograd's fake mode; constants are real tensors
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            for n in graph.nodes:
                if n.op == "get_attr":
                    t = _fetch_attr(gm, n.target)
                    consts[n] = (
                        jax.device_put(t.detach().cpu().numpy(), self.device)
                        if isinstance(t, torch.Tensor)
                        else t
                    )
        self.consts = consts
        self.const_tensors = {n: _fetch_attr(gm, n.target) for n in consts}
        segments, _ = _segment(graph)
        self.pieces = []
        for i, seg in enumerate(segments):
            if seg.kind == "jax":
                self.pieces.append(JaxPiece(seg, consts, self.device, f"{name}[{i}]"))
            else:
                self.pieces.append(seg)
        self.fallback_ops = [
            op_name(n.target) for s in segments if s.kind == "eager" for n in s.nodes
        ]
        # (on the device, results are fresh contiguous tensors: nothing to fix, no op to record)
        self._post = [] if self.on_device else output_fixups(self.outs, self.placeholders)
        self._fast = len(self.pieces) == 1 and isinstance(self.pieces[0], JaxPiece)
        self.last_in = None  # SPMD: the argument shardings of the latest call (a forward's)
        self._grad_src = None  # SPMD: (forward Lowered, per program output its argument there)
        if self._fast:
            self._prepare_fast()

    # -- the common case: the whole graph is one program -------------------------------------
    def _prepare_fast(self):
        piece = self.pieces[0]
        index = {n: i for i, n in enumerate(self.placeholders)}
        seg_in = piece.seg.inputs
        self._fast_static = [index[n] for i, n in enumerate(seg_in) if i in piece.static]
        self._fast_dynamic = []
        for i, n in enumerate(seg_in):
            if i in piece.static:
                continue
            if n in index:
                self._fast_dynamic.append(index[n])
            else:
                raise AssertionError(f"unexpected program input {n}")
        produced = set(piece.seg.outputs)
        ordered = []  # the program returns the graph's outputs in the graph's order
        for o in self.outs:
            if isinstance(o, fx.Node) and o in produced and o not in ordered:
                ordered.append(o)
        piece.seg.outputs = ordered
        out_pos = {n: i for i, n in enumerate(ordered)}
        # per graph output: ("prog", i) | ("input", i) | ("const", node) | ("value", v)
        plan = []
        for o in self.outs:
            if isinstance(o, fx.Node) and o in out_pos:
                plan.append(("prog", out_pos[o]))
            elif isinstance(o, fx.Node) and o in index:
                plan.append(("input", index[o]))
            elif isinstance(o, fx.Node) and o in self.const_tensors:
                plan.append(("const", self.const_tensors[o]))
            else:
                plan.append(("value", o))
        self._plan = plan
        self._simple = plan == [("prog", i) for i in range(len(plan))] and not self._post
        self._prog_dtypes = [_val(o).dtype for o in ordered]

    def keep_shardings(self, pairs):
        """SPMD: each ``(graph output, graph input)`` of ``pairs`` gives that output its input's
        sharding (Note [Device tensors in a trace-once program] in engine/handoff.py)."""
        if not (self.on_device and self._fast):
            return
        piece = self.pieces[0]
        position = {ph: j for j, ph in enumerate(self._fast_dynamic)}
        like = [None] * len(piece.seg.outputs)
        for out, ph in pairs:
            kind, x = self._plan[out]
            if kind == "prog" and ph in position and like[x] is None:
                like[x] = position[ph]
        piece.out_like = like

    def grads_of(self, forward):
        """SPMD, a backward graph: its outputs are the gradients of AOTAutograd forward graph
        ``forward``'s inputs (its primals, in order); each comes out laid out as its input was at
        the latest forward call (a parameter's FSDP shard), not as XLA's propagation would leave
        it (a bias's gradient, a sum over the sharded batch, replicated). One executable per set
        of those shardings (Note [torch.compile over torchacc tensors])."""
        if not (self.on_device and self._fast and forward.on_device and forward._fast):
            return
        primals = forward.placeholders
        if len(self.outs) != len(primals) or not all(p.name.startswith("primals") for p in primals):
            return  # not the layout this mapping knows
        position = {ph: k for k, ph in enumerate(forward._fast_dynamic)}
        src = [None] * len(self.pieces[0].seg.outputs)
        for i, (kind, x) in enumerate(self._plan):
            if kind == "prog" and src[x] is None:
                src[x] = position.get(i)
        if any(k is not None for k in src):
            self._grad_src = (forward, src)

    def __call__(self, *args):
        # boxed (one list, cleared) or, behind dynamo's disable() wrapper, unboxed arguments
        args = args[0] if len(args) == 1 and type(args[0]) is list else list(args)
        metrics.counter_inc("DynamoExecute")
        if self._fast:
            return self._call_fast(args)
        return self._call_general(args)

    def _call_fast(self, args):
        piece = self.pieces[0]
        device = self.device
        statics = tuple([args[i] for i in self._fast_static])
        arrays = [_to_jax(args[i], device) for i in self._fast_dynamic]
        if piece.dynamic:
            statics += tuple([a.shape for a in arrays])
        targets = None
        if self.on_device:  # one executable per set of argument shardings
            shardings = tuple([a.sharding for a in arrays])
            statics += shardings
            self.last_in = shardings
            if self._grad_src is not None and self._grad_src[0].last_in is not None:
                last, src = self._grad_src[0].last_in, self._grad_src[1]
                targets = tuple([None if k is None else last[k] for k in src])
                statics += (targets,)
        key = piece.new_key()
        exe = piece._exes.get(statics) or piece.executable(statics, key, arrays, targets)
        if launch_hook is not None:
            launch_hook(exe, key, arrays)
        outs = exe(key, *arrays)
        metrics.program_ran(exe)
        if self.on_device:
            outs = list(map(handoff.tensor_of, outs, self._prog_dtypes))
            conv = bridge.same
        elif not self.cuda:
            jax.block_until_ready(outs)
            conv = bridge.to_torch_cpu
        else:
            conv = bridge.to_torch_cuda
        if self._simple:
            args.clear()
            return [conv(o) for o in outs]
        result = []
        for kind, x in self._plan:
            if kind == "prog":
                result.append(conv(outs[x]))
            elif kind == "input":
                result.append(args[x])
            else:
                result.append(x)
        args.clear()
        return self._fixup(result)

    def _fixup(self, result):
        for i, fix in self._post:
            result[i] = fix(result[i])
        return result

    # -- graphs with eager fallbacks -----------------------------------------------------------
    def _call_general(self, args):
        env = dict(zip(self.placeholders, args))
        args.clear()
        env.update(self.const_tensors)
        for piece in self.pieces:
            if isinstance(piece, JaxPiece):
                self._run_piece(piece, env)
            else:
                self._run_eager(piece, env)
        result = []
        for o in self.outs:
            v = env[o] if isinstance(o, fx.Node) else o
            result.append(to_torch(v, self.cuda, getattr(_val(o), "dtype", None)))
        return self._fixup(result)

    def _run_piece(self, piece, env):
        statics, arrays = [], []
        for i, n in enumerate(piece.seg.inputs):
            v = env[n]
            if i in piece.static:
                statics.append(v)
            elif n in self.consts:
                arrays.append(self.consts[n])
            else:
                arrays.append(_to_jax(v, self.device))
        statics = tuple(statics)
        if piece.dynamic:
            statics += tuple([a.shape for a in arrays])
        key = piece.new_key()
        exe = piece._exes.get(statics) or piece.executable(statics, key, arrays)
        if launch_hook is not None:
            launch_hook(exe, key, arrays)
        outs = exe(key, *arrays)
        metrics.program_ran(exe)
        if not self.cuda:
            jax.block_until_ready(outs)
        if self.on_device:
            outs = [handoff.tensor_of(o, _val(n).dtype) for n, o in zip(piece.seg.outputs, outs)]
        for n, o in zip(piece.seg.outputs, outs):
            env[n] = o

    def _run_eager(self, seg, env):
        local = {}
        for n in seg.inputs:
            local[n] = to_torch(env[n], self.cuda)
        for node in seg.nodes:
            if node in local:
                continue
            if node.op == "call_function" and not _is_scalar_node(node):
                name = op_name(node.target)
                metrics.counter_inc(name)
                if name not in _warned_ops:
                    _warned_ops.add(name)
                    warnings.warn(
                        f"torchacc.dynamo: {node.target} has no lowering; it runs eagerly in "
                        "PyTorch between compiled programs (a graph break; counted as "
                        f"'{name}' in torchacc.metrics)",
                        stacklevel=2,
                    )
            local[node] = _run_python(node, local)
        for n in seg.outputs:
            env[n] = local[n]


def _fetch_attr(gm, target):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _graph_device(placeholders, graph):
    for n in list(placeholders) + list(graph.nodes):
        v = _val(n)
        for t in _meta_list(v):
            if isinstance(t, torch.Tensor) and (
                t.device.type == "cuda" or handoff.is_device_tensor(t)
            ):
                return t.device
    return torch.device("cpu")
