"""``device="xla"`` where a torch_xla script writes it: the string mapped onto the torchacc device.

Installed by ``import torchacc.torch_xla`` (so by ``import torchacc.alias`` and
``python -m torchacc.run_torch_xla``); Note [The xla device string] says how and what it costs.
:func:`resolve` is the one place that maps a device spec (``"xla"``, ``"xla:0"``,
``torch.device("xla")``, ``0``, ``"torchacc"``) and rejects the rest with one message.
"""

from __future__ import annotations

import functools

import torch

import torchacc
from torchacc.lazy import factories
from torchacc.lazy.device import DEVICE_TYPE
from torchacc.lowering import RULES

# Note [The xla device string]
# torch knows the ``xla`` device type (``torch.device("xla")`` parses) but, without torch_xla's
# C++ library, has no device guard for it, and one cannot be registered from Python (torch 2.13
# registers Python guards for PrivateUse1 only). torchacc's tensors stay on ``torchacc:0``; an
# ``xla`` spec is rewritten to that device at the few entry points that take one:
# - factories (``torch.zeros/rand/arange/full(..., device="xla")``, ``new_*``, ``*_like``): the
#   dispatcher picks their kernel from the device argument alone, so kernels registered for the
#   ``XLA`` dispatch key receive them; each calls the op again with the torchacc device. The ops
#   torchacc records directly (its PrivateUse1 factory kernels) get a direct XLA kernel, so that a
#   composite (``arange`` = ``empty`` + ``arange.out``) is not taken instead; every other op
#   reaches a fallback for the key. No cost for ops that do not name ``xla``.
# - ``Tensor.to``, ``Tensor.new_tensor``, ``torch.tensor``, ``torch.as_tensor``, ``torch.asarray``
#   fail in torch's C++ device guard before any kernel runs, so these five Python entry points are
#   wrapped: one extra Python frame and a type check of the device argument per call. A
#   ``TorchFunctionMode`` would see every torch call instead, a Python frame for every op
#   (benchmarks/RESULTS.md measures both on the gallery models).
# - ``torch.autocast("xla")`` (also ``torch.amp.autocast``) would turn on torch's AutocastXLA
#   key, which torchacc tensors do not carry: ``autocast.__init__`` is wrapped so that an
#   ``"xla"`` device type means torchacc's autocast (its policy and default dtype, bf16). One
#   Python frame per autocast region, none per op. Inside ``torch.compile``d code dynamo builds
#   its own autocast object, so there ``"xla"`` is not mapped.
# What cannot be mapped: a tensor's ``.device`` stays ``torchacc:0``, so ``t.device.type ==
# "xla"`` and ``t.device == torch.device("xla")`` are False; torch_xla's own helpers
# (``xm.xla_device()``, ``torch_xla.device()``) return the torchacc device, so comparisons with
# what they return hold.

_XLA = "xla"


def _available():
    also = "" if DEVICE_TYPE == _XLA else f" or '{DEVICE_TYPE}:0'"
    return f"'xla', 'xla:0', torch.device('xla', 0){also} (this process has one device)"


def resolve(spec):
    """The torchacc device for a device spec naming this process's device, else a ``ValueError``
    naming ``spec`` and what exists."""
    if spec is None:
        return torchacc.device()
    shown = repr(str(spec)) if isinstance(spec, torch.device) else repr(spec)
    if isinstance(spec, int) and not isinstance(spec, bool):
        dev = torch.device(_XLA, spec)
    elif isinstance(spec, (str, torch.device)):
        try:
            dev = torch.device(spec)
        except RuntimeError as e:
            raise ValueError(f"device {shown}: not a device; devices here: {_available()}") from e
    else:
        raise TypeError(f"device {shown}: expected a str, torch.device or int")
    if dev.type not in (_XLA, "torchacc", DEVICE_TYPE):
        raise ValueError(f"device {shown}: not an XLA device; devices here: {_available()}")
    if dev.index not in (None, 0):
        raise ValueError(
            f"device {shown}: no such device; each torchacc process drives one device, so the "
            f"devices here are {_available()}; start one process per device with torchrun"
        )
    return torchacc.device()


def _is_xla(a):
    tp = type(a)
    if tp is str:
        return a == _XLA or a.startswith("xla:")
    return tp is torch.device and a.type == _XLA


# --- factories: kernels for the XLA dispatch key -----------------------------------------------

_lib = torch.library.Library("aten", "IMPL")
_fallback_lib = torch.library.Library("_", "IMPL")


def _redirect(op, *args, **kwargs):
    """The kernel of ``op`` for the XLA key: ``op`` again, on the torchacc device."""
    if "device" not in kwargs:
        raise RuntimeError(
            f"torchacc: {op} reached the 'xla' device without a device argument; torchacc maps "
            "'xla' onto its own device only where a device is named"
        )
    kwargs = dict(kwargs, device=resolve(kwargs["device"]))
    return op(*args, **kwargs)


_kernels = [False]


def _register_kernels():
    if _kernels[0]:
        return
    for op in RULES:
        if factories._is_factory(op):
            _lib.impl(op, functools.partial(_redirect, op), "XLA")
    _fallback_lib.fallback(_redirect, "XLA")
    _kernels[0] = True


# --- Python entry points that torch's device guard stops ---------------------------------------


def _wrap_method(original, device_pos):
    """``original`` with an ``xla`` device (keyword ``device`` or positional ``device_pos``)
    replaced by the torchacc device."""

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if len(args) > device_pos and _is_xla(args[device_pos]):
            args = (*args[:device_pos], resolve(args[device_pos]), *args[device_pos + 1 :])
        elif "device" in kwargs and _is_xla(kwargs["device"]):
            kwargs = dict(kwargs, device=resolve(kwargs["device"]))
        return original(*args, **kwargs)

    wrapper.__torchacc_original__ = original
    return wrapper


def _wrap_autocast_init(original):
    """``torch.autocast.__init__`` with an ``"xla"`` device type meaning the torchacc device."""

    @functools.wraps(original)
    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == _XLA:
            from torchacc import amp

            amp.autocast_policy.install()
            device_type = torchacc.device().type
            dtype = amp.default_dtype() if dtype is None else dtype
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    __init__.__torchacc_original__ = original
    return __init__


_KEYWORD_ONLY = 1 << 30
# (owner, name, position of a positional device argument, counting self for methods)
_ENTRY_POINTS = (
    (torch.Tensor, "to", 1),
    (torch.Tensor, "new_tensor", _KEYWORD_ONLY),
    (torch, "tensor", _KEYWORD_ONLY),
    (torch, "as_tensor", 2),
    (torch, "asarray", _KEYWORD_ONLY),
)
_AUTOCAST = torch.amp.autocast_mode.autocast

_installed = False


def install():
    """Map ``xla`` device specs onto the torchacc device (idempotent)."""
    global _installed
    if _installed:
        return
    torchacc.device()  # the PrivateUse1 backend is registered before the first redirect
    _register_kernels()
    for owner, name, pos in _ENTRY_POINTS:
        setattr(owner, name, _wrap_method(getattr(owner, name), pos))
    _AUTOCAST.__init__ = _wrap_autocast_init(_AUTOCAST.__init__)
    _installed = True


def uninstall():
    """Restore the wrapped entry points (the dispatcher kernels stay; they only see ``xla``)."""
    global _installed
    for owner, name, _pos in (*_ENTRY_POINTS, (_AUTOCAST, "__init__", None)):
        current = getattr(owner, name)
        original = getattr(current, "__torchacc_original__", None)
        if original is not None:
            setattr(owner, name, original)
    _installed = False
