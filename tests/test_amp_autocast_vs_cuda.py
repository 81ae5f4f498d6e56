"""torchacc's autocast policy compared in full with CUDA autocast, op by op, by behaviour.

Note [Probing CUDA autocast without a GPU]
PyTorch's CUDA autocast kernels (ATen/autocast_mode.cpp) are compiled into every build, CPU-only
ones included, and registered at the ``AutocastCUDA`` dispatch key. The dispatcher lists every op
that has one (``torch._C._dispatch_dump``): that is the complete CUDA op list, not a copy of it.
What each kernel *does* is observed, not read: a probe tensor (a wrapper subclass that only claims
to live on ``cuda`` or ``torchacc``) is passed to the op with autocast on. The autocast kernel
casts the arguments it wants cast (the probe answers ``_to_copy``/``to`` with a probe of the new
dtype) and calls the next op down, which reaches the probe's ``__torch_dispatch__``: it stops there
and reports which op was called with which dtypes. Autograd is excluded while probing so that
composite ops (``conv2d``, ``matmul``) arrive undecomposed and shapes never matter. Running the same
probe against torch's CUDA kernels and torchacc's ``AutocastPrivateUse1`` kernels for several input
dtype mixes compares the two policies completely: which ops have one, lower precision vs float32,
``dtype=`` set or appended, promotion, and the banned op's error.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._pytree import tree_leaves

import torchacc
from torchacc.amp import autocast_policy

aten = torch.ops.aten

# CUDA autocast ops torchacc deliberately has no policy for, and why.
NOT_ON_TORCHACC = {
    # cuDNN's own kernels: only reachable with CUDA tensors, never recorded on the torchacc device
    # (convolutions on torchacc are aten.convolution, which is in the lower-precision list).
    "aten::cudnn_convolution": "cuDNN kernel",
    "aten::cudnn_convolution_transpose": "cuDNN kernel",
}


_PRIORITIZE_ERROR = "Unexpected floating ScalarType in at::autocast::prioritize"


def _deliberate_difference(cuda, ours):
    """The one deliberate difference in behaviour. A "promote" op (addcmul, dot, atan2, ...) given
    the *other* 16-bit type (float16 under bfloat16 autocast, or the reverse): CUDA raises
    "Unexpected floating ScalarType in at::autocast::prioritize"; torchacc computes in float32,
    which holds both types exactly (torchacc/amp/autocast_policy.py, ``_promote_dtype``)."""
    return (
        cuda[0] == "error"
        and _PRIORITIZE_ERROR in cuda[1]
        and ours[0] != "error"
        and {d for d in ours[1] if "float" in d} == {"torch.float32"}
    )


class _Reached(Exception):
    """The op an autocast kernel called, with its arguments."""


class _Probe(torch.Tensor):
    @staticmethod
    def __new__(cls, dtype, device):
        return torch.Tensor._make_wrapper_subclass(cls, (2, 2), dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (aten._to_copy.default, aten.to.dtype):  # the autocast casts
            dtype = kwargs.get("dtype") or (args[1] if func is aten.to.dtype else None)
            return _Probe(dtype or args[0].dtype, args[0].device)
        raise _Reached(func, args, kwargs)


def _cuda_autocast_ops():
    """Every op with a (non-fallthrough) AutocastCUDA kernel in this torch build."""
    ops = set()
    for name in torch._C._dispatch_get_all_op_names():
        for line in torch._C._dispatch_dump(name).splitlines():
            if line.startswith("AutocastCUDA:") and "fallthrough" not in line:
                ops.add(name)
    return ops


def _torchacc_policy_ops():
    names = set()
    tables = (
        autocast_policy.LOWER_PRECISION_FP,
        autocast_policy.FP32,
        autocast_policy.FP32_SET_OPT_DTYPE,
        autocast_policy.PROMOTE,
        autocast_policy.BANNED,
        [entry for entry, _ in autocast_policy.FP32_APPEND_DTYPE],
    )
    for table in tables:
        for name, overload in table:
            names.add(f"aten::{name}" + ("" if overload == "default" else f".{overload}"))
    return names


def _overload(qualified):
    base, _, overload = qualified.split("::")[1].partition(".")
    return getattr(getattr(aten, base), overload or "default")


def _value(type_name, tensor):
    """An argument of the schema type ``type_name`` (tensors from ``tensor()``)."""
    optional = type_name.startswith("Optional[")
    if optional:
        type_name = type_name[len("Optional[") : -1]
    if type_name == "Tensor":
        return tensor()
    if type_name == "List[Tensor]":
        return [tensor(), tensor()]
    if type_name == "List[Optional[Tensor]]":  # indices (index_put): integers in any valid call
        return [tensor(torch.int64)]
    if optional:
        return None
    if type_name.startswith("List["):
        return [1]
    simple = {
        "int": 1,
        "SymInt": 1,
        "float": 1.0,
        "bool": False,
        "Scalar": 1.0,
        "number": 1.0,
        "str": "ij",
    }
    if type_name not in simple:
        raise TypeError(f"no probe value for schema type {type_name}")
    return simple[type_name]


def _arguments(op, dtypes, device):
    """The op's required arguments; tensors take ``dtypes`` in turn (the last one repeats)."""
    remaining = list(dtypes)

    def tensor(dtype=None):
        if dtype is None:
            dtype = remaining.pop(0) if len(remaining) > 1 else remaining[0]
        return _Probe(dtype, device)

    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.has_default_value():
            continue
        v = _value(str(a.type), tensor)
        if a.kwarg_only:
            kwargs[a.name] = v
        else:
            args.append(v)
    return args, kwargs


def _observe(op, dtypes, device):
    """What the autocast kernel for ``device`` does with tensors of ``dtypes``."""
    args, kwargs = _arguments(op, dtypes, device)
    try:
        with torch._C._AutoDispatchBelowAutograd():
            op(*args, **kwargs)
    except _Reached as reached:
        func, a, k = reached.args
        leaves = [x for x in tree_leaves((a, k)) if isinstance(x, (torch.Tensor, torch.dtype))]
        return str(func), tuple(str(x.dtype if isinstance(x, torch.Tensor) else x) for x in leaves)
    except RuntimeError as e:  # the banned op
        return "error", str(e)
    raise AssertionError(f"{op}: the probe was never reached")


def _cuda(op, low, dtypes):
    prev_enabled, prev_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", low)
    try:
        return _observe(op, dtypes, "cuda")
    finally:
        torch.set_autocast_enabled("cuda", prev_enabled)
        torch.set_autocast_dtype("cuda", prev_dtype)
        torch.clear_autocast_cache()


def _torchacc(op, low, dtypes):
    with torch.autocast(torchacc.device().type, dtype=low):
        return _observe(op, dtypes, torchacc.device())


def test_torchacc_has_a_policy_for_every_cuda_autocast_op():
    cuda, ours = _cuda_autocast_ops(), _torchacc_policy_ops()
    assert len(cuda) > 100, "the dispatcher lists CUDA autocast's ops"
    assert cuda - ours == set(NOT_ON_TORCHACC), "CUDA autocast ops without a torchacc policy"
    assert ours <= cuda, f"torchacc policies CUDA does not have: {sorted(ours - cuda)}"


F32, F64, F16, BF16 = torch.float32, torch.float64, torch.float16, torch.bfloat16


@pytest.mark.parametrize("low", [F16, BF16], ids=["fp16", "bf16"])
def test_every_op_behaves_like_cuda_autocast(low):
    other = BF16 if low == F16 else F16
    mixes = [[F32], [low], [other], [F64], [F32, low], [low, F32], [low, other], [F64, low]]
    differ = {}
    for name in sorted(_cuda_autocast_ops() - set(NOT_ON_TORCHACC)):
        op = _overload(name)
        for dtypes in mixes:
            want, got = _cuda(op, low, dtypes), _torchacc(op, low, dtypes)
            if got != want and not _deliberate_difference(want, got):
                differ[f"{name} {[str(d) for d in dtypes]}"] = {"cuda": want, "torchacc": got}
    assert not differ, f"{len(differ)} differences from CUDA autocast: {differ}"


def test_the_probe_sees_casts():
    """The probe itself: CUDA autocast casts mm's float32 inputs and leaves exp's float16 alone
    (float32 policy: cast up); a probe blind to casts would make the comparison vacuous."""
    assert _cuda(aten.mm.default, F16, [F32]) == ("aten.mm.default", ("torch.float16",) * 2)
    assert _cuda(aten.exp.default, F16, [F16]) == ("aten.exp.default", ("torch.float32",))
    assert _cuda(aten.softmax.int, F16, [F16]) == (
        "aten.softmax.int",
        ("torch.float16", "torch.float32"),
    )
