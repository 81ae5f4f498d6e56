"""Known steps: launch a step whose ops match an earlier step's without walking its graph.

Note [Known steps]
A training loop records the same ops every step, so after the first steps a ``mark_step`` that
walks the pending graph, builds its structural key and works out donations (program/key.py)
finds an executable it already has. This module checks the step *while it is recorded* instead,
so that a sync of a known step only gathers its inputs and scalars: O(inputs), not O(ops).

- **The op stream.** Every Node recorded since the last ``mark_step`` gets its position in the
  step's stream (``Node.spos``, offset by a per-step ``base`` so numbers of different steps never
  meet) and a tuple of input codes: an input produced by stream node ``q`` (output ``i``) is
  ``q << _SHIFT | i``; a data input (an array) is ``~k``, ``k`` being the order in which the step
  first used that Value (``Value.sid``). Two steps with equal streams record the same ops on the
  same connections, with data inputs used in the same pattern.
- **Matching.** While a step follows a known stream, each node is compared with the stream's
  entry at its position (OpEntries are unique per structural signature, so ``is`` compares
  ops, input descs and static arguments). On the first difference the step *diverges*: another
  known stream with the same prefix takes over if one matches there, else the step records a
  new stream. The step after a known one is predicted to be the one that followed it last time,
  so loops that alternate (gradient accumulation, evaluation every N steps) match too.
- **Launching.** At ``mark_step`` a fully matched stream looks up its *variant* by the output
  codes (which storages are pending, from ``_live_outputs``), checks its inputs' descs, where
  they live (which pack and offset: Note [Packed state] in pack.py), which inputs no live tensor
  holds (donation) and the float32 precision settings, and launches the executable the full
  path compiled for exactly that key, with the runtime scalars of the nodes the program holds.
  Any check failing takes the full path, which learns the new variant.
- **What is never known.** A step that read a pending value before ``mark_step`` (``.item()``,
  a collective run eagerly) or used a pending Value recorded in an earlier step takes the full
  path and is not learnt: its graph is not described by its stream alone.

Equal stream + output codes + input descs + input layout + donatable inputs + precision imply the
full path's key (Note [What a compiled step is keyed on]), so a known step runs the very program
the full path would: tests compare results bit for bit with ``TORCHACC_KNOWN_STEPS=0``.
``TORCHACC_DEBUG=1`` prints where a step left its known stream.
"""

from __future__ import annotations

import os
import sys

from torchacc.ir import graph as ir_graph
from torchacc.program import pack
from torchacc.program.key import args_of, donatable_flags
from torchacc.sharding import layout as sharding

_STEP = 1 << 40  # base spacing: positions and data numbers of one step stay below the next base
_SHIFT = 24  # a pending input's code: (stream position << _SHIFT) | output index
_MAX_STREAMS = 8
_MAX_VARIANTS = 16  # per stream, and launches per variant (the oldest goes first)


class Stream:
    """The op stream of a step: OpEntry and input codes per position, and its variants."""

    __slots__ = ("ops", "ins", "n", "variants", "next")

    def __init__(self, ops, ins):
        self.ops = ops
        self.ins = ins
        self.n = len(ops)
        self.variants = {}  # output codes -> Variant
        self.next = None  # the stream of the step that followed this one last time


class Variant:
    """One program of a stream: which stream positions and data inputs it uses."""

    __slots__ = ("in_pick", "in_descs", "scalar_pos", "n_order", "launches", "plan")

    def __init__(self, in_pick, in_descs, scalar_pos, n_order):
        self.in_pick = in_pick
        self.in_descs = in_descs
        self.scalar_pos = scalar_pos
        self.n_order = n_order
        # (input codes, pack sizes, donatable flags, precision key) ->
        # (executable, donated positions, output codes, output packs, loose output order)
        self.launches = {}
        self.plan = None  # (output codes, output packs, max_numel) the last time it was learnt


class Launch:
    """What ``mark_step`` needs to run a known step (the argument packs and loose inputs,
    donations and output plan are as for a Graph: Note [Packed state] in pack.py)."""

    __slots__ = (
        "exe",
        "packs",
        "loose",
        "donate",
        "out_codes",
        "out_packs",
        "out_order",
        "floats",
        "ints",
        "n_order",
    )

    def __init__(self, compiled, packs, loose, floats, ints, n_order):
        self.exe, self.donate, self.out_codes, self.out_packs, self.out_order = compiled
        self.packs = packs
        self.loose = loose
        self.floats = floats
        self.ints = ints
        self.n_order = n_order

    def args(self):
        return args_of(self.packs, self.loose)


class _Step:
    """The step being recorded."""

    __slots__ = ("base", "pos", "stream", "ops", "ins", "data", "scalars", "known", "used")

    def __init__(self, base, stream):
        self.base = base
        self.pos = 0
        self.stream = stream  # the known stream it follows, or None while it records its own
        self.ops = None if stream is not None else []
        self.ins = None if stream is not None else []
        self.data = []  # data input Values in first-use order
        self.scalars = []  # each position's runtime scalars
        self.known = True  # False: cannot be launched or learnt as a known step
        self.used = None  # the stream this step launched or learnt at its mark_step


_streams: list = []  # known streams, most recently used last
_step = _Step(_STEP, None)
_last = [None]  # the stream of the previous step


def enabled():
    return os.environ.get("TORCHACC_KNOWN_STEPS", "1").strip().lower() not in ("0", "false", "off")


def _observe(node):
    """Number ``node`` in the step's stream and compare it with the known stream."""
    st = _step
    pos = st.pos
    st.pos = pos + 1
    base = st.base
    node.spos = base + pos
    st.scalars.append(node.scalars)
    codes = []
    for v in node.inputs:
        n = v.node
        if n is None:
            k = v.sid - base
            if k < 0:
                k = len(st.data)
                v.sid = base + k
                st.data.append(v)
            codes.append(~k)
        else:
            q = n.spos - base
            if q < 0:  # recorded in an earlier step (and still pending)
                if st.known:
                    _spoil(st, f"{node.op.rule.name} reads a pending value of an earlier step")
                q = 0
            codes.append(q << _SHIFT | v.index)
    codes = tuple(codes)
    s = st.stream
    if s is not None:
        if pos < s.n and s.ops[pos] is node.op and s.ins[pos] == codes:
            return
        _diverge(st, s, pos, node, codes)
    else:
        st.ops.append(node.op)
        st.ins.append(codes)


def _diverge(st, s, pos, node, codes):
    ops, ins = s.ops[:pos], s.ins[:pos]
    for other in reversed(_streams):
        if (
            other is not s
            and other.n > pos
            and other.ops[pos] is node.op
            and other.ins[pos] == codes
            and other.ops[:pos] == ops
            and other.ins[:pos] == ins
        ):
            st.stream = other
            return
    if _debug():
        expected = s.ops[pos].rule.name if pos < s.n else "mark_step"
        print(
            f"torchacc: known step: op #{pos} is {node.op.rule.name}, the known step had "
            f"{expected} there; this step records a new stream{_site(node)}",
            file=sys.stderr,
        )
    st.stream = None
    ops.append(node.op)
    ins.append(codes)
    st.ops, st.ins = ops, ins


def _spoil(st, why):
    st.known = False
    if _debug():
        print(f"torchacc: known step: not this step: {why}", file=sys.stderr)


def spoil(why):
    """This step cannot be a known step (a read ran part of it before ``mark_step``)."""
    if _step.known and observing():
        _spoil(_step, why)


def _recorded_stream(st):
    """The known stream equal to what the step recorded, or None."""
    s = st.stream
    if s is None or st.pos == s.n:
        return s
    ops, ins = s.ops[: st.pos], s.ins[: st.pos]  # the step stopped inside the stream it follows
    for other in _streams:
        if other.n == st.pos and other.ops == ops and other.ins == ins:
            return other
    return None


def _output_codes(outputs, base):
    """Which stream node (and output) computes each output: a variant's key."""
    return tuple([(v.node.spos - base) << _SHIFT | v.index for v in outputs])


def match(outputs, held, precision_key, starts=None):
    """The Launch of this step if it is a known step, else None (take the full path).

    ``outputs``: the pending Values to compute, ``held``: ids of Values and arrays live storages
    hold, ``starts``: the Values the outputs' storages held before (all three from
    ``engine.execute._live_outputs``)."""
    st = _step
    if not st.known or st.stream is None:
        return None
    s = _recorded_stream(st)
    if s is None:
        return None
    st.stream = s
    base = st.base
    variant = s.variants.get(_output_codes(outputs, base))
    if variant is None:
        return None
    data = st.data
    inputs = [data[k] for k in variant.in_pick]
    if [v.desc for v in inputs] != variant.in_descs:
        return None
    if variant.plan is not None and variant.plan[2] != pack.max_numel():
        return None  # TORCHACC_PACK_MAX_NUMEL changed: the full path packs by the new setting
    compiled, packs, loose = _compiled_for(variant, inputs, held, precision_key)
    if compiled is None and variant.plan is not None and variant.plan[1] and starts is not None:
        # its state is not where the program reads it (a new model, a loaded checkpoint): lay
        # it out as the full path would (Note [Packed state]) and look again
        pack.lay_out_like_results(outputs, starts, variant.plan[:2], held)
        compiled, packs, loose = _compiled_for(variant, inputs, held, precision_key)
    if compiled is None:
        return None
    floats, ints = [], []
    scalars = st.scalars
    for p in variant.scalar_pos:
        for x in scalars[p]:
            (ints if type(x) is int or type(x) is bool else floats).append(x)
    st.used = s
    return Launch(compiled, packs, loose, floats, ints, variant.n_order)


def _compiled_for(variant, inputs, held, precision_key):
    codes, packs, loose = pack.input_layout(inputs)
    sizes = tuple([p.size for p in packs])
    flags = donatable_flags(packs, loose, held)
    key = (codes, sizes, flags, precision_key, *sharding.launch_key(loose))
    return variant.launches.get(key), packs, loose


def learn(graph, exe, held, precision_key):
    """Remember the step the full path just compiled or found, as a known stream's variant."""
    st = _step
    if not st.known or not observing():
        return
    base = st.base
    if st.stream is None:
        s = Stream(st.ops, st.ins)
    else:
        s = _recorded_stream(st)
        if s is None:  # a prefix of the known stream: a stream of its own
            s = Stream(st.stream.ops[: st.pos], st.stream.ins[: st.pos])
    if s not in _streams:
        _streams.append(s)
        if len(_streams) > _MAX_STREAMS:
            del _streams[0]
    st.stream, st.ops, st.ins, st.used = s, None, None, s
    out_codes = _output_codes(graph.outputs, base)
    data, in_pick = st.data, []
    for v in graph.inputs:
        k = v.sid - base
        if k < 0 or k >= len(data) or data[k] is not v:
            return  # an input no node of this step read as data
        in_pick.append(k)
    scalar_pos = []
    for node in graph.order:
        p = node.spos - base
        if p < 0:
            return
        if node.scalars:
            scalar_pos.append(p)
    variant = s.variants.get(out_codes)
    if variant is None:
        if len(s.variants) >= _MAX_VARIANTS:
            del s.variants[next(iter(s.variants))]
        in_descs = [v.desc for v in graph.inputs]
        variant = s.variants[out_codes] = Variant(in_pick, in_descs, scalar_pos, len(graph.order))
    if len(variant.launches) >= _MAX_VARIANTS:
        del variant.launches[next(iter(variant.launches))]
    flags = donatable_flags(graph.packs, graph.loose, held)
    compiled = (exe, graph.donate, graph.out_codes, graph.out_packs, graph.out_order)
    variant.plan = (graph.out_codes, graph.out_packs, pack.max_numel())
    sizes = tuple([p.size for p in graph.packs])
    spmd = sharding.launch_key(graph.loose)  # Note [SPMD mode] in sharding/mesh.py
    variant.launches[(graph.in_codes, sizes, flags, precision_key, *spmd)] = compiled


def next_step():
    """Start numbering the next step's stream (called at the end of every ``mark_step``)."""
    global _step
    if _step.pos == 0 and _step.used is None:  # an empty mark_step: keep the prediction
        _step = _Step(_step.base + _STEP, _step.stream)
        return
    s = _step.used
    last = _last[0]
    if last is not None and s is not None:
        last.next = s
    _last[0] = s
    if s is not None and s in _streams:
        _streams.remove(s)
        _streams.append(s)
        s = s.next or s
    elif _streams:
        s = _streams[-1]
    _step = _Step(_step.base + _STEP, s)


def forget():
    """Drop every known stream (compiled programs were forgotten); the step being recorded will
    take the full path."""
    global _step
    _streams.clear()
    _last[0] = None
    _step = _Step(_step.base + _STEP, None)
    _step.known = False


def observing():
    return ir_graph.observe is _observe


def start(on=None):
    """Observe recorded nodes (``on`` defaults to ``TORCHACC_KNOWN_STEPS`` != 0)."""
    ir_graph.observe = _observe if (enabled() if on is None else on) else None
    if ir_graph.observe is None:
        forget()


def _debug():
    return os.environ.get("TORCHACC_DEBUG", "0").strip() not in ("", "0")


site_of = [None]  # fn(node) -> the user's line that recorded it, or None (engine/explain.py)


def _site(node):
    site = site_of[0](node) if site_of[0] is not None else None
    return f" (recorded at {site})" if site is not None else ""


start()
