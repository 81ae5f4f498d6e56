"""``ta.dist``: AlibabaPAI/torchacc's process-level names, over torchacc's own distributed pieces.

``world_size()``, ``rank()``, ``local_rank()`` (this job's, as torchrun's ``WORLD_SIZE`` /
``RANK`` / ``LOCAL_RANK`` give them; the ``torchacc.distributed`` drop-in answers),
``init_process_group(config)`` (the backend ``config.backend`` needs), ``rendezvous`` and the
``"lazy"`` ``torch.distributed`` backend: TorchAcc's name for the lazy device's process group,
here torchacc's ``"xla"`` one (torchacc/distributed/xla_backend.py, imported on first use), so
``torch.distributed.init_process_group(backend="lazy")`` works after ``import torchacc``.
Pipeline parallel: ``PipelineParallel(model, config)`` and its base ``ParallelModule``
(parallel_module.py, over torchacc/pipeline/).
"""

from __future__ import annotations

import torch
import torch.distributed as _td

from torchacc.distributed import host as _host
from torchacc.distributed import torch_api as _torch_api
from torchacc.lazy.device import DEVICE_TYPE

BACKEND_NAME = "lazy"


def __getattr__(name):  # pipeline parallel pulls in JAX: imported on first use
    if name in ("ParallelModule", "PipelineParallel"):
        from torchacc.dist import parallel_module

        return getattr(parallel_module, name)
    raise AttributeError(f"module 'torchacc.dist' has no attribute {name!r}")


def _eager_backend_name():
    return "nccl" if torch.cuda.is_available() else "gloo"


def world_size():
    """Number of processes in the job."""
    return _torch_api.get_world_size()


def rank():
    """This process's rank in the job."""
    return _torch_api.get_rank()


def local_rank():
    """This process's rank on its machine (its device there)."""
    return _torch_api.get_local_rank()


def init_process_group(config) -> None:
    """Join the job's default process group with the backend ``config.backend`` runs on:
    ``"lazy"`` (the torchacc device) or, for ``backend='eager'``, NCCL (gloo without CUDA).
    An already initialized group must have that backend."""
    backend = _eager_backend_name() if config.is_eager_backend() else BACKEND_NAME
    if _td.is_initialized():
        have = str(_td.get_backend()).lower()
        want = "xla" if backend == BACKEND_NAME else backend
        if have not in (backend, want):
            raise ValueError(
                f"ta.dist.init_process_group: the default process group uses backend {have!r}, "
                f"but config.backend={config.backend!r} needs {backend!r}"
            )
        return
    _td.init_process_group(backend=backend)


def rendezvous(tag, payload=b"", replicas=()):
    """Wait for every process (or ``replicas``) to reach ``tag``; returns each one's payload,
    in rank order."""
    return _host.rendezvous(tag, payload, replicas)


def _create_lazy_group(dist_backend_opts, backend_options=None):
    from torchacc.distributed import xla_backend

    return xla_backend._create_process_group(dist_backend_opts, backend_options)  # its creator


def _register_lazy_backend():
    if BACKEND_NAME.upper() not in _td.Backend._plugins:
        _td.Backend.register_backend(
            BACKEND_NAME, _create_lazy_group, extended_api=True, devices=[DEVICE_TYPE, "cpu"]
        )


_register_lazy_backend()

__all__ = [
    "BACKEND_NAME",
    "ParallelModule",
    "PipelineParallel",
    "init_process_group",
    "local_rank",
    "rank",
    "rendezvous",
    "world_size",
]
