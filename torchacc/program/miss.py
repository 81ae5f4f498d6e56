"""Why a graph missed the compiled-program cache: the nearest cached key and its first difference.

The answer is structured (``Miss``) so the engine can put it in the user's words (input names,
the user's lines: ``torchacc/engine/explain.py``); ``describe_op``/``describe_args`` render an op
and its arguments with ATen names. Keys are described in Note [What a compiled step is keyed on].
"""

from __future__ import annotations

import torch

from torchacc.lowering.custom_ops import ATEN_NAMES


class Miss:
    """``what`` is one of ``first``, ``new`` (the nearest cached graph starts with another op),
    ``inputs`` (count), ``input`` (shape/dtype of input
    ``index``), ``op`` (another op at ``index``), ``args`` (the same op with other arguments),
    ``ops`` (count), ``outputs``, ``layout`` (which inputs arrive packed, ``index`` the first
    input that moved), ``precision``, ``donation``; ``new``/``old`` are the differing parts of
    this key and of ``nearest``."""

    __slots__ = ("what", "index", "new", "old", "nearest")

    def __init__(self, what, index=None, new=None, old=None, nearest=None):
        self.what = what
        self.index = index
        self.new = new
        self.old = old
        self.nearest = nearest


def _nearest(key, cached):
    """The cached key sharing the most: ops with the same signature count 2, the same op with
    other arguments 1, the same input shapes 1; of equals, the newest (what just ran)."""
    in_avals, parts = key[0], key[1]
    funcs = [_func(op.key) for op in parts[::2]]
    best, best_score = None, -1
    for other in cached:
        score = 0
        for a, b, f in zip(parts[::2], other[1][::2], funcs):
            if a is b:
                score += 2
            elif f == _func(b.key):
                score += 1
        if other[0] == in_avals:
            score += 1
        if score >= best_score:
            best, best_score = other, score
    return best


def find_miss(key, cached):
    """The first difference between ``key`` and the nearest of the ``cached`` keys."""
    if not cached:
        return Miss("first")
    best = _nearest(key, cached)
    in_avals, parts, out_slots = key[:3]
    o_avals, o_parts = best[0], best[1]
    if parts and o_parts and _func(parts[0].key) != _func(o_parts[0].key):
        return Miss("new", 0, parts[0].key, len(cached), best)
    if len(o_avals) != len(in_avals):
        return Miss("inputs", None, len(in_avals), len(o_avals), best)
    for i, (a, b) in enumerate(zip(in_avals, o_avals)):
        if a != b:
            return Miss("input", i, a, b, best)
    for i, (a, b) in enumerate(zip(parts[::2], o_parts[::2])):
        if a is not b and a.key != b.key:
            if _func(a.key) != _func(b.key):
                return Miss("op", i, a.key, b.key, best)
            return Miss("args", i, a.key, b.key, best)
    if len(parts) != len(o_parts):
        return Miss("ops", None, len(parts) // 2, len(o_parts) // 2, best)
    if out_slots != best[2]:
        return Miss("outputs", None, len(out_slots), len(best[2]), best)
    if key[4] != best[4]:
        return Miss("layout", None, _first_layout_change(key[4], best[4]), None, best)
    if key[5:] != best[5:]:
        return Miss("precision", None, key[5:], best[5:], best)
    return Miss("donation", None, key[3], best[3], best)


def _first_layout_change(layout, other):
    """The first input whose place (loose or in a pack) differs, else None (the packs' sizes or
    the packed outputs differ)."""
    for i, (a, b) in enumerate(zip(layout[0], other[0])):
        if a != b:
            return i
    return None


def _func(op_key):
    """The op of an OpEntry key (a batched ``_foreach_*`` node's key starts with a marker)."""
    if isinstance(op_key[0], torch._ops.OpOverload):
        return op_key[0]
    return op_key[1]


def describe_op(op_key):
    """``aten::addmm``; a fused torchacc op with its ATen meaning; ``aten::add (x148, foreach)``."""
    func = _func(op_key)
    name = func.name() if hasattr(func, "name") else str(func)
    aten = ATEN_NAMES.get(name)
    if aten is not None:
        name = f"{aten} (recorded as torchacc's fused {name})"
    if func is not op_key[0]:
        name = f"{name} (x{op_key[2]}, one batched _foreach_ node)"
    return name


_DTYPES = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "bool",
    torch.uint8: "u8",
    torch.uint32: "u32",
}


def describe_aval(shape, dtype):
    """``f32[5, 16]``."""
    name = _DTYPES.get(dtype, str(dtype).replace("torch.", ""))
    return f"{name}[{', '.join(str(s) for s in shape)}]"


def _is_desc(part):
    return (
        type(part) is tuple
        and len(part) == 4
        and isinstance(part[2], torch.dtype)
        and type(part[0]) is tuple
    )


def describe_args(op_key):
    """The signature parts of an op key after the op, readable: tensors as ``f32[5, 16]``."""
    parts = op_key[1:] if _func(op_key) is op_key[0] else op_key[3:]
    out = []
    for p in parts:
        if _is_desc(p):
            out.append(describe_aval(p[0], p[2]))
        elif isinstance(p, type):
            out.append(f"<{p.__name__} scalar>")
        elif isinstance(p, (str, int, float, bool, tuple, torch.dtype)) or p is None:
            out.append(repr(p))
    return out


def first_arg_difference(new_key, old_key):
    """``(position, new text, old text)`` of the first differing argument part, or None."""
    a, b = describe_args(new_key), describe_args(old_key)
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i, x, y
    if len(a) != len(b):
        return min(len(a), len(b)), f"{len(a)} parts", f"{len(b)} parts"
    # same rendering: strides or storage offsets differ
    for x, y in zip(new_key, old_key):
        if _is_desc(x) and _is_desc(y) and x != y:
            return None, f"strides {x[1]} offset {x[3]}", f"strides {y[1]} offset {y[3]}"
    return None
