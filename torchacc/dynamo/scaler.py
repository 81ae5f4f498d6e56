"""``torch.amp.GradScaler`` (and torchacc's) inside ``compile_step``: no host sync.

Note [GradScaler in a compiled step]
A scaler's state is two tensors, ``_scale`` (float32) and ``_growth_tracker`` (int32). They join
the step's world like optimizer state: inputs of the program, their updates written back, so
``scaler.get_scale()`` and ``scaler.state_dict()`` see every step. At trace time:

- ``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_`` are traced as their
  ATen twins (torchacc/lowering/amp_twins.py): the inf/NaN check, unscale and scale update are
  part of the program.
- ``scaler.step(optimizer)`` would read ``found_inf`` on the host (``.item()``) to decide whether
  to call ``optimizer.step()``. The traced step always calls it and then keeps, element for
  element, the old parameters and optimizer state where ``found_inf`` is set
  (``torch.where``): the same values as eager PyTorch skipping the step (the step counters,
  weight decay and momentum included), decided on the device.
- The scaler's hyper-parameters (growth/backoff factors, growth interval, enabled) are constants
  of the program: a change retraces once (a guard).

``scaler.step`` and ``scaler.update`` must both run inside the compiled step (``update`` reads
what ``step`` recorded in that same call).
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch

from torchacc.lowering.amp_twins import non_finite_check_and_unscale_, update_scale_

aten = torch.ops.aten


def decompositions():
    """The two AMP kernels as ATen ops (for make_fx's decomposition table)."""
    return {
        aten._amp_foreach_non_finite_check_and_unscale_.default: non_finite_check_and_unscale_,
        aten._amp_update_scale_.default: update_scale_,
    }


def find(objects):
    """The enabled GradScalers among ``objects`` (torch.amp's and its subclasses)."""
    out, seen = [], set()
    for x in objects:
        if isinstance(x, torch.amp.GradScaler) and id(x) not in seen and x.is_enabled():
            seen.add(id(x))
            out.append(x)
    return out


def state_tensors(scaler, device):
    """``[_scale, _growth_tracker]``, created on ``device`` if the scaler has not run yet."""
    if scaler._scale is None:
        scaler._lazy_init_scale_growth_tracker(device)
    return [scaler._scale, scaler._growth_tracker]


def guard(scalers):
    return tuple(
        (s._enabled, s._growth_factor, s._backoff_factor, s._growth_interval) for s in scalers
    )


@contextlib.contextmanager
def swapped(scalers, tensors, index):
    """Point each scaler at the traced tensors ``tensors[index[k]]`` and make its optimizer step
    sync-free for the trace (Note [GradScaler in a compiled step])."""
    saved = [
        (s, s._scale, s._growth_tracker, s._per_optimizer_states, s.__dict__.get("_maybe_opt_step"))
        for s in scalers
    ]
    for s, (i, j) in zip(scalers, index):
        s._scale, s._growth_tracker = tensors[i], tensors[j]
        s._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
        s._maybe_opt_step = _syncfree_opt_step
    try:
        yield
    finally:
        for s, scale, tracker, states, own_step in saved:
            s._scale, s._growth_tracker, s._per_optimizer_states = scale, tracker, states
            del s._maybe_opt_step
            if own_step is not None:
                s._maybe_opt_step = own_step


def _syncfree_opt_step(optimizer, optimizer_state, *args, **kwargs):
    found = None
    for f in optimizer_state["found_inf_per_device"].values():
        found = f if found is None else found + f.to(found.device)
    tensors = _optimizer_tensors(optimizer)
    with torch.no_grad():
        before = [t.detach().clone() for t in tensors]
    result = optimizer.step(*args, **kwargs)
    with torch.no_grad():
        skip = found > 0
        for t, old in zip(tensors, before):
            t.copy_(torch.where(skip, old, t))
    return result


def _optimizer_tensors(optimizer):
    """The tensors ``optimizer.step()`` may update: its parameters and tensor state."""
    out, seen = [], set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            for t in [p, *optimizer.state.get(p, {}).values()]:
                if isinstance(t, torch.Tensor) and id(t) not in seen:
                    seen.add(id(t))
                    out.append(t)
    return out
