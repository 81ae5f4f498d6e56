"""Distributed checkpoints of torchacc tensors in torch.distributed.checkpoint's (DCP's) format.

The engine part of ``torch_xla.experimental.distributed_checkpoint``: the save and load planners
that turn sharded torchacc tensors into DCP chunks and back, the host snapshot an asynchronous
save writes from, and a metadata reader that unpickles nothing but DCP's own metadata classes.
``checkpoint_manager.py`` builds step-numbered, atomic checkpoints on top.

Note [Sharded checkpoints]
A torchacc tensor in SPMD mode is a global ``jax.Array``; each process holds the shards of its
own devices, and a shard replicated over several devices has one ``replica_id`` per copy,
numbered over the *whole job* by JAX. Saving writes, for every torchacc tensor, exactly the
shards with ``replica_id == 0`` this process holds: each block of the tensor is written once in
the job, by one process, and no block is left out. (torch_xla 2.9 de-duplicates by shard offset
within a host instead, which drops both local copies of a weight split on one mesh axis and
replicated on another.) Each block is a DCP ``SHARD`` write item whose chunk is the block's
offsets and sizes in the global tensor, so the checkpoint is plain DCP: any DCP reader (or
``torch.distributed.checkpoint.format_utils``) reads it, and the files hold tensors only. A
replicated tensor (or one on the one-device-per-process device) is the same case with one block.
A padded array (Note [Padded shards] in sharding/layout.py) is cut to the tensor's logical
shape: chunks never hold padding, and loading pads the new array with zeros as its layout
needs. Plain CPU tensors and other objects go through DCP's default path.

Loading never assumes the saved layout: for every torchacc tensor in the target state dict, the
planner lists the distinct blocks its *current* sharding puts on this process's devices and lets
DCP (``create_read_items_for_chunk_list``) compute which parts of which saved chunks overlap
them -- that is the resharding (4 devices -> 2, sharded -> replicated, ...). The blocks are
filled on the host, then each tensor gets a new global array with its current sharding
(``jax.make_array_from_callback``) installed as a data value, like a host-to-device copy.
Shapes are checked against the checkpoint before anything is read. A tensor's new array is
installed when its last block is read (torch_xla's behaviour; one tensor's blocks on the host
at a time), or, with ``all_or_nothing`` (``CheckpointManager.restore``), once *every* torchacc
tensor's reads are complete: a bad checkpoint then raises and leaves the device state as it
was.

``weights_only``: DCP reads tensor data with ``torch.load(weights_only=True)``, but its
``FileSystemReader`` unpickles the ``.metadata`` file with plain ``pickle`` and the default
planner loads non-tensor values with ``weights_only=False``. ``SafeFileSystemReader``
(``checkpoint_metadata.py``) reads metadata with an unpickler that only builds DCP's metadata
classes, and ``SPMDLoadPlanner`` loads
non-tensor values with ``weights_only=True``; ``CheckpointManager.restore`` uses both.

Note [Asynchronous saves]
``CheckpointManager.save_async`` must let the next steps run while it writes, and hold at most one
copy of this process's shards on the host. Its snapshot (``snapshot(on_device=True)``) enqueues a
device-to-device copy of each unique block (``jax.device_put(may_alias=False)``: a new buffer,
ordered before the next step's programs on the device, so donating the original is safe) and
returns at once; the background writer reads the copies to the host one block at a time as DCP
writes them: the device holds one extra copy until the write ends, the host one block. On a CPU
device the copy is host memory and the writer reads it in place (``transfer.read_view``). The
writer thread runs ``writer_nice`` below the training's priority (Linux: a thread's own niceness):
where the steps keep the host's cores busy, its serialization and page-cache writes (~5 CPU-s per
1.5 GB) take what the steps leave, and the write takes longer.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import jax
import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from torchacc.distributed.checkpoint_metadata import SafeFileSystemReader
from torchacc.lazy.device import DEVICE_TYPE

__all__ = [
    "SPMDLoadPlanner",
    "SPMDSavePlanner",
    "SafeFileSystemReader",
    "Shards",
    "check_state_dict",
    "host_state_dict",
    "is_sharded",
    "prime_optimizer",
    "snapshot",
    "unique_shards",
]


def _on_device(x):
    return isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE


def _block(index, padded, shape):
    """(offsets, sizes) in a tensor of logical ``shape`` of a shard's index (a tuple of slices)
    into its array of shape ``padded``: the padding at the end is cut off (Note [Padded
    shards] in sharding/layout.py), so a block of padding only has a size 0."""
    offsets, sizes = [], []
    for sl, p, n in zip(index, padded, shape):
        start, stop, _ = sl.indices(p)
        start, stop = min(start, n), min(stop, n)
        offsets.append(start)
        sizes.append(stop - start)
    return tuple(offsets), tuple(sizes)


def _device_array(t):
    """The global jax array holding ``t``, padded where its layout needs it (computes ``t``
    first if it is pending)."""
    from torchacc.engine.execute import sync
    from torchacc.lazy.record import value_of

    value = value_of(t)
    if value.node is not None:
        sync()
        value = value_of(t)
    return value.buf if isinstance(value.buf, jax.Array) else value.array


def _layout(array):
    """An array's sharding for messages: its partition spec and mesh (or its devices)."""
    s = array.sharding
    if isinstance(s, jax.sharding.NamedSharding):
        return f"partition spec {tuple(s.spec)} on mesh {dict(s.mesh.shape)}"
    devices = sorted(d.id for d in s.device_set)
    if len(devices) == 1:
        return f"unsharded on device {devices[0]}"
    return f"sharding {s._to_xla_hlo_sharding(array.ndim)} over devices {devices}"


class Shards:
    """The blocks of one tensor this process writes: ``pieces`` maps a block's offsets to
    ``(sizes, data, hint)``, data a single-device jax array (read when written) or a CPU tensor,
    hint the block's position among the tensor's local shards (torch_xla's write item index).
    ``replicated``: the tensor is whole on every device (one block). ``private``: the device
    blocks are this object's own copies (:meth:`on_device`), read without a host copy where the
    device is the host (Note [Asynchronous saves])."""

    def __init__(self, shape, dtype, pieces, replicated=False, private=False):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.pieces = pieces
        self.replicated = replicated
        self.private = private

    def read(self, offsets):
        from torchacc.engine.transfer import read, read_view

        sizes, data, _ = self.pieces[tuple(offsets)]
        if isinstance(data, torch.Tensor):
            return data
        host = (read_view if self.private else read)(data, self.dtype)
        if tuple(host.shape) != sizes:  # a padded block: its logical part, in its own storage
            host = host[tuple(slice(0, n) for n in sizes)].clone()
        return host

    def on_host(self):
        """A copy whose blocks are CPU tensors (the device buffers may be donated later)."""
        pieces = {o: (s, self.read(o), h) for o, (s, _, h) in self.pieces.items()}
        return Shards(self.shape, self.dtype, pieces, self.replicated)

    def on_device(self):
        """A copy whose blocks are new buffers on their devices (Note [Asynchronous saves]):
        enqueued, not waited for; the originals may then be donated by the next step."""
        return _on_devices([self])[0]

    def __repr__(self):
        return f"Shards(shape={self.shape}, dtype={self.dtype}, blocks={sorted(self.pieces)})"


def _on_devices(shards):
    """:meth:`Shards.on_device` of several at once: one batched ``jax.device_put`` for all of
    their device blocks (a call per block costs the training thread ~1 ms each)."""
    out = [dict(sh.pieces) for sh in shards]
    where = [(p, o) for p in out for o, v in p.items() if not isinstance(v[1], torch.Tensor)]
    arrays = [p[o][1] for p, o in where]
    devices = [next(iter(a.devices())) for a in arrays]
    for (p, o), c in zip(where, jax.device_put(arrays, devices, may_alias=False)):
        p[o] = (p[o][0], c, p[o][2])
    pairs = zip(shards, out)
    return [Shards(sh.shape, sh.dtype, p, sh.replicated, private=True) for sh, p in pairs]


def is_sharded(t):
    """Whether torchacc tensor ``t`` is split over devices (not whole on each of them)."""
    return not _device_array(t).sharding.is_fully_replicated


def unique_shards(t):
    """``t``'s blocks that this process writes: its shards with replica id 0 (Note [Sharded
    checkpoints]); the data stays on the device until :meth:`Shards.read`."""
    array = _device_array(t)
    shape = tuple(t.shape)
    pieces = {}
    local = sorted(array.addressable_shards, key=lambda s: s.device.id)
    for hint, s in enumerate(local):
        if s.replica_id == 0:
            offsets, sizes = _block(s.index, array.shape, shape)
            if 0 not in sizes or math.prod(shape) == 0:  # not a block of padding only
                pieces[offsets] = (sizes, s.data, hint)
    return Shards(shape, t.dtype, pieces, array.sharding.is_fully_replicated)


def snapshot(state_dict, on_device=False):
    """A flat copy of ``state_dict`` that training cannot change: torchacc tensors become
    :class:`Shards` of this process's unique blocks -- on the host, or with ``on_device`` new
    device buffers read block by block when written (Note [Asynchronous saves]) --, CPU tensors
    clones, other values deep copies (what an asynchronous save writes while the next steps
    run)."""
    flat, _ = flatten_state_dict(state_dict)
    out, seen = {}, {}  # one copy of a tensor under several names (tied weights)
    refs, to_copy = {}, {}  # name -> key in seen; key -> Shards to copy (all at once, below)
    for k, v in flat.items():
        if _on_device(v):
            key = (id(_device_array(v)), tuple(v.shape), v.dtype)  # detach() makes new tensors
            if key not in seen:
                shards = unique_shards(v)
                seen[key] = shards if on_device else shards.on_host()
                if on_device:
                    to_copy[key] = shards
            refs[k] = out[k] = key
        elif isinstance(v, Shards):
            key = ("shards", k)
            seen[key] = v if on_device else v.on_host()
            if on_device:
                to_copy[key] = v
            refs[k] = out[k] = key
        elif isinstance(v, torch.Tensor):
            out[k] = v.detach().clone()
        else:
            out[k] = copy.deepcopy(v)
    seen.update(zip(to_copy, _on_devices(list(to_copy.values()))))
    return {k: seen[refs[k]] if k in refs else v for k, v in out.items()}


def prime_optimizer(optimizer):
    """Create ``optimizer``'s state so that a checkpoint can be loaded into it in place: one
    step with zero gradients, each laid out like its parameter (so the state gets the sharding
    training gives it). The step changes the parameters (weight decay), so call it only right
    before restoring a checkpoint that overwrites them."""
    from torchacc.engine.execute import sync
    from torchacc.sharding import api as sharding

    sync()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not p.requires_grad:
                continue
            p.grad = torch.zeros_like(p)
            s = sharding.sharding_of(p)
            if sharding.is_spmd() and isinstance(s, jax.sharding.NamedSharding):
                sharding.mark(p.grad, s, "prime_optimizer")
    optimizer.step()
    optimizer.zero_grad()
    sync()
    return optimizer


def host_state_dict(state_dict):
    """``state_dict`` (nested) with every torchacc tensor on the host: a sharded one as the
    :class:`Shards` of this process's unique blocks, a replicated one as a CPU tensor
    (torch_xla's ``_sharded_cpu_state_dict``)."""
    from torch.utils._pytree import tree_map

    def to_host(v):
        if not _on_device(v):
            return v
        return unique_shards(v).on_host() if is_sharded(v) else v.detach().cpu()

    return tree_map(to_host, state_dict)


def _check_job():
    if jax.process_count() > 1 and not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "distributed checkpoint: this job has "
            f"{jax.process_count()} processes but no torch.distributed process group; DCP "
            "coordinates the processes through one: call "
            "torch.distributed.init_process_group('gloo') first"
        )


def _write_item(fqn, shards, offsets, sizes, hint):
    return WriteItem(
        index=MetadataIndex(fqn, offsets, hint),
        type=WriteItemType.SHARD,
        tensor_data=TensorWriteData(
            chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
            properties=TensorProperties(dtype=shards.dtype),
            size=torch.Size(shards.shape),
        ),
    )


class SPMDSavePlanner(DefaultSavePlanner):
    """DCP save planner for state dicts holding (sharded) torchacc tensors: each process writes
    only its own unique blocks (Note [Sharded checkpoints]); everything else as DCP's default."""

    def __init__(self, flatten_state_dict=True, flatten_sharded_tensors=True):
        super().__init__(flatten_state_dict, flatten_sharded_tensors)
        self.shards: dict = {}

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        if isinstance(storage_meta, bool):  # torch_xla's set_up_planner(state_dict, coordinator)
            storage_meta, is_coordinator = None, storage_meta
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        self.shards, rest = {}, {}
        for k, v in self.state_dict.items():
            if _on_device(v):
                _check_job()
                self.shards[k] = unique_shards(v)
            elif isinstance(v, Shards):
                self.shards[k] = v
            else:
                rest[k] = v  # DCP's own path (CPU tensors, DTensors: nothing starts JAX)
        self.state_dict = rest

    @property
    def sharded_state_dict(self):
        """torch_xla's view: the entries split over devices (the rest is unsharded)."""
        return {k: v for k, v in self.shards.items() if not v.replicated}

    @property
    def unsharded_state_dict(self):
        replicated = {k: v for k, v in self.shards.items() if v.replicated}
        return {**self.state_dict, **replicated}

    def create_local_plan(self):
        plan = super().create_local_plan()
        items = [
            _write_item(fqn, shards, offsets, sizes, hint)
            for fqn, shards in self.shards.items()
            for offsets, (sizes, _, hint) in shards.pieces.items()
        ]
        self.plan = dataclasses.replace(plan, items=plan.items + items)
        return self.plan

    def lookup_object(self, index):
        shards = self.shards.get(index.fqn)
        if shards is None:
            return super().lookup_object(index)
        return shards.read(index.offset)


def _numpy(t):
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class _Target:
    """A torchacc tensor being loaded: the distinct blocks its current sharding places on this
    process's devices, filled on the host from DCP's reads."""

    def __init__(self, t):
        self.tensor = t
        self.array = _device_array(t)  # padded where the layout needs it
        self.replicated = self.array.sharding.is_fully_replicated
        self.shape = tuple(t.shape)
        self.padded = tuple(self.array.shape)
        index_map = self.array.sharding.addressable_devices_indices_map(self.padded)
        blocks = {}
        for index in index_map.values():
            offsets, sizes = _block(index, self.padded, self.shape)
            if 0 not in sizes:
                blocks.setdefault(offsets, sizes)
        self.offsets = sorted(blocks)
        self.sizes = [blocks[o] for o in self.offsets]
        self.buffers: dict = {}
        self.left = 0  # elements still to read

    def chunks(self):
        return [
            ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s))
            for o, s in zip(self.offsets, self.sizes)
        ]

    def numel(self):
        return sum(math.prod(s) for s in self.sizes)

    def buffer(self, index):
        i = index.index
        if i is None or i >= len(self.offsets) or self.offsets[i] != tuple(index.offset):
            i = self.offsets.index(tuple(index.offset))
        buf = self.buffers.get(i)
        if buf is None:
            buf = self.buffers[i] = torch.empty(self.sizes[i], dtype=self.tensor.dtype)
        return buf

    def build(self):
        """A global array of the loaded data with the tensor's current sharding, padded with
        zeros as its array was (Note [Padded shards] in sharding/layout.py)."""
        by_offsets = {o: self.buffers[i] for i, o in enumerate(self.offsets)}
        dtype = _numpy(torch.empty(0, dtype=self.tensor.dtype)).dtype

        def block(index):
            offsets, sizes = _block(index, self.padded, self.shape)
            full = tuple(sl.indices(p)[1] - sl.indices(p)[0] for sl, p in zip(index, self.padded))
            if 0 not in sizes:
                data = _numpy(by_offsets[offsets])
                if tuple(data.shape) == full:
                    return data
            out = np.zeros(full, dtype)  # padding only, or a block with padding at its end
            if 0 not in sizes:
                out[tuple(slice(0, n) for n in sizes)] = data
            return out

        return jax.make_array_from_callback(self.padded, self.array.sharding, block)

    def check(self, fqn, md):
        where = f"tensor {fqn!r} of shape {self.shape} ({_layout(self.array)})"
        if isinstance(md, BytesStorageMetadata):
            raise ValueError(f"load: {where}: the checkpoint holds a non-tensor value for it")
        if tuple(md.size) != self.shape:
            raise ValueError(
                f"load: {where}: the checkpoint's tensor has shape {tuple(md.size)}; nothing "
                "was loaded"
            )


def install(targets):
    """Give each loaded tensor its new data (all arrays are built before any is installed)."""
    from torchacc.sharding import api as sharding

    arrays = [(tg, tg.build()) for tg in targets]
    for tg, array in arrays:
        sharding.set_data(tg.tensor, array)
        tg.buffers = {}


class SPMDLoadPlanner(DefaultLoadPlanner):
    """DCP load planner for state dicts holding (sharded) torchacc tensors: each tensor is
    loaded in place with the sharding it has now, whatever the saved layout (Note [Sharded
    checkpoints]); other values as DCP's default, non-tensor values with ``weights_only``.

    A tensor gets its new data as soon as all of its blocks are read (as torch_xla's planner);
    with ``all_or_nothing=True`` no torchacc tensor changes until every one of them is read (a
    failing read leaves them all as they were; this process's share of the state is held on
    the host meanwhile). ``CheckpointManager.restore`` uses ``all_or_nothing``."""

    def __init__(self, *args, all_or_nothing=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.all_or_nothing = all_or_nothing

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        super().set_up_planner(state_dict, metadata, is_coordinator)
        self.targets = {k: _Target(v) for k, v in self.state_dict.items() if _on_device(v)}
        if self.targets:  # torchacc tensors; the others (DTensors, CPU) are DCP's own
            _check_job()
        self.pending = 0

    @property
    def sharded_state_dict(self):
        """torch_xla's view: the targets split over devices (the rest is unsharded)."""
        return {k: t.tensor for k, t in self.targets.items() if not t.replicated}

    @property
    def unsharded_state_dict(self):
        sharded = self.sharded_state_dict
        return {k: v for k, v in self.state_dict.items() if k not in sharded}

    def create_local_plan(self):
        if self.metadata is None:
            raise ValueError("SPMDLoadPlanner: no checkpoint metadata")
        check_shapes(self.state_dict, self.metadata, not self.allow_partial_load, self.targets)
        rest = {k: v for k, v in self.state_dict.items() if k not in self.targets}
        plan = create_default_local_load_plan(rest, self.metadata, not self.allow_partial_load)
        items = list(plan.items)
        self.pending = 0
        for fqn, target in self.targets.items():
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None or target.numel() == 0:
                continue
            items += create_read_items_for_chunk_list(fqn, md, target.chunks())
            target.left = target.numel()
            self.pending += target.left
        return LoadPlan(items, planner_data=plan.planner_data)

    def lookup_tensor(self, index):
        target = self.targets.get(index.fqn)
        if target is None:
            return super().lookup_tensor(index)
        return target.buffer(index)

    def commit_tensor(self, read_item, tensor):
        target = self.targets.get(read_item.dest_index.fqn)
        if target is None:
            return
        n = math.prod(read_item.lengths)
        target.left -= n
        self.pending -= n
        if target.left < 0:
            raise RuntimeError(f"SPMDLoadPlanner: more data read than asked for {read_item}")
        if not self.all_or_nothing and target.left == 0:
            install([target])
        elif self.all_or_nothing and self.pending == 0:
            install([t for t in self.targets.values() if t.buffers])

    def load_bytes(self, read_item, value):
        obj = torch.load(value, weights_only=True)
        fqn = read_item.dest_index.fqn
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def check_shapes(flat, metadata, strict=True, targets=None):
    """Raise a ``ValueError`` naming the first tensor of the flat state dict ``flat`` whose shape
    (or kind) differs from the checkpoint's ``metadata`` (or that it lacks, when ``strict``)."""
    targets = targets if targets is not None else {}
    saved = metadata.state_dict_metadata
    for fqn, v in flat.items():
        md = saved.get(fqn)
        if md is None:
            if strict:
                raise ValueError(f"load: the checkpoint has no value for {fqn!r}")
            continue
        if fqn in targets:
            targets[fqn].check(fqn, md)
        elif _on_device(v):
            _Target(v).check(fqn, md)
        elif isinstance(v, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata) or tuple(md.size) != tuple(v.shape):
                got = tuple(md.size) if isinstance(md, TensorStorageMetadata) else "no tensor"
                raise ValueError(
                    f"load: CPU tensor {fqn!r} of shape {tuple(v.shape)}: the checkpoint has "
                    f"{got}; nothing was loaded"
                )


def check_state_dict(state_dict, metadata, strict=True):
    """:func:`check_shapes` of a nested state dict (before a load changes anything)."""
    flat, _ = flatten_state_dict(state_dict)
    check_shapes(flat, metadata, strict)
