"""``torch_xla.distributed.xla_multiprocessing`` (``xmp``) on torchacc.

torchacc drives one device per process and leaves starting processes to torchrun (or
``launch_single_task.py``), so ``spawn`` runs ``fn(index, *args)`` in the calling process: index 0
for a single process, the local rank when a launcher already started this process as one worker
of many.
"""

from __future__ import annotations

import os

from torchacc.torch_xla._api import differs, not_implemented


@differs("runs fn(local_ordinal, *args) in this process; start processes with torchrun")
def spawn(fn, args=(), nprocs=None, join=True, daemon=False, start_method="spawn"):
    """Run ``fn(local_ordinal, *args)`` here (one process per device; see module doc)."""
    launched = os.environ.get("WORLD_SIZE") not in (None, "", "1")
    if nprocs not in (None, 1) and not launched:
        raise NotImplementedError(
            f"xmp.spawn(nprocs={nprocs}): torchacc runs one process per device and does not fork "
            "them itself; start the script with torchrun --nproc_per_node="
            f"{nprocs} (or launch_single_task.py) and call spawn with nprocs=None"
        )
    from torchacc.torch_xla.core import xla_model

    return fn(xla_model.get_local_ordinal(), *args)


class MpModelWrapper:
    """torch_xla's shared-memory model holder; with one process per device it just keeps the
    model and moves it to the device on ``to``."""

    def __init__(self, model):
        self._model = model

    def to(self, device):
        return self._model.to(device)


class MpSerialExecutor:
    """``run(fn)`` runs ``fn()`` in this process (torch_xla serializes it among the processes of
    one host; here each process is its own host of one device)."""

    def __init__(self):
        import threading

        self._lock = threading.Lock()

    def run(self, fn):
        with self._lock:
            return fn()


create_optimized_replica_groups = not_implemented(
    "xmp.create_optimized_replica_groups",
    "replica groups optimized for a TPU topology; torchacc has one replica group (all processes)",
)
