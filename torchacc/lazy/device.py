"""The plugin's torch device: PrivateUse1 renamed to ``torchacc`` (torch-side registration).

Which JAX device computes is torchacc/runtime/device.py's (Note [Device choice]).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

from torchacc.lazy import autograd_engine
from torchacc.runtime import device as _runtime_device

# Note [The device's name]
# torchacc's tensors live on PrivateUse1, which torch lets a backend rename once per process.
# Its name is ``xla`` in processes started by ``python -m torchacc.run_torch_xla`` and where
# ``TORCHACC_DEVICE_TYPE=xla`` asks for it, else ``torchacc`` (``TORCHACC_DEVICE_TYPE=torchacc``
# keeps it in run_torch_xla; fixed when torchacc is first imported). Named ``xla``, tensors
# report ``xla:0`` and ``torch.device("xla")`` itself parses to this device, so
# unchanged torch_xla scripts' ``t.device == torch.device("xla", 0)`` / ``t.device.type ==
# "xla"`` hold, and ``device="xla"`` needs no mapping. torch's built-in ``XLA`` device type is
# then unreachable by name in the process (torch_xla is not installed beside torchacc anyway),
# and torch's own Python paths for ``device.type == "xla"`` apply (printing, deepcopy and
# pickling go through ``.cpu()``). torch's per-backend helper methods (``Tensor.is_xla``, ...)
# already exist for ``xla``, so they are not generated; ``Tensor.is_xla`` stays False (it asks
# for torch's XLA key). Every check of "is this a torchacc tensor" compares with DEVICE_TYPE.
_DEVICE_TYPES = ("torchacc", "xla")


def _default_type():
    """``xla`` when this process runs ``python -m torchacc.run_torch_xla`` (torchacc is imported
    before that module runs, so the command line is read), else ``torchacc``."""
    args = iter(list(getattr(sys, "orig_argv", ()))[1:])
    for arg in args:  # the interpreter's options, up to the module, script or -c
        if arg in ("-W", "-X"):
            next(args, None)
        elif arg.startswith("-m"):
            module = arg[2:] or next(args, "")
            return "xla" if module == "torchacc.run_torch_xla" else "torchacc"
        elif arg.startswith("-c") or not arg.startswith("-"):
            break
    return "torchacc"


DEVICE_TYPE = os.environ.get("TORCHACC_DEVICE_TYPE", "").strip() or _default_type()
if DEVICE_TYPE not in _DEVICE_TYPES:
    raise ValueError(
        f"TORCHACC_DEVICE_TYPE={DEVICE_TYPE!r}: the torchacc device can be named "
        f"{' or '.join(_DEVICE_TYPES)}"
    )


# Note [torchacc is not torch.accelerator]
# torch picks a registered PrivateUse1 backend as *the* accelerator (``torch.accelerator``) and asks
# its module whether it is available. If it said yes, every script that merely imports torchacc
# would change: ``DataLoader(pin_memory=True)`` (HF Trainer's default) asks the accelerator for a
# pinned-memory allocator, which a Python backend cannot provide (torch 2.13's Python
# PrivateUse1 hooks expose only is_available/has_primary_context/is_built), so it raised;
# libraries that probe ``torch.accelerator`` would move models to a device the script never asked
# for. torch_xla is not in torch's accelerator list, so it never had this. So the module reports
# ``is_available() == False``: ``torch.accelerator.is_available()`` and pinning behave as without
# torchacc (on a CUDA box pinning is skipped with torch's warning instead of targeting CUDA, because
# torch prefers a registered PrivateUse1 backend over CUDA). Nothing in torch's paths that torchacc
# uses needs it to be True: tensors, autocast, GradScaler and seeding go through the dispatcher and
# the other module functions; ``torch.save`` of torchacc tensors writes CPU tensors.
class _BackendModule:
    """What torch expects of ``torch.torchacc`` (AMP, seeding, availability)."""

    @staticmethod
    def is_available():
        # False on purpose (Note [torchacc is not torch.accelerator]).
        return False

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def current_device():
        return 0

    @staticmethod
    def is_initialized():  # FakeTensorMode asks (scan traces on fake torchacc tensors)
        return True

    @staticmethod
    def get_amp_supported_dtype():
        return [torch.float16, torch.bfloat16]

    @staticmethod
    def is_bf16_supported():
        return True

    @staticmethod
    def _is_in_bad_fork():
        return False

    @staticmethod
    def manual_seed_all(seed):
        from torchacc.lazy import random  # (same stage; loaded by then)

        random.manual_seed(seed)

    manual_seed = manual_seed_all

    @staticmethod
    def synchronize(device=None):
        from torchacc.engine import execute

        execute.wait_device_ops()


class _DeviceGuard(torch._C._acc.DeviceGuard):
    """torch asks the device guard for its device type a few times per op and per autograd node;
    a C-level callable answers without running a Python frame each time."""

    def __init__(self):
        super().__init__()
        self.type_ = itertools.repeat(torch._C._autograd.DeviceType.PrivateUse1).__next__


class _Hooks(torch._C._acc.PrivateUse1Hooks):
    """The PrivateUse1 hooks torch's Python-backend setup would register."""

    def is_available(self):
        return True

    def has_primary_context(self, dev_id):
        return True

    def is_built(self):
        return True


_registered = False


def register_backend():
    global _registered
    if _registered:
        return
    if torch._C._get_privateuse1_backend_name() != DEVICE_TYPE:
        if DEVICE_TYPE == "xla":  # Note [The device's name]: torch has is_xla & co. already
            torch.utils.rename_privateuse1_backend(DEVICE_TYPE)
            torch._register_device_module(DEVICE_TYPE, _BackendModule())
            torch._C._acc.register_python_privateuseone_hook(_Hooks())
            torch._C._acc.register_python_privateuseone_device_guard(_DeviceGuard())
        else:
            _setup_privateuseone_for_python_backend(
                DEVICE_TYPE, backend_module=_BackendModule(), device_guard=_DeviceGuard()
            )
    _registered = True
    # a backward before `import torchacc` sized the autograd engine's device queues
    autograd_engine.ensure_backward_works(torch.device(DEVICE_TYPE, 0))


def device(index=0):
    """The torch device for torchacc tensors: ``torch.device('torchacc', index)`` (``'xla'``
    with ``TORCHACC_DEVICE_TYPE=xla``; Note [The device's name])."""
    register_backend()
    if index not in (0, None):
        raise ValueError(
            f"torchacc.device({index}): each process drives one device; index must be 0 "
            "(use one process per GPU, as torchrun does)"
        )
    return torch.device(DEVICE_TYPE, 0)


def device_hw():
    """'GPU' or 'CPU', like torch_xla's xla_device_hw."""
    return _runtime_device.device_hw()
