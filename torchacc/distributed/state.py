"""Making every rank start equal: broadcasting parameters (a ``state_dict`` or ``(name, tensor)``
pairs) and an optimizer's state and hyperparameters from one rank. Shared by
``torchacc.horovod`` and the ``torch.distributed`` drop-in (``torchacc.distributed``).

CPU/CUDA tensors go through the ``torch.distributed`` default group; torchacc tensors through
one recorded broadcast. Before it, the pending work of each rank runs on its own: ranks may differ
in it (rank 0 alone loaded a checkpoint), and a program holding a collective must be the same on
every rank. After it, a sync, so the values are final on return.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchacc.lazy.tensor import LazyTensor
from torchacc.sharding import collectives as C


def _need_group(name):
    if not dist.is_initialized():
        raise RuntimeError(
            f"torchacc.distributed.{name}: no process group; call init_process_group() (or "
            "hvd.init()) first"
        )


def broadcast_tensors(tensors, root_rank, name="broadcast"):
    """Overwrite ``tensors`` in place with rank ``root_rank``'s."""
    lazy = [t for t in tensors if isinstance(t, LazyTensor)]
    eager = [t for t in tensors if not isinstance(t, LazyTensor)]
    if lazy:  # Note [One gradient average, one start] in torchacc/sharding/collectives.py
        C.start_equal(lazy, int(root_rank))
    if eager:
        _need_group(name)
        works = [dist.broadcast(t, int(root_rank), async_op=True) for t in eager]
        for w in works:
            w.wait()


def broadcast_object(obj, root_rank, name="broadcast_object"):
    _need_group(name)
    box = [obj]
    dist.broadcast_object_list(box, src=int(root_rank))
    return box[0]


def broadcast_parameters(params, root_rank):
    """``params``: a ``state_dict()`` (sorted by name) or ``(name, tensor)`` pairs."""
    if isinstance(params, dict):
        items = sorted(params.items(), key=lambda kv: kv[0])
    elif hasattr(params, "__iter__") and not isinstance(params, (str, bytes)):
        items = list(params)
        if any(not (isinstance(x, tuple) and len(x) == 2) for x in items):
            raise ValueError(
                "broadcast_parameters: expected a state_dict or (name, tensor) pairs, e.g. "
                "model.named_parameters()"
            )
    else:
        raise ValueError(f"broadcast_parameters: invalid params of type {type(params).__name__}")
    tensors = [t.data for _, t in items if isinstance(t, torch.Tensor)]
    with torch.no_grad():
        broadcast_tensors(tensors, root_rank, "broadcast_parameters")


def _step_without_sync(optimizer):
    if hasattr(optimizer, "skip_synchronize"):  # hvd.DistributedOptimizer
        with optimizer.skip_synchronize():
            optimizer.step()
    else:
        optimizer.step()


def create_state(optimizer):
    """Horovod's way: a step on zero gradients creates the state a fresh optimizer lacks
    (parameters and gradients are put back afterwards)."""
    missing = [
        p
        for g in optimizer.param_groups
        for p in g["params"]
        if p.requires_grad and p not in optimizer.state
    ]
    if not missing:
        return
    saved = [(p, p.detach().clone(), p.grad) for p in missing]
    for p in missing:
        p.grad = torch.zeros_like(p)
    _step_without_sync(optimizer)
    with torch.no_grad():
        for p, data, grad in saved:
            p.copy_(data)
            p.grad = grad


def _layout(optimizer, params):
    return [
        {
            k: ("tensor", tuple(v.shape), str(v.dtype)) if torch.is_tensor(v) else ("value", v)
            for k, v in sorted(optimizer.state.get(p, {}).items())
        }
        for p in params
    ]


def broadcast_optimizer_state(optimizer, root_rank):
    """Every rank's optimizer state and hyperparameters (lr, momentum, ...) become rank
    ``root_rank``'s; state not created yet is created first."""
    create_state(optimizer)
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    params = [p for g in optimizer.param_groups for p in g["params"]]
    layout = _layout(optimizer, params)
    root_groups, root_layout = broadcast_object((groups, layout), root_rank)
    if len(root_groups) != len(groups) or len(root_layout) != len(layout):
        raise ValueError(
            "broadcast_optimizer_state: the optimizers differ across ranks "
            f"({len(groups)} groups and {len(layout)} parameters here, {len(root_groups)} and "
            f"{len(root_layout)} on rank {root_rank})"
        )
    for g, root in zip(optimizer.param_groups, root_groups, strict=True):
        for k, v in root.items():
            if torch.is_tensor(g.get(k)) and torch.is_tensor(v):
                g[k].copy_(v)
            else:
                g[k] = v
    tensors = []
    for p, mine, root in zip(params, layout, root_layout, strict=True):
        if mine.keys() != root.keys() or any(
            mine[k] != root[k] for k in root if root[k][0] == "tensor"
        ):
            raise ValueError(
                "broadcast_optimizer_state: the state of a parameter of shape "
                f"{tuple(p.shape)} differs across ranks: {mine} here, {root} on rank {root_rank}"
            )
        for k, desc in root.items():
            if desc[0] == "value":
                optimizer.state[p][k] = desc[1]
            else:
                tensors.append(optimizer.state[p][k])
    with torch.no_grad():
        broadcast_tensors(tensors, root_rank, "broadcast_optimizer_state")
