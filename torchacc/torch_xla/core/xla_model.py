"""``torch_xla.core.xla_model`` (``xm``) on torchacc.

Devices: each process drives one torchacc device (``xla_device()`` = ``torchacc.device()``).
Ranks: :func:`world_info` reads ``torchacc.distributed`` when that package is present, else the
launcher's environment (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``, as torchrun
sets them), else a single process. Collectives: with world size 1 they are identities (times
``scale``), exactly what torch_xla computes on one replica; with more processes they go to
``torchacc.distributed.collectives.<name>`` (same arguments as here), or raise
``NotImplementedError`` naming the op when that module is not available.
"""

from __future__ import annotations

import importlib
import os
import sys

import torch

import torchacc
from torchacc import metrics  # noqa: F401  (xm users reach metrics through torch_xla.debug)
from torchacc.engine import execute as _execute

REDUCE_SUM = "sum"
REDUCE_MUL = "mul"
REDUCE_AND = "and"
REDUCE_OR = "or"
REDUCE_MIN = "min"
REDUCE_MAX = "max"
_REDUCE_TYPES = (REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX)


# --------------------------------------------------------------------------------------------
# ranks


_modules: dict = {}


def _distributed_module(name="torchacc.distributed"):
    """The module ``name``, or None when it does not exist (looked up once)."""
    if name in _modules:
        return _modules[name]
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or not name.startswith(exc.name):
            raise
        mod = None
    _modules[name] = mod
    return mod


def _ask_distributed(*names):
    mod = _distributed_module()
    if mod is None:
        return None
    for name in names:
        fn = getattr(mod, name, None)
        if callable(fn):
            value = fn()
            if value is not None:
                return int(value)
    return None


def _env_int(*names, default):
    for name in names:
        value = os.environ.get(name)
        if value not in (None, ""):
            return int(value)
    return default


def world_info():
    """``(rank, world_size, local_rank, local_world_size)`` of this process.

    From ``torchacc.distributed`` (``get_rank``/``get_world_size``/``get_local_rank``/
    ``get_local_world_size``, or ``rank``/``world_size``/...) when present, else the environment a
    launcher sets (torchrun's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``LOCAL_WORLD_SIZE``), else 1
    process. ``torch.distributed.get_rank`` is deliberately not consulted: TorchAcc recipes rebind
    it to :func:`get_ordinal`.
    """
    world = _ask_distributed("get_world_size", "world_size")
    if world is None:
        world = _env_int("WORLD_SIZE", default=1)
    rank = _ask_distributed("get_rank", "rank", "global_rank")
    if rank is None:
        rank = _env_int("RANK", default=0)
    local_rank = _ask_distributed("get_local_rank", "local_rank")
    if local_rank is None:
        local_rank = _env_int("LOCAL_RANK", default=rank if world == 1 else 0)
    local_world = _ask_distributed("get_local_world_size", "local_world_size")
    if local_world is None:
        local_world = _env_int("LOCAL_WORLD_SIZE", default=world)
    return rank, world, local_rank, local_world


def get_ordinal(defval=0):
    """Global rank of this process."""
    return world_info()[0]


def get_local_ordinal(defval=0):
    """Rank of this process on its node."""
    return world_info()[2]


def xrt_world_size(defval=1):
    """Number of processes (one device each) in the job."""
    return world_info()[1]


world_size = xrt_world_size


def is_master_ordinal(local=True):
    """Whether this is rank 0 (of the node when ``local``, of the job otherwise)."""
    return (get_local_ordinal() if local else get_ordinal()) == 0


def master_print(*args, fd=sys.stdout, local=False, flush=False):
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


# --------------------------------------------------------------------------------------------
# devices


def xla_device(n=None, devkind=None):
    """The torchacc device of this process (``n`` may only be ``None``/0: one device each)."""
    if devkind not in (None, "GPU", "CUDA", "CPU", "TPU"):
        raise ValueError(f"xla_device: unknown devkind {devkind!r}")
    return torchacc.device(0 if n is None else n)


def get_xla_supported_devices(devkind=None, max_devices=None):
    return [str(torchacc.device())]


def xla_device_hw(device):
    """``'GPU'`` or ``'CPU'``: the hardware behind a torchacc device."""
    kind = device if isinstance(device, str) else torch.device(device).type
    if kind.split(":")[0] not in ("torchacc", "xla"):
        raise RuntimeError(f"xla_device_hw: {device} is not a torchacc device")
    return torchacc.device_hw()


def xla_real_devices(devices=None):
    hw = "CUDA" if torchacc.device_hw() == "GPU" else "CPU"
    return [f"{hw}:{get_local_ordinal()}" for _ in (devices or [None])]


def is_xla_tensor(tensor):
    return isinstance(tensor, torch.Tensor) and tensor.device.type == "torchacc"


_replication = []


def set_replication(device, devices):
    """Declare the devices this process replicates over (the seed calls it with ``[device]``).

    One device per process: ``devices`` may hold only this process's device. In a multi-process
    job ``torchacc.distributed.set_replication`` is called when it exists.
    """
    device = torch.device(device)
    if device.type not in ("torchacc", "xla"):
        raise ValueError(f"set_replication: {device} is not a torchacc device")
    devices = [torch.device(d) for d in devices or []]
    if len(devices) > 1:
        raise ValueError(
            "set_replication: torchacc drives one device per process; run one process per device "
            "(torchrun --nproc_per_node) instead of replicating over several devices in one process"
        )
    _replication[:] = devices
    mod = _distributed_module()
    fn = getattr(mod, "set_replication", None) if mod is not None else None
    if fn is not None and xrt_world_size() > 1:
        fn(device, devices)


def get_replication_devices():
    return list(_replication)


# --------------------------------------------------------------------------------------------
# steps


_step_closures: list = []


def add_step_closure(closure, args=(), run_async=False):
    """Run ``closure(*args)`` right after the next :func:`mark_step` has launched the step.

    Device tensors in ``args`` then hold this step's values (reading them, e.g. ``loss.item()``,
    is a host transfer of an already computed buffer). ``run_async`` closures run in order too.
    """
    _step_closures.append((closure, args))


@_execute.after_sync
def _run_step_closures():
    closures = list(_step_closures)
    _step_closures.clear()
    for closure, args in closures:
        closure(*args)


def mark_step(wait=False, reset_scope=True):
    """Compile (on a cache miss) and launch the recorded step: ``torchacc.sync``."""
    torchacc.sync(wait=wait)  # step closures run from the after-sync hook


def wait_device_ops(devices=None):
    """Block until everything launched on the device has finished."""
    torchacc.wait_device_ops()


def unlazy(tensors=None):
    mark_step(wait=True)


def set_rng_state(seed, device=None):
    torch.manual_seed(seed)


def get_memory_info(device=None):
    """Device memory as torch_xla reports it: ``bytes_used``/``bytes_limit``/``peak_bytes_used``
    (and the older ``kb_free``/``kb_total``). On the CPU platform: host RAM."""
    stats = None
    try:
        stats = torchacc.jax_device().memory_stats()
    except Exception:  # some PJRT clients do not implement memory stats
        stats = None
    if stats:
        used = int(stats.get("bytes_in_use", 0))
        limit = int(stats.get("bytes_limit", 0))
        peak = int(stats.get("peak_bytes_in_use", used))
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        limit = page * os.sysconf("SC_PHYS_PAGES")
        used = limit - page * os.sysconf("SC_AVPHYS_PAGES")
        peak = used
    return {
        "bytes_used": used,
        "bytes_limit": limit,
        "peak_bytes_used": peak,
        "kb_free": max(limit - used, 0) // 1024,
        "kb_total": limit // 1024,
    }


# --------------------------------------------------------------------------------------------
# collectives


def _collective(name):
    """``torchacc.distributed.collectives.<name>`` or a clear error."""
    mod = _distributed_module("torchacc.distributed.collectives")
    fn = getattr(mod, name, None) if mod is not None else None
    if fn is None:
        raise NotImplementedError(
            f"xm.{name} with world size {xrt_world_size()}: multi-process collectives need "
            f"torchacc.distributed.collectives.{name}, which is not available"
        )
    return fn


def _check_reduce_type(reduce_type):
    if reduce_type not in _REDUCE_TYPES:
        raise ValueError(f"invalid reduce type {reduce_type!r}: expected one of {_REDUCE_TYPES}")


def _single_replica_groups(groups):
    if groups and any(len(g) > 1 for g in groups):
        raise ValueError(f"replica groups {groups} name more replicas than the single process")


def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    """Reduce ``inputs`` over all replicas, then multiply by ``scale``.

    A tensor gives a new tensor; a list of tensors is reduced in place (and returned), as in
    torch_xla. Recorded into the step's graph; no host transfer.
    """
    _check_reduce_type(reduce_type)
    if xrt_world_size() > 1:
        return _collective("all_reduce")(
            reduce_type, inputs, scale=scale, groups=groups, pin_layout=pin_layout
        )
    _single_replica_groups(groups)
    if isinstance(inputs, torch.Tensor):
        return inputs * scale if scale != 1.0 else inputs.clone()
    if scale != 1.0:
        with torch.no_grad():
            for t in inputs:
                t.mul_(scale)
    return inputs


def _fetch_gradients(optimizer):
    """The ``.grad`` of every parameter of ``optimizer`` that has one (torch_xla's helper)."""
    gradients = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.grad is not None:
                gradients.append(p.grad.data)
    return gradients


def reduce_gradients(optimizer, groups=None, pin_layout=True):
    """Average the gradients over the replicas (nothing to do on one)."""
    count = xrt_world_size()
    if count > 1:
        all_reduce(
            REDUCE_SUM,
            _fetch_gradients(optimizer),
            scale=1.0 / count,
            groups=groups,
            pin_layout=pin_layout,
        )


def optimizer_step(optimizer, barrier=False, optimizer_args=None, groups=None, pin_layout=True):
    """``reduce_gradients`` then ``optimizer.step(**optimizer_args)``; ``mark_step`` if barrier."""
    reduce_gradients(optimizer, groups=groups, pin_layout=pin_layout)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def all_gather(value, dim=0, groups=None, output=None, pin_layout=True):
    """Concatenate ``value`` from all replicas along ``dim``."""
    if xrt_world_size() > 1:
        return _collective("all_gather")(
            value, dim=dim, groups=groups, output=output, pin_layout=pin_layout
        )
    _single_replica_groups(groups)
    if output is not None:
        with torch.no_grad():
            output.copy_(value)
        return output
    return value.clone()


def reduce_scatter(
    reduce_type, input, scale, scatter_dim, shard_count, groups=None, output=None, pin_layout=True
):
    """Reduce over replicas, scale, and keep this replica's shard along ``scatter_dim``."""
    _check_reduce_type(reduce_type)
    if xrt_world_size() > 1:
        return _collective("reduce_scatter")(
            reduce_type,
            input,
            scale,
            scatter_dim,
            shard_count,
            groups=groups,
            output=output,
            pin_layout=pin_layout,
        )
    _single_replica_groups(groups)
    if shard_count != 1:
        raise ValueError(f"reduce_scatter: shard_count={shard_count} with a single replica")
    if isinstance(input, (list, tuple)):
        results = [t * scale for t in input]
        if output is not None:
            with torch.no_grad():
                for o, r in zip(output, results, strict=True):
                    o.copy_(r)
            return output
        return results
    result = input * scale
    if output is not None:
        with torch.no_grad():
            output.copy_(result)
        return output
    return result


def all_to_all(value, split_dimension, concat_dimension, split_count, groups=None, pin_layout=True):
    if xrt_world_size() > 1:
        return _collective("all_to_all")(
            value,
            split_dimension,
            concat_dimension,
            split_count,
            groups=groups,
            pin_layout=pin_layout,
        )
    if split_count != 1:
        raise ValueError(f"all_to_all: split_count={split_count} with a single replica")
    return value.clone()


def collective_broadcast(tensors, root_ordinal=0, groups=None, pin_layout=True):
    """Make every replica's ``tensors`` equal to those of ``root_ordinal`` (in place)."""
    if xrt_world_size() > 1:
        return _collective("collective_broadcast")(
            tensors, root_ordinal=root_ordinal, groups=groups, pin_layout=pin_layout
        )
    return None


def broadcast_master_param(model):
    """Copy rank 0's parameters into every replica (nothing to do on one)."""
    if xrt_world_size() > 1:
        return _collective("broadcast_master_param")(model)
    return None


def rendezvous(tag, payload=b"", replicas=None):
    """Wait for all replicas to reach ``tag``; returns every replica's ``payload`` (bytes)."""
    if xrt_world_size() > 1:
        return _collective("rendezvous")(tag, payload, replicas=replicas or [])
    return [payload]


def _maybe_convert_to_cpu(data, convert=True):
    """``data`` with every torchacc tensor replaced by a CPU copy (one sync for all of them)."""
    found = []

    def collect(x):
        if isinstance(x, torch.Tensor) and x.device.type == "torchacc":
            found.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                collect(v)
        elif isinstance(x, (list, tuple, set)):
            for v in x:
                collect(v)

    def rewrite(x):
        if isinstance(x, torch.Tensor) and x.device.type == "torchacc":
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
