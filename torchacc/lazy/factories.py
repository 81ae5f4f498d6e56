"""Factory ops with ``device=torchacc`` (no tensor argument) routed into the recorder.

The dispatcher picks a kernel for ``torch.empty(..., device=dev)`` from the device argument, so
these ops get PrivateUse1 kernels; composite factories (zeros, ones, full, rand, arange, ...) reach
them as ``empty`` followed by an in-place fill that the recorder handles like any op.
"""

import torch

from torchacc.lazy import dispatch
from torchacc.lowering import RULES

_lib = torch.library.Library("aten", "IMPL")
aten = torch.ops.aten


def _is_factory(op):
    """No tensor arguments and a ``device`` argument: the dispatcher picks by device."""
    args = op._schema.arguments
    return any(a.name == "device" for a in args) and not any("Tensor" in str(a.type) for a in args)


def _no_such_device(op, device):
    raise ValueError(
        f"{op}: device '{device}': no such device; each torchacc process drives one device, "
        f"'{device.type}:0' (start one process per device with torchrun)"
    )


def _register_factories():
    for op in list(RULES):
        if not _is_factory(op):
            continue

        def kernel(*args, _op=op, **kwargs):
            device = kwargs.get("device")
            if device is not None and device.index not in (None, 0):
                _no_such_device(_op, device)
            return dispatch.dispatch(_op, args, kwargs)

        _lib.impl(op, kernel, "PrivateUse1")


_register_factories()


def _copy_from(src, dst, non_blocking=False):
    """Host -> device copies made by torch itself (``torch.tensor(data, device=dev)``)."""
    return dispatch.dispatch(aten.copy_.default, (dst, src), {})


_lib.impl(aten._copy_from.default, _copy_from, "PrivateUse1")
