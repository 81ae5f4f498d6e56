"""Reads of values the host already knows: answered by eager PyTorch on the host, no device sync.

Note [Reads of host-known values]
Real training steps read values that depend only on the batch the host just uploaded:
transformers' attention-mask helper asks ``padding_mask.sum() == padding_mask.numel()`` in a
Python ``if`` (every LLaMA/Qwen/GPT-2 forward with an ``attention_mask``), loops count tokens with
``(labels != -100).sum().item()``, code tests ``mask.any()``. Run on the device, each such read
splits the step: the part it needs runs as its own program, the host waits for the device (the
previous step included, so host and device stop overlapping), and the step's known-step match and
graph are spoiled (torch_xla pays the same). Yet every input of the read is host data.

So a small integer/bool upload (``engine.transfer.upload``, at most its ``MIRROR_MAX_ELEMENTS``
elements) keeps a CPU copy on its Value (``Value.host``), and a read of a *pending* Value first
tries ``host_value``: if the Value's pending graph reaches only such uploads, has at most
``MAX_NODES`` nodes and only deterministic, functional ATen ops with eager semantics (no random
ops, no torchacc kernels, no CPU 0-dim tensor arguments), eager PyTorch runs those nodes on the
copies and the read returns that, counted as ``HostEvaluatedRead`` in torchacc.metrics. The
device graph is untouched: the step still computes the same ops in its one program. Anything else
(a parameter, a computed result, a bigger graph) returns None and the read syncs as before.
Only integer and bool arrays qualify, every input and output of every node: those the host and
the device compute bit for bit alike (a float read computed by eager CPU kernels could differ from
the device's rounding of the same value, which the rest of the step uses). A result whose shape or
dtype differs from the recorded desc also returns None.
"""

from __future__ import annotations

import torch

from torchacc import metrics
from torchacc.ir import fill

MAX_NODES = 64  # a read that needs more is not a mask check: it syncs as before


class _NotHostKnown(Exception):
    pass


def host_value(value):
    """A CPU tensor with pending ``value``'s data, computed by eager PyTorch from the host copies
    of the uploads it depends on; None where it is not host-known (Note [Reads of host-known
    values])."""
    try:
        out = _eval(value, {}, [MAX_NODES])
    except _NotHostKnown:
        return None
    shape, _stride, dtype, _offset = value.desc
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
        return None
    metrics.counter_inc("HostEvaluatedRead")
    return out.clone()


def _eval(value, memo, budget):
    node = value.node
    if node is None:
        host = value.host
        if host is None:  # only small integer/bool uploads keep one
            raise _NotHostKnown
        return host
    outs = memo.get(id(node))
    if outs is None:
        outs = memo[id(node)] = _run(node, memo, budget)
    return outs[value.index]


def _run(node, memo, budget):
    budget[0] -= 1
    op = node.op
    func = op.key[0]
    if budget[0] < 0 or not _eager_safe(op, func):
        raise _NotHostKnown
    inputs = [_eval(v, memo, budget) for v in node.inputs]
    scalars = node.scalars
    args = fill(op.args, inputs, scalars)
    kwargs = fill(op.kwargs, inputs, scalars)
    if "device" in kwargs:  # a factory (zeros, arange, full): made on the host here
        kwargs["device"] = _CPU
    out = func(*args, **kwargs)
    return [out] if op.kind == "one" else list(out)


_SAFE: dict = {}  # OpOverload -> bool
_CPU = torch.device("cpu")
# contents not defined by the op (the device and the host would each read their own garbage)
_UNDEFINED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}


def _exact(desc):
    """Integer and bool arrays: the host and the device compute them bit for bit alike."""
    dtype = desc[2]
    return not (dtype.is_floating_point or dtype.is_complex)


def _eager_safe(op, func):
    if op.rule.rng or op.kind not in ("one", "tuple", "list"):
        return False
    if not all(d is None or _exact(d) for d in op.descs):
        return False
    if any(type(k) is tuple and k[:1] == ("cpu0",) for k in op.key):
        return False  # a CPU 0-dim tensor argument, recorded as a Python number
    safe = _SAFE.get(func)
    if safe is None:
        safe = _SAFE[func] = (
            isinstance(func, torch._ops.OpOverload)
            and func.namespace == "aten"
            and not func._schema.is_mutable
            and torch.Tag.nondeterministic_seeded not in func.tags
            and func.overloadpacket.__name__ not in _UNDEFINED
        )
    return safe
