"""Every process loads its own data: the library half of per-process batches (the loaders'
layout of a batch, and the processes' agreement on its shapes); ``mesh.put_local`` builds the
global arrays.

Note [Per-process batches]
In a job of several processes every process loads its own data (a ``DistributedSampler`` gives
each rank its share), as in JAX. A batch a loader (``MpDeviceLoader``, ``ta.AsyncLoader``)
takes in SPMD mode is this process's *local* batch, uploaded only to this process's devices,
each device getting only its shard (``TransferToDeviceBytes`` counts the bytes that reach them).
Where it goes depends on how the loader's ``input_sharding`` splits dimension 0 (default: over
every axis of the engine mesh):

- over axes that run along processes (``process_axes``; or a mesh with no such axis): a *global
  batch*. ``jax.make_array_from_process_local_data`` builds one array whose dimension 0 is every
  process's batch in process order (process ``p``'s rows ``[p*b, (p+1)*b)``); the step sees the
  global batch, as with one process (1 x 4 and 2 x 2 devices train on the same numbers).
  ``ta.accelerate``'s dp x fsdp splits over (dp, fsdp).
- over local axes only (``ShardingSpec(mesh, ("fsdp", None))`` on a (dp, fsdp) mesh whose rows
  are processes): the batch stays this process's *own* (its shape is the local one), for
  per-process code in the step: DDP/Horovod averaging, ``xm.all_reduce`` (a manual region over the
  process axes, Note [One mesh]) next to sharding over the local devices.

Before a batch is built the processes exchange its tensors' shapes through the JAX coordination
service (``agree_local_shapes``): local batches of different shapes, or one process's loader
ending before another's, are a ``ValueError`` naming the processes and shapes on every process,
never a program that waits for a peer forever. A plain ``.to(device)`` stays global (every
process passes the same data: parameters, buffers, constants).
"""

from __future__ import annotations

import time

import torch

from torchacc.runtime import processes
from torchacc.sharding import layout as layout_
from torchacc.sharding import mesh


def batch_layout(input_sharding=None):
    """How the loaders lay a batch's tensors out: ``fn(key, host tensor) -> (sharding, local)``
    (``key``: the tensor's top-level key in a dict batch; ``local``: ``host`` is this process's
    share of a global batch). Off SPMD mode nothing is laid out. In SPMD mode the batch is split
    by ``input_sharding`` (an ``xs.ShardingSpec``, a dict of them per key, a ``NamedSharding`` or
    ``fn(tensor) -> NamedSharding``; with several processes, default: over every axis of the
    engine mesh) as it is uploaded, each device getting only its shard (Note [Per-process
    batches]: a split over the process axes makes a global batch of every process's share, a
    split over local axes only keeps the batch this process's own)."""

    def layout(key, host):
        if not mesh.is_spmd():
            return None, False
        spec = input_sharding
        if isinstance(spec, dict):
            spec = spec.get(key)
        if spec is None:
            sharding = None
        elif hasattr(spec, "xla_spec"):  # xs.ShardingSpec (None where the rank differs)
            sharding = spec.xla_spec(host)
            if sharding is not None and getattr(spec, "minibatch", False):
                _check_minibatch(host)
        elif callable(spec):
            sharding = spec(host)
        else:
            sharding = spec
        if processes.spans_processes():
            sharding = sharding or mesh.batch_sharding(host.dim())
            return sharding, host.dim() > 0 and _splits_processes(sharding)
        if sharding is not None and layout_.padded_shape(tuple(host.shape), sharding) == tuple(
            host.shape
        ):
            return sharding, False
        return None, False

    return layout


def _check_minibatch(host):
    """``ShardingSpec(minibatch=True)``: the batch is this host's share, split over its devices;
    a batch those devices do not divide is torch_xla's ``RuntimeError`` (its text)."""
    n = len(mesh.local_devices())
    if host.dim() > 0 and host.shape[0] % n:
        raise RuntimeError(
            "When minibatch is configured, the per-host batch size must be divisible by local "
            f"runtime device count. Per host input data shape = {host.size()}, "
            f"local_runtime_device_count = {n}"
        )


def _splits_processes(sharding):
    """Whether ``sharding`` splits dimension 0 over an axis that runs along processes."""
    spec = tuple(sharding.spec)
    entry = spec[0] if spec else None
    names = set() if entry is None else set(entry if isinstance(entry, tuple) else (entry,))
    if not names:
        return False
    try:
        return bool(names & set(mesh.process_axes(sharding.mesh)))
    except ValueError:  # no axis runs along processes alone: a global split of the batch
        return True


def batch_signature(x):
    """The shapes and dtypes of a (nested) batch's tensors, as one string (for
    :func:`agree_local_shapes`)."""
    parts = []

    def walk(v, path):
        if isinstance(v, torch.Tensor):
            dtype = str(v.dtype).replace("torch.", "")
            parts.append(f"batch{path}: {dtype}{list(v.shape)}")
        elif isinstance(v, dict):
            for k, item in v.items():
                walk(item, f"{path}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for i, item in enumerate(v):
                walk(item, f"{path}[{i}]")

    walk(x, "")
    return ", ".join(parts) or "no tensors"


class BatchAgreement:
    """Per-process batches (Note [Per-process batches]): before each batch of one pass over a
    loader is uploaded, every process checks the others load the same shapes (and as many
    batches). Made on the recording thread; ``check`` runs on the loader's thread."""

    def __init__(self):
        self.on = mesh.is_spmd() and processes.spans_processes()
        self.id = next_loader_id() if self.on else None
        self.count = 0

    def check(self, batch, stop=None):
        """``batch`` (None: the loader ended) agrees with every process's; False if ``stop``
        was set while waiting."""
        if not self.on:
            return True
        i = self.count
        self.count += 1
        if batch is None:
            signature = f"the loader ended after {i} batches"
        else:
            signature = batch_signature(batch)
        ok = agree_local_shapes(f"{self.id}/{i}", signature, stop, what=f"batch {i}")
        if ok and i:
            forget_local_shapes(f"{self.id}/{i - 1}")
        return ok


_loader_ids = iter(range(1 << 62))
BATCH_WAIT_S = 300.0  # how long a process waits for a peer's next batch before giving up


def next_loader_id():
    """A number for a new pass over a loader: every process makes its loaders in the same order,
    so equal numbers name the same pass on every process (the recording thread)."""
    return next(_loader_ids)


def agree_local_shapes(key, signature, stop=None, wait_s=None, what=None):
    """Post this process's batch ``signature`` (a string: its tensors' shapes, or ``"end"`` when
    its loader has no more batches) under ``key`` and check every process posted the same; a
    ``ValueError`` naming the processes and their signatures otherwise. ``stop`` (an Event)
    gives up quietly (returns False) when set while waiting; ``what`` names the batch."""
    world = processes.world_size()
    if world == 1:
        return True
    client = processes._jax_distributed_client()
    me = processes.rank()
    prefix = f"torchacc/batch/{key}"
    what = what or f"batch {key}"
    client.key_value_set(f"{prefix}/{me}", signature)
    deadline = time.monotonic() + (BATCH_WAIT_S if wait_s is None else wait_s)
    seen = {me: signature}
    for r in range(world):
        while r not in seen:
            if stop is not None and stop.is_set():
                return False
            try:
                seen[r] = client.blocking_key_value_get(f"{prefix}/{r}", 1000)
            except Exception:  # the 1 s wait ran out (or the service is gone)
                if time.monotonic() > deadline:
                    raise ValueError(
                        f"torchacc: process {me} waited {wait_s or BATCH_WAIT_S:.0f} s for "
                        f"process {r}'s {what} (its own: {signature}); process {r} did not load "
                        "it (slow, stopped iterating, or dead)"
                    ) from None
    if len(set(seen.values())) > 1:
        lines = "; ".join(f"process {r}: {seen[r]}" for r in sorted(seen))
        raise ValueError(
            f"torchacc: per-process batches differ across processes at {what} of a loader "
            f"({lines}); "
            "every process must load batches of the same shapes (drop_last=True, the same batch "
            "size, and as many batches per process: DistributedSampler pads to that)"
        )
    return True


def forget_local_shapes(key):
    """Delete this process's posting under ``key`` (every peer has read it)."""
    if processes.world_size() > 1:
        try:
            processes._jax_distributed_client().key_value_delete(
                f"torchacc/batch/{key}/{processes.rank()}"
            )
        except Exception:
            pass


# --- uploading batches (any thread) and wrapping them as torchacc tensors (the recording thread),
# shared by MpDeviceLoader and ta.AsyncLoader


class _Uploaded:
    """A host tensor's copy on the device, not yet wrapped as a tensor (wrapping is main-thread)."""

    __slots__ = ("array", "mirror", "shape", "dtype", "seconds", "nbytes")

    def __init__(self, array, mirror, shape, dtype, seconds, nbytes):
        self.array = array
        self.mirror = mirror
        self.shape = shape
        self.dtype = dtype
        self.seconds = seconds
        self.nbytes = nbytes


def upload_tree(x, layout=None, key=None):
    """Start copying every CPU tensor of a (nested) batch to the device; any thread. ``layout``:
    :func:`batch_layout`'s function (default: no sharding of SPMD mode's own)."""
    from torchacc.engine import transfer

    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            return x  # already elsewhere (e.g. on the device): left as is
        host = x.detach().contiguous()
        sharding, local = (None, False) if layout is None else layout(key, host)
        start = time.perf_counter()
        array, mirror = transfer.device_array(host, sharding, local)
        seconds = time.perf_counter() - start
        nbytes = transfer.sent_bytes(array)
        return _Uploaded(array, mirror, tuple(array.shape), host.dtype, seconds, nbytes)
    if isinstance(x, dict):
        return type(x)((k, upload_tree(v, layout, k if key is None else key)) for k, v in x.items())
    return _map(lambda v: upload_tree(v, layout, key), x)


def wrap_tree(x):
    """The batch ``upload_tree`` made, as torchacc tensors; the recording thread."""
    from torchacc import metrics
    from torchacc.ir import Value, contiguous_desc
    from torchacc.lazy.record import fresh

    if isinstance(x, _Uploaded):
        value = Value(contiguous_desc(x.shape, x.dtype), array=x.array)
        value.host = x.mirror  # Note [Reads of host-known values] (torchacc/lazy/host_eval.py)
        metrics.record_time("TransferToDeviceTime", x.seconds)
        metrics.counter_inc("TransferToDevice")
        metrics.counter_inc("TransferToDeviceBytes", x.nbytes)
        return fresh(value)
    return _map(wrap_tree, x)


def _map(fn, x):
    if isinstance(x, dict):
        return type(x)((k, fn(v)) for k, v in x.items())
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return type(x)(*(fn(v) for v in x))
    if isinstance(x, (list, tuple)):
        return type(x)(fn(v) for v in x)
    return x


_global_batches = [0]


def global_batch(batch, input_sharding=None):
    """A (nested) batch of CPU tensors on the device as the loaders lay it out, on the recording
    thread: in a multi-process SPMD job ``batch`` is this process's share (Note [Per-process
    batches]; every process calls this the same number of times, with batches of the same
    shapes). ``input_sharding`` as for :func:`batch_layout`."""
    check = BatchAgreement()
    if check.on:  # one pass of its own per call (the same number on every process)
        check.id = f"global/{_global_batches[0]}"
        _global_batches[0] += 1
        check.check(batch)
    return wrap_tree(upload_tree(batch, batch_layout(input_sharding)))
