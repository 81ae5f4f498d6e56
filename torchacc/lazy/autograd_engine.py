"""Make backward on the torchacc device work whatever ran first: `import torchacc` or a backward.

Note [Autograd engine sized before torchacc registered]
torch's autograd engine (torch/csrc/autograd/engine.cpp) starts its device threads once per
process, at the first backward of any kind (``initialize_device_threads_pool`` ->
``c10::call_once(start_device_threads)``). ``start_device_threads`` walks the device-guard
registry and sizes ``device_ready_queues_`` as max(``deviceCount()``) over the registered
non-CPU device types. Our PrivateUse1 guard only enters that registry when torchacc registers its
backend (``_setup_privateuseone_for_python_backend`` at ``import torchacc``). So a backward that
runs *before* the import (a notebook's eager cell) on a machine with no other accelerator sizes
the queues at 0, and never again: every later backward from a torchacc tensor asks
``ready_queue(device=torchacc:0)`` and fails ``device.index() < device_ready_queues_.size()``
(an INTERNAL ASSERT). With CUDA present the queues are sized by the GPU count (>= 1) and
torchacc:0 shares GPU 0's thread, so only GPU-less machines hit it.

The engine has no way to re-size its queues, but ``ready_queue`` skips them when the calling
thread has multithreaded backward disabled (``torch.autograd.set_multithreading_enabled(False)``;
the backward then runs in the caller's thread, as CPU backward always does). So, right after
registering, :func:`ensure_backward_works` runs one backward from a torchacc-device probe tensor
(a bare wrapper subclass: no JAX, no recorded graph). If it reaches a device thread, nothing is
needed (and the engine is now sized with our device counted, so a later backward cannot size it
without us). If it hits the assert, backward calls from then on disable multithreading around
themselves: ``torch.autograd.backward``/``grad`` are wrapped (they call
``torch.autograd._engine_run_backward``), and the importing thread gets the thread-local switch too.
In that state no other device has engine threads, so nothing else changes behaviour.
"""

from __future__ import annotations

import functools

import torch

_ASSERT_TEXT = "device_ready_queues_"
_caller_thread_backward = False


class _Probe(torch.Tensor):
    """A scalar on the torchacc device whose every op returns another probe."""

    @staticmethod
    def __new__(cls, device, requires_grad=False):
        return torch.Tensor._make_wrapper_subclass(
            cls, (), dtype=torch.float32, device=device, requires_grad=requires_grad
        )

    def __init__(self, device, requires_grad=False):
        self._probe_device = device

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _Probe(torch.device(torch._C._get_privateuse1_backend_name(), 0))

    __torch_function__ = torch._C._disabled_torch_function_impl


def caller_thread_backward() -> bool:
    """True when torchacc had to switch backward to the caller's thread (see the Note)."""
    return _caller_thread_backward


def _engine_reaches(device: torch.device) -> bool:
    leaf = _Probe(device, requires_grad=True)
    try:
        torch.autograd.grad(leaf.mul(2.0), leaf, grad_outputs=_Probe(device))
    except RuntimeError as e:
        if _ASSERT_TEXT not in str(e):
            raise
        return False
    return True


def _in_caller_thread(run_backward):
    @functools.wraps(run_backward)
    def wrapper(*args, **kwargs):
        with torch.autograd.set_multithreading_enabled(False):
            return run_backward(*args, **kwargs)

    wrapper._torchacc_caller_thread = True
    return wrapper


def ensure_backward_works(device: torch.device) -> None:
    """Call once, right after the PrivateUse1 backend is registered (Note above)."""
    global _caller_thread_backward
    if _caller_thread_backward or _engine_reaches(device):
        return
    _caller_thread_backward = True
    torch._C._set_multithreading_enabled(False)  # this thread, even if the wrapper cannot apply
    run_backward = getattr(torch.autograd, "_engine_run_backward", None)
    if run_backward is not None and not getattr(run_backward, "_torchacc_caller_thread", False):
        torch.autograd._engine_run_backward = _in_caller_thread(run_backward)
