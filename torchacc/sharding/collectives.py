"""Collectives on torchacc tensors, recorded in the step and run by XLA at the next sync.

Each collective is a custom op (``torch.ops.torchacc_dist.*``, ``sharding/rules.py``) with a meta
kernel and a lowering rule marked ``torchacc_collective``: recording it is ordinary op recording
(dispatch.py), and a graph that holds one compiles as a manual region over the process axis of the
job-wide mesh (Note [Multi-process programs] in ``torchacc/distributed/__init__.py``).

The helpers below are what ``xm.*`` and the ``"xla"`` process group call. Their arguments follow
torch_xla's ``xla_model``: ``reduce_type`` is ``"sum"``, ``"avg"``/``"mean"``, ``"min"``,
``"max"``, ``"mul"``/``"product"``, ``"and"``/``"or"`` (bool tensors), or a
``torch.distributed.ReduceOp``. Lists are reduced in place (one coalesced collective) and returned;
a single tensor gives a new tensor. ``groups`` may be None, the whole world, or sub-groups that
partition the members (``[[0, 1], [2, 3]]``). Inside a manual region (``sharding.regions``) the
members are the region's, along its axes; otherwise they are the job's processes. With one member
nothing is recorded: the helpers do the (trivial) math locally.
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
    "collective_permute",
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


for _name in (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "collective_permute",
):
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


class _Region:
    """The manual region whose function is being traced: its axes and their size."""

    __slots__ = ("axes", "size")

    def __init__(self, axes, size):
        self.axes, self.size = tuple(axes), int(size)


_regions: list = []  # stack: collectives called while a region's function is traced


def in_region():
    """The manual region being traced (``sharding.regions``), or None."""
    return _regions[-1] if _regions else None


def _members():
    """How many members a collective runs over: the region's size inside a manual region, else
    the number of processes."""
    r = in_region()
    return r.size if r is not None else world_size()


def _where():
    r = in_region()
    if r is None:
        return f"the job's {world_size()} processes"
    return f"the manual region's axes {r.axes} ({r.size} members)"


def check_groups(name, groups, equal=True):
    """``groups`` as the rules' static string: "" for None / every member, else sub-groups that
    must partition the members (each member once; of one size where ``equal``). A ValueError
    names the op and the groups otherwise."""
    if groups is None or len(groups) == 0:
        return ""
    w = _members()
    try:
        gs = [[int(r) for r in g] for g in groups]
    except (TypeError, ValueError):
        raise ValueError(
            f"torchacc.distributed.{name}: groups={groups!r} must be a list of lists of ranks"
        ) from None
    flat = sorted(r for g in gs for r in g)
    if flat != list(range(w)) or any(not g for g in gs):
        raise ValueError(
            f"torchacc.distributed.{name}: groups={groups!r} do not partition the members "
            f"0..{w - 1} of {_where()} (each must appear in exactly one group)"
        )
    if len(gs) == 1:
        return ""
    if equal and len({len(g) for g in gs}) != 1:
        raise ValueError(
            f"torchacc.distributed.{name}: groups={groups!r} must all have the same size"
        )
    return rules.format_groups(gs)


def _group_size(groups):
    return len(rules.parse_groups(groups)[0]) if groups else _members()


def _check_tensors(name, tensors):
    for t in tensors:
        if in_region() is not None and isinstance(t, torch.Tensor):
            continue  # the region's traced (fake) tensors
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
    """Reduce over all processes (or ``groups`` of them; inside a manual region, over its axes),
    then multiply by ``scale`` (torch_xla's ``xm.all_reduce``).

    A list is reduced in place (one coalesced collective) and returned; a tensor gives a new one.
    """
    op = reduce_op_name(reduce_type)
    g = check_groups("all_reduce", groups, equal=False)
    single = isinstance(inputs, torch.Tensor)
    tensors = [inputs] if single else list(inputs)
    if not tensors:
        return inputs
    results = all_reduce_coalesced(op, tensors, scale, _groups=g)
    if single:
        return results[0]
    _write(tensors, results)
    return inputs


def all_reduce_coalesced(reduce_type, tensors, scale=1.0, _groups=""):
    """Reduce a list of tensors over all processes as one collective; returns new tensors."""
    op = reduce_op_name(reduce_type)
    tensors, scale = list(tensors), float(scale)
    _check_tensors("all_reduce", tensors)
    _check_reduction("all_reduce", op, tensors, scale)
    if not tensors:
        return []
    if _members() == 1:
        return [_local_scale(t, scale) for t in tensors]
    return list(ops.all_reduce.default(tensors, op, scale, scale != 1.0, _groups))


def all_gather(value, dim=0, groups=None, output=None, pin_layout=True):
    """Concatenate every member's ``value`` along ``dim`` (rank order; each group's members
    in the group's order with ``groups``)."""
    g = check_groups("all_gather", groups)
    if isinstance(value, (list, tuple)):
        results = [all_gather(v, dim, groups) for v in value]
        if output is not None:
            _write(output, results)
            return output
        return results
    _check_tensors("all_gather", [value])
    w = _group_size(g)
    if value.dim() == 0:  # scalars gather into a vector
        value = value.unsqueeze(0)
    dim = dim % value.dim()
    result = value.clone() if w == 1 else ops.all_gather.default(value, dim, w, g)
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
    """Reduce over all members (of each group) and keep this member's ``1/size`` block of
    ``scatter_dim``."""
    op = reduce_op_name(reduce_type, "reduce_scatter")
    g = check_groups("reduce_scatter", groups)
    w = _group_size(g)
    if shard_count is not None and int(shard_count) != w:
        raise NotImplementedError(
            f"torchacc.distributed.reduce_scatter: shard_count={shard_count} must equal the "
            f"number of members {w} of {_where() if not g else 'each group'}"
        )
    if isinstance(input, (list, tuple)):
        results = [reduce_scatter(op, x, scale, scatter_dim, shard_count, groups) for x in input]
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
        result = ops.reduce_scatter.default(input, op, scale, scale != 1.0, dim, w, g)
    if output is not None:
        _write([output], [result])
        return output
    return result


def broadcast(tensors, src=0, groups=None):
    """Every member gets member ``src``'s values (bit-exact; with ``groups``, ``src`` is the
    position in each group of its sender).

    A list is overwritten in place and returned; a single tensor gives a new tensor.
    """
    g = check_groups("broadcast", groups)
    single = isinstance(tensors, torch.Tensor)
    items = [tensors] if single else list(tensors)
    if not items:
        return tensors
    _check_tensors("broadcast", items)
    w = _group_size(g)
    if not 0 <= int(src) < w:
        raise ValueError(f"torchacc.distributed.broadcast: src={src} is not a rank in [0, {w})")
    if _members() == 1:
        results = [t.clone() for t in items]
    else:
        results = ops.broadcast.default(items, int(src), g)
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
    """Split ``value`` into ``size`` blocks along ``split_dimension``, send block ``i`` to member
    ``i`` (of this member's group), and concatenate the received blocks along
    ``concat_dimension``."""
    g = check_groups("all_to_all", groups)
    _check_tensors("all_to_all", [value])
    w = _group_size(g)
    if split_count is not None and int(split_count) != w:
        raise NotImplementedError(
            f"torchacc.distributed.all_to_all: split_count={split_count} must equal the number "
            f"of members {w}"
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
    return ops.all_to_all.default(value, split, concat, w, g)


def check_pairs(name, pairs):
    """``pairs`` ([(source, target), ...]) as the rule's static string; a ValueError unless they
    are a (partial) permutation of the members: each source and each target at most once."""
    w = _members()
    try:
        ps = [(int(a), int(b)) for a, b in pairs]
    except (TypeError, ValueError):
        raise ValueError(
            f"torchacc.distributed.{name}: pairs={pairs!r} must be (source, target) pairs"
        ) from None
    bad = [p for p in ps if not (0 <= p[0] < w and 0 <= p[1] < w)]
    srcs, dsts = [a for a, _ in ps], [b for _, b in ps]
    if bad or len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
        raise ValueError(
            f"torchacc.distributed.{name}: pairs={pairs!r} are not a permutation of the members "
            f"0..{w - 1} of {_where()}"
            + (f" (out of range: {bad})" if bad else " (a source or target repeats)")
        )
    return rules.format_groups(ps)


def collective_permute(value, pairs):
    """torch_xla's ``xm.collective_permute``: member ``target`` gets member ``source``'s
    ``value`` for each pair; a member no pair sends to gets zeros (one ppermute)."""
    p = check_pairs("collective_permute", pairs)
    _check_tensors("collective_permute", [value])
    if _members() == 1:
        return value.clone() if p == "0,0" else torch.zeros_like(value)
    return ops.collective_permute.default(value, p)


def send_recv(value, source, target, name="send"):
    """``value`` moved from member ``source`` to member ``target`` (torch's blocking
    ``dist.send``/``recv``): one ppermute that both call (``value`` a buffer of the right shape on
    the receiver), run at once with just what it needs, so the sender's and the receiver's
    programs hold the same collective in the order they call. In a job of more than two processes
    the ppermute is a program over the two processes' devices alone (``manual.pair_permute``):
    the others take no part (in SPMD mode ``point_to_point.send_recv`` takes a program of the
    two peers instead, Note [Send and receive in SPMD mode]). The receiver's result."""
    if source == target:
        return value
    if world_size() > 2 and in_region() is None:  # a program of the two processes alone
        from torchacc.lazy.transfer import _array_of, _tensor_of
        from torchacc.sharding import manual

        out = manual.pair_permute(_array_of(value), int(source), int(target))
        return _tensor_of(out, value.dtype)
    result = collective_permute(value, [(int(source), int(target))])
    from torchacc.lazy.record import value_of

    v = value_of(result)
    if v.node is not None:
        execute.run([v], donate=False)
    return result


# --------------------------------------------------------------------------------------------
# recipes


# Note [One gradient average, one start]
# Every front door that averages gradients (DDP, Horovod's DistributedOptimizer, ta.accelerate's
# dp, xm.reduce_gradients) calls ``average_gradients``: one coalesced all_reduce of the list,
# summed then scaled (1/members by default), written back in place. Every front door that makes
# replicas start equal (DDP, hvd.broadcast_parameters / broadcast_optimizer_state, accelerate,
# xm.broadcast_master_param, the drop-in's broadcast of a state) calls ``start_equal``: each
# rank's pending work runs alone first (ranks may differ in it: rank 0 alone loaded a
# checkpoint, and a program holding a collective must be the same on every rank), then one
# bit-exact broadcast, then a sync, so the values are final on return and no rank later reads
# them alone while the broadcast is pending.


def average_gradients(grads, scale=None, op="sum", groups=None):
    """The gradient-averaging recipe (Note [One gradient average, one start]): ``grads`` (None
    entries skipped) reduced by ``op`` over the members as one collective, times ``scale``
    (default ``1 / members``: the mean), in place. Returns the reduced list."""
    grads = [g for g in grads if g is not None]
    if not grads:
        return grads
    if scale is None:
        scale = 1.0 / _members()
    all_reduce(op, grads, scale=scale, groups=groups)
    return grads


def start_equal(tensors, src=0):
    """The "start ranks equal" recipe (Note [One gradient average, one start]): the torchacc
    tensors among ``tensors`` overwritten in place with rank ``src``'s."""
    lazy = [t for t in tensors if isinstance(t, LazyTensor)]
    if lazy and world_size() > 1:
        execute.sync()
        broadcast(lazy, src)
        execute.sync()
    return tensors


def broadcast_parameters(module, src=0):
    """Overwrite ``module``'s parameters and buffers with process ``src``'s (replicas start equal,
    ``start_equal``). Returns ``module``."""
    start_equal(list(itertools.chain(module.parameters(), module.buffers())), src)
    return module


def broadcast_master_param(model):
    """torch_xla's ``xm.broadcast_master_param``: rank 0's parameters and buffers everywhere."""
    broadcast_parameters(model, 0)
