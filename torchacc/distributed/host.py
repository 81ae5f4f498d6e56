"""Host-side synchronisation of the job's processes through the JAX coordination service:
``barrier`` and ``rendezvous`` (torch_xla's ``xm.rendezvous``). Nothing is recorded and pending
device work is not run.
"""

from __future__ import annotations

import itertools

from torchacc.runtime import processes as runtime
from torchacc.runtime.processes import rank, world_size

_barrier_count = itertools.count()
_rendezvous_count = itertools.count()


def _client(name):
    client = runtime._jax_distributed_client()
    if client is None:
        raise RuntimeError(f"torchacc.distributed.{name}: the multi-process runtime is not running")
    return client


def barrier(tag="", timeout_s=1800.0):
    """Block until every process reaches a barrier (a host-side wait; pending work is not run)."""
    if world_size() == 1:
        return
    n = next(_barrier_count)
    _client("barrier").wait_at_barrier(f"torchacc/barrier/{n}/{tag}", int(timeout_s * 1000))


def rendezvous(tag, payload=b"", replicas=(), timeout_s=1800.0):
    """torch_xla's ``xm.rendezvous``: wait for every process and return all their payloads."""
    if replicas and sorted(replicas) != list(range(world_size())):
        raise NotImplementedError(
            f"torchacc.distributed.rendezvous: replicas={list(replicas)} is not supported (only "
            "all processes)"
        )
    payload = bytes(payload)
    w = world_size()
    if w == 1:
        return [payload]
    client = _client("rendezvous")
    n = next(_rendezvous_count)
    prefix = f"torchacc/rendezvous/{n}/{tag}"
    client.key_value_set_bytes(f"{prefix}/{rank()}", payload)
    ms = int(timeout_s * 1000)
    out = [client.blocking_key_value_get_bytes(f"{prefix}/{r}", ms) for r in range(w)]
    client.wait_at_barrier(f"{prefix}/done", ms)
    client.key_value_delete(f"{prefix}/{rank()}")
    return out
