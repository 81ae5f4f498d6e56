"""``torch_xla`` on torchacc: the same module paths, backed by the torchacc lazy device.

``import torchacc.torch_xla as torch_xla`` (TorchAcc recipes), or run an unchanged torch_xla script
with ``python -m torchacc.run_torch_xla script.py`` / ``import torchacc.alias`` so that
``import torch_xla...`` resolves here. What is supported, what differs and what is missing:
the README (section "torch_xla / TorchAcc API").
"""

from __future__ import annotations

import contextlib
import functools

import torch

import torchacc
from torchacc.torch_xla._api import differs

__version__ = "2.13.0+torchacc"


def device(index=None):
    """This process's torchacc device (torch_xla's ``torch_xla.device()``)."""
    return torchacc.device(0 if index is None else index)


def devices():
    return [torchacc.device()]


def device_count():
    return 1


def real_devices():
    hw = "CUDA" if torchacc.device_hw() == "GPU" else "CPU"
    return [f"{hw}:0"]


def sync(wait=False, reset_scope=True):
    """Compile (on a cache miss) and launch everything recorded: ``xm.mark_step``."""
    from torchacc.torch_xla.core import xla_model

    xla_model.mark_step(wait=wait)


def manual_seed(seed, device=None):
    torch.manual_seed(seed)


@contextlib.contextmanager
def step():
    """``with torch_xla.step():`` -- the block is one step: sync before and after."""
    sync()
    try:
        yield
    finally:
        sync()


@differs(
    "always lazy: the call is one recorded step, synced on return; max_different_graphs tells "
    "traces apart by their ops' names and output shapes"
)
def compile(
    f=None, full_graph=False, name=None, max_different_graphs=None, custom_compile_options=None
):
    """torch_xla's eager-mode ``compile``: torchacc is always lazy, so the function body is simply
    one recorded step, synced when the call returns. ``max_different_graphs``: at most that many
    different traces of ``f`` (torchacc/torch_xla/_graph_limit.py)."""
    if f is None:
        return functools.partial(
            compile, full_graph=full_graph, name=name, max_different_graphs=max_different_graphs
        )

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        sync()
        if max_different_graphs is None:
            out = f(*args, **kwargs)
        else:
            from torchacc.torch_xla import _graph_limit

            out = _graph_limit.watched(f, max_different_graphs, lambda: f(*args, **kwargs))
        sync()
        return out

    return wrapper


@differs("runs fn(index, *args) in this process; start processes with torchrun")
def launch(fn, args=(), start_method="spawn", debug_single_process=False):
    """Run ``fn(index, *args)`` in this process (one process per device; start several with
    torchrun)."""
    from torchacc.torch_xla.distributed import xla_multiprocessing

    return xla_multiprocessing.spawn(fn, args=args, nprocs=None, start_method=start_method)


# torch_xla._XLAC and torch_xla.runtime are attributes right after `import torch_xla`
from torchacc.torch_xla import _XLAC, _xla_device, runtime  # noqa: E402, F401

_xla_device.install()  # device="xla" means the torchacc device (Note [The xla device string])

# as torch_xla does on import: nn.GRU becomes the scan-based GRU (its time loop is one scan)
from torchacc.torch_xla.experimental import gru as _gru  # noqa: E402

_gru.install()

# XLA_SAVE_TENSORS_FILE: every sync's graph appended to a file, as torch_xla does
from torchacc.torch_xla import _graph_dump  # noqa: E402

_graph_dump.install()

__all__ = [
    "compile",
    "device",
    "device_count",
    "devices",
    "launch",
    "manual_seed",
    "real_devices",
    "step",
    "sync",
]
