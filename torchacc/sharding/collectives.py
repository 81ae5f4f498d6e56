"""Collectives on torchacc tensors, recorded in the step and run by XLA at the next sync.

Each collective is a custom op (``torch.ops.torchacc_dist.*``, ``sharding/rules.py``) with a meta
kernel and a lowering rule marked ``torchacc_collective``: recording it is ordinary op recording
(dispatch.py), and a graph that holds one compiles as a manual region over the process axis of the
job-wide mesh (Note [Multi-process programs] in ``torchacc/distributed/__init__.py``).

The helpers below are what ``xm.*`` and the ``"xla"`` process group call. Their arguments follow
torch_xla's ``xla_model``: ``reduce_type`` is ``"sum"``, ``"avg"``/``"mean"``, ``"min"``,
``"max"``, ``"mul"``/``"product"``, ``"and"``/``"or"`` (bool tensors), or a
``torch.distributed.ReduceOp``. Lists are reduced in place (one coalesced collective) and returned;
a single tensor gives a new tensor. ``groups`` may be None or the whole world (``[[0, ..., W-1]]``);
sub-groups raise ``NotImplementedError`` naming the op. In a one-process job nothing is recorded:
the helpers do the (trivial) math locally.
"""

from __future__ import annotations

import itertools

import torch

from torchacc.distributed.host import barrier, rendezvous  # noqa: F401  (xm's host-side waits)
from torchacc.engine import execute
from torchacc.lazy.tensor import LazyTensor
from torchacc.runtime.processes import is_initialized, local_rank, rank, world_size
from torchacc.sharding import rules

__all__ = [
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "collective_broadcast",
    "all_to_all",
    "barrier",
    "rendezvous",
    "broadcast_parameters",
    "broadcast_master_param",
    "world_size",
    "rank",
    "local_rank",
    "is_initialized",
]


ops = rules.ops


def _eager_kernel(name):
    """CPU/CUDA kernel (compile_step's eager first call): the rule as a one-op program."""
    op = getattr(ops, name).default

    def kernel(*args):
        from torchacc.dynamo import collective

        return collective.run_eager(op, args)

    return kernel


for _name in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"):
    rules._dist.impl(_name, _eager_kernel(_name), "CPU")
    rules._dist.impl(_name, _eager_kernel(_name), "CUDA")

# --------------------------------------------------------------------------------------------
# helpers (xm-style API)

_REDUCE_NAMES = {
    "sum": "sum",
    "add": "sum",
    "avg": "avg",
    "mean": "avg",
    "min": "min",
    "max": "max",
    "mul": "product",
    "prod": "product",
    "product": "product",
    "and": "and",
    "band": "and",
    "or": "or",
    "bor": "or",
}


def reduce_op_name(reduce_type, name="all_reduce"):
    """The canonical reduction name for a string or ``torch.distributed.ReduceOp``."""
    if isinstance(reduce_type, str):
        op = _REDUCE_NAMES.get(reduce_type.lower())
        if op is None:
            raise ValueError(
                f"torchacc.distributed.{name}: unknown reduce type {reduce_type!r} (expected one "
                f"of {sorted(_REDUCE_NAMES)})"
            )
        return op
    import torch.distributed as dist

    R = dist.ReduceOp
    for member, op in (
        (R.SUM, "sum"),
        (R.AVG, "avg"),
        (R.MIN, "min"),
        (R.MAX, "max"),
        (R.PRODUCT, "product"),
        (R.BAND, "and"),
        (R.BOR, "or"),
    ):
        if reduce_type == member:
            return op
    raise NotImplementedError(
        f"torchacc.distributed.{name}: reduce op {reduce_type} is unsupported"
    )


def check_groups(name, groups):
    """Accept None or the whole world; raise NotImplementedError naming ``name`` otherwise."""
    if groups is None or len(groups) == 0:
        return
    w = world_size()
    if len(groups) == 1 and sorted(int(r) for r in groups[0]) == list(range(w)):
        return
    raise NotImplementedError(
        f"torchacc.distributed.{name}: groups={groups!r} is not supported; collectives run over "
        f"all {w} processes of the job (groups=None or [[0, ..., {w - 1}]])"
    )


def _check_tensors(name, tensors):
    for t in tensors:
        # torchacc tensors, or CPU/CUDA tensors of a step compiled by torchacc.compile_step
        if not isinstance(t, LazyTensor) and not (
            isinstance(t, torch.Tensor) and t.device.type in ("cpu", "cuda")
        ):
            where = t.device if isinstance(t, torch.Tensor) else type(t).__name__
            raise TypeError(
                f"torchacc.distributed.{name}: expected torchacc tensors (or CPU/CUDA tensors in "
                f"a torchacc.compile_step step), got {where}"
            )


def _check_reduction(name, op, tensors, scale):
    for t in tensors:
        if t.dtype.is_complex:
            raise NotImplementedError(
                f"torchacc.distributed.{name}: complex tensors are unsupported"
            )
        if op == "avg" and not t.dtype.is_floating_point:
            raise NotImplementedError(
                f"torchacc.distributed.{name}: reduce type 'avg' needs floating point tensors, "
                f"got {t.dtype}"
            )
        if op in ("and", "or") and t.dtype != torch.bool:
            raise NotImplementedError(
                f"torchacc.distributed.{name}: reduce type {op!r} is supported for bool tensors "
                f"only, got {t.dtype}"
            )
        if scale != 1.0 and not t.dtype.is_floating_point:
            raise NotImplementedError(
                f"torchacc.distributed.{name}: scale={scale} on a {t.dtype} tensor (scaling "
                "applies to floating point tensors)"
            )


def _write(targets, results):
    with torch.no_grad():
        for t, r in zip(targets, results, strict=True):
            t.copy_(r)


def _local_scale(t, scale):
    return t * scale if scale != 1.0 else t.clone()


def all_reduce(reduce_type, inputs, scale=1.0, groups=None, pin_layout=True):
    """Reduce over all processes, then multiply by ``scale`` (torch_xla's ``xm.all_reduce``).

    A list is reduced in place (one coalesced collective) and returned; a tensor gives a new one.
    """
    op = reduce_op_name(reduce_type)
    check_groups("all_reduce", groups)
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    if not tensors:
        return inputs
    results = all_reduce_coalesced(op, tensors, scale)
    if single:
        return results[0]
    _write(tensors, results)
    return inputs


def all_reduce_coalesced(reduce_type, tensors, scale=1.0):
    """Reduce a list of tensors over all processes as one collective; returns new tensors."""
    op = reduce_op_name(reduce_type)
    tensors, scale = list(tensors), float(scale)
    _check_tensors("all_reduce", tensors)
    _check_reduction("all_reduce", op, tensors, scale)
    if not tensors:
        return []
    if world_size() == 1:
        return [_local_scale(t, scale) for t in tensors]
    return list(ops.all_reduce.default(tensors, op, scale, scale != 1.0))


def all_gather(value, dim=0, groups=None, output=None, pin_layout=True):
    """Concatenate every process's ``value`` along ``dim`` (rank order)."""
    check_groups("all_gather", groups)
    if isinstance(value, (list, tuple)):
        results = [all_gather(v, dim) for v in value]
        if output is not None:
            _write(output, results)
            return output
        return results
    _check_tensors("all_gather", [value])
    w = world_size()
    if value.dim() == 0:  # scalars gather into a vector
        value = value.unsqueeze(0)
    dim = dim % value.dim()
    result = value.clone() if w == 1 else ops.all_gather.default(value, dim, w)
    if output is not None:
        _write([output], [result])
        return output
    return result


def reduce_scatter(
    reduce_type,
    input,
    scale=1.0,
    scatter_dim=0,
    shard_count=None,
    groups=None,
    output=None,
    pin_layout=True,
):
    """Reduce over all processes and keep this process's ``1/world`` block of ``scatter_dim``."""
    op = reduce_op_name(reduce_type, "reduce_scatter")
    check_groups("reduce_scatter", groups)
    w = world_size()
    if shard_count is not None and int(shard_count) != w:
        raise NotImplementedError(
            f"torchacc.distributed.reduce_scatter: shard_count={shard_count} must equal the world "
            f"size {w}"
        )
    if isinstance(input, (list, tuple)):
        results = [reduce_scatter(op, x, scale, scatter_dim, shard_count) for x in input]
        if output is not None:
            _write(output, results)
            return output
        return results
    scale = float(scale)
    _check_tensors("reduce_scatter", [input])
    _check_reduction("reduce_scatter", op, [input], scale)
    dim = scatter_dim % max(input.dim(), 1)
    if input.shape[dim] % w:
        raise ValueError(
            f"torchacc.distributed.reduce_scatter: dimension {dim} of size {input.shape[dim]} "
            f"does not split into {w} equal blocks"
        )
    if w == 1:
        result = _local_scale(input, scale)
    else:
        result = ops.reduce_scatter.default(input, op, scale, scale != 1.0, dim, w)
    if output is not None:
        _write([output], [result])
        return output
    return result


def broadcast(tensors, src=0, groups=None):
    """Every process gets process ``src``'s values (bit-exact).

    A list is overwritten in place and returned; a single tensor gives a new tensor.
    """
    check_groups("broadcast", groups)
    single = isinstance(tensors, torch.Tensor)
    items = [tensors] if single else list(tensors)
    if not items:
        return tensors
    _check_tensors("broadcast", items)
    w = world_size()
    if not 0 <= int(src) < w:
        raise ValueError(f"torchacc.distributed.broadcast: src={src} is not a rank in [0, {w})")
    if w == 1:
        results = [t.clone() for t in items]
    else:
        results = ops.broadcast.default(items, int(src))
    if single:
        return results[0]
    _write(items, results)
    return tensors


def collective_broadcast(tensors, root_ordinal=0, groups=None, pin_layout=True):
    """torch_xla's ``xm.collective_broadcast``: in place on a list of tensors."""
    broadcast(list(tensors), root_ordinal, groups)


def all_to_all(
    value, split_dimension=0, concat_dimension=0, split_count=None, groups=None, pin_layout=True
):
    """Split ``value`` into ``world`` blocks along ``split_dimension``, send block ``i`` to rank
    ``i``, and concatenate the received blocks (rank order) along ``concat_dimension``."""
    check_groups("all_to_all", groups)
    _check_tensors("all_to_all", [value])
    w = world_size()
    if split_count is not None and int(split_count) != w:
        raise NotImplementedError(
            f"torchacc.distributed.all_to_all: split_count={split_count} must equal the world "
            f"size {w}"
        )
    nd = max(value.dim(), 1)
    split, concat = split_dimension % nd, concat_dimension % nd
    if value.shape[split] % w:
        raise ValueError(
            f"torchacc.distributed.all_to_all: dimension {split} of size {value.shape[split]} does "
            f"not split into {w} equal blocks"
        )
    if w == 1:
        return value.clone()
    return ops.all_to_all.default(value, split, concat, w)


# --------------------------------------------------------------------------------------------
# recipes


def broadcast_parameters(module, src=0):
    """Overwrite ``module``'s parameters and buffers with process ``src``'s (replicas start equal).

    Like torch_xla's ``broadcast_master_param`` it syncs right away, so the parameters hold their
    final values on return (no rank can later read them alone while the broadcast is pending).
    Returns ``module``.
    """
    tensors = [
        t
        for t in itertools.chain(module.parameters(), module.buffers())
        if isinstance(t, LazyTensor)
    ]
    if tensors and world_size() > 1:
        execute.sync()  # pending work may differ between ranks (a rank-0-only load): run it alone
        broadcast(tensors, src)
        execute.sync()
    return module


def broadcast_master_param(model):
    """torch_xla's ``xm.broadcast_master_param``: rank 0's parameters and buffers everywhere."""
    broadcast_parameters(model, 0)
