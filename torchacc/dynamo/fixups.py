"""Eager semantics a lowered graph's outputs need after the program: torch's strides, fresh memory.

XLA's results are row-major and distinct per output; an FX graph may return an output with other
(meta) strides, or the same node twice. ``output_fixups`` says, per output position, what restores
the graph's semantics (lower.py applies it to CPU/CUDA results; torchacc-device results need none).
"""

from __future__ import annotations

import torch
from torch import fx

from torchacc.lowering.fx_calling import _val


def output_fixups(outs, placeholders):
    """Per output position, a function restoring eager semantics the program cannot express:
    the meta strides (XLA results are row-major) and distinct memory for a repeated output."""
    fixes = []
    seen = set()
    for i, o in enumerate(outs):
        if not isinstance(o, fx.Node) or o in placeholders:
            continue
        v = _val(o)
        if o in seen:
            fixes.append((i, _clone))
            continue
        seen.add(o)
        if isinstance(v, torch.Tensor) and v.dim() > 1 and _needs_strides(v):
            fixes.append((i, _restride(tuple(v.stride()))))
    return fixes


def _needs_strides(v):
    try:
        shape = [int(s) for s in v.shape]
        stride = [int(s) for s in v.stride()]
    except (TypeError, ValueError):
        return False
    expected, acc = [], 1
    for s in reversed(shape):
        expected.append(acc)
        acc *= max(s, 1)
    expected.reverse()
    return any(a != b for a, b, n in zip(stride, expected, shape) if n > 1)


def _clone(t):
    return t.clone() if isinstance(t, torch.Tensor) else t


def _restride(stride):
    def fix(t):
        if not isinstance(t, torch.Tensor):
            return t
        out = torch.empty_strided(t.shape, stride, dtype=t.dtype, device=t.device)
        return out.copy_(t)

    return fix
