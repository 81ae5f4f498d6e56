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
import time

import torch

import torchacc
from torchacc import metrics  # noqa: F401  (xm users reach metrics through torch_xla.debug)
from torchacc.engine import execute as _execute
from torchacc.torch_xla._api import differs, not_implemented

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


@differs("n must be None/0: one device per process")
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


@differs("one device per process: devices may only be [device]")
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
_async_closures: list = []


def add_step_closure(closure, args=(), run_async=False):
    """Run ``closure(*args)`` right after the next :func:`mark_step` has launched the step.

    Device tensors in ``args`` then hold this step's values (reading them, e.g. ``loss.item()``,
    is a host transfer of an already computed buffer). Closures run in the order they were added.
    ``run_async=True`` closures run on a worker thread (Note [Async step closures]).
    """
    (_async_closures if run_async else _step_closures).append((closure, args))


# Note [Async step closures]
# As in torch_xla, ``add_step_closure(..., run_async=True)`` closures are handed at the next
# mark_step to one worker thread that runs them in order while the host goes on tracing. If one
# raises, the worker stops; the next mark_step that hands over async closures raises
# ``RuntimeError("Cannot run asynchronous closure due to previously raised exception")`` from the
# closure's exception (torch_xla's ``AsyncClosureHandler`` semantics). ``wait_async_closures()``
# blocks until the queue is drained (torchacc helper; also used at interpreter exit).
class _AsyncClosureRunner:
    def __init__(self, max_queue=None):
        import queue
        import threading

        size = int(os.environ.get("XLA_MAX_ASYNC_QUEUE", max_queue or 100))
        self._queue = queue.Queue(size)
        self._errors = queue.Queue()
        self._lock = threading.Lock()
        self._thread = None

    def _loop(self):
        import queue

        while True:
            try:
                closure, args = self._queue.get(timeout=3)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                closure(*args)
            except BaseException as e:  # reraised on the main thread at the next handover
                self._errors.put(e)
                with self._lock:
                    self._thread = None
                return
            finally:
                self._queue.task_done()

    def run_all(self, closures):
        import queue
        import threading

        with self._lock:
            try:
                error = self._errors.get(block=False)
            except queue.Empty:
                error = None
            if error is not None:
                raise RuntimeError(
                    "Cannot run asynchronous closure due to previously raised exception"
                ) from error
            for item in closures:
                self._queue.put(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="torchacc-async-closures", daemon=True
                )
                self._thread.start()

    def wait(self):
        self._queue.join()


_async_runner = _AsyncClosureRunner()


def wait_async_closures():
    """Block until every async step closure handed over so far has run (torchacc helper)."""
    _async_runner.wait()


@_execute.after_sync
def _run_step_closures():
    if _async_closures:
        closures = list(_async_closures)
        _async_closures.clear()
        _async_runner.run_all(closures)
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
    """Set the device RNG's state to ``seed`` (an int, as :func:`get_rng_state` returns). The CPU
    generator is left alone, as in torch_xla."""
    from torchacc.lazy import random as _random

    _random.manual_seed(int(seed))


def get_rng_state(device=None):
    """The device RNG's current state as an int; ``set_rng_state`` of it continues the same
    stream. Reads the state from the device (a host transfer; a pending state runs its graph)."""
    from torchacc.lazy import random as _random

    words = _execute.fetch(_random.state_value(), torch.uint32).tolist()
    return (int(words[0]) << 32) | int(words[1])


class fork_rng:  # noqa: N801  (torch_xla's name; a context manager)
    """``with xm.fork_rng():`` restores the device RNG state on exit."""

    def __init__(self, device=None, enabled=True):
        self._enabled = enabled
        self._state = None

    def __enter__(self):
        if self._enabled:
            self._state = get_rng_state()
        return self

    def __exit__(self, *exc):
        if self._enabled:
            set_rng_state(self._state)
        return False


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
    info = {
        "bytes_used": used,
        "bytes_limit": limit,
        "peak_bytes_used": peak,
        "kb_free": max(limit - used, 0) // 1024,
        "kb_total": limit // 1024,
    }
    from torchacc.distributed import sharding

    if sharding.is_spmd():  # per device: the bytes of live tensors' shards (padding included)
        info["tensor_bytes_per_device"] = sharding.live_bytes_per_device()
    return info


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
    """The ``.grad`` of every parameter of ``optimizer`` that has one (torch_xla's helper).

    torch_xla returns ``p.grad.data``; a gradient that does not require grad (no
    ``create_graph``) is returned as is, which aliases the same memory without making a new
    tensor per parameter per step (a ``.data`` alias costs a dispatch and a wrapper tensor)."""
    gradients = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            g = p.grad
            if g is not None:
                gradients.append(g.data if g.requires_grad else g)
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
    if device.type not in ("torchacc", "xla"):
        raise ValueError(f"send_cpu_data_to_device: {device} is not a torchacc device")
    dev = torchacc.device()

    def select(t):
        if type(t) is not torch.Tensor or t.device.type != "cpu":
            return False
        if input_sharding is not None and input_sharding.can_apply(t):
            input_sharding.xla_spec(t)  # replicated only: raises for a real sharding
        return True

    return _rewrite(datas, select, lambda t: t.to(dev))


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


def _buckets(tensors, bucket_cap_mb):
    """Split ``tensors`` (index lists) into buckets of about ``bucket_cap_mb`` MB, as torch_xla's
    coalescing does: a bucket is flushed before it would spill over the cap; one big tensor goes
    with a small bucket when the two stay under twice the cap."""
    cap = bucket_cap_mb * 1024 * 1024
    buckets, current, total = [], [], 0
    for i, t in enumerate(tensors):
        size = t.numel() * t.element_size()
        if size > cap and total < 0.5 * cap and total + size <= 2 * cap:
            buckets.append(current + [i])
            current, total = [], 0
            continue
        if total + size > cap and current:
            buckets.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        buckets.append(current)
    return buckets


def _check_tensor_list(name, tensors, what):
    if not isinstance(tensors, list) or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{name}: `{what}` needs to be a list of Tensors, got {type(tensors)}")


def _bucketized(name, fn, input_list, output, bucket_cap_mb):
    _check_tensor_list(name, input_list, "input_list")
    if output is not None:
        _check_tensor_list(name, output, "output")
        if len(output) != len(input_list):
            raise ValueError(
                f"{name}: output has {len(output)} tensors for {len(input_list)} inputs"
            )
    results = []
    for bucket in _buckets(input_list, bucket_cap_mb):
        ins = [input_list[i] for i in bucket]
        outs = None if output is None else [output[i] for i in bucket]
        if len(bucket) == 1:
            results.append(fn(ins[0], None if outs is None else outs[0]))
        else:
            results.extend(fn(ins, outs))
    return results


def reduce_scatter_bucketized(
    reduce_type,
    input_list,
    scale,
    scatter_dim,
    shard_count,
    groups=None,
    output=None,
    pin_layout=False,
    bucket_cap_mb=160,
):
    """:func:`reduce_scatter` over ``input_list`` in buckets of about ``bucket_cap_mb`` MB;
    returns one result per input."""

    def fn(inputs, outputs):
        return reduce_scatter(
            reduce_type, inputs, scale, scatter_dim, shard_count, groups, outputs, pin_layout
        )

    return _bucketized("reduce_scatter_bucketized", fn, input_list, output, bucket_cap_mb)


def all_gather_bucketized(
    input_list, dim=0, groups=None, output=None, pin_layout=False, bucket_cap_mb=160
):
    """:func:`all_gather` over ``input_list`` in buckets; returns one result per input."""
    if pin_layout:
        raise RuntimeError("For xm.all_gather_bucketized, pin_layout=True is not yet supported.")

    def fn(inputs, outputs):
        if isinstance(inputs, list):
            outs = outputs or [None] * len(inputs)
            return [all_gather(t, dim, groups, o, pin_layout) for t, o in zip(inputs, outs)]
        return all_gather(inputs, dim, groups, outputs, pin_layout)

    return _bucketized("all_gather_bucketized", fn, input_list, output, bucket_cap_mb)


def all_reduce_bucketized_gradients(gradients, scale, groups, pin_layout, bucket_cap_mb=0):
    """In-place sum all-reduce of ``gradients`` (times ``scale``) in buckets of
    ``bucket_cap_mb`` MB."""
    for bucket in _buckets(gradients, bucket_cap_mb):
        all_reduce(
            REDUCE_SUM,
            [gradients[i] for i in bucket],
            scale=scale,
            groups=groups,
            pin_layout=pin_layout,
        )


def xla_device_kind(device=None):
    """The JAX device kind (e.g. ``'cpu'``, ``'NVIDIA H100 80GB HBM3'``)."""
    return torchacc.jax_device().device_kind


def xla_replication_devices(local_devices=None):
    return xla_real_devices(local_devices)


def optimization_barrier_(tensors):
    """The tensors keep their values, now as the outputs of one XLA optimization barrier
    (``jax.lax.optimization_barrier``; torchacc/accel/checkpoint.py)."""
    from torchacc.accel.checkpoint import optimization_barrier_ as barrier

    barrier(tensors)


def do_on_ordinals(target, data=(), ordinals=(0,)):
    """Run ``target(*data)`` on the listed ordinals; every replica meets at a rendezvous after."""
    result = target(*data) if get_ordinal() in ordinals else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


def xla_rendezvous(payload=b"", ordinals=None, tag=None):
    """Exchange ``payload`` bytes among replicas (every replica's payload, in rank order)."""
    return rendezvous(tag or "torch_xla.core.xla_model.xla_rendezvous", payload, ordinals)


def check_view_sharing(obj):
    """torch_xla refuses to save views sharing storage; torchacc moves tensors to the CPU one by
    one, so there is nothing to check."""
    return None


send = not_implemented(
    "xm.send", "point-to-point send/recv is not implemented: torchacc records collectives only"
)
recv = not_implemented(
    "xm.recv", "point-to-point send/recv is not implemented: torchacc records collectives only"
)
collective_permute = not_implemented(
    "xm.collective_permute", "collective_permute is not implemented in torchacc's collectives"
)
get_stablehlo = not_implemented(
    "xm.get_stablehlo", "StableHLO export of the pending graph is not implemented"
)
get_stablehlo_bytecode = not_implemented(
    "xm.get_stablehlo_bytecode", "StableHLO export of the pending graph is not implemented"
)
