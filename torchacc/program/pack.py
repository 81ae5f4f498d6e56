"""Packed state: a step's small results come back as one array per dtype.

Note [Packed state]
Calling an executable costs JAX a few microseconds per result (an array object, a runtime
buffer, its events), and a training step returns every parameter, gradient, optimizer moment
and batch-norm statistic it updated: ~800 results for ResNet-50 with AdamW, most of them small
(biases, norm scales, running statistics, step counters). That per-result cost was most of a
known step's ``mark_step`` (measured on the CPU box: 1 input / 805 outputs 1.1-2.5 ms per call,
645 inputs / 1 output 0.28 ms).

So a program returns its results of at most ``max_numel()`` elements concatenated, one flat
array per dtype (a ``Pack``), followed by its larger results as they are. Each packed Value's
``buf`` is the piece ``(pack, offset)``; its shape is its desc's. A piece is not a separate
buffer:

- **As an input**, the program takes the pack and slices its pieces out (static slices, which
  XLA fuses into their readers). ``input_layout`` gives each input's place: its pack's position
  among the program's packs and its offset, or ``LOOSE``. The layout is part of the key (Note
  [What a compiled step is keyed on]): the step after a step that returned the same packs reads
  them the same way, so one executable serves every later step.
- **Donation** is per pack: a pack is donated when no live storage holds a piece of it that this
  step does not recompute (a frozen parameter packed with updated ones keeps the old pack alive;
  the packs hold small tensors only, so that costs little memory). Donating a pack deletes its
  array for every piece at once (``Pack.array = None``).
- **Reading** a piece (``Value.array``: ``.cpu()``, a transfer, ``call_jax``) slices it out of
  its pack on the device; the Value stays a piece, so reading a parameter does not change the
  next step's program.

Large results stay separate: a library call (cuDNN convolution, cuBLAS matmul) reads its operands
from their own buffers, and a slice of a large pack fed to one would be copied first.
``TORCHACC_PACK_MAX_NUMEL=0`` switches packing off.
"""

from __future__ import annotations

import math
import os

import jax

from torchacc.ir import graph as ir_graph

LOOSE = -1  # an input or output that is not a piece of a pack
SHIFT = 40  # a piece's code: (pack position << SHIFT) | offset
_MASK = (1 << SHIFT) - 1
DEFAULT_MAX_NUMEL = 1 << 14  # 16K elements: 64 KiB in float32


class Pack:
    """One flat array of ``size`` elements of torch dtype ``dtype`` holding several Values (its
    ``array`` is None once donated)."""

    __slots__ = ("array", "size", "dtype")

    def __init__(self, array, size, dtype):
        self.array = array
        self.size = size
        self.dtype = dtype


def max_numel():
    """Results of at most this many elements are packed (0: none)."""
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
        if type(b) is tuple:
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


def output_plan(outputs, limit):
    """Per output its code (``LOOSE`` or pack position and offset) and each pack's (size,
    dtype), packs in order of their dtype's first output.

    Pieces are placed in the order the step recorded the nodes computing them, not in the order
    of ``outputs`` (storage creation): a training loop's gradients are new storages every step,
    created after the optimizer state, but computed before it in every step. So the first step
    (which creates the optimizer state) and the steady steps pack alike, and the steady step's
    inputs are laid out as its outputs: no extra compile for a new layout."""
    codes = [LOOSE] * len(outputs)
    if limit <= 0:
        return tuple(codes), ()
    small = [(v.node.seq, v.index, j) for j, v in enumerate(outputs) if _numel(v) <= limit]
    small.sort()  # in recording order (see the note above ``output_plan``'s caller)
    sizes, where = [], {}
    for _, _, j in small:
        dtype = outputs[j].desc[2]
        k = where.get(dtype)
        if k is None:
            k = where[dtype] = len(sizes)
            sizes.append([0, dtype])
        codes[j] = k << SHIFT | sizes[k][0]
        sizes[k][0] += _numel(outputs[j])
    return tuple(codes), tuple((n, dtype) for n, dtype in sizes)


def _numel(v):
    return math.prod(v.desc[0])


def bind(results, outputs, out_codes, out_packs):
    """Give each output Value its array or its piece of a pack (``results``: the packs first, as
    ``output_plan`` gave them in ``out_packs``, then the loose outputs)."""
    packs = [Pack(a, n, dtype) for a, (n, dtype) in zip(results, out_packs)]
    j = len(packs)
    for v, code in zip(outputs, out_codes):
        if code < 0:
            v.buf = results[j]
            j += 1
        else:
            v.buf = (packs[code >> SHIFT], code & _MASK)
        v.node = None


def buffer_of(value):
    """The device array holding ``value``'s data: its own or its pack's (None once donated)."""
    b = value.buf
    return b[0].array if type(b) is tuple else b


def piece(flat, offset, shape):
    """Inside a program: the piece of ``flat`` at ``offset`` with ``shape``."""
    n = math.prod(shape)
    return jax.lax.slice(flat, (offset,), (offset + n,)).reshape(shape)


def concat(arrays):
    """Inside a program: one pack of ``arrays`` (all of one dtype), flattened in order."""
    if len(arrays) == 1:
        return arrays[0].reshape(-1)
    return jax.numpy.concatenate([a.reshape(-1) for a in arrays])


_unpack_jit = jax.jit(piece, static_argnums=(1, 2))


def _unpack(pack, offset, desc):
    array = pack.array
    if array is None:
        return None  # donated with its pack
    return _unpack_jit(array, offset, tuple(desc[0]))


ir_graph.unpack[0] = _unpack
