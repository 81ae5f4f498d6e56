"""The last resort: an op with no lowering and no decomposition runs eagerly on CPU, counted as
``aten::<op>`` and warned about once (``TORCHACC_STRICT=1`` makes it an error)."""

from __future__ import annotations

import os

import torch

from torchacc import metrics
from torchacc.engine import sites
from torchacc.engine.transfer import upload
from torchacc.lazy.mutation import assign
from torchacc.lazy.record import mutated_positions
from torchacc.lazy.tensor import LazyTensor
from torchacc.lazy.transfer import to_cpu, to_device

_warned: set = set()


def fallback_handler(func, args, kwargs):
    name = f"aten::{func.overloadpacket.__name__}"
    if os.environ.get("TORCHACC_STRICT", "0") not in ("", "0"):
        raise RuntimeError(
            f"torchacc: {func} has no lowering and no decomposition "
            "(TORCHACC_STRICT=1 forbids running it eagerly on CPU)"
        )
    metrics.counter_inc(name)
    if name not in _warned:
        _warned.add(name)
        sites.warn_at(  # at the user's line, not torchacc's (Note [Trigger sites])
            sites.user_site(sites.caller(1)),
            f"torchacc: {func} has no lowering; it runs eagerly on CPU (counter {name!r}). "
            "Each call syncs its inputs to the host.",
        )
    cpu_args = _map_tensors(args, to_cpu)
    cpu_kwargs = _map_tensors(kwargs, to_cpu)
    if "device" in cpu_kwargs:
        cpu_kwargs["device"] = "cpu"
    out = func(*cpu_args, **cpu_kwargs)
    for i in mutated_positions(func):
        target = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
        source = cpu_args[i] if i < len(args) else cpu_kwargs.get(func._schema.arguments[i].name)
        if type(target) is LazyTensor:
            assign(target, upload(source))
        elif isinstance(target, list):
            for t, s in zip(target, source):
                assign(t, upload(s))
    if mutated_positions(func) and out is not None and isinstance(out, torch.Tensor):
        return args[0]
    return _map_tensors(out, to_device)


def _map_tensors(x, fn):
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        return type(x)(_map_tensors(v, fn) for v in x)
    if isinstance(x, dict):
        return {k: _map_tensors(v, fn) for k, v in x.items()}
    return x
