"""Horovod's collectives other than allreduce: ``allgather``, ``broadcast``, ``alltoall``,
``reducescatter``, object collectives, ``barrier``, ``join`` (paths as in ``ops.py``).
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from torchacc.horovod import basics
from torchacc.horovod.ops import (
    _DEVICE_OP,
    _TORCH_OP,
    Average,
    _check_op,
    _check_tensor,
    _describe,
    _exchange,
    _grouped_start,
    _new_handle,
    _scales,
    _signature,
    check_same,
    on_device,
    synchronize,
)
from torchacc.sharding import collectives as C

# --------------------------------------------------------------------------------------------
# allgather, broadcast, alltoall, reducescatter


def _pad0(t, n):
    if t.shape[0] == n:
        return t
    return torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))])


def allgather(tensor, name=None, process_set=None):
    """Every rank's ``tensor`` concatenated along dim 0 in rank order (dim 0 may differ)."""
    basics.require("allgather")
    _check_tensor("allgather", tensor)
    if tensor.dim() == 0:
        raise ValueError("torchacc.horovod.allgather: expected a tensor of at least 1 dimension")
    if basics.size() == 1:
        return tensor.clone()
    sizes = check_same("allgather", [tensor], skip_dim0=True)
    m = max(sizes)
    if on_device(tensor):
        gathered = C.all_gather(_pad0(tensor, m), 0)
        pieces = gathered.split(m)
    else:
        pieces = [tensor.new_empty((m, *tensor.shape[1:])) for _ in sizes]
        dist.all_gather(pieces, _pad0(tensor.contiguous(), m))
    return torch.cat([p[:n] for p, n in zip(pieces, sizes, strict=True)])


def allgather_object(obj, name=None, process_set=None):
    """A list of every rank's (picklable) ``obj``, in rank order."""
    basics.require("allgather_object")
    if basics.size() == 1:
        return [obj]
    out = [None] * basics.size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, root_rank=0, name=None, process_set=None):
    """Rank ``root_rank``'s (picklable) ``obj`` on every rank."""
    basics.require("broadcast_object")
    _check_root("broadcast_object", root_rank)
    if basics.size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=int(root_rank))
    return box[0]


def _check_root(name, root_rank):
    if not 0 <= int(root_rank) < basics.size():
        raise ValueError(
            f"torchacc.horovod.{name}: root_rank={root_rank} is not a rank in [0, {basics.size()})"
        )


def broadcast_start(tensors, root_rank, in_place, name="broadcast"):
    """Start broadcasting ``tensors`` from ``root_rank``; returns (work, finish)."""
    basics.require(name)
    _check_root(name, root_rank)
    tensors = list(tensors)
    for t in tensors:
        _check_tensor(name, t)
    out = tensors if in_place else [t.clone() for t in tensors]
    if basics.size() == 1 or not tensors:
        return None, lambda: out
    check_same(name, tensors, root=int(root_rank))
    if on_device(tensors[0]):
        C.broadcast(out, int(root_rank))
        return None, lambda: out
    works = [dist.broadcast(o, int(root_rank), async_op=True) for o in out]

    class _All:
        def is_completed(self):
            return all(w.is_completed() for w in works)

        def wait(self):
            for w in works:
                w.wait()

    return _All(), lambda: out


def broadcast_async(tensor, root_rank, name=None, process_set=None):
    work, finish = broadcast_start([tensor], root_rank, False)
    return _new_handle(work, lambda: finish()[0])


def broadcast_async_(tensor, root_rank, name=None, process_set=None):
    work, finish = broadcast_start([tensor], root_rank, True, "broadcast_")
    return _new_handle(work, lambda: finish()[0])


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Rank ``root_rank``'s ``tensor`` as a new tensor on every rank."""
    return synchronize(broadcast_async(tensor, root_rank))


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """Overwrite ``tensor`` with rank ``root_rank``'s; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank))


def alltoall(tensor, splits=None, name=None, process_set=None):
    """Send block ``i`` of ``tensor``'s dim 0 to rank ``i`` and concatenate what arrives.

    ``splits`` (one int per rank) sizes the blocks; without it dim 0 splits evenly. Returns the
    received tensor, and with ``splits`` also the received splits (as Horovod does).
    """
    basics.require("alltoall")
    _check_tensor("alltoall", tensor)
    w = basics.size()
    given = splits is not None
    if splits is None:
        if tensor.shape[0] % w:
            raise ValueError(
                f"torchacc.horovod.alltoall: dim 0 of size {tensor.shape[0]} does not split into "
                f"{w} equal blocks; pass splits="
            )
        splits = [tensor.shape[0] // w] * w
    splits = [int(s) for s in (splits.tolist() if torch.is_tensor(splits) else splits)]
    if len(splits) != w or any(s < 0 for s in splits) or sum(splits) != tensor.shape[0]:
        raise ValueError(
            f"torchacc.horovod.alltoall: splits={splits} must be {w} non-negative sizes adding up "
            f"to dim 0 ({tensor.shape[0]})"
        )
    if w == 1:
        out, received = tensor.clone(), splits
    else:
        _describe.current = f"{tuple(tensor.shape)} {tensor.dtype}"
        sig = _signature("alltoall", tuple(tensor.shape[1:]), str(tensor.dtype))
        matrix = _exchange("alltoall", splits, sig)  # matrix[src][dst]
        me = basics.rank()
        received = [matrix[src][me] for src in range(w)]
        if on_device(tensor):
            m = max(max(row) for row in matrix)
            blocks = [_pad0(b, m) for b in tensor.split(splits)]
            got = C.all_to_all(torch.cat(blocks), 0, 0).split(m)
            out = torch.cat([g[:n] for g, n in zip(got, received, strict=True)])
        else:
            out = tensor.new_empty((sum(received), *tensor.shape[1:]))
            dist.all_to_all_single(out, tensor.contiguous(), received, splits)
    if given:
        return out, torch.tensor(received, dtype=torch.int32)
    return out


def reducescatter(
    tensor, op=Average, name=None, process_set=None, prescale_factor=1.0, postscale_factor=1.0
):
    """Reduce ``tensor`` over all ranks and keep this rank's block of dim 0 (blocks as even as
    possible, the first ranks one row longer)."""
    basics.require("reducescatter")
    _check_tensor("reducescatter", tensor)
    _check_op("reducescatter", op, tensor)
    w, me, n = basics.size(), basics.rank(), tensor.shape[0]
    sizes = [n // w + (1 if r < n % w else 0) for r in range(w)]
    start = sum(sizes[:me])
    pre, post = _scales(op, prescale_factor, postscale_factor)
    if w > 1:
        check_same("reducescatter", [tensor])
    x = tensor * pre if pre != 1.0 else tensor
    if w > 1 and n % w == 0 and on_device(tensor):
        return C.reduce_scatter(_DEVICE_OP[op.name], x, post, 0)
    if w > 1 and n % w == 0:
        out = tensor.new_empty((sizes[me], *tensor.shape[1:]))
        torch_op = getattr(dist.ReduceOp, _TORCH_OP[op.name])
        dist.reduce_scatter_tensor(out, x.contiguous(), torch_op)
        return out * post if post != 1.0 else out
    full = _grouped_start("reducescatter", [x], op, 1.0, postscale_factor, False)
    reduced = synchronize(_new_handle(*full))[0]
    return reduced[start : start + sizes[me]].clone()


def barrier(process_set=None):
    """Wait until every rank reaches this barrier."""
    basics.require("barrier")
    if basics.size() > 1:
        dist.barrier()


_joins = itertools.count()


def join(device=-1):
    """Wait until every rank has joined; returns the rank that joined last.

    Unlike Horovod, ranks that joined do not take part in collectives other ranks start after
    that: every rank must call ``join()`` after its last collective.
    """
    basics.require("join")
    if basics.size() == 1:
        return 0
    store = dist.distributed_c10d._get_default_store()
    n = next(_joins)
    arrived = store.add(f"torchacc/hvd/join/{n}", 1)
    last = basics.rank() if arrived == basics.size() else -1
    return max(allgather_object(last))
