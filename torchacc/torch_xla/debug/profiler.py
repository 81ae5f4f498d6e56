"""``torch_xla.debug.profiler`` (``xp``) on torchacc, backed by JAX's profiler.

``start_trace(log_dir)``/``stop_trace()`` write a real profile (XLA device activity and the host
annotations below) that TensorBoard's profile plugin or Perfetto opens; ``start_server(port)``
starts JAX's profiler server (capture from TensorBoard). ``Trace(name)``/``trace_me(name)`` annotate
host code; ``StepTrace(name, step_num=...)`` annotates a step and, as in torch_xla, runs
``mark_step`` when the block ends. Remote capture from Python (``trace``/``trace_detached``) is not
implemented: use ``start_trace``/``stop_trace`` or TensorBoard's capture button.
"""

from __future__ import annotations

import functools

import jax

from torchacc.torch_xla._api import not_implemented

_tracer_marked_step = [False]


def set_tracer_marked_step(value):
    _tracer_marked_step[0] = bool(value)


def get_tracer_marked_step():
    return _tracer_marked_step[0]


_server = [None, None]  # (port, server): JAX runs one profiler server per process


def start_server(port, only_on_master=True):
    """Start JAX's profiler server on ``port`` (returns it). Asking again for the same port
    returns the running server; another port while one runs is an error (one per process)."""
    port = int(port)
    if _server[1] is not None:
        if _server[0] == port:
            return _server[1]
        raise RuntimeError(
            f"torch_xla.debug.profiler.start_server({port}): a profiler server already runs on "
            f"port {_server[0]}; JAX runs one per process"
        )
    _server[:] = [port, jax.profiler.start_server(port)]
    return _server[1]


def start_trace(log_dir, create_perfetto_link=False, create_perfetto_trace=False):
    """Start writing a profile into ``log_dir``."""
    jax.profiler.start_trace(str(log_dir), create_perfetto_trace=create_perfetto_trace)


def stop_trace():
    jax.profiler.stop_trace()


class Trace:
    """``with xp.Trace("name"):`` annotates the block in the profile."""

    def __init__(self, name, **kwargs):
        self.name = name
        self._annotation = jax.profiler.TraceAnnotation(name, **kwargs)

    def __enter__(self):
        self._annotation.__enter__()
        return self

    def __exit__(self, *exc):
        return self._annotation.__exit__(*exc)


class StepTrace(Trace):
    """``with xp.StepTrace("train_step", step_num=i):`` a step annotation; ``mark_step`` at the
    end of the block (torch_xla's behaviour)."""

    def __init__(self, name, **kwargs):
        self.name = name
        step = kwargs.pop("step_num", 0)
        self._annotation = jax.profiler.StepTraceAnnotation(name, step_num=step, **kwargs)

    def __exit__(self, *exc):
        from torchacc.torch_xla.core import xla_model as xm

        try:
            if exc[0] is None:
                xm.mark_step()
        finally:
            result = self._annotation.__exit__(*exc)
        return result


def trace_me(name):
    """Decorator: every call of the function is a ``Trace(name)``."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with Trace(name):
                return fn(*args, **kwargs)

        return wrapper

    return decorate


trace = not_implemented(
    "xp.trace",
    "capturing from a profiler server through Python is not implemented; use "
    "xp.start_trace(log_dir)/xp.stop_trace() or TensorBoard's capture with xp.start_server(port)",
)
trace_detached = not_implemented(
    "xp.trace_detached",
    "capturing from a profiler server through Python is not implemented; use "
    "xp.start_trace(log_dir)/xp.stop_trace()",
)
