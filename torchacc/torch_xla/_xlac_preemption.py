"""torch_xla's preemption sync point (``_XLAC._activate_preemption_sync_manager``,
``_sync_point_reached``, ``_deactivate_preemption_sync_manager``): after a SIGTERM every process
of the job reaches the same step's sync point, so that they all checkpoint that step before the
machine goes away.

In a job of several processes this is JAX's preemption sync manager, which
``jax.distributed.initialize`` starts (torchacc's processes join JAX that way:
torchacc/runtime/processes.py); it listens for SIGTERM and agrees on the step through the
coordination service (``multihost_utils.reached_preemption_sync_point``). A single process has
nobody to agree with: a SIGTERM handler notes the signal and the next step asked about is the
sync point.
"""

from __future__ import annotations

import signal

_state = {"active": False, "signalled": False, "previous": None, "jax": False}


def _jax_manager():
    from jax._src import distributed

    state = distributed.global_state
    return state.client is not None and state.preemption_sync_manager is not None


def _on_sigterm(signum, frame):
    _state["signalled"] = True


def _activate_preemption_sync_manager():
    """Start watching for SIGTERM (idempotent)."""
    if _state["active"]:
        return
    _state["jax"] = _jax_manager()
    if not _state["jax"]:
        _state["signalled"] = False
        _state["previous"] = signal.signal(signal.SIGTERM, _on_sigterm)
    _state["active"] = True


def _deactivate_preemption_sync_manager():
    """Stop watching (the SIGTERM handler in place before is restored)."""
    if not _state["active"]:
        return
    if not _state["jax"]:
        signal.signal(signal.SIGTERM, _state["previous"] or signal.SIG_DFL)
    _state.update(active=False, signalled=False, previous=None, jax=False)


def _sync_point_reached(step):
    """Whether ``step`` is the step every process stops at after a SIGTERM."""
    if not _state["active"]:
        raise RuntimeError(
            "_sync_point_reached: the preemption sync manager is not active; call "
            "torch_xla._XLAC._activate_preemption_sync_manager() first"
        )
    if _state["jax"]:
        from jax.experimental import multihost_utils

        return bool(multihost_utils.reached_preemption_sync_point(int(step)))
    return _state["signalled"]
