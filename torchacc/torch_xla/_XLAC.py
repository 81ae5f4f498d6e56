"""``torch_xla._XLAC`` on torchacc: the C-extension calls that scripts and tests really make.

Implemented: syncing (``_xla_sync_multi``, ``_xla_sync_live_tensors``, ``_xla_step_marker``,
``_xla_wait_device_ops``), devices (``_xla_get_default_device``, ``_xla_get_all_devices``,
``_xla_real_devices``, ``_xla_device_kind``, ``_xla_memory_info``, ``_xla_tensors_from_aten``),
tensor ids and the pending graph as text or HLO (``_xla_get_tensor_id``,
``_get_xla_tensors_text``, ``_get_xla_tensors_hlo``), RNG seed, mat-mul precision, and the metric
and counter calls behind ``torch_xla.debug.metrics``. Any other name raises an error that is both
``NotImplementedError`` (with the reason) and ``AttributeError`` (so ``hasattr`` stays False).
"""

from __future__ import annotations

import itertools

import torch

import torchacc
from torchacc.torch_xla._api import differs, not_implemented_class


class XLACNotImplementedError(NotImplementedError, AttributeError):
    """A ``torch_xla._XLAC`` name torchacc does not provide."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    raise XLACNotImplementedError(
        f"torch_xla._XLAC.{name}: not implemented by torchacc (it has no torch_xla C++ lazy tensor "
        "core); the implemented _XLAC calls are listed in torchacc/torch_xla/_XLAC.py"
    )


# --- steps and devices ------------------------------------------------------------------------


@differs("syncs everything pending (one program), which includes the tensors")
def _xla_sync_multi(tensors, devices=(), wait=True, sync_xla_data=True):
    """Compute ``tensors``: torchacc syncs everything pending (one program), which includes them."""
    torchacc.sync(wait=wait)


def _xla_sync_live_tensors(device="", devices=(), wait=True):
    torchacc.sync(wait=wait)


def _xla_step_marker(device="", devices=(), wait=True):
    from torchacc.torch_xla.core import xla_model as xm

    xm.mark_step(wait=wait)


def _xla_wait_device_ops(devices=()):
    torchacc.wait_device_ops()


def _xla_get_default_device():
    return str(torchacc.device())


def _xla_get_all_devices():
    from torchacc.torch_xla.core import xla_model as xm

    return xm.xla_real_devices()


def _xla_real_devices(devices=None):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.xla_real_devices(devices)


def _xla_device_kind(device=""):
    return torchacc.jax_device().device_kind


def _xla_memory_info(device=""):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.get_memory_info(device)


def _xla_runtime_is_initialized():
    from jax._src import xla_bridge

    return bool(xla_bridge._backends)


def _xla_tensors_from_aten(tensors, devices=None, shardings=None):
    dev = torchacc.device()
    return [t.to(dev) for t in tensors]


# --- tensors and the pending graph ------------------------------------------------------------

_ids = itertools.count(1)
_ID_ATTR = "_torchacc_xla_tensor_id"


def _xla_get_tensor_id(tensor):
    """A unique id for ``tensor`` (stable for its lifetime)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "torchacc":
        raise RuntimeError(f"_xla_get_tensor_id: expected a torchacc tensor, got {tensor!r}")
    tid = getattr(tensor, _ID_ATTR, None)
    if tid is None:
        tid = next(_ids)
        setattr(tensor, _ID_ATTR, tid)
    return tid


def _values(tensors):
    from torchacc.lazy.record import value_of

    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.device.type != "torchacc":
            raise RuntimeError(f"expected torchacc tensors, got {type(t).__name__} on {t.device}")
    return [value_of(t) for t in tensors]


def _get_xla_tensors_text(tensors):
    """The pending graph computing ``tensors``, one recorded op per line."""
    from torchacc import program as compiler

    values = _values(tensors)
    pending = [v for v in values if v.node is not None]
    lines = ["IR {"]
    names = {}
    if pending:
        graph = compiler.Graph(pending)
        for i, v in enumerate(graph.inputs):
            names[id(v)] = f"%{i}"
            lines.append(f"  %{i} = data {_desc_text(v.desc)}")
        n = len(graph.inputs)
        for node in graph.order:
            args = ", ".join(
                names[id(v)] if v.node is None else f"{names[id(v.node)]}.{v.index}"
                for v in node.inputs
            )
            names[id(node)] = f"%{n}"
            outs = ", ".join(_desc_text(d) for d in node.op.descs if d is not None)
            lines.append(f"  %{n} = {node.op.rule.name}({args}) -> ({outs})")
            n += 1
    for i, v in enumerate(values):
        where = "data" if v.node is None else f"{names[id(v.node)]}.{v.index}"
        lines.append(f"  ROOT {i} = {where}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _desc_text(desc):
    shape, dtype = desc[0], desc[2]
    return f"{str(dtype).replace('torch.', '')}[{','.join(map(str, shape))}]"


def _get_xla_tensors_hlo(tensors):
    """The program (StableHLO text) torchacc would compile for the pending ``tensors``."""
    import jax
    import numpy as np

    from torchacc import program as compiler
    from torchacc.program.build import program_of

    pending = [v for v in _values(tensors) if v.node is not None]
    if not pending:
        return ""
    graph = compiler.Graph(pending)
    args = [np.asarray(graph.floats, dtype=np.float64), np.asarray(graph.ints, dtype=np.int64)]
    args += graph.args()
    return jax.jit(program_of(graph)).lower(*args).as_text()


# --- RNG and precision -------------------------------------------------------------------------


def _xla_get_rng_seed(device=""):
    from torchacc.torch_xla.core import xla_model as xm

    return xm.get_rng_state()


def _xla_set_rng_seed(seed, device=""):
    from torchacc.torch_xla.core import xla_model as xm

    xm.set_rng_state(seed)


def _xla_set_mat_mul_precision(precision):
    from torchacc.torch_xla import backends

    backends.set_mat_mul_precision(precision)


def _xla_get_mat_mul_precision():
    from torchacc.torch_xla import backends

    return backends.get_mat_mul_precision()


def _xla_set_use_full_mat_mul_precision(use_full_mat_mul_precision=True):
    _xla_set_mat_mul_precision("highest" if use_full_mat_mul_precision else "default")


# --- metrics ---------------------------------------------------------------------------------


def _met():
    from torchacc.torch_xla.debug import metrics

    return metrics


def _xla_counter_names():
    return _met().counter_names()


def _xla_counter_value(name):
    return _met().counter_value(name)


def _xla_metric_names():
    return _met().metric_names()


def _xla_metric_data(name):
    return _met().metric_data(name)


def _xla_metrics_report():
    return _met().metrics_report()


def _short_xla_metrics_report(counter_names, metric_names):
    return _met().short_metrics_report(counter_names, metric_names)


def _clear_xla_counters():
    _met().clear_counters()


def _clear_xla_metrics():
    _met().clear_metrics()


def _get_executed_fallback_ops():
    return _met().executed_fallback_ops()


_NO_SPMD = "XLA sharding objects: torchacc has no SPMD partitioner (one device per process)"
OpSharding = not_implemented_class("torch_xla._XLAC.OpSharding", _NO_SPMD)
XlaShardingSpec = not_implemented_class("torch_xla._XLAC.XlaShardingSpec", _NO_SPMD)


# --- SPMD ----------------------------------------------------------------------------------------


def _get_xla_sharding_spec(tensor):
    """``tensor``'s sharding in torch_xla's text form (``{devices=[2,1,2]0,2,1,3
    last_tile_dim_replicate}``, ``{replicated}``); ``""`` when it has none."""
    from torchacc.distributed import sharding

    t = getattr(tensor, "global_tensor", tensor)
    if not sharding.is_spmd():
        return ""
    return sharding.hlo_text(sharding.sharding_of(t), t.dim())


def _get_xla_sharding_type(tensor):
    """torch_xla's ShardingType number of ``tensor``'s sharding, None when replicated/none."""
    spec = _get_xla_sharding_spec(tensor)
    if spec in ("", "{replicated}"):
        return None
    return 5 if "last_tile_dim_replicate" in spec else 3
