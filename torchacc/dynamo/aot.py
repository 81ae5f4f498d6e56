"""The ``torch.compile(..., backend="torchacc")`` backend: dynamo -> AOTAutograd -> lowered JAX.

Dynamo captures a Python frame as an FX graph of torch calls (graph breaks run eagerly between
captured graphs); AOTAutograd functionalizes it, decomposes it to ATen and splits it into a
forward and a backward graph; each of those becomes one jitted JAX program (lower.py).

Decompositions: core ATen's, minus every op the lowering registry already has a rule for (so a
fused rule such as SDPA, layer norm or convolution backward is kept whole).

Metrics (torchacc.metrics): ``DynamoGraph`` (graphs dynamo handed to the backend),
``DynamoRecompile`` (of those, recompiles of an already compiled frame after a guard failure;
``TORCHACC_DEBUG=1`` prints dynamo's guard-failure reason), ``DynamoCompile`` (XLA compiles,
``DynamoCompileTime``), ``DynamoCacheHit`` (a forward/backward graph identical to one compiled
before reused its programs), ``DynamoExecute`` (program calls) and ``aten::<op>`` (eager runs of an
op with no lowering, Note [Fallback policy] in lower.py).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch._dynamo
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from torchacc import metrics
from torchacc.dynamo import lower
from torchacc.lowering import lookup, scan_rewrites

_lowered: dict = {}  # structural key of an AOT graph -> Lowered (reused across recompiles)
_failures_seen = [0]


@functools.lru_cache(maxsize=None)
def decompositions():
    """AOTAutograd's decomposition table: core ATen minus the ops torchacc lowers directly."""
    from torch._decomp import core_aten_decompositions

    table = {op: fn for op, fn in core_aten_decompositions().items() if lookup(op) is None}
    table[torch.ops.aten.native_batch_norm.default] = _native_batch_norm
    return table


def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    """``native_batch_norm`` writes the running stats although its schema does not say so, so
    functionalization would lose them: training with stats becomes the functional op plus
    visible ``copy_`` writes (the lowering keeps the other cases whole)."""
    if not training or running_mean is None or running_var is None:
        return NotImplemented
    out, mean, rstd, new_mean, new_var = torch.ops.aten._native_batch_norm_legit_functional(
        x, weight, bias, running_mean, running_var, training, momentum, eps
    )
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


def _structural_key(gm, example_inputs):
    if any(n.op == "get_attr" for n in gm.graph.nodes):
        return None  # constants' values are not in the code text
    avals = []
    for x in example_inputs:
        if isinstance(x, torch.Tensor):
            avals.append((tuple(x.shape), tuple(x.stride()), x.dtype, x.device.type))
        else:
            avals.append(type(x))
    return gm.code, tuple(avals)


def lower_graph(gm, example_inputs, name):
    """A cached Lowered for an AOT forward/backward/inference graph."""
    try:
        key = _structural_key(gm, example_inputs)
        hash(key)
    except TypeError:  # symbolic sizes in example inputs
        key = None
    if key is not None and key in _lowered:
        metrics.counter_inc("DynamoCacheHit")
        return _lowered[key]
    compiled = lower.Lowered(gm, name=name)
    if compiled.fallback_ops and lower.debug_enabled():
        print(
            f"torchacc.dynamo: {name} graph runs {len(compiled.fallback_ops)} op(s) eagerly "
            f"(no lowering): {sorted(set(compiled.fallback_ops))}",
            file=sys.stderr,
        )
    if key is not None:
        _lowered[key] = compiled
    return compiled


def _fw(gm, example_inputs):
    compiled = lower_graph(gm, example_inputs, "forward")
    ctx = torch._guards.TracingContext.try_get()
    if ctx is not None:  # the backward compiles (lazily) under this same context
        ctx._torchacc_forward = compiled
    return compiled


def _bw(gm, example_inputs):
    compiled = lower_graph(gm, example_inputs, "backward")
    ctx = torch._guards.TracingContext.try_get()
    forward = getattr(ctx, "_torchacc_forward", None)
    if forward is not None and compiled._grad_src is None:
        compiled.grads_of(forward)  # SPMD: gradients laid out as their inputs
    return compiled


def _inference(gm, example_inputs):
    return lower_graph(gm, example_inputs, "inference")


def _new_guard_failures():
    """Guard-failure reasons dynamo recorded since the last call (its own bookkeeping)."""
    from torch._dynamo.utils import guard_failures

    reasons = [r for rs in guard_failures.values() for r in rs]
    fresh = reasons[_failures_seen[0] :]
    _failures_seen[0] = len(reasons)
    return fresh


def _note_compile(gm):
    metrics.counter_inc("DynamoGraph")
    cid = torch._guards.CompileContext.current_compile_id()
    reasons = _new_guard_failures()
    if cid is not None and cid.frame_compile_id:
        metrics.counter_inc("DynamoRecompile")
        if lower.debug_enabled():
            why = "; ".join(reasons) if reasons else "dynamo gave no guard-failure reason"
            print(f"torchacc.dynamo: recompiling (compile {cid}): {why}", file=sys.stderr)
    elif lower.debug_enabled():
        n = sum(1 for n in gm.graph.nodes if n.op == "call_function")
        print(f"torchacc.dynamo: new graph (compile {cid}), {n} torch ops", file=sys.stderr)


def _partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
    """torch's min-cut partition; what the forward saves for a backward scan is rewritten not to
    copy stacks (Note [Copy-free backward scans] in torchacc/lowering/scan_rewrites.py)."""
    fw, bw = min_cut_rematerialization_partition(
        joint, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs
    )
    scan_rewrites.rewrite_partition(fw, bw, num_fwd_outputs)
    return fw, bw


_aot = aot_autograd(
    fw_compiler=_fw,
    bw_compiler=_bw,
    inference_compiler=_inference,
    decompositions=decompositions,
    partition_fn=_partition,
    keep_inference_input_mutations=False,
)


def backend(gm, example_inputs, **kwargs):
    """The dynamo backend (``torch.compile(model, backend="torchacc")``)."""
    if kwargs:
        raise TypeError(
            f"torchacc backend: unknown options {sorted(kwargs)} (it takes none; use "
            "torch.compile's own arguments)"
        )
    _note_compile(gm)
    return _aot(gm, example_inputs)
