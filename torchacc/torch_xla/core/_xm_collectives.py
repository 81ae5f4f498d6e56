"""``xla_model``: collectives (all_reduce, gradients, gather/scatter, bucketized forms) and
the ones torchacc does not have."""

from __future__ import annotations

import sys

import torch

from torchacc import metrics  # noqa: F401
from torchacc.torch_xla._api import not_implemented
from torchacc.torch_xla.core._xm_devices import (
    _REDUCE_TYPES,
    REDUCE_SUM,
    _distributed_module,
    get_ordinal,
    xrt_world_size,
)
from torchacc.torch_xla.core._xm_step import mark_step

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


def _multi():
    """Whether collectives go to the engine: several processes, or inside a manual region
    (``xs.shard_map``), where they run over the region's axes."""
    if xrt_world_size() > 1:
        return True
    regions = sys.modules.get("torchacc.sharding.collectives")
    return regions is not None and regions.in_region() is not None


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
    if _multi():
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
    if count > 1:  # the one recipe: Note [One gradient average, one start]
        _collective("average_gradients")(
            _fetch_gradients(optimizer),
            1.0 / count,
            groups=groups,
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
    if _multi():
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
    if _multi():
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
    if _multi():
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
    if _multi():
        return _collective("collective_broadcast")(
            tensors, root_ordinal=root_ordinal, groups=groups, pin_layout=pin_layout
        )
    return None


def broadcast_master_param(model):
    """Copy rank 0's parameters into every replica (nothing to do on one)."""
    if _multi():
        return _collective("broadcast_master_param")(model)
    return None


def rendezvous(tag, payload=b"", replicas=None):
    """Wait for all replicas to reach ``tag``; returns every replica's ``payload`` (bytes)."""
    if _multi():
        return _collective("rendezvous")(tag, payload, replicas=replicas or [])
    return [payload]


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


def do_on_ordinals(target, data=(), ordinals=(0,)):
    """Run ``target(*data)`` on the listed ordinals; every replica meets at a rendezvous after."""
    result = target(*data) if get_ordinal() in ordinals else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


def xla_rendezvous(payload=b"", ordinals=None, tag=None):
    """Exchange ``payload`` bytes among replicas (every replica's payload, in rank order)."""
    return rendezvous(tag or "torch_xla.core.xla_model.xla_rendezvous", payload, ordinals)


send = not_implemented(
    "xm.send",
    "a send paired with a recv by channel id is not supported; write the exchange as "
    "xm.collective_permute(value, [(source, target)]) on every rank (one ppermute)",
)
recv = not_implemented(
    "xm.recv",
    "a recv paired with a send by channel id is not supported; write the exchange as "
    "xm.collective_permute(value, [(source, target)]) on every rank (one ppermute)",
)


def collective_permute(value, pairs):
    """Member ``target`` gets member ``source``'s ``value`` for each ``(source, target)`` pair
    (one ppermute over the processes, or over a manual region's axes); a member no pair sends to
    gets zeros."""
    return _collective("collective_permute")(value, pairs)


get_stablehlo = not_implemented(
    "xm.get_stablehlo", "StableHLO export of the pending graph is not implemented"
)
get_stablehlo_bytecode = not_implemented(
    "xm.get_stablehlo_bytecode", "StableHLO export of the pending graph is not implemented"
)
