"""``xla_model``: steps (mark_step, step closures), the device RNG state and memory info."""

from __future__ import annotations

import os

import torch

import torchacc
from torchacc import metrics  # noqa: F401
from torchacc.engine import execute as _execute

# --------------------------------------------------------------------------------------------
# steps


_step_closures: list = []
_async_closures: list = []


def add_step_closure(closure, args=(), run_async=False):
    """Run ``closure(*args)`` right after the next :func:`mark_step` has launched the step.

    Device tensors in ``args`` then hold this step's values (reading them, e.g. ``loss.item()``,
    is a host transfer of an already computed buffer). Closures run in the order they were added.
    ``run_async=True`` closures run on a worker thread (Note [Async step closures]).
    """
    (_async_closures if run_async else _step_closures).append((closure, args))


# Note [Async step closures]
# As in torch_xla, ``add_step_closure(..., run_async=True)`` closures are handed at the next
# mark_step to one worker thread that runs them in order while the host goes on tracing. If one
# raises, the worker stops; the next mark_step that hands over async closures raises
# ``RuntimeError("Cannot run asynchronous closure due to previously raised exception")`` from the
# closure's exception (torch_xla's ``AsyncClosureHandler`` semantics). ``wait_async_closures()``
# blocks until the queue is drained (torchacc helper; also used at interpreter exit).
class _AsyncClosureRunner:
    def __init__(self, max_queue=None):
        import queue
        import threading

        size = int(os.environ.get("XLA_MAX_ASYNC_QUEUE", max_queue or 100))
        self._queue = queue.Queue(size)
        self._errors = queue.Queue()
        self._lock = threading.Lock()
        self._thread = None

    def _loop(self):
        import queue

        while True:
            try:
                closure, args = self._queue.get(timeout=3)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
                        return
                continue
            try:
                closure(*args)
            except BaseException as e:  # reraised on the main thread at the next handover
                self._errors.put(e)
                with self._lock:
                    self._thread = None
                return
            finally:
                self._queue.task_done()

    def run_all(self, closures):
        import queue
        import threading

        with self._lock:
            try:
                error = self._errors.get(block=False)
            except queue.Empty:
                error = None
            if error is not None:
                raise RuntimeError(
                    "Cannot run asynchronous closure due to previously raised exception"
                ) from error
            for item in closures:
                self._queue.put(item)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._loop, name="torchacc-async-closures", daemon=True
                )
                self._thread.start()

    def wait(self):
        self._queue.join()


_async_runner = _AsyncClosureRunner()


def wait_async_closures():
    """Block until every async step closure handed over so far has run (torchacc helper)."""
    _async_runner.wait()


@_execute.after_sync
def _run_step_closures():
    if _async_closures:
        closures = list(_async_closures)
        _async_closures.clear()
        _async_runner.run_all(closures)
    closures = list(_step_closures)
    _step_closures.clear()
    for closure, args in closures:
        closure(*args)


def mark_step(wait=False, reset_scope=True):
    """Compile (on a cache miss) and launch the recorded step: ``torchacc.sync``."""
    torchacc.sync(wait=wait)  # step closures run from the after-sync hook


def wait_device_ops(devices=None):
    """Block until everything launched on the device has finished."""
    torchacc.wait_device_ops()


def unlazy(tensors=None):
    mark_step(wait=True)


def set_rng_state(seed, device=None):
    """Set the device RNG's state to ``seed`` (an int, as :func:`get_rng_state` returns). The CPU
    generator is left alone, as in torch_xla."""
    from torchacc.lazy import random as _random

    _random.manual_seed(int(seed))


def get_rng_state(device=None):
    """The device RNG's current state as an int; ``set_rng_state`` of it continues the same
    stream. Reads the state from the device (a host transfer; a pending state runs its graph)."""
    from torchacc.lazy import random as _random

    words = _execute.fetch(_random.state_value(), torch.uint32).tolist()
    return (int(words[0]) << 32) | int(words[1])


class fork_rng:  # noqa: N801  (torch_xla's name; a context manager)
    """``with xm.fork_rng():`` restores the device RNG state on exit."""

    def __init__(self, device=None, enabled=True):
        self._enabled = enabled
        self._state = None

    def __enter__(self):
        if self._enabled:
            self._state = get_rng_state()
        return self

    def __exit__(self, *exc):
        if self._enabled:
            set_rng_state(self._state)
        return False


def get_memory_info(device=None):
    """Device memory as torch_xla reports it: ``bytes_used``/``bytes_limit``/``peak_bytes_used``
    (and the older ``kb_free``/``kb_total``). On the CPU platform: host RAM."""
    stats = None
    try:
        stats = torchacc.jax_device().memory_stats()
    except Exception:  # some PJRT clients do not implement memory stats
        stats = None
    if stats:
        used = int(stats.get("bytes_in_use", 0))
        limit = int(stats.get("bytes_limit", 0))
        peak = int(stats.get("peak_bytes_in_use", used))
    else:
        page = os.sysconf("SC_PAGE_SIZE")
        limit = page * os.sysconf("SC_PHYS_PAGES")
        used = limit - page * os.sysconf("SC_AVPHYS_PAGES")
        peak = used
    info = {
        "bytes_used": used,
        "bytes_limit": limit,
        "peak_bytes_used": peak,
        "kb_free": max(limit - used, 0) // 1024,
        "kb_total": limit // 1024,
    }
    from torchacc.sharding import api as sharding

    if sharding.is_spmd():  # per device: the bytes of live tensors' shards (padding included)
        info["tensor_bytes_per_device"] = sharding.live_bytes_per_device()
    return info
