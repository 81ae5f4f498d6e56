"""The two device kernels ``torch.amp.GradScaler`` relies on, written as ordinary ATen ops.

The trace-once path decomposes ``torch._amp_foreach_non_finite_check_and_unscale_`` and
``torch._amp_update_scale_`` into these twins, which compute the same values (same float32
scale, int32 growth tracker, same order of operations) with ops that have one, so a scaler's
unscale, inf/NaN check and scale update become part of the compiled step instead of a host read.
``torchacc.compile_step`` traces them as decompositions of the two ops (torchacc/dynamo/scaler.py);
on the lazy device the two ops are recorded as one node each instead (torchacc/lowering/amp.py).
"""

from __future__ import annotations

import torch


def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
    """Device twin of ``torch._amp_foreach_non_finite_check_and_unscale_``.

    Multiplies every grad by ``inv_scale`` in place and sets ``found_inf`` (float32, 0-dim) to 1.0
    if any grad holds an inf or NaN; leaves it unchanged otherwise.
    """
    if not grads:
        return
    finite = [torch.isfinite(g).all() for g in grads]
    all_finite = finite[0] if len(finite) == 1 else torch.stack(finite).all()
    found_inf.copy_(torch.where(all_finite, found_inf, torch.ones_like(found_inf)))
    for g in grads:
        g.mul_(inv_scale)


def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    """Device twin of ``torch._amp_update_scale_`` (same arithmetic, no host read)."""
    found = found_inf > 0
    successful = growth_tracker + 1
    grow = successful == growth_interval
    grown = (scale.double() * growth_factor).float()
    grown = torch.where(torch.isfinite(grown), grown, scale)
    backed_off = (scale.double() * backoff_factor).float()
    new_scale = torch.where(found, backed_off, torch.where(grow, grown, scale))
    zero = torch.zeros_like(growth_tracker)
    new_tracker = torch.where(found | grow, zero, successful.to(growth_tracker.dtype))
    scale.copy_(new_scale)
    growth_tracker.copy_(new_tracker)
    return scale
