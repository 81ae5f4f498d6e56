"""GradScaler whose unscale, inf/NaN check and scale update stay on the torchacc device.

It is ``torch.amp.GradScaler`` whose two device kernels
(``_amp_foreach_non_finite_check_and_unscale_`` and ``_amp_update_scale_``) are each recorded as
one node of the step's graph (torchacc/lowering/amp.py), so nothing is read on the host.
Growth/backoff follow ``torch.amp.GradScaler`` exactly (same float32 scale, int32 growth tracker,
same order of operations). The same kernels as ordinary ATen ops
(torchacc/lowering/amp_twins.py) serve ``torchacc.compile_step``.

``step(optimizer)``: when ``optimizer.step`` accepts ``found_inf`` (the torchacc/torch_xla syncfree
optimizers) the combined found-inf tensor is passed and the optimizer skips its update on the
device: no host transfer. Otherwise it falls back to torch's behaviour: read found-inf on the host
(one counted ``TransferFromDevice``) and call ``optimizer.step()`` only if it is zero. With
``use_zero_grad=True`` (torch_xla's option) such optimizers get zeroed gradients instead of a
host read; note that weight decay and momentum still act on a zero-gradient step.
"""

from __future__ import annotations

import inspect
from collections import defaultdict

import torch
from torch.amp.grad_scaler import _MultiDeviceReplicator

from torchacc.lazy.device import DEVICE_TYPE, register_backend

_FIELDS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")


def accepts_found_inf(optimizer):
    """Whether ``optimizer.step`` takes a ``found_inf`` argument (a syncfree optimizer)."""
    try:
        return "found_inf" in inspect.signature(optimizer.step).parameters
    except (TypeError, ValueError):
        return False


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for the torchacc device, sync-free.

    Accepts torch's signature ``GradScaler(device='torchacc', init_scale=2.**16, growth_factor=2.,
    backoff_factor=.5, growth_interval=2000, enabled=True)`` and torch_xla's
    ``GradScaler(init_scale, growth_factor, backoff_factor, growth_interval, enabled,
    use_zero_grad=False)`` (a first positional number is ``init_scale``). ``GradScaler()`` works.
    """

    def __init__(self, *args, use_zero_grad=False, **kwargs):
        device = kwargs.pop("device", None)
        if args and isinstance(args[0], (str, torch.device)):
            device, args = args[0], args[1:]
        if len(args) > len(_FIELDS):
            raise TypeError(f"GradScaler takes at most {len(_FIELDS)} positional settings")
        for name, value in zip(_FIELDS, args, strict=False):
            if name in kwargs:
                raise TypeError(f"GradScaler got multiple values for {name!r}")
            kwargs[name] = value
        kind = DEVICE_TYPE if device is None else torch.device(device).type
        if kind == "xla":
            kind = DEVICE_TYPE
        if kind == DEVICE_TYPE:
            register_backend()
        super().__init__(kind, **kwargs)
        self.use_zero_grad = use_zero_grad

    # -- device kernels -----------------------------------------------------------------------
    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        per_device_inv_scale = _MultiDeviceReplicator(inv_scale)
        per_device_found_inf = _MultiDeviceReplicator(found_inf)
        grouped = defaultdict(lambda: defaultdict(list))
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    if (not allow_fp16) and param.grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")
                    grad = param.grad
                    if grad.is_sparse:
                        if grad.dtype is torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    grouped[grad.device][grad.dtype].append(grad)
            for device, per_dtype in grouped.items():
                for grads in per_dtype.values():
                    # on the torchacc device: one recorded node per dtype group
                    # (torchacc/lowering/amp.py)
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        grads,
                        per_device_found_inf.get(device),
                        per_device_inv_scale.get(device),
                    )
        return per_device_found_inf._per_device_tensors

    def _found_inf_combined(self, optimizer_state):
        found = list(optimizer_state["found_inf_per_device"].values())
        combined = found[0]
        for f in found[1:]:
            combined = combined + f.to(combined.device)
        return combined

    def _maybe_opt_step(self, optimizer, optimizer_state, *args, **kwargs):
        if accepts_found_inf(optimizer):
            kwargs["found_inf"] = self._found_inf_combined(optimizer_state)
            return optimizer.step(*args, **kwargs)
        if self.use_zero_grad:
            keep = (self._found_inf_combined(optimizer_state) == 0).float()
            with torch.no_grad():
                for group in optimizer.param_groups:
                    for p in group["params"]:
                        if p.grad is not None:
                            g = torch.nan_to_num(p.grad, nan=0.0, posinf=0.0, neginf=0.0)
                            p.grad.copy_(g * keep.to(g.dtype))
            return optimizer.step(*args, **kwargs)
        return super()._maybe_opt_step(optimizer, optimizer_state, *args, **kwargs)

    def update(self, new_scale=None):
        if not self._enabled:
            return
        _scale, _growth_tracker = self._check_scale_growth_tracker("update")
        if new_scale is not None or _scale.device.type != DEVICE_TYPE:
            return super().update(new_scale)
        found_infs = [
            found_inf.to(device=_scale.device, non_blocking=True)
            for state in self._per_optimizer_states.values()
            for found_inf in state["found_inf_per_device"].values()
        ]
        if not found_infs:
            raise AssertionError("No inf checks were recorded prior to update.")
        combined = found_infs[0]
        for f in found_infs[1:]:
            combined = combined + f
        torch._amp_update_scale_(  # one recorded node (torchacc/lowering/amp.py)
            _scale,
            _growth_tracker,
            combined,
            self._growth_factor,
            self._backoff_factor,
            self._growth_interval,
        )
        self._per_optimizer_states = defaultdict(torch.amp.grad_scaler._refresh_per_optimizer_state)
