"""Autocast kernels for the ``torchacc`` device (dispatch key ``AutocastPrivateUse1``).

PyTorch's C++ registers autocast kernels for CUDA, CPU, XPU, MPS... but none for PrivateUse1:
without this module ``torch.autocast('torchacc')`` fails on the first matmul ("Could not run
'aten::mm' with arguments from the 'Autocasttorchacc' backend"). :func:`install` registers

* a fallthrough for every op (ops without a policy run in their input dtypes), and
* a Python kernel per op family following CUDA autocast's policy, with the op lists of torch's own
  ``ATen/autocast_mode.h`` (``AT_FORALL_LOWER_PRECISION_FP`` / ``AT_FORALL_FP32`` /
  ``AT_FORALL_FP32_SET_OPT_DTYPE`` / ``AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE`` /
  ``AT_FORALL_PROMOTE``) and the same banned op (``binary_cross_entropy``).

Each kernel excludes the autocast key, casts the *eligible* tensor arguments (floating point, on the
torchacc device, not float64: CUDA's ``is_eligible``) and calls the op again. The casts go through
autograd like any op, so backward sees them. The low-precision dtype is
``torch.get_autocast_dtype('torchacc')``, which :class:`torchacc.amp.autocast` sets (bf16 unless
told otherwise). Unlike CUDA, casts of weights are not cached within an autocast region (the
cache is C++-internal); the recorded graph simply holds one cast per use.

Ops outside the lists (``cat``, ``stack``, pointwise arithmetic) rely on PyTorch's own type
promotion, which gives the same result dtypes as CUDA autocast.
"""

from __future__ import annotations

import torch
from torch.library import Library, fallthrough_kernel

from torchacc.lazy.device import DEVICE_TYPE, register_backend
from torchacc.lazy.layer_kernels import FOLDED_CASTS

aten = torch.ops.aten
_KEY = "AutocastPrivateUse1"
_KEYSET = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)

# (op, overload) lists from torch 2.13's ATen/autocast_mode.h (overload "default" = no name).
LOWER_PRECISION_FP = (
    ("_convolution", "deprecated"),
    ("_convolution", "default"),
    ("conv1d", "default"),
    ("conv2d", "default"),
    ("conv3d", "default"),
    ("conv_tbc", "default"),
    ("conv_transpose1d", "default"),
    ("conv_transpose2d", "input"),
    ("conv_transpose3d", "input"),
    ("convolution", "default"),
    ("prelu", "default"),
    ("addmm", "default"),
    ("addmv", "default"),
    ("addr", "default"),
    ("matmul", "default"),
    ("einsum", "default"),
    ("mm", "default"),
    ("mv", "default"),
    ("linalg_vecdot", "default"),
    ("linear", "default"),
    ("addbmm", "default"),
    ("baddbmm", "default"),
    ("bmm", "default"),
    ("chain_matmul", "default"),
    ("linalg_multi_dot", "default"),
    ("_thnn_fused_lstm_cell", "default"),
    ("_thnn_fused_gru_cell", "default"),
    ("lstm_cell", "default"),
    ("gru_cell", "default"),
    ("rnn_tanh_cell", "default"),
    ("rnn_relu_cell", "default"),
    ("_scaled_dot_product_flash_attention", "default"),
    ("scaled_dot_product_attention", "default"),
)
FP32 = (
    ("acos", "default"),
    ("asin", "default"),
    ("cosh", "default"),
    ("erfinv", "default"),
    ("exp", "default"),
    ("expm1", "default"),
    ("log", "default"),
    ("log10", "default"),
    ("log2", "default"),
    ("log1p", "default"),
    ("reciprocal", "default"),
    ("rsqrt", "default"),
    ("sinh", "default"),
    ("tan", "default"),
    ("pow", "Tensor_Scalar"),
    ("pow", "Tensor_Tensor"),
    ("pow", "Scalar"),
    ("softplus", "default"),
    ("layer_norm", "default"),
    ("native_layer_norm", "default"),
    ("rms_norm", "default"),
    ("group_norm", "default"),
    ("frobenius_norm", "dim"),
    ("nuclear_norm", "default"),
    ("nuclear_norm", "dim"),
    ("cosine_similarity", "default"),
    ("poisson_nll_loss", "default"),
    ("cosine_embedding_loss", "default"),
    ("nll_loss", "default"),
    ("nll_loss2d", "default"),
    ("hinge_embedding_loss", "default"),
    ("kl_div", "default"),
    ("l1_loss", "default"),
    ("smooth_l1_loss", "default"),
    ("huber_loss", "default"),
    ("mse_loss", "default"),
    ("margin_ranking_loss", "default"),
    ("multilabel_margin_loss", "default"),
    ("soft_margin_loss", "default"),
    ("triplet_margin_loss", "default"),
    ("multi_margin_loss", "default"),
    ("binary_cross_entropy_with_logits", "default"),
    ("dist", "default"),
    ("pdist", "default"),
    ("cdist", "default"),
    ("renorm", "default"),
    ("logsumexp", "default"),
    ("upsample_nearest1d", "default"),
    ("_upsample_nearest_exact1d", "default"),
    ("upsample_nearest2d", "default"),
    ("_upsample_nearest_exact2d", "default"),
    ("upsample_nearest3d", "default"),
    ("_upsample_nearest_exact3d", "default"),
    ("upsample_linear1d", "default"),
    ("upsample_bilinear2d", "default"),
    ("_upsample_bilinear2d_aa", "default"),
    ("upsample_trilinear3d", "default"),
    ("upsample_bicubic2d", "default"),
    ("_upsample_bicubic2d_aa", "default"),
)
FP32_SET_OPT_DTYPE = (
    ("prod", "default"),
    ("prod", "dim_int"),
    ("softmax", "int"),
    ("log_softmax", "int"),
    ("cumprod", "default"),
    ("cumsum", "default"),
    ("linalg_vector_norm", "default"),
    ("linalg_matrix_norm", "default"),
    ("linalg_matrix_norm", "str_ord"),
    ("sum", "default"),
    ("sum", "dim_IntList"),
)
# fp32_append_dtype: registered op -> the overload called with dtype=float32 appended
FP32_APPEND_DTYPE = (
    (("norm", "Scalar"), ("norm", "ScalarOpt_dtype")),
    (("norm", "ScalarOpt_dim"), ("norm", "ScalarOpt_dim_dtype")),
)
PROMOTE = (
    ("addcdiv", "default"),
    ("addcmul", "default"),
    ("atan2", "default"),
    ("bilinear", "default"),
    ("cross", "default"),
    ("dot", "default"),
    ("vdot", "default"),
    ("grid_sampler", "default"),
    ("index_put", "default"),
    ("tensordot", "default"),
    ("scatter_add", "default"),
)
BANNED = (("binary_cross_entropy", "default"),)

_BCE_MESSAGE = (
    "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
    "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
    "In this case, combine the two layers using "
    "torch.nn.functional.binary_cross_entropy_with_logits\n"
    "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
    "safe to autocast."
)


# --------------------------------------------------------------------------------------------
# casting helpers (CUDA's is_eligible / cached_cast / promote_type)


def _eligible(t):
    return (
        isinstance(t, torch.Tensor)
        and t.device.type == DEVICE_TYPE
        and t.is_floating_point()
        and t.dtype != torch.float64
    )


def _cast(a, dtype):
    if isinstance(a, torch.Tensor):
        return a.to(dtype) if _eligible(a) and a.dtype != dtype else a
    if isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
        return type(a)(_cast(x, dtype) for x in a)
    return a


def _cast_all(args, kwargs, dtype):
    args = tuple(_cast(a, dtype) for a in args)
    if kwargs:
        kwargs = {k: _cast(v, dtype) for k, v in kwargs.items()}
    return args, kwargs


def _promote_dtype(values, low):
    current = low
    for a in values:
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if not _eligible(t):
                continue
            if t.dtype == torch.float32 or current == torch.float32:
                current = torch.float32
            elif t.dtype != current:  # two different 16-bit types: float32 holds both exactly
                current = torch.float32
    return current


def _low_dtype():
    return torch.get_autocast_dtype(DEVICE_TYPE)


# --------------------------------------------------------------------------------------------
# kernels


def _lower_precision_kernel(op):
    folded = FOLDED_CASTS.get(op)  # Note [Layer kernels] in torchacc/lazy/layer_kernels.py

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if folded is not None:
                out = folded(_low_dtype(), *args, **kwargs)
                if out is not None:
                    return out
            args, kwargs = _cast_all(args, kwargs, _low_dtype())
            return op(*args, **kwargs)

    return kernel


def _fp32_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            args, kwargs = _cast_all(args, kwargs, torch.float32)
            return op(*args, **kwargs)

    return kernel


def _dtype_position(op):
    for i, a in enumerate(op._schema.arguments):
        if a.name == "dtype":
            return i, a.kwarg_only
    raise ValueError(f"{op} has no dtype argument")


def _fp32_set_opt_dtype_kernel(op):
    pos, kwarg_only = _dtype_position(op)

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            if args and _eligible(args[0]):
                given = args[pos] if (not kwarg_only and pos < len(args)) else kwargs.get("dtype")
                if given is None:
                    if not kwarg_only and pos < len(args):
                        args = args[:pos] + (torch.float32,) + args[pos + 1 :]
                    else:
                        kwargs = dict(kwargs, dtype=torch.float32)
            return op(*args, **kwargs)

    return kernel


def _fp32_append_dtype_kernel(op, target):
    # the target overload has no defaults for the trailing positional arguments: fill them in
    defaults = [
        a.default_value if a.has_default_value() else None
        for a in op._schema.arguments
        if not a.kwarg_only
    ]

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            full = tuple(args) + tuple(defaults[len(args) :])
            # CUDA's type_from_firstarg: float32 for an eligible input, else the input's own dtype
            dtype = torch.float32 if _eligible(args[0]) else args[0].dtype
            return target(*full, **kwargs, dtype=dtype)

    return kernel


def _promote_kernel(op):
    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_KEYSET):
            dtype = _promote_dtype(list(args) + list(kwargs.values()), _low_dtype())
            args, kwargs = _cast_all(args, kwargs, dtype)
            return op(*args, **kwargs)

    return kernel


def _banned_kernel(*args, **kwargs):
    raise RuntimeError(_BCE_MESSAGE)


# --------------------------------------------------------------------------------------------
# registration

_libs: list = []
_policy: dict = {}  # "op.overload" -> policy name, for tests and docs


def _overload(name, overload):
    packet = getattr(aten, name, None)
    if packet is None or overload not in packet.overloads():
        return None
    return getattr(packet, overload)


def _qualified(name, overload):
    return name if overload == "default" else f"{name}.{overload}"


def install():
    """Register the autocast kernels for the torchacc device (idempotent)."""
    if _libs:
        return
    register_backend()
    fallback = Library("_", "IMPL")
    fallback.fallback(fallthrough_kernel, _KEY)
    lib = Library("aten", "IMPL")
    _libs.extend([fallback, lib])

    def reg(entries, make, policy):
        for name, overload in entries:
            op = _overload(name, overload)
            if op is None:  # not in this torch build
                continue
            lib.impl(_qualified(name, overload), make(op), _KEY)
            _policy[str(op)] = policy

    reg(LOWER_PRECISION_FP, _lower_precision_kernel, "lower_precision_fp")
    reg(FP32, _fp32_kernel, "fp32")
    reg(FP32_SET_OPT_DTYPE, _fp32_set_opt_dtype_kernel, "fp32_set_opt_dtype")
    reg(PROMOTE, _promote_kernel, "promote")
    reg(BANNED, lambda op: _banned_kernel, "banned")
    for (name, overload), (tname, toverload) in FP32_APPEND_DTYPE:
        op, target = _overload(name, overload), _overload(tname, toverload)
        if op is None or target is None:
            continue
        lib.impl(_qualified(name, overload), _fp32_append_dtype_kernel(op, target), _KEY)
        _policy[str(op)] = "fp32_append_dtype"


def policy_of(op):
    """The autocast policy name of an ATen overload (``None``: runs in its input dtypes)."""
    return _policy.get(str(op))
