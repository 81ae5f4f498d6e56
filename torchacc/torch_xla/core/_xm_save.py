"""``xla_model``: host data: save, mesh_reduce, moving CPU data to the device, RateTracker,
and small helpers."""

from __future__ import annotations

import time

import torch

import torchacc
from torchacc import metrics  # noqa: F401
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.torch_xla.core._xm_collectives import rendezvous
from torchacc.torch_xla.core._xm_devices import (
    is_master_ordinal,
    xla_real_devices,
    xrt_world_size,
)


def _maybe_convert_to_cpu(data, convert=True):
    """``data`` with every torchacc tensor replaced by a CPU copy (one sync for all of them)."""
    found = []

    def collect(x):
        if isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE:
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                collect(v)

    def rewrite(x):
        if isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE:
            return x.detach().cpu()
        if isinstance(x, dict):
            return type(x)((k, rewrite(v)) for k, v in x.items())
        if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
            return type(x)(*(rewrite(v) for v in x))
        if isinstance(x, (list, tuple, set)):
            return type(x)(rewrite(v) for v in x)
        return x

    if not convert:
        return data
    collect(data)
    if found:
        torchacc.sync()
    return rewrite(data)


def mesh_reduce(tag, data, reduce_fn):
    """``reduce_fn`` over every replica's ``data`` (moved to the CPU), like torch_xla."""
    import io

    cpu_data = _maybe_convert_to_cpu(data)
    if xrt_world_size() == 1:
        return reduce_fn([cpu_data])
    bio = io.BytesIO()
    torch.save(cpu_data, bio)
    xdata = rendezvous(tag, bio.getvalue())
    xldata = [torch.load(io.BytesIO(x), weights_only=False) for x in xdata]
    return reduce_fn(xldata) if xldata else cpu_data


def save(data, file_or_path, master_only=True, global_master=False):
    """``torch.save`` of ``data`` with device tensors moved to the CPU, by the master only."""
    should_write = not master_only or is_master_ordinal(local=not global_master)
    cpu_data = _maybe_convert_to_cpu(data, convert=should_write)
    if should_write:
        torch.save(cpu_data, file_or_path)
    if xrt_world_size() > 1:
        rendezvous("torch_xla.core.xla_model.save")


def _rewrite(data, select, convert, memo=None):
    """``data`` with every ``select``-ed tensor replaced by ``convert(t)``: dicts, lists, tuples
    (namedtuples too), sets and plain objects' ``__dict__`` are rebuilt; the input is unchanged."""
    import copy

    memo = {} if memo is None else memo
    if id(data) in memo:
        return memo[id(data)]
    if isinstance(data, torch.Tensor):
        out = convert(data) if select(data) else data
    elif isinstance(data, dict):
        out = copy.copy(data)
        for k, v in data.items():
            out[k] = _rewrite(v, select, convert, memo)
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        out = type(data)(*(_rewrite(v, select, convert, memo) for v in data))
    elif isinstance(data, (list, tuple, set)):
        out = type(data)(_rewrite(v, select, convert, memo) for v in data)
    elif hasattr(data, "__dict__") and not isinstance(data, type) and not callable(data):
        out = copy.copy(data)
        for k, v in vars(data).items():
            setattr(out, k, _rewrite(v, select, convert, memo))
    else:
        out = data
    memo[id(data)] = out
    return out


def send_cpu_data_to_device(datas, device, input_sharding=None):
    """``datas`` with every CPU tensor copied to ``device`` (nested containers rebuilt)."""
    if input_sharding is not None:
        input_sharding.xla_spec  # noqa: B018  (attribute check: a ShardingSpec)
    device = torch.device(device)
    if device.type not in (DEVICE_TYPE, "xla"):
        raise ValueError(f"send_cpu_data_to_device: {device} is not a torchacc device")
    dev = torchacc.device()

    def select(t):
        if type(t) is not torch.Tensor or t.device.type != "cpu":
            return False
        if input_sharding is not None and input_sharding.can_apply(t):
            input_sharding.xla_spec(t)  # checks the spec against the shape before any upload
        return True

    def send(t):
        out = t.to(dev)  # in SPMD mode still on the host (Note [Deferred uploads])
        if input_sharding is not None and input_sharding.can_apply(t):
            input_sharding.apply(out)  # one upload, each device its shard
        return out

    return _rewrite(datas, select, send)


class RateTracker:
    """Smoothed rate of ``add``-ed counts per second (torch_xla's samples/s tracker)."""

    def __init__(self, smooth_factor=None):
        from torchacc.torch_xla.utils.utils import getenv_as

        if smooth_factor is None:
            smooth_factor = getenv_as("RATE_TRACKER_SMOOTHING", float, 0.4)
        self._smooth_factor = smooth_factor
        self._start_time = time.time()
        self._partial_time = self._start_time
        self._partial_count = 0.0
        self._partial_rate = None
        self._count = 0.0

    def add(self, count):
        self._count += count

    def rate(self):
        """Count since the last call over the time since then, smoothed with the last rate."""
        now = time.time()
        delta = now - self._partial_time
        if delta <= 0:
            return 0.0
        current = self._count / delta
        if self._partial_rate is not None:
            current = (1 - self._smooth_factor) * current + self._smooth_factor * self._partial_rate
        self._partial_count += self._count
        self._count = 0.0
        self._partial_time = now
        self._partial_rate = current
        return current

    def global_rate(self):
        delta = time.time() - self._start_time
        return (self._partial_count + self._count) / delta if delta > 0 else 0.0


def xla_device_kind(device=None):
    """The JAX device kind (e.g. ``'cpu'``, ``'NVIDIA H100 80GB HBM3'``)."""
    return torchacc.jax_device().device_kind


def xla_replication_devices(local_devices=None):
    return xla_real_devices(local_devices)


def optimization_barrier_(tensors):
    """The tensors keep their values, now as the outputs of one XLA optimization barrier
    (``jax.lax.optimization_barrier``; torchacc/lazy/checkpoint.py)."""
    from torchacc.lazy.checkpoint import optimization_barrier_ as barrier

    barrier(tensors)


def check_view_sharing(obj):
    """torch_xla refuses to save views sharing storage; torchacc moves tensors to the CPU one by
    one, so there is nothing to check."""
    return None
