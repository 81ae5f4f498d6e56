"""Packed state: a step's small results come back as one array per dtype.

Note [Packed state]
Calling an executable costs JAX a few microseconds per result (an array object, a runtime
buffer, its events), and a training step returns every parameter, gradient, optimizer moment
and batch-norm statistic it updated: ~800 results for ResNet-50 with AdamW, most of them small
(biases, norm scales, running statistics, step counters). That per-result cost was most of a
known step's ``mark_step`` (measured on the CPU box: 1 input / 805 outputs 1.1-2.5 ms per call,
645 inputs / 1 output 0.28 ms).

So a ``mark_step``'s program returns its small *state* -- results of at most ``max_numel()``
elements (16K by default) whose storage overwrote a computed Value in the step (``Storage.start``:
parameters, optimizer moments, running statistics; not gradients set to None, the loss, or a
tensor kept for logging) -- concatenated, one flat array per dtype (a ``Pack``), followed by its
other results as they are. Each packed Value's ``buf`` is the piece ``(pack, offset)``; its shape
is its desc's. A piece is not a separate buffer:

- **As an input**, the program takes the pack and slices its pieces out (static slices, which
  XLA fuses into their readers). ``input_layout`` gives each input's place: its pack's position
  among the program's packs and its offset, or ``LOOSE``. The layout is part of the key (Note
  [What a compiled step is keyed on]) and of a known step's launch.
- **One layout per loop.** Pieces are placed in the order the step recorded the nodes that
  compute them, and before a step whose state is not already where its results will be (the
  first step, with uploaded parameters; the step where optimizer state appears; a new model or
  a loaded checkpoint) ``lay_out_like_results`` gathers the state into a pack laid out like the
  results. That step's program then reads its state exactly as the next step reads its
  results, so packing adds no compile: the same programs as without it, the same count.
- **Donation** is per pack: a pack is donated when no live storage holds a piece of it that this
  step does not recompute (a frozen parameter packed with updated ones keeps the old pack alive;
  the packs hold small tensors only, so that costs little memory). Donating a pack deletes its
  array for every piece at once (``Pack.array = None``).
- **Reading** a piece (``Value.array``: ``.cpu()``, a transfer, ``call_jax``) slices it out of
  its pack on the device; the Value stays a piece, so reading a parameter does not change the
  next step's program. A read that runs part of a step (``.item()`` before ``mark_step``)
  returns its results loose.

Large results stay separate: a library call (cuDNN convolution, cuBLAS matmul) reads its operands
from their own buffers, and a slice of a large pack fed to one would be copied first.
``TORCHACC_PACK_MAX_NUMEL=0`` switches packing off.

Compile time: XLA compiles identical kernels (the same update of two same-shaped tensors) once.
A piece is read at its own offset, so kernels that touch pieces are all distinct: XLA:CPU spends
~8 ms on each (trivial programs: 640 slices of one array feeding 640 results compile in 5.4 s,
640 separate inputs in 0.7 s; an optimization barrier does not change it). Most such kernels were
the optimizer's, a few per parameter, so fused optimizers update the pieces of a pack as one flat
array (Note [Flat optimizer updates] in lowering/optim.py): the narrow ResNet-50 step's two
programs compile in 12.9 s and 13.3 s packed (13.4-14.5 s unpacked; 18.4 s and 24.1 s packed
before the flat update), 1,128 kernels instead of 1,588. GPU compile time with packs is not
measured yet. The other readers of pieces (a GPT's layer norms and bias
adds) read them at offset arguments (Note [Pieces read at offset arguments] in build.py), so
their kernels are shared between layers again.
"""

from __future__ import annotations

import math
import os

import jax
import numpy as np

from torchacc.ir import graph as ir_graph
from torchacc.sharding import mesh

LOOSE = -1  # an input or output that is not a piece of a pack
SHIFT = 40  # a piece's code: (pack position << SHIFT) | offset
MASK = (1 << SHIFT) - 1  # a piece's code & MASK: its offset
DEFAULT_MAX_NUMEL = 1 << 14  # 16K elements: 64 KiB in float32


class Pack:
    """One flat array of ``size`` elements of torch dtype ``dtype`` holding several Values (its
    ``array`` is None once donated); ``state``: a pack of state, read by the next step as a
    pack (else of results the step created, whose pieces a later program reads loose)."""

    __slots__ = ("array", "size", "dtype", "state", "host")

    def __init__(self, array, size, dtype, state=True):
        self.array = array
        self.size = size
        self.dtype = dtype
        self.state = state
        self.host = None  # a NumPy copy, made by the first host read of a piece


def max_numel():
    """Results of at most this many elements are packed (0: none; always 0 in SPMD mode, Note
    [SPMD mode] in sharding/mesh.py)."""
    if mesh.is_spmd():
        return 0
    text = os.environ.get("TORCHACC_PACK_MAX_NUMEL", "").strip()
    if not text:
        return DEFAULT_MAX_NUMEL
    try:
        return max(int(text), 0)
    except ValueError:
        raise ValueError(
            f"torchacc: TORCHACC_PACK_MAX_NUMEL must be a whole number of elements, got {text!r}"
        ) from None


def input_layout(inputs):
    """Per input its code (``LOOSE`` or its pack's position and offset), the distinct packs in
    order of first use and the loose inputs: the program's array arguments are the packs' arrays,
    then the loose inputs' arrays."""
    codes, packs, loose, where = [], [], [], {}
    for v in inputs:
        b = v.buf
        if type(b) is tuple and b[0].state:
            pack = b[0]
            k = where.get(id(pack))
            if k is None:
                k = where[id(pack)] = len(packs)
                packs.append(pack)
            codes.append(k << SHIFT | b[1])
        else:
            codes.append(LOOSE)
            loose.append(v)
    return tuple(codes), packs, loose


def output_plan(outputs, starts, limit):
    """Per output its code (``LOOSE`` or pack position and offset) and each pack's (size,
    dtype, state), packs in order of their first output.

    Results of at most ``limit`` elements are packed per dtype, *state* and the rest apart.
    State is a result whose storage overwrote a computed Value in the step (``starts[j]``, see
    ``Storage.start``): parameters, optimizer state, running statistics; the next step reads it
    from its pack. The rest is what the step created (gradients set to None every step, the
    loss, a tensor kept for logging every N steps): a later program that reads one of those
    gets it sliced out (loose), so the state packs -- and the next step's program -- do not
    change with what else a step returns.

    Pieces are placed in the order the step recorded the nodes computing them, not in the order
    of ``outputs`` (storage creation), so that a first step that creates the optimizer state and
    the steady steps place the parameters alike."""
    codes = [LOOSE] * len(outputs)
    if limit <= 0:
        return tuple(codes), ()
    small = [(v.node.seq, v.index, j) for j, v in enumerate(outputs) if _numel(v) <= limit]
    small.sort()
    sizes, where = [], {}
    for _, _, j in small:
        start = starts[j]
        group = (outputs[j].desc[2], start is not None and start.node is None)
        k = where.get(group)
        if k is None:
            k = where[group] = len(sizes)
            sizes.append([0, *group])
        codes[j] = k << SHIFT | sizes[k][0]
        sizes[k][0] += _numel(outputs[j])
    return tuple(codes), tuple(tuple(size) for size in sizes)


def _numel(v):
    return math.prod(v.desc[0])


def lay_out_like_results(outputs, starts, plan, held):
    """Put the step's state inputs where the step's packed results will be, before it runs.

    ``starts[j]`` is the Value the storage of ``outputs[j]`` held when the step began. Unless
    every packed result's earlier Value already sits at the result's place in one pack of the
    same size (the steady state), they are gathered into a new pack laid out like the results
    (one small gather program per layout) and become its pieces. The step's program then reads
    its state exactly as the next step will read this step's results, so both run one
    executable: a loop whose first step is its steady step (plain SGD, a resumed run, a loaded
    state dict) compiles once, as without packing. ``held`` gains the new packs that a live
    storage holds a piece of."""
    codes, sizes = plan
    members = [[] for _ in sizes]  # (only state packs get members: the rest have no start)
    for v, start, code in zip(outputs, starts, codes):
        if code < 0 or start is None or not sizes[code >> SHIFT][2]:
            continue  # loose, or a result the step created
        if _movable(start, v):
            members[code >> SHIFT].append((code & MASK, start))
    for (size, dtype, _), group in zip(sizes, members):
        if not group or _in_place(group, size):
            continue
        sources, where, layout = [], {}, []
        for offset, s in group:
            b = s.buf
            src, at = (b[0].array, b[1]) if type(b) is tuple else (b, LOOSE)
            i = where.get(id(src))
            if i is None:
                i = where[id(src)] = len(sources)
                sources.append(src)
            layout.append((offset, tuple(s.desc[0]), i, at))
        pack = Pack(_gather_jit(size, tuple(layout), *sources), size, dtype)
        for offset, s in group:
            s.buf = (pack, offset)
            if id(s) in held:
                held.add(id(pack))


def _movable(start, v):
    """Whether ``start`` (a storage's earlier Value) has data of ``v``'s shape and dtype."""
    if start.desc[0] != v.desc[0] or start.desc[2] != v.desc[2] or start.buf is None:
        return False
    return type(start.buf) is not tuple or start.buf[0].array is not None


def _in_place(group, size):
    """Whether every Value of ``group`` already is the piece at its offset of one pack of
    ``size`` elements."""
    first = group[0][1].buf
    if type(first) is not tuple or first[0].size != size or not first[0].state:
        return False
    pack = first[0]
    for offset, s in group:
        b = s.buf
        if type(b) is not tuple or b[0] is not pack or b[1] != offset:
            return False
    return True


def _gather(size, layout, *sources):
    """Inside a program: a pack of ``size`` elements with, per ``(offset, shape, source, at)``
    of ``layout``, source array ``source`` (or its piece at ``at``) at ``offset``; gaps (a
    result whose earlier Value had another shape) are zeros."""
    parts, end = [], 0
    dtype = sources[0].dtype
    for offset, shape, i, at in sorted(layout):
        src, n = sources[i], math.prod(shape)
        x = src.reshape(-1) if at == LOOSE else piece(src, at, (n,))
        if offset > end:
            parts.append(jax.numpy.zeros((offset - end,), dtype))
        parts.append(x.astype(dtype))
        end = offset + n
    if size > end:
        parts.append(jax.numpy.zeros((size - end,), dtype))
    return jax.numpy.concatenate(parts) if len(parts) > 1 else parts[0]


_gather_jit = jax.jit(_gather, static_argnums=(0, 1))


def bind(results, outputs, out_codes, out_packs, out_order):
    """Give each output Value its array or its piece of a pack (``results``: the packs first, as
    ``output_plan`` gave them in ``out_packs``, then the loose outputs in ``out_order``, Note
    [Donation pairs] in key.py)."""
    packs = [Pack(a, n, dtype, state) for a, (n, dtype, state) in zip(results, out_packs)]
    for j, r in zip(out_order, results[len(packs) :]):
        outputs[j].buf = r
    for v, code in zip(outputs, out_codes):
        if code >= 0:
            v.buf = (packs[code >> SHIFT], code & MASK)
        v.node = None


def buffer_of(value):
    """The device array holding ``value``'s data: its own or its pack's (None once donated)."""
    b = value.buf
    return b[0].array if type(b) is tuple else b


def piece(flat, offset, shape):
    """Inside a program: the piece of ``flat`` at ``offset`` with ``shape``."""
    n = math.prod(shape)
    return jax.lax.slice(flat, (offset,), (offset + n,)).reshape(shape)


def piece_at(flat, offset, shape):
    """Inside a program: the piece of ``flat`` at the runtime ``offset`` with ``shape`` (Note
    [Pieces read at offset arguments] in build.py)."""
    return jax.lax.dynamic_slice(flat, (offset,), (math.prod(shape),)).reshape(shape)


def concat(arrays):
    """Inside a program: one pack of ``arrays`` (all of one dtype), flattened in order."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    return jax.numpy.concatenate([a.reshape(-1) for a in arrays])


def _dynamic_piece(flat, offset, shape):
    n = math.prod(shape)
    return jax.lax.dynamic_slice(flat, (offset,), (n,)).reshape(shape)


# the offset is an argument, so reading every piece of a pack compiles once per shape
_unpack_jit = jax.jit(_dynamic_piece, static_argnums=(2,))


def _unpack(pack, offset, desc):
    array = pack.array
    if array is None:
        return None  # donated with its pack
    return _unpack_jit(array, np.int64(offset), tuple(desc[0]))


def host_piece(value):
    """``value``'s data as a NumPy array, from a host copy of its whole pack made at the first
    read (a pack's array never changes: a step's results are new packs). Reading a state dict
    then costs one transfer per pack, not one device slice and transfer per tensor."""
    pack, offset = value.buf
    host = pack.host
    if host is None:
        host = pack.host = np.asarray(pack.array)
    shape = value.desc[0]
    return host[offset : offset + math.prod(shape)].reshape(shape)


ir_graph.unpack[0] = _unpack
