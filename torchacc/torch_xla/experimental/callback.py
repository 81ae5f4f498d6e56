"""``torch_xla.experimental.callback`` on torchacc: run a function when a tensor's data is ready.

A tensor whose value is pending (recorded, not synced) is handed over at the next sync; then a
thread waits for its device buffer and calls the callback with the tensor. A tensor already
computed is waited for at once.
"""

from __future__ import annotations

import threading

import torch

from torchacc.lazy.device import DEVICE_TYPE


def _value(tensor):
    from torchacc.lazy.record import value_of

    if not isinstance(tensor, torch.Tensor) or tensor.device.type != DEVICE_TYPE:
        raise TypeError(f"on_ready_callback: expected a torchacc tensor, got {tensor!r}")
    return value_of(tensor)


def _wait_and_call(tensor, callback):
    value = _value(tensor)
    array = value.array
    if array is not None:
        array.block_until_ready()
    callback(tensor)


def on_ready_callback(tensor, callback):
    """Call ``callback(tensor)`` from another thread once ``tensor``'s data is on the device."""
    from torchacc.engine import execute

    def start():
        threading.Thread(target=_wait_and_call, args=(tensor, callback), daemon=True).start()

    if _value(tensor).node is None:
        start()
        return
    state = {"done": False}

    def after_sync():
        if not state["done"] and _value(tensor).node is None:
            state["done"] = True
            start()

    execute.after_sync(after_sync)


def on_ready_event(tensor):
    """A ``threading.Event`` set once ``tensor``'s data is on the device."""
    event = threading.Event()
    on_ready_callback(tensor, lambda _t: event.set())
    return event


__all__ = ["on_ready_callback", "on_ready_event"]
