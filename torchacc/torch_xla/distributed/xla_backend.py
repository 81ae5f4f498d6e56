"""``torch_xla.distributed.xla_backend`` on torchacc: importing it registers the ``"xla"``
torch.distributed backend (see ``torchacc.distributed.xla_backend``) and, as torch_xla does, the
``xla://`` rendezvous: ``dist.init_process_group("xla", init_method="xla://")`` under torchrun
(or any launcher that sets ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``), or in a plain
single process.
"""

from __future__ import annotations

import importlib
import os
import threading

import torch.distributed as dist

from torchacc.distributed.xla_backend import ProcessGroupXla  # noqa: F401  (registers "xla")

_store = [None]
_store_lock = threading.Lock()


def _make_store(rank, world_size, timeout):
    """torchrun's agent store when torchrun started us, else a TCP store hosted by rank 0."""
    host = os.environ.get("MASTER_ADDR") or "localhost"
    port = int(os.environ.get("MASTER_PORT") or 12355)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"/worker/attempt_{attempt}", store)
    return dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)


def xla_rendezvous_handler(url, timeout=None, **kwargs):
    """torch.distributed rendezvous for ``xla://``: rank and world size from the launcher's
    environment (one process: 0 of 1)."""
    import datetime

    from torchacc.torch_xla import runtime as xr

    timeout = timeout or datetime.timedelta(minutes=30)
    rank, world_size = xr.global_ordinal(), xr.world_size()
    with _store_lock:
        if _store[0] is None:
            _store[0] = _make_store(rank, world_size, timeout)
    yield (_store[0], rank, world_size)


if "xla" not in importlib.import_module("torch.distributed.rendezvous")._rendezvous_handlers:
    dist.register_rendezvous_handler("xla", xla_rendezvous_handler)
